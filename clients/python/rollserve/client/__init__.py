"""rollserve's trainer SDK: submit prompt groups, read finished groups exactly once.

Sync: :class:`RolloutClient`; asyncio: :class:`AsyncRolloutClient`. Trainer steps over-sampled
with the tail carried over: :class:`StepBatcher` / :class:`AsyncStepBatcher`. The stream's
format, for readers in other languages, is in docs/stream-format.md.
"""

from rollserve.client.aio import AsyncReceivedGroup, AsyncReceivedSample, AsyncRolloutClient
from rollserve.client.batches import (
    AsyncStepBatcher,
    BatchedGroup,
    BatchTimeout,
    Dropped,
    GroupsRefused,
    StepBatch,
    StepBatcher,
    StepCounts,
)
from rollserve.client.client import ReceivedGroup, ReceivedSample, RolloutClient
from rollserve.client.credentials import SchedulerCredentials
from rollserve.client.errors import (
    AlreadySubmitted,
    ClientClosed,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    RolloutError,
    RunDeleted,
    SchedulerUnavailable,
    StreamReadOnly,
    StreamRefused,
    StreamUnavailable,
    Unauthenticated,
    UndecodableEntry,
)
from rollserve.client.types import (
    CancelResult,
    DeleteRunResult,
    EngineStatus,
    FinishReason,
    GroupResult,
    GroupStatus,
    PromptGroup,
    PublishResult,
    RunStatus,
    Sample,
    SamplingParams,
    SchedulerStatus,
)
from rollserve.client.wire import (
    SCHEMA_VERSION,
    SampleResult,
    VersionSegment,
    samples_stream_key,
    stream_key,
)

__all__ = [
    "SCHEMA_VERSION",
    "AlreadySubmitted",
    "AsyncReceivedGroup",
    "AsyncReceivedSample",
    "AsyncRolloutClient",
    "AsyncStepBatcher",
    "BatchTimeout",
    "BatchedGroup",
    "CancelResult",
    "ClientClosed",
    "DeleteRunResult",
    "Dropped",
    "EngineStatus",
    "FinishReason",
    "GroupResult",
    "GroupStatus",
    "GroupsRefused",
    "InvalidArgument",
    "PermissionDenied",
    "PromptGroup",
    "PublishResult",
    "ReceivedGroup",
    "ReceivedSample",
    "ResourceExhausted",
    "RolloutClient",
    "RolloutError",
    "RunDeleted",
    "RunStatus",
    "Sample",
    "SampleResult",
    "SamplingParams",
    "SchedulerCredentials",
    "SchedulerStatus",
    "SchedulerUnavailable",
    "StepBatch",
    "StepBatcher",
    "StepCounts",
    "StreamReadOnly",
    "StreamRefused",
    "StreamUnavailable",
    "Unauthenticated",
    "UndecodableEntry",
    "VersionSegment",
    "samples_stream_key",
    "stream_key",
]
