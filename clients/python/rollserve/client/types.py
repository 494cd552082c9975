"""Typed objects of the trainer SDK: what you submit and what the scheduler reports.

What comes back through the stream (:class:`GroupResult`, :class:`Sample`) is
defined in :mod:`rollserve.client.wire`, the stream's contract, and re-exported here.

The checks here catch malformed requests before they leave the trainer; the
scheduler checks again against what only it knows (the model's context length,
its queue size).
"""

from __future__ import annotations

import numbers
import operator
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

from rollserve.client.errors import InvalidArgument
from rollserve.client.wire import (
    INT32_MAX,
    INT32_MIN,
    INT64_MAX,
    INT64_MIN,
    MAX_EPOCH,
    MAX_GROUP_ID_LEN,
    MAX_METADATA_BYTES,
    MAX_POLICY_VERSION,
    MAX_PROMPT_KEY_LEN,
    MAX_STOP_LEN,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    FinishReason,
    GroupResult,
    GroupStatus,
    Sample,
)
from rollserve.v1 import rollserve_pb2 as pb

__all__ = [
    "CancelResult",
    "EngineStatus",
    "FinishReason",
    "GroupResult",
    "GroupStatus",
    "PromptGroup",
    "Sample",
    "SamplingParams",
    "SchedulerStatus",
]


def _as_float32(value: float) -> float:
    """What a proto ``float`` field makes of ``value`` (within float32's range)."""
    return float(struct.unpack("<f", struct.pack("<f", value))[0])


def _check_int(where: str, value: object) -> None:
    """Raises InvalidArgument unless ``value`` is an integer (an int, or numpy's; a bool is
    not)."""
    if type(value) is int:
        return
    try:
        if isinstance(value, bool):
            raise TypeError
        operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgument(f"{where} must be an int, got {type(value).__name__}") from None


def _check_number(where: str, value: object) -> None:
    """Raises InvalidArgument unless ``value`` is a real number (a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgument(f"{where} must be a number, got {type(value).__name__}")


def _check_token_ids(where: str, values: Sequence[object]) -> None:
    """Raises InvalidArgument unless every value is an integer in 0..INT32_MAX."""
    if not all(type(v) is int for v in values):  # (a prompt's ids are ints, as a rule)
        for i, value in enumerate(values):
            _check_int(f"{where}[{i}]", value)
    ints = cast(Sequence[int], values)
    if ints and not 0 <= min(ints) <= max(ints) <= INT32_MAX:
        raise InvalidArgument(f"{where} must be in 0..{INT32_MAX}")


def _check_text(where: str, text: object) -> None:
    """Raises InvalidArgument unless ``text`` is a str that can go on the wire (UTF-8: a lone
    surrogate, as a bad decode leaves, cannot)."""
    if not isinstance(text, str):
        raise InvalidArgument(f"{where} must be a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument(
            f"{where} is not valid UTF-8 text: {text[exc.start : exc.end]!r} at {exc.start}"
        ) from None


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """How the n samples of a group are drawn.

    temperature: in [0, 2] (vLLM's range); 0 is greedy.
    top_p: in (0, 1].
    top_k: -1 (or 0) disables; otherwise >= 1.
    max_tokens: response tokens per sample, >= 1 (the scheduler also bounds it by
        the model's context minus the prompt).
    stop: stop strings (need an engine that detokenizes; one str is one stop string), at
        most 64 of at most 1,024 characters.
    stop_token_ids: extra token ids that end a sample, at most 1,024.
    seed: None for random; sample i of a group uses seed + i.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for name in ("temperature", "top_p"):
            _check_number(name, getattr(self, name))
        for name in ("top_k", "max_tokens"):
            _check_int(name, getattr(self, name))
        if self.seed is not None:
            _check_int("seed", self.seed)
        _check_token_ids("stop_token_ids", self.stop_token_ids)
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidArgument(
                f"temperature ({self.temperature}) must be in [0, {MAX_TEMPERATURE:g}]; 0 is greedy"
            )
        if not 0 < self.top_p <= 1 or _as_float32(self.top_p) == 0:
            raise InvalidArgument(f"top_p ({self.top_p}) must be in (0, 1] (as a 32-bit float)")
        if not -1 <= self.top_k <= INT32_MAX:
            raise InvalidArgument(f"top_k ({self.top_k}) must be -1 or 0 (disabled) or >= 1")
        if not 1 <= self.max_tokens <= INT32_MAX:
            raise InvalidArgument(f"max_tokens ({self.max_tokens}) must be >= 1")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidArgument(
                f"stop has {len(self.stop)} strings; the limit is {MAX_STOP_STRINGS}"
            )
        for i, text in enumerate(self.stop):
            _check_text(f"stop[{i}]", text)
            if not 0 < len(text) <= MAX_STOP_LEN:
                raise InvalidArgument(
                    f"stop[{i}] is {len(text)} characters; it must be 1 to {MAX_STOP_LEN}"
                )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidArgument(
                f"stop_token_ids has {len(self.stop_token_ids)} ids; the limit is "
                f"{MAX_STOP_TOKEN_IDS}"
            )
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            raise InvalidArgument(f"seed ({self.seed}) must fit in int64")

    def to_proto(self) -> pb.SamplingParams:
        msg = pb.SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=self.max_tokens,
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids),
        )
        if self.seed is not None:
            msg.seed = self.seed
        return msg


@dataclass(frozen=True, kw_only=True, slots=True)
class PromptGroup:
    """One prompt and the n samples to draw from it, delivered together.

    group_id: yours, unique within the run; the stream entry carries it back.
    prompt_token_ids / prompt_text: the prompt, exactly one of the two (text is
        tokenized by the scheduler with the model's tokenizer).
    n: samples in the group, >= 1.
    prompt_key: stable id of the dataset row across epochs; the scheduler keeps
        length history by it (defaults to nothing: no history).
    priority: lower runs first, among the run's own groups (runs share the engines on
        equal terms: each run's priorities count from its most urgent queued group).
    epoch: the pass over the dataset this group belongs to (from 0); the length
        history of a prompt_key decays by epochs. None: one more than the last epoch
        the scheduler learnt the prompt_key in.
    metadata: passed through to the stream entry untouched.
    stream_samples: also write each sample to the run's samples stream the moment it
        finishes (read with a client made with ``reads="samples"``); the group's entry
        still comes, with the same samples, once all have finished.
    """

    group_id: str
    prompt_token_ids: Sequence[int] = ()
    prompt_text: str = ""
    n: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prompt_key: str = ""
    priority: int = 0
    epoch: int | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    stream_samples: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        if not isinstance(self.metadata, Mapping):
            raise InvalidArgument(
                f"metadata must be a mapping of str to str, got {type(self.metadata).__name__}"
            )
        object.__setattr__(self, "metadata", dict(self.metadata))
        _check_text("group_id", self.group_id)
        if not 0 < len(self.group_id) <= MAX_GROUP_ID_LEN:
            raise InvalidArgument(
                f"group_id is {len(self.group_id)} characters; it must be 1 to {MAX_GROUP_ID_LEN}"
            )
        if not isinstance(self.sampling, SamplingParams):
            raise InvalidArgument(
                f"group {self.group_id!r}: sampling must be a SamplingParams, got "
                f"{type(self.sampling).__name__}"
            )
        for name in ("n", "priority"):
            _check_int(f"group {self.group_id!r}: {name}", getattr(self, name))
        if self.epoch is not None:
            _check_int(f"group {self.group_id!r}: epoch", self.epoch)
        _check_token_ids(f"group {self.group_id!r}: prompt_token_ids", self.prompt_token_ids)
        for name in ("prompt_text", "prompt_key"):
            _check_text(f"group {self.group_id!r}: {name}", getattr(self, name))
        if len(self.prompt_key) > MAX_PROMPT_KEY_LEN:
            raise InvalidArgument(
                f"group {self.group_id!r}: prompt_key is {len(self.prompt_key)} characters; "
                f"the limit is {MAX_PROMPT_KEY_LEN} (key a longer id by its hash)"
            )
        if bool(self.prompt_token_ids) == bool(self.prompt_text):
            raise InvalidArgument(
                f"group {self.group_id!r}: give exactly one of prompt_token_ids and prompt_text"
            )
        if not 1 <= self.n <= INT32_MAX:
            raise InvalidArgument(f"group {self.group_id!r}: n ({self.n}) must be >= 1")
        seed = self.sampling.seed
        if seed is not None and seed + self.n - 1 > INT64_MAX:
            raise InvalidArgument(
                f"group {self.group_id!r}: sampling.seed ({seed}) + n - 1 ({self.n - 1}) passes "
                f"int64's limit ({INT64_MAX}); sample i is seeded seed + i"
            )
        if not INT32_MIN <= self.priority <= INT32_MAX:
            raise InvalidArgument(
                f"group {self.group_id!r}: priority ({self.priority}) must fit in int32"
            )
        if self.epoch is not None and not 0 <= self.epoch <= MAX_EPOCH:
            raise InvalidArgument(
                f"group {self.group_id!r}: epoch ({self.epoch}) must be in 0..{MAX_EPOCH}"
            )
        if any(not isinstance(v, str) for v in self.metadata.values()):
            raise InvalidArgument(f"group {self.group_id!r}: metadata values must be str")
        if any(not isinstance(k, str) for k in self.metadata):
            raise InvalidArgument(f"group {self.group_id!r}: metadata keys must be str")
        for key, value in self.metadata.items():
            _check_text(f"group {self.group_id!r}: a metadata key", key)
            _check_text(f"group {self.group_id!r}: metadata[{key!r}]", value)
        size = sum(len(k.encode()) + len(v.encode()) for k, v in self.metadata.items())
        if size > MAX_METADATA_BYTES:
            raise InvalidArgument(
                f"group {self.group_id!r}: metadata holds {size} bytes (UTF-8, keys and "
                f"values); the limit is {MAX_METADATA_BYTES}"
            )

    def to_proto(self) -> pb.PromptGroup:
        return pb.PromptGroup(
            group_id=self.group_id,
            prompt_token_ids=list(self.prompt_token_ids),
            prompt_text=self.prompt_text,
            n=self.n,
            sampling=self.sampling.to_proto(),
            prompt_key=self.prompt_key,
            priority=self.priority,
            epoch=self.epoch,
            metadata=dict(self.metadata),
            stream_samples=self.stream_samples,
        )


@dataclass(frozen=True, slots=True)
class CancelResult:
    cancelled: tuple[str, ...]  # were queued or running, now cancelled: never delivered
    unknown: tuple[str, ...]  # not pending in the run: unknown, or already finished

    @classmethod
    def from_proto(cls, msg: pb.CancelResponse) -> CancelResult:
        return cls(cancelled=tuple(msg.cancelled), unknown=tuple(msg.unknown))


@dataclass(frozen=True, slots=True)
class DeleteRunResult:
    cancelled: int  # groups that were queued or running, now cancelled: never delivered
    existed: bool  # the run had state in Redis (False: nothing was there to delete)

    @classmethod
    def from_proto(cls, msg: pb.DeleteRunResponse) -> DeleteRunResult:
        return cls(cancelled=msg.cancelled, existed=msg.existed)


@dataclass(frozen=True, slots=True)
class PublishResult:
    version: int  # the run's policy version now
    engines_updated: int  # engines that loaded the weights (0 without weights_path)
    engines_failed: tuple[str, ...]  # "engine_id: reason"; out of service until they load them

    @classmethod
    def from_proto(cls, msg: pb.PublishVersionResponse) -> PublishResult:
        return cls(msg.version, msg.engines_updated, tuple(msg.engines_failed))


@dataclass(frozen=True, slots=True)
class RunStatus:
    """A run with groups queued or running at the scheduler."""

    run_id: str
    queued_groups: int  # groups with samples waiting for an engine
    queued_samples: int
    running_groups: int  # groups with samples on engines
    running_samples: int

    @classmethod
    def from_proto(cls, msg: pb.RunStatus) -> RunStatus:
        return cls(
            msg.run_id,
            msg.queued_groups,
            msg.queued_samples,
            msg.running_groups,
            msg.running_samples,
        )


@dataclass(frozen=True, slots=True)
class EngineStatus:
    engine_id: str
    address: str
    healthy: bool
    inflight_groups: int
    inflight_samples: int
    outstanding_tokens: int  # upper bound of tokens still to generate
    capacity_samples: int  # most samples the scheduler runs at once on it
    last_error: str
    # The weights it serves as the scheduler last saw them ("" and 0: its launch weights).
    weights_path: str = ""
    weights_version: int = 0
    loading_weights: bool = False  # loading the fleet's weights now
    restarts: int = 0  # times the scheduler found it started anew (a new boot id)
    # Tokens its running samples are predicted still to make (the length predictor's view).
    predicted_outstanding_tokens: float = 0.0
    # What it serves and the dtype it computes in, as its Stats said ("": not known or said).
    model: str = ""
    dtype: str = ""

    @classmethod
    def from_proto(cls, msg: pb.EngineStatus) -> EngineStatus:
        return cls(
            engine_id=msg.engine_id,
            address=msg.address,
            healthy=msg.healthy,
            inflight_groups=msg.inflight_groups,
            inflight_samples=msg.inflight_samples,
            outstanding_tokens=msg.outstanding_tokens,
            capacity_samples=msg.capacity_samples,
            last_error=msg.last_error,
            weights_path=msg.weights_path,
            weights_version=msg.weights_version,
            loading_weights=msg.loading_weights,
            restarts=msg.restarts,
            predicted_outstanding_tokens=msg.predicted_outstanding_tokens,
            model=msg.model,
            dtype=msg.dtype,
        )


@dataclass(frozen=True, slots=True)
class SchedulerStatus:
    queue_depth: int  # groups waiting for an engine
    inflight_groups: int
    inflight_samples: int
    groups_delivered: int
    samples_delivered: int
    tokens_generated: int  # output tokens of delivered groups
    groups_failed: int
    groups_cancelled: int
    engine_failures: int  # times an engine was marked unhealthy
    engines: tuple[EngineStatus, ...]
    samples_preempted: int = 0  # times a running sample was stopped, its tokens kept
    predictor_keys: int = 0  # prompt keys with length history
    predictor_epoch: int = 0  # the length predictor's newest epoch
    # The predictor's accuracy over the latest delivered samples (up to 4096): each one's
    # length as predicted from its prompt's history before it was learnt, against the truth.
    predictor_scored_samples: int = 0
    predictor_mae_tokens: float | None = None  # mean absolute error, tokens
    predictor_tail_auc: float | None = None  # ranking of the longest 10% (1: perfect, 0.5: chance)
    # The fleet's weights: the last publish_version with a weights_path ("" and 0: none).
    fleet_weights_path: str = ""
    fleet_weights_version: int = 0
    # Publishes without weights whose engines have not all said what the samples had made.
    publishes_awaiting_counts: int = 0
    # Earlier outputs of their prompts (made on other engines) that calls carried to engines
    # that draft from them.
    earlier_outputs_sent: int = 0
    # Outputs sent at once to engines running other samples of their groups (AddOutputs).
    earlier_outputs_pushed: int = 0
    # Stream entries every reader had acknowledged, removed since the scheduler started.
    stream_entries_trimmed: int = 0
    samples_streamed: int = 0  # written to the samples streams as they finished
    runs: tuple[RunStatus, ...] = ()  # those with groups queued or running, by run id

    @classmethod
    def from_proto(cls, msg: pb.StatusResponse) -> SchedulerStatus:
        return cls(
            queue_depth=msg.queue_depth,
            inflight_groups=msg.inflight_groups,
            inflight_samples=msg.inflight_samples,
            groups_delivered=msg.groups_delivered,
            samples_delivered=msg.samples_delivered,
            tokens_generated=msg.tokens_generated,
            groups_failed=msg.groups_failed,
            groups_cancelled=msg.groups_cancelled,
            engine_failures=msg.engine_failures,
            engines=tuple(EngineStatus.from_proto(e) for e in msg.engines),
            samples_preempted=msg.samples_preempted,
            predictor_keys=msg.predictor_keys,
            predictor_epoch=msg.predictor_epoch,
            predictor_scored_samples=msg.predictor_scored_samples,
            predictor_mae_tokens=msg.predictor_mae_tokens
            if msg.HasField("predictor_mae_tokens")
            else None,
            predictor_tail_auc=msg.predictor_tail_auc
            if msg.HasField("predictor_tail_auc")
            else None,
            fleet_weights_path=msg.fleet_weights_path,
            fleet_weights_version=msg.fleet_weights_version,
            publishes_awaiting_counts=msg.publishes_awaiting_counts,
            earlier_outputs_sent=msg.earlier_outputs_sent,
            earlier_outputs_pushed=msg.earlier_outputs_pushed,
            stream_entries_trimmed=msg.stream_entries_trimmed,
            samples_streamed=msg.samples_streamed,
            runs=tuple(RunStatus.from_proto(r) for r in msg.runs),
        )

    @property
    def healthy_engines(self) -> int:
        return sum(e.healthy for e in self.engines)

    @property
    def engine_dtypes(self) -> tuple[str, ...]:
        """The dtypes the engines said they compute in, each once, sorted (those that said)."""
        return tuple(sorted({e.dtype for e in self.engines if e.dtype}))


def submit_request(run_id: str, groups: Sequence[PromptGroup]) -> pb.SubmitRequest:
    """The Submit request of a batch; rejects a batch that repeats a group id."""
    _check_text("run_id", run_id)
    groups = list(groups)  # (a generator read twice sent none)
    seen: set[str] = set()
    for i, group in enumerate(groups):
        if not isinstance(group, PromptGroup):
            raise InvalidArgument(f"groups[{i}] is a {type(group).__name__}, not a PromptGroup")
        if group.group_id in seen:
            raise InvalidArgument(f"groups[{i}].group_id ({group.group_id!r}) repeats in the batch")
        seen.add(group.group_id)
    return pb.SubmitRequest(run_id=run_id, groups=[g.to_proto() for g in groups])


def publish_version_request(
    run_id: str, version: int, weights_path: str = ""
) -> pb.PublishVersionRequest:
    if isinstance(version, bool) or not isinstance(version, int):
        raise InvalidArgument(f"version must be an int, got {type(version).__name__}")
    if not 0 <= version <= MAX_POLICY_VERSION:
        raise InvalidArgument(f"version ({version}) must be in 0..{MAX_POLICY_VERSION}")
    _check_text("weights_path", weights_path)
    _check_text("run_id", run_id)
    return pb.PublishVersionRequest(run_id=run_id, version=version, weights_path=weights_path)


WEIGHTS_TIMEOUT_S = 900.0  # a PublishVersion that loads weights into the engines


def publish_timeout_s(rpc_timeout_s: float, weights_path: str, timeout_s: float | None) -> float:
    """The deadline of a PublishVersion call: the caller's, or the client's, or at least
    ``WEIGHTS_TIMEOUT_S`` when the engines load weights."""
    if timeout_s is not None:
        return timeout_s
    return max(rpc_timeout_s, WEIGHTS_TIMEOUT_S) if weights_path else rpc_timeout_s


def cancel_request(run_id: str, group_ids: Sequence[str]) -> pb.CancelRequest:
    if isinstance(group_ids, str):
        raise InvalidArgument("group_ids must be a sequence of ids, not one string")
    group_ids = list(group_ids)  # (a generator read twice sent none)
    _check_text("run_id", run_id)
    for i, group_id in enumerate(group_ids):
        _check_text(f"group_ids[{i}]", group_id)
        if not 0 < len(group_id) <= MAX_GROUP_ID_LEN:
            raise InvalidArgument(
                f"group_ids[{i}] is {len(group_id)} characters; it must be 1 to {MAX_GROUP_ID_LEN}"
            )
    return pb.CancelRequest(run_id=run_id, group_ids=list(group_ids))
