"""The Redis stream contract between the scheduler (writer) and trainers (readers).

One module owns it so that the writer and every reader agree byte for byte.
The format is documented for readers in other languages in docs/stream-format.md.

Keys of a run ``R`` (``{R}`` is a Redis hash tag, so a run's keys share a
cluster slot and the scheduler's Lua scripts may touch them together):

- ``rollserve:{R}:groups``  the stream, one entry per finished or failed group
- ``rollserve:{R}:pending`` hash group_id -> accepted group (msgpack), until it ends
- ``rollserve:{R}:ended``   set of group ids that were delivered, failed or cancelled
- ``rollserve:{R}:samples`` a second stream, one entry per finished sample of the groups
  submitted with ``stream_samples``, written the moment it finishes
- ``rollserve:{R}:streamed:<group_id>`` hash index -> the sample as written to the samples
  stream, while its group has not ended (a restarted scheduler keeps those samples)

An entry has three fields:

- ``v``        the schema version, ``"1"``
- ``group_id`` the caller's group id (lets a reader suppress duplicates cheaply)
- ``body``     a JSON object, :class:`GroupResult`

An entry of the samples stream has ``v``, ``sample_id`` (``"<group_id>/<index>"``) and
``body``, a JSON object :class:`SampleResult`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator, Sequence
from typing import TypeVar

import msgspec

_T = TypeVar("_T")

SCHEMA_VERSION = "1"
KEY_PREFIX = "rollserve"
RUNS_KEY = f"{KEY_PREFIX}:runs"  # set of run ids with state in Redis
WEIGHTS_KEY = f"{KEY_PREFIX}:weights"  # hash: the fleet's weights (path, version, run, since)

MAX_RUN_ID_LEN = 128
DELETES_KEPT_S = 7 * 24 * 3600  # how long a run's count of deletes stays (``deletes_key``)
MAX_POLICY_VERSION = 2**31 - 1  # PublishVersion's bound (Redis scripts count in doubles)
# A group's epoch (passes over the dataset): far past any run's, so a wrong one is caught before
# it moves the length predictor's clock and ages all it learnt away.
MAX_EPOCH = 1_000_000
# The most characters of a refusal's status details: gRPC sends them percent-encoded in the
# trailers and drops a call whose trailers pass 16 KiB (the caller then reads
# RESOURCE_EXHAUSTED "received metadata size exceeds hard limit" instead of the refusal).
# 1,000 characters are at most 12,000 bytes so encoded.
MAX_STATUS_DETAILS = 1_000
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
# What one group may carry, checked by the SDK and the scheduler alike: each is kept in memory
# and in Redis until the group ends (the prompt key for good, in the length history).
MAX_GROUP_ID_LEN = 256  # characters
MAX_PROMPT_KEY_LEN = 1024  # characters: a dataset row's id, or a hash of a longer one
MAX_METADATA_BYTES = 16 * 1024  # keys and values, UTF-8
MAX_STOP_STRINGS = 64
MAX_STOP_LEN = 1024  # characters of one stop string
MAX_STOP_TOKEN_IDS = 1024
# Samples of a group: n of a Generate call (an engine takes a vLLM request and a task per
# sample of a call), so the scheduler's --max-n too
MAX_SAMPLES_PER_CALL = 1024
# prompt_text is tokenized before its tokens can be counted: a text longer than this many
# characters a token of the prompt limit is refused unread (a tokenizer's tokens are rarely
# more than a few characters long on average, and tokenizing is the scheduler's time).
MAX_PROMPT_CHARS_PER_TOKEN = 8
MAX_TEMPERATURE = 2.0  # vLLM refuses a hotter request (as OpenAI's API does)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # a seed's range (sample i is seeded seed + i)
MAX_WEIGHTS_PATH_LEN = 4096  # characters of a checkpoint path (PublishVersion, UpdateWeights)
MAX_EARLIER_OUTPUTS = 256  # earlier outputs a Generate call carries (the drafter keeps 64)
MAX_EARLIER_OUTPUT_TOKENS = 1 << 22  # their tokens a call (16 MiB as 4-byte ids)
RUN_ID_ALPHABET = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
# An engine id: no control character (ids go into logs and metrics' labels).
ENGINE_ID_PATTERN = r"^[^\x00-\x1f\x7f]+$"


def stream_key(run_id: str) -> str:
    return f"{KEY_PREFIX}:{{{run_id}}}:groups"


def samples_stream_key(run_id: str) -> str:
    """The stream of finished samples of the run's groups submitted with ``stream_samples``."""
    return f"{KEY_PREFIX}:{{{run_id}}}:samples"


def streamed_key(run_id: str, group_id: str) -> str:
    """Hash: index -> the entry's body (``SampleResult`` JSON) of each sample of the group
    written to the samples stream, until the group ends."""
    return f"{KEY_PREFIX}:{{{run_id}}}:streamed:{group_id}"


def pending_key(run_id: str) -> str:
    return f"{KEY_PREFIX}:{{{run_id}}}:pending"


def ended_key(run_id: str) -> str:
    return f"{KEY_PREFIX}:{{{run_id}}}:ended"


def deletes_key(run_id: str) -> str:
    """How many times the run was deleted (an integer; absent: 0), counted by DeleteRun and
    kept ``DELETES_KEPT_S`` after the last: a reader whose stream vanished learns whether the
    run was deleted since it made its consumer group (and then makes nothing again)."""
    return f"{KEY_PREFIX}:{{{run_id}}}:deletes"


def version_key(run_id: str) -> str:
    """The run's policy version (an integer; absent: 0), set by PublishVersion."""
    return f"{KEY_PREFIX}:{{{run_id}}}:version"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class GroupStatus(str, enum.Enum):
    DELIVERED = "delivered"  # all n samples are in the entry
    FAILED = "failed"  # no samples; ``error`` says why


class VersionSegment(msgspec.Struct, array_like=True, frozen=True):
    """``length`` consecutive response tokens generated under policy ``version``."""

    version: int
    length: int

    def __iter__(self) -> Iterator[int]:
        """``version, length``, as the stream's ``[version, length]`` pairs unpack."""
        yield self.version
        yield self.length


class Sample(msgspec.Struct, frozen=True, kw_only=True):
    sample_id: str  # "<group_id>/<index>"
    index: int
    token_ids: list[int]
    logprobs: list[float]  # one per token, of the distribution actually sampled from
    finish_reason: FinishReason
    engine_id: str
    versions: list[VersionSegment] = []
    num_prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    preemptions: int = 0
    resumed_tokens: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_drafts: int = 0  # verification passes that carried drafts
    started_at: float = 0.0  # unix seconds, first dispatch of this sample
    finished_at: float = 0.0


class GroupResult(msgspec.Struct, frozen=True, kw_only=True):
    run_id: str
    group_id: str
    status: GroupStatus
    prompt_key: str = ""
    prompt_token_ids: list[int] = []
    samples: list[Sample] = []
    metadata: dict[str, str] = {}
    error: str = ""
    attempts: int = 1  # dispatches it took (more than 1 after engine failures)
    submitted_at: float = 0.0
    finished_at: float = 0.0

    @property
    def latency_s(self) -> float:
        return self.finished_at - self.submitted_at

    @property
    def num_output_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)

    @property
    def oldest_version(self) -> int | None:
        """The oldest policy version any of its tokens was made under (None without tokens):
        a trainer at version ``v`` learns from tokens ``v - oldest_version`` versions old."""
        return min((seg.version for s in self.samples for seg in s.versions), default=None)


class SampleResult(msgspec.Struct, frozen=True, kw_only=True):
    """One finished sample of a group submitted with ``stream_samples``, as it finished. The
    group's entry in the groups stream carries the same sample once all ``n`` have finished;
    a group that fails or is cancelled after some of its samples were written has no entry
    there (failed: an entry with no samples), so a sample is final training data only with
    its group."""

    run_id: str
    group_id: str
    n: int  # samples in the group
    prompt_key: str = ""
    metadata: dict[str, str] = {}
    submitted_at: float = 0.0  # unix seconds, the group accepted by the scheduler
    sample: Sample

    @property
    def sample_id(self) -> str:
        return self.sample.sample_id

    @property
    def index(self) -> int:
        return self.sample.index


def first_non_finite(logprobs: Sequence[float]) -> int | None:
    """Index of the first logprob that is NaN or infinite, None if all are finite. Such a
    value cannot be trained on, and JSON cannot carry it (it would be written as null and
    the entry would not decode): engines and the scheduler refuse it before the stream."""
    for index, value in enumerate(logprobs):
        if not math.isfinite(value):
            return index
    return None


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(GroupResult)


class SchemaError(ValueError):
    """An entry that this reader cannot decode (unknown version or bad body)."""


def encode_entry(result: GroupResult) -> dict[str, bytes]:
    return {
        "v": SCHEMA_VERSION.encode(),
        "group_id": result.group_id.encode(),
        "body": _encoder.encode(result),
    }


def decode_entry(fields: dict[bytes, bytes]) -> GroupResult:
    return _decode(fields, _decoder)


_sample_decoder = msgspec.json.Decoder(SampleResult)


def encode_sample_entry(result: SampleResult) -> dict[str, bytes]:
    return {
        "v": SCHEMA_VERSION.encode(),
        "sample_id": result.sample.sample_id.encode(),
        "body": _encoder.encode(result),
    }


def decode_sample_entry(fields: dict[bytes, bytes]) -> SampleResult:
    return _decode(fields, _sample_decoder)


def _decode(fields: dict[bytes, bytes], decoder: msgspec.json.Decoder[_T]) -> _T:
    version = fields.get(b"v")
    if version != SCHEMA_VERSION.encode():
        raise SchemaError(f"stream entry schema version {version!r}; this reader knows '1'")
    body = fields.get(b"body")
    if body is None:
        raise SchemaError("stream entry has no 'body' field")
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise SchemaError(f"stream entry body does not decode: {exc}") from exc


def status_details(message: str) -> str:
    """``message`` cut to ``MAX_STATUS_DETAILS`` characters (saying how long it was), so that a
    refusal that quotes what it was sent reaches the caller whatever was sent."""
    if len(message) <= MAX_STATUS_DETAILS:
        return message
    return f"{message[: MAX_STATUS_DETAILS - 40]}... ({len(message)} characters in all)"


def quoted(text: str, limit: int = 100) -> str:
    """``repr(text)``, its first ``limit`` characters where it is longer: for a message that
    quotes what it was sent."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"
