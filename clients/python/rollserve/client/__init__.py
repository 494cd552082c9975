"""rollserve's trainer SDK: submit prompt groups, read finished groups exactly once.

Sync: :class:`RolloutClient`; asyncio: :class:`AsyncRolloutClient`. The stream's
format, for readers in other languages, is in docs/stream-format.md.
"""

from rollserve.client.aio import AsyncReceivedGroup, AsyncRolloutClient
from rollserve.client.client import ReceivedGroup, RolloutClient
from rollserve.client.errors import (
    InvalidArgument,
    ResourceExhausted,
    RolloutError,
    SchedulerUnavailable,
    StreamUnavailable,
    UndecodableEntry,
)
from rollserve.client.types import (
    CancelResult,
    EngineStatus,
    FinishReason,
    GroupResult,
    GroupStatus,
    PromptGroup,
    Sample,
    SamplingParams,
    SchedulerStatus,
)
from rollserve.client.wire import SCHEMA_VERSION, VersionSegment, stream_key

__all__ = [
    "SCHEMA_VERSION",
    "AsyncReceivedGroup",
    "AsyncRolloutClient",
    "CancelResult",
    "EngineStatus",
    "FinishReason",
    "GroupResult",
    "GroupStatus",
    "InvalidArgument",
    "PromptGroup",
    "ReceivedGroup",
    "ResourceExhausted",
    "RolloutClient",
    "RolloutError",
    "Sample",
    "SamplingParams",
    "SchedulerStatus",
    "SchedulerUnavailable",
    "StreamUnavailable",
    "UndecodableEntry",
    "VersionSegment",
    "stream_key",
]
