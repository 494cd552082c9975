"""The engine's one settings object, and the one place that turns it into vLLM's environment.

vLLM reads several knobs from environment variables when it is imported. `apply_environment`
sets them from `EngineSettings`; the server calls it once, before its first `import vllm`.
Nothing else in the engine reads or writes the environment.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from rollserve.client.address import join_host_port
from rollserve.client.credentials import SchedulerCredentials
from rollserve.client.wire import ENGINE_ID_PATTERN
from rollserve.common.access import ServerTls, TokenFile
from rollserve.engine.cpu_features import emulates_bf16
from rollserve.engine.host_memory import host_memory_bytes

__all__ = [
    "MAX_PROMPT_LOOKUP",
    "MAX_SPECULATIVE_TOKENS",
    "SPECULATIVE_FIELDS",
    "UPCAST_MEMORY_SHARE",
    "Device",
    "Dtype",
    "DtypeChoice",
    "EngineSettings",
    "SpecMethod",
    "apply_environment",
    "checkpoint_dtype",
    "checkpoint_weight_bytes",
    "choose_dtype",
    "resolve_device",
    "resolve_dtype",
]

Device = Literal["cpu", "cuda"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
SpecMethod = Literal["ngram", "rollout", "suffix"]

MAX_SPECULATIVE_TOKENS = 32
"""Most draft tokens per step: verifying more costs more than the rare long match repays."""
MAX_PROMPT_LOOKUP = 64
"""Longest n-gram the ngram and rollout drafters may match."""
SPECULATIVE_FIELDS = (
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "spec_max_batch",
    "spec_factor",
    "spec_min_share",
    "spec_background_tokens",
    "spec_history_tokens",
    "spec_history_per_prompt",
)
"""Settings that mean something only with a `spec_method`."""
_NGRAM_FIELDS = ("prompt_lookup_min", "prompt_lookup_max")
_ROLLOUT_FIELDS = (
    "spec_factor",
    "spec_min_share",
    "spec_background_tokens",
    "spec_history_tokens",
    "spec_history_per_prompt",
)

UPCAST_MEMORY_SHARE = 0.5
"""`resolve_dtype` upcasts a 16-bit checkpoint to float32 only where its float32 weights and
the KV cache space, for each of the machine's engines (``engines_per_host``), take at most
this share of the memory the process may use: the rest is left to the processes' other
needs (activations, the runtime, the scheduler and Redis beside them)."""
_GIB = 1 << 30
_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt")

_HOST_PORT = r"^[^\s:]+(:[^\s:]+)*:\d{1,5}$|^\[[0-9a-fA-F:.]+\]:\d{1,5}$"


class SchedulerLink(BaseModel):
    """How an engine (vLLM's or a simulated one) reaches the scheduler it registers with, and
    who may call the engine's own API."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    scheduler_address: str | None = Field(
        None,
        pattern=_HOST_PORT,
        description="host:port of the scheduler to register with and heartbeat; none if unset.",
    )
    scheduler_token_file: str | None = Field(
        None,
        description="File holding the bearer token registrations carry (one of the "
        "scheduler's --auth-tokens-file); none if unset.",
    )
    scheduler_tls: bool = Field(
        False,
        description="Reach the scheduler over TLS, its certificate checked against gRPC's "
        "bundled public CAs (implied by scheduler_ca_file, which names others).",
    )
    scheduler_ca_file: str | None = Field(
        None, description="PEM CA certificates that signed the scheduler's (TLS)."
    )
    scheduler_cert_file: str | None = Field(
        None,
        description="PEM certificate chain shown to a scheduler that asks for one (mutual TLS).",
    )
    scheduler_key_file: str | None = Field(None, description="PEM key of scheduler_cert_file.")
    auth_tokens_file: str | None = Field(
        None,
        description="NAME:TOKEN lines (docs/access.md): every call of the engine's gRPC API "
        "(not health checks nor reflection) must carry one as 'authorization: Bearer TOKEN'; "
        "the scheduler's --engine-token-file holds one. Read again when it changes; none: "
        "the API asks for none.",
    )
    tls_cert_file: str | None = Field(
        None,
        description="PEM certificate chain the engine's gRPC API serves TLS with (with "
        "tls_key_file; the scheduler's --engine-ca-file names its CA); read again when it "
        "changes; none: plaintext.",
    )
    tls_key_file: str | None = Field(None, description="PEM key of tls_cert_file.")
    tls_client_ca_file: str | None = Field(
        None,
        description="PEM CA certificates: callers of the engine's gRPC API must show a "
        "certificate one of them signed (mutual TLS; needs tls_cert_file; the scheduler's "
        "--engine-cert-file shows one); read again when it changes; none: callers show none.",
    )

    @model_validator(mode="after")
    def _readable_scheduler_credentials(self) -> SchedulerLink:
        files = {
            "scheduler_token_file": self.scheduler_token_file,
            "scheduler_ca_file": self.scheduler_ca_file,
            "scheduler_cert_file": self.scheduler_cert_file,
            "scheduler_key_file": self.scheduler_key_file,
        }
        given = [name for name, path in files.items() if path is not None]
        if self.scheduler_address is None and (given or self.scheduler_tls):
            named = ", ".join(given or ["scheduler_tls"])
            raise ValueError(f"{named}: for a scheduler; give scheduler_address too")
        self.scheduler_credentials()  # (its ValueError names the file)
        self.api_tokens()
        self.api_tls()
        return self

    def api_tls(self) -> ServerTls | None:
        """The TLS of the engine's API (files read and checked now); None: plaintext."""
        return ServerTls.from_settings(
            self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file
        )

    def api_tokens(self) -> TokenFile | None:
        """The tokens calls of the engine's API must carry (read now); None: none asked."""
        if self.auth_tokens_file is None:
            return None
        return TokenFile(self.auth_tokens_file, scoped=False)  # (no role but admin either)

    def scheduler_credentials(self) -> SchedulerCredentials:
        """What registrations show the scheduler (the files read now)."""
        return SchedulerCredentials.from_files(
            token_file=self.scheduler_token_file,
            ca_file=self.scheduler_ca_file,
            cert_file=self.scheduler_cert_file,
            key_file=self.scheduler_key_file,
            tls=self.scheduler_tls,
        )


class EngineSettings(SchedulerLink):
    """Settings of one engine process (`python -m rollserve.engine --help` lists them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    engine_id: str = Field(
        "engine-0",
        min_length=1,
        max_length=128,
        pattern=ENGINE_ID_PATTERN,
        description="Name of this engine, reported to the scheduler and in Stats.",
    )
    host: str = Field(
        "127.0.0.1", min_length=1, description="Interface the gRPC server listens on."
    )
    port: int = Field(0, ge=0, le=65535, description="gRPC port; 0 picks a free one.")
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description=(
            "Port of the Prometheus endpoint (HTTP GET /metrics: vLLM's own metrics, as its "
            "OpenAI server serves them) on host; 0 picks a free one; unset serves none."
        ),
    )
    advertise_host: str | None = Field(
        None,
        min_length=1,
        description="Host the scheduler should dial (default: host).",
    )
    model: Path = Field(
        description="Directory of a Hugging Face checkpoint (config.json, weights, tokenizer).",
    )
    max_model_len: int = Field(
        2048, ge=16, le=1_048_576, description="Context length: prompt plus response tokens."
    )
    max_num_seqs: int = Field(
        64, ge=1, le=4096, description="Most sequences vLLM runs in one batch."
    )
    kv_cache_space_gib: int = Field(
        2, ge=1, le=4096, description="KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE), GiB."
    )
    engines_per_host: int = Field(
        1,
        ge=1,
        le=1024,
        description=(
            "Engines like this one that share this machine's memory (rollserve up sets it): "
            "dtype auto upcasts a 16-bit checkpoint only where all their float32 weights and "
            "KV caches fit in half the memory."
        ),
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Share of GPU memory vLLM may use (GPU only)."
    )
    block_size: int = Field(
        32,
        ge=16,
        le=256,
        multiple_of=16,
        description="KV cache block size in tokens (CPU attention needs a multiple of 32).",
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse KV blocks of shared prompt prefixes (samples of a group)."
    )
    seed: int = Field(0, ge=0, le=2**31 - 1, description="vLLM's global random seed.")
    dtype: Dtype = Field(
        "auto",
        description=(
            "Weight and activation dtype. auto is vLLM's choice (the checkpoint's, but a "
            "float32 one runs in bfloat16), except on an x86 CPU that emulates bfloat16 "
            "(AVX2 without AVX-512 BF16 or AMX): there the model runs in float32, a 16-bit "
            "checkpoint upcast where its float32 weights and the KV cache space, times "
            "engines_per_host, take at most half the memory (emulated bfloat16 decoded 64 "
            "sequences of the shipped reasoner 2.3x slower, and 8 of a 0.36B model 4.3x "
            "slower)."
        ),
    )
    enforce_eager: bool = Field(
        True, description="Skip graph capture: starts much faster, runs a little slower."
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "priority",
        description="vLLM queue order; priority honours GenerateRequest.priority (lower first).",
    )
    stream_interval: int = Field(
        16,
        ge=1,
        le=4096,
        description=(
            "vLLM hands a sample's new tokens to the service every this many tokens (and at "
            "its end): fewer wake-ups of the front end per token."
        ),
    )
    flush_interval_ms: float = Field(
        2000.0,
        ge=0,
        le=60_000,
        description=(
            "Period of the engine's flush tick: at each, every call sends the tokens it made "
            "since (one Chunk); 0 sends at once. A sample's end is sent at once, with the "
            "tokens batched so far. Each Chunk costs the scheduler a wake-up (about 0.3-0.6 ms "
            "of CPU when messages come spaced out, a third of that back to back, as one tick "
            "sends them); only progress waits for it."
        ),
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where vLLM runs; auto picks cpu unless torch sees a GPU."
    )
    omp_num_threads: int = Field(
        0,
        ge=0,
        le=1024,
        description="OpenMP threads on CPU (set 1 when engines share a machine); 0 leaves it.",
    )
    frontend_nice: int = Field(
        0,
        ge=0,
        le=19,
        description=(
            "Niceness of this process's threads (gRPC, output handling) once vLLM's engine "
            "core runs; the core keeps its own, so a CPU-bound model wins the CPU. 0 leaves it."
        ),
    )
    shutdown_grace_s: float = Field(
        5.0, ge=0, le=600, description="On SIGTERM, how long running Generate calls may finish."
    )
    spec_method: SpecMethod | None = Field(
        None,
        description=(
            "Speculative decoding: ngram (drafts from the sample's own prompt and output), "
            "rollout (also from its group's other samples and earlier samples of the same "
            "prompt) or suffix (needs arctic-inference); unset: off."
        ),
    )
    num_speculative_tokens: int = Field(
        4,
        ge=1,
        le=MAX_SPECULATIVE_TOKENS,
        description="Draft tokens proposed per sample and step (suffix: at most this many).",
    )
    prompt_lookup_min: int = Field(
        2,
        ge=1,
        le=MAX_PROMPT_LOOKUP,
        description=(
            "ngram and rollout: shortest n-gram of the sample's recent tokens matched earlier on."
        ),
    )
    prompt_lookup_max: int = Field(
        5,
        ge=1,
        le=MAX_PROMPT_LOOKUP,
        description="ngram and rollout: longest n-gram matched (the longest match found drafts).",
    )
    spec_factor: float = Field(
        0.0,
        ge=0,
        le=MAX_SPECULATIVE_TOKENS,
        description=(
            "rollout: draft at most this many tokens per token matched (a short match drafts "
            "little); 0: always up to num_speculative_tokens."
        ),
    )
    spec_min_share: float = Field(
        0.0,
        ge=0,
        le=1,
        description=(
            "rollout: end a draft where the share of matches that agree on it (multiplied "
            "token by token) falls below this; 0: never."
        ),
    )
    spec_history_tokens: int = Field(
        1 << 26,
        ge=1,
        le=1 << 34,
        description=(
            "rollout: tokens of finished samples (prompts and outputs, 4 bytes each) kept to "
            "draft later samples of the same prompts, least recently used prompts dropped "
            "first; to draft from the last epoch it must hold an epoch's outputs on this "
            "engine (the default, 64M tokens, is 256 MiB)."
        ),
    )
    spec_history_per_prompt: int = Field(
        64,
        ge=1,
        le=1 << 16,
        description="rollout: finished outputs kept a prompt, the newest.",
    )
    spec_background_tokens: int = Field(
        1 << 16,
        ge=0,
        le=1 << 30,
        description=(
            "rollout: a prompt's earlier outputs of at least this many tokens are indexed on a "
            "thread, not in the engine's step (64 outputs of 28k tokens take about 2 s); its "
            "samples draft without them until it is done. 0: always in the step."
        ),
    )
    spec_max_batch: int = Field(
        0,
        ge=0,
        le=4096,
        description=(
            "Speculate only in steps that run at most this many sequences (the long tail of a "
            "rollout); 0 speculates in every step. Where it pays depends on the hardware: "
            "`rollserve sim calibrate-spec` prints the largest batch at which a pass costs "
            "less a token than decoding (at the trained reasoner's drafts: about 30 on a CPU "
            "with native bfloat16, 16-21 on one with AVX2 alone in float32, 4-5 there in "
            "emulated bfloat16)."
        ),
    )

    @field_validator("model")
    @classmethod
    def _model_is_a_checkpoint(cls, value: Path) -> Path:
        if not (value / "config.json").is_file():
            raise ValueError(
                f"model ({value}) is not a directory with a config.json; pass the directory of "
                "a Hugging Face checkpoint (the engine runs offline and downloads nothing)"
            )
        return value.resolve()

    @model_validator(mode="after")
    def _metrics_port_is_not_the_grpc_port(self) -> EngineSettings:
        if self.metrics_port and self.metrics_port == self.port:
            raise ValueError(
                f"metrics_port ({self.metrics_port}) is the gRPC port; give it another"
            )
        return self

    @model_validator(mode="after")
    def _speculative_settings_agree(self) -> EngineSettings:
        if self.spec_method is None:
            given = [name for name in SPECULATIVE_FIELDS if name in self.model_fields_set]
            if given:
                raise ValueError(
                    f"{', '.join(given)} set but spec_method is not; pass spec_method "
                    "(ngram, rollout or suffix) to turn speculative decoding on, or drop them"
                )
            return self
        for fields, methods in (
            (_NGRAM_FIELDS, ("ngram", "rollout")),
            (_ROLLOUT_FIELDS, ("rollout",)),
        ):
            given = [name for name in fields if name in self.model_fields_set]
            if given and self.spec_method not in methods:
                raise ValueError(
                    f"{', '.join(given)} apply to spec_method {' and '.join(methods)} only, "
                    f"not {self.spec_method}; drop them"
                )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                f"({self.prompt_lookup_max}); use at most {self.prompt_lookup_max}"
            )
        if self.spec_max_batch >= self.max_num_seqs:
            raise ValueError(
                f"spec_max_batch ({self.spec_max_batch}) must be below max_num_seqs "
                f"({self.max_num_seqs}) to leave any step unspeculated; use at most "
                f"{self.max_num_seqs - 1}, or 0 to speculate in every step"
            )
        return self

    @property
    def address(self) -> str:
        """host:port to bind (the port as given; 0 means one is picked at bind time)."""
        return join_host_port(self.host, self.port)

    def advertised_address(self, bound_port: int) -> str:
        """host:port others should dial, once the port is bound."""
        return join_host_port(self.advertise_host or self.host, bound_port)


def resolve_device(settings: EngineSettings) -> Device:
    """The device `auto` stands for: cuda when torch sees a GPU (imports torch), else cpu."""
    if settings.device != "auto":
        return settings.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def checkpoint_dtype(model: Path) -> str | None:
    """The dtype a checkpoint's config.json names (``dtype``, or ``torch_dtype`` as older
    transformers write it); None where it names none or cannot be read as JSON (vLLM then
    reports the checkpoint's problem itself)."""
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    value = config.get("dtype", config.get("torch_dtype"))
    return value if isinstance(value, str) else None


def checkpoint_weight_bytes(model: Path) -> int:
    """Bytes of a checkpoint's weight files (safetensors, else PyTorch ones) at its top
    level; 0 where it has none that can be read."""
    for pattern in _WEIGHT_FILES:
        try:
            files = sorted(model.glob(pattern))
            if files:
                return sum(f.stat().st_size for f in files)
        except OSError:
            return 0
    return 0


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    """The dtype vLLM is given, and why, for the engine's log."""

    dtype: str
    why: str
    slower: bool = False  # vLLM will emulate bfloat16 here: say it as a warning


def resolve_dtype(
    settings: EngineSettings,
    device: Device,
    cpuinfo: str | None = None,
    memory_bytes: int | None = None,
) -> str:
    """The dtype vLLM is given for these settings (`choose_dtype`'s)."""
    return choose_dtype(settings, device, cpuinfo, memory_bytes).dtype


def choose_dtype(
    settings: EngineSettings,
    device: Device,
    cpuinfo: str | None = None,
    memory_bytes: int | None = None,
) -> DtypeChoice:
    """The dtype vLLM is given for these settings: `settings.dtype` unless it is ``auto``.

    ``auto`` on a CPU that emulates bfloat16 (`emulates_bf16`; ``cpuinfo`` is /proc/cpuinfo's
    text, read when None) is ``float32``, where vLLM would run bfloat16 (it downcasts a
    float32 checkpoint, and keeps a bfloat16 one): emulated bfloat16 was slower at every
    batch measured on such a CPU, 2.3x at 64 sequences of the shipped reasoner, and 1.25x,
    4.3x and 6.0x at 1, 8 and 32 sequences of a 0.36B model, whose float32 weights are read
    twice the bytes a step (docs/calibration.md). A 16-bit checkpoint is upcast only where
    its weights in float32 and the KV cache space, times ``engines_per_host`` (the engines
    sharing the machine, each choosing the same), take at most `UPCAST_MEMORY_SHARE` of
    ``memory_bytes`` (`host_memory_bytes` when None: the machine's, or the container's
    limit). Anything else stays ``auto`` for vLLM to resolve. The answer depends on files
    and the machine alone, so every call in a process gives the same.
    """
    if settings.dtype != "auto":
        return DtypeChoice(settings.dtype, "as set")
    if device != "cpu":
        return DtypeChoice("auto", f"vLLM's choice on {device}")
    if not emulates_bf16(cpuinfo):
        return DtypeChoice("auto", "vLLM's choice: bfloat16 is native here, or flags unknown")
    stored = checkpoint_dtype(settings.model)
    if stored == "float32":
        return DtypeChoice("float32", f"{_EMULATED}: the float32 checkpoint is not downcast")
    if stored not in ("bfloat16", "float16"):
        why = f"vLLM's choice: {_EMULATED}, and the checkpoint names no dtype"
        return DtypeChoice("auto", why, slower=True)
    return _upcast(settings, stored, memory_bytes)


_EMULATED = "this CPU emulates bfloat16 (AVX2 without AVX-512 BF16 or AMX)"


def _upcast(settings: EngineSettings, stored: str, memory_bytes: int | None) -> DtypeChoice:
    """float32 for a 16-bit checkpoint on a CPU that emulates bfloat16, where it fits."""
    weights = checkpoint_weight_bytes(settings.model) * 2  # 16-bit weights in float32
    memory = host_memory_bytes() if memory_bytes is None else memory_bytes
    engines = settings.engines_per_host
    needed = (weights + settings.kv_cache_space_gib * _GIB) * engines
    sizes = (
        f"its weights in float32 ({_size(weights)}) and the KV cache "
        f"({settings.kv_cache_space_gib} GiB)"
        f"{f', for each of {engines} engines on this machine,' if engines > 1 else ''}"
    )
    share = f"{UPCAST_MEMORY_SHARE:.0%} of {_size(memory)}"
    if weights and needed <= UPCAST_MEMORY_SHARE * memory:
        return DtypeChoice(
            "float32", f"{_EMULATED}: the {stored} checkpoint is upcast, {sizes} within {share}"
        )
    if not weights or not memory:
        reason = f"the size of {'its weights' if not weights else 'the memory'} is not known"
    else:
        reason = f"{sizes} would take more than {share}"
    why = (
        f"vLLM's choice: {_EMULATED}, but {reason}, so the {stored} checkpoint is not "
        "upcast (--dtype float32 upcasts it)"
    )
    return DtypeChoice("auto", why, slower=True)


def _size(n: int) -> str:
    return f"{n / _GIB:.1f} GiB" if n >= _GIB // 10 else f"{n / (1 << 20):.1f} MiB"


def apply_environment(settings: EngineSettings, device: Device) -> None:
    """Sets the environment variables vLLM reads; call once, before the first `import vllm`.

    - the engine never downloads: models are local directories;
    - on CPU, the KV cache size is an environment variable (VLLM_CPU_KVCACHE_SPACE);
    - VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps the model worker inside the engine-core process
      (AsyncLLM still runs the engine core in one child process);
    - a CPU engine with the ngram drafter gets as many numba threads as OpenMP threads
      (unless NUMBA_NUM_THREADS is set): numba starts one a core, and on the dev stack (two
      engines of one OpenMP thread on two cores) they made every step ten times slower
      (64 groups x 4 of the trained reasoner: 45-56 s a batch against 4.5-4.7 s);
    - the rollout drafter runs in the engine core, where vLLM gives it only vLLM's config:
      its settings travel in ROLLSERVE_DRAFTER.
    """
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(settings.kv_cache_space_gib)
    if settings.omp_num_threads > 0:
        env["OMP_NUM_THREADS"] = str(settings.omp_num_threads)
    threads = env.get("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", ""))
    if (
        device == "cpu"
        and settings.spec_method == "ngram"
        and "NUMBA_NUM_THREADS" not in os.environ
        and threads.isdigit()
        and int(threads) > 0
    ):
        env["NUMBA_NUM_THREADS"] = threads
    if settings.spec_method == "rollout":
        from rollserve.engine.drafter import DRAFTER_ENV, DrafterConfig

        env[DRAFTER_ENV] = DrafterConfig(
            min_n=settings.prompt_lookup_min,
            max_n=settings.prompt_lookup_max,
            spec_factor=settings.spec_factor,
            min_share=settings.spec_min_share,
            background_tokens=settings.spec_background_tokens,
            history_tokens=settings.spec_history_tokens,
            history_per_prompt=settings.spec_history_per_prompt,
        ).to_env()
    os.environ.update(env)
