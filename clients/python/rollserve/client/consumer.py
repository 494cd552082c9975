"""The bookkeeping of one stream consumer, without I/O, shared by both clients.

A reader of the run's stream goes through three kinds of reads, in this order:

1. its own pending entries: ``XREADGROUP ... STREAMS key 0``, then from the last
   id returned, until a read comes back empty. These were delivered to this
   consumer name before (a previous process with the same name, or an iterator
   that stopped early) and never acknowledged. Redis does not block on them.
2. ``XAUTOCLAIM key group me claim_idle_ms cursor``: entries another consumer
   took and left unacknowledged for longer than ``claim_idle_ms`` (it died, or
   is too slow). A scan runs every ``claim_idle_ms / 2`` and walks the whole
   pending list with the cursor before it rests.
3. ``XREADGROUP ... STREAMS key >``: new entries, blocking up to ``block_ms``
   but never past the next claim scan or the caller's deadline.

:class:`ConsumerState` says which read comes next (:meth:`~ConsumerState.next_read`),
is told what it returned (:meth:`~ConsumerState.on_read`) and answers with a
:class:`Batch`: what to do with each entry. An entry is

- handed to the caller (:class:`Deliver`);
- left alone: it is already in the caller's hands, not yet acknowledged (our
  own claim scan re-claimed it, which only resets its idle time);
- acknowledged unread (:class:`Drop`): a second entry for a group id this
  consumer already handed out, or an entry trimmed from the stream while pending;
- reported (:class:`~rollserve.client.errors.UndecodableEntry`), and left pending.

The clients (``client.py`` over redis-py, ``aio.py`` over redis.asyncio) only run
the reads it asks for and give out what it decides.

**Heartbeat.** An entry a read returned stays pending for this consumer until it is
acknowledged, and step 2 of every other consumer takes it over once it has been idle
``claim_idle_ms``. So that only a dead (or hung) process loses its entries, the clients
re-claim the entries this consumer holds every ``claim_idle_ms / 3``
(:attr:`ConsumerConfig.heartbeat_interval_s`), which resets their idle time without
raising their delivery count. Held are the entries handed to the caller and not yet
acknowledged, and those a read returned for delivery that no iterator has handed out yet
(:meth:`~ConsumerState.beat_ids`), even after the iterator that read them ended: the next
iteration's read of the pending list hands them out. A beat runs :data:`HEARTBEAT_SCRIPT`:
``XCLAIM key group me 0 ids... JUSTID`` on the ids still pending *for this consumer*
(a plain XCLAIM would take an id back from a consumer that took it over while this
process stalled). :meth:`~ConsumerState.on_heartbeat` reads its reply: an id held by
another consumer now is lost to us (a warning names its group; one read ahead is not
handed out), an id no longer pending was acknowledged (or trimmed); neither is beaten
again. :meth:`~ConsumerState.release` stops beating an entry the caller keeps pending
on purpose, for another consumer to take over.

Duplicates are recognised by group id in a bounded set (``dedupe_capacity``, the
most recent acknowledged group ids) plus the groups in the caller's hands. The
scheduler writes one entry per group id, so a second entry is rare; the common
duplicate is the same entry read again (our pending list, our claim scan). What no
consumer can see is whether another consumer used an entry before it died without
acknowledging it: that entry is delivered again, with ``delivery_count > 1``.
"""

from __future__ import annotations

import enum
import logging
import math
import os
import secrets
import socket
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar, cast

import redis
from rollserve.client.errors import (
    InvalidArgument,
    RolloutError,
    StreamUnavailable,
    UndecodableEntry,
    is_read_only,
    is_wrong_type,
    refuses_keys,
    stream_error,
)
from rollserve.client.wire import (
    MAX_RUN_ID_LEN,
    RUN_ID_ALPHABET,
    GroupResult,
    SampleResult,
    SchemaError,
    decode_entry,
    decode_sample_entry,
    deletes_key,
    samples_stream_key,
    stream_key,
)

log = logging.getLogger(__name__)
_R = TypeVar("_R")
_Result = TypeVar("_Result", GroupResult, SampleResult)

StreamKind = Literal["groups", "samples"]
STREAM_KINDS: tuple[StreamKind, ...] = ("groups", "samples")
_KIND: dict[StreamKind, str] = {"groups": "group", "samples": "sample"}

PENDING_START_ID = "0"
NEW_ENTRIES_ID = ">"
CLAIM_START_CURSOR = "0-0"
DEFAULT_READ_COUNT = 64  # entries per XREADGROUP / XAUTOCLAIM call
DEFAULT_DEDUPE_CAPACITY = 100_000  # acknowledged group ids remembered
HEARTBEATS_PER_CLAIM_IDLE = 3  # beats within claim_idle_ms: idle time stays far below it
HEARTBEAT_CHUNK = 512  # ids per heartbeat script call (Lua's unpack() has a stack limit)

# KEYS[1]: the stream; ARGV[1]: the consumer group; ARGV[2]: this consumer; ARGV[3..]: ids.
# Re-claims, with min-idle 0 and JUSTID (idle time reset, delivery count unchanged), the ids
# still pending for ARGV[2]; XCLAIM alone would take an id from whoever holds it. Returns
# {claimed ids, {id, holder, id, holder, ...}} for the ids another consumer holds now; ids
# no longer pending (acknowledged, or trimmed) are in neither list. Atomic, as scripts are.
HEARTBEAT_SCRIPT = """
local claim = {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], '0'}
local others = {}
for i = 3, #ARGV do
  local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  local entry = pending[1]
  if entry then
    if entry[2] == ARGV[2] then
      claim[#claim + 1] = ARGV[i]
    else
      others[#others + 1] = ARGV[i]
      others[#others + 1] = entry[2]
    end
  end
end
local claimed = {}
if #claim > 5 then
  claim[#claim + 1] = 'JUSTID'
  claimed = redis.call(unpack(claim))
end
return {claimed, others}
"""

# KEYS: stream. ARGV: group, consumer, parking consumer, idle ms, then entry ids. Moves to the
# parking consumer, idle, those of the ids still pending for the consumer (one another
# consumer took over meanwhile stays its own); returns how many it moved.
PARK_SCRIPT = """
local moved = 0
for i = 5, #ARGV do
  local held = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if #held > 0 then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, ARGV[i], 'IDLE', ARGV[4], 'JUSTID')
    moved = moved + 1
  end
end
return moved
"""


# A read waits up to block_ms in Redis: the client's socket timeout must outlast it.
READ_TIMEOUT_MARGIN_S = 5.0
_TRUE = {"true", "1", "yes", "on"}


def redis_client(from_url: Callable[..., _R], redis_url: str, block_ms: int) -> _R:
    """The Redis client of a reader (``from_url`` of redis-py's sync or asyncio client):
    its socket timeout is ``block_ms`` plus a margin unless ``redis_url`` sets one (which
    must then outlast ``block_ms``: redis-py 8's default of 5 s cut every longer read off
    as an outage), and it must not decode replies (the entries are binary)."""
    if not isinstance(redis_url, str):
        raise InvalidArgument(f"redis_url must be a str, got {type(redis_url).__name__}")
    try:
        client = from_url(redis_url, socket_timeout=block_ms / 1000 + READ_TIMEOUT_MARGIN_S)
    except ValueError as exc:
        raise InvalidArgument(f"redis_url ({redis_url!r}): {exc}") from exc
    options = cast(Any, client).connection_pool.connection_kwargs
    if str(options.get("decode_responses", "")).lower() in _TRUE:
        raise InvalidArgument(
            "redis_url sets decode_responses: the stream's entries are binary, leave it out"
        )
    timeout = options.get("socket_timeout")
    if timeout is not None and float(timeout) * 1000 <= block_ms:
        raise InvalidArgument(
            f"block_ms ({block_ms}) must be below redis_url's socket_timeout ({timeout} s): "
            "a read waits up to block_ms for new entries"
        )
    return client


def deletes_count(reply: object) -> int:
    """The count of a run's deletes from GET's reply."""
    return int(reply) if isinstance(reply, (bytes, str, int)) else 0


def run_deleted(config: ConsumerConfig) -> str:
    """What a reader says when its run was deleted while it read."""
    return (
        f"run {config.run_id!r} was deleted (DeleteRun) while this client read {config.stream}: "
        "nothing more will come of it (a Submit of the run id starts it anew)"
    )


def heartbeat_refused(exc: Exception) -> str:
    """What to say when Redis refuses the heartbeat script (an ACL without scripting)."""
    return (
        f"Redis refuses the heartbeat script ({exc}): the groups this consumer holds would be "
        "taken over by other consumers after claim_idle_ms while the trainer still uses them. "
        "Give the Redis user scripting (SCRIPT LOAD, EVALSHA), or pass heartbeat=False with a "
        "claim_idle_ms above the longest time a group is held"
    )


def heartbeat_error(exc: redis.RedisError, stream: str) -> RolloutError:
    """What the reader raises for a heartbeat Redis refused (not an outage, which the next
    beat retries): the groups held are no longer kept claimed. The advice is for the cause
    Redis names (a read-only replica, no permission on the run's keys, a key of another
    type); otherwise it is the usual one, an ACL without scripting."""
    if is_read_only(exc) or refuses_keys(exc) or is_wrong_type(exc):
        return stream_error(exc, f"heartbeat of {stream}")
    return StreamUnavailable(heartbeat_refused(exc))


def park_refused(stream: str, count: int, exc: Exception) -> None:
    """Says that Redis refused PARK_SCRIPT (no scripting): not fatal, since other consumers
    take the released entries over once idle past claim_idle_ms anyway."""
    log.warning(
        "stream %s: could not give up %d released entries (%s); other consumers take them "
        "over after claim_idle_ms",
        stream,
        count,
        exc,
    )


def default_consumer_name() -> str:
    """``host-pid-random``: unique per process; pass your own to resume after a restart."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class Source(enum.Enum):
    PENDING = "pending"  # our own unacknowledged entries, read from id 0
    CLAIMED = "claimed"  # taken over from an idle consumer by XAUTOCLAIM
    NEW = "new"  # never delivered before


@dataclass(frozen=True, slots=True)
class RawEntry:
    """One entry as Redis returned it. ``fields`` is empty for an entry trimmed from
    the stream while it was pending; ``entry_id`` is None when Redis 6.2's
    XAUTOCLAIM returns such an entry (it does not say which id it was)."""

    entry_id: str | None
    fields: dict[bytes, bytes]


@dataclass(frozen=True, slots=True)
class ReadPending:
    start_id: str
    count: int


@dataclass(frozen=True, slots=True)
class Claim:
    cursor: str
    min_idle_ms: int
    count: int


@dataclass(frozen=True, slots=True)
class ReadNew:
    count: int
    block_ms: int  # >= 1: XREADGROUP's BLOCK 0 would mean forever
    start_id: str = NEW_ENTRIES_ID


NextRead = ReadPending | Claim | ReadNew


@dataclass(frozen=True, slots=True)
class Deliver:
    entry_id: str
    result: GroupResult | SampleResult
    key: str  # what duplicates are told by: the group id, or the sample id
    redelivered: bool  # from our pending list or claimed: its count is in XPENDING
    # Times this consumer read it before and did not hand it out (an iterator closed with
    # it read ahead): not deliveries to the trainer, taken off XPENDING's count.
    unhanded_reads: int = 0

    def delivery_count(self, pending_count: int) -> int:
        """Its delivery count, from XPENDING's (``pending_count``)."""
        return max(1, pending_count - self.unhanded_reads)


@dataclass(frozen=True, slots=True)
class Drop:
    entry_id: str
    reason: str  # why it is acknowledged without being delivered


@dataclass(frozen=True, slots=True)
class Batch:
    """What to do with one read's entries, in stream order.

    ``items`` are handed out in order up to the first :class:`UndecodableEntry`,
    which is raised; ``drop`` are acknowledged at once. Entries in neither list are
    already in the caller's hands (or are trimmed entries Redis did not name).
    """

    items: list[Deliver | UndecodableEntry]
    drop: list[Drop]

    @property
    def drop_ids(self) -> list[str]:
        return [d.entry_id for d in self.drop]

    @property
    def redelivered_ids(self) -> list[str]:
        return [d.entry_id for d in self.items if isinstance(d, Deliver) and d.redelivered]


@dataclass(frozen=True, slots=True)
class HeartbeatReply:
    """What a run of :data:`HEARTBEAT_SCRIPT` did with the ids it was given."""

    claimed: list[str]  # re-claimed: still ours, idle time reset
    taken: dict[str, str]  # entry id -> the consumer that holds it now


@dataclass(frozen=True, slots=True)
class Lost:
    """An entry this consumer held that a heartbeat found it no longer holds."""

    entry_id: str
    group_id: str  # what the entry holds: the group id, or the sample id (samples stream)
    holder: str | None  # the consumer that took it over; None: no longer pending at all
    in_hand: bool  # the caller has it; else it was read ahead and is not handed out


@dataclass(frozen=True, slots=True)
class ConsumerConfig:
    """Who reads which stream, and how. Checked once, shared by both clients."""

    run_id: str
    consumer_group: str
    consumer_name: str
    claim_idle_ms: int
    block_ms: int
    read_count: int = DEFAULT_READ_COUNT
    dedupe_capacity: int = DEFAULT_DEDUPE_CAPACITY
    heartbeat: bool = True  # keep held entries claimed while the process lives
    # The run's stream read: its finished groups, or the samples of its groups submitted
    # with ``stream_samples``, each as it finished.
    reads: StreamKind = "groups"

    def __post_init__(self) -> None:
        check_run_id(self.run_id)
        if self.reads not in STREAM_KINDS:
            raise InvalidArgument(f"reads ({self.reads!r}) must be one of {STREAM_KINDS}")
        for name in ("claim_idle_ms", "block_ms", "read_count", "dedupe_capacity"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgument(f"{name} must be an int, got {value!r}")
        if not self.consumer_group:
            raise InvalidArgument("consumer_group must not be empty")
        if not self.consumer_name:
            raise InvalidArgument("consumer_name must not be empty (None picks one)")
        if self.claim_idle_ms < 1:
            raise InvalidArgument(f"claim_idle_ms ({self.claim_idle_ms}) must be >= 1")
        if self.block_ms < 1:
            raise InvalidArgument(
                f"block_ms ({self.block_ms}) must be >= 1 (Redis reads 0 as forever)"
            )
        if self.read_count < 1:
            raise InvalidArgument(f"read_count ({self.read_count}) must be >= 1")
        if self.dedupe_capacity < 1:
            raise InvalidArgument(f"dedupe_capacity ({self.dedupe_capacity}) must be >= 1")

    @property
    def stream(self) -> str:
        return (
            samples_stream_key(self.run_id) if self.reads == "samples" else stream_key(self.run_id)
        )

    @property
    def deletes(self) -> str:
        """The key that counts the run's deletes (``wire.deletes_key``)."""
        return deletes_key(self.run_id)

    def check_reads(self, kind: StreamKind) -> None:
        """Refuses to iterate ``kind`` on a client that reads the other stream."""
        if kind != self.reads:
            raise InvalidArgument(
                f"this client reads the run's {self.reads} stream; make one with "
                f"reads={kind!r} to read its {kind}"
            )

    @property
    def heartbeat_interval_s(self) -> float:
        """Seconds between two heartbeats: a held entry's idle time stays below
        ``claim_idle_ms`` by a wide margin while this process lives."""
        return self.claim_idle_ms / HEARTBEATS_PER_CLAIM_IDLE / 1000


def check_run_id(run_id: str) -> None:
    if not run_id or len(run_id) > MAX_RUN_ID_LEN or not set(run_id) <= RUN_ID_ALPHABET:
        raise InvalidArgument(
            f"run_id ({run_id!r}) must be 1..{MAX_RUN_ID_LEN} characters of "
            "letters, digits, '-', '_' and '.'"
        )


class Budget:
    """How much one ``groups()`` iteration may still take: groups and time."""

    def __init__(self, limit: int | None, timeout_s: float | None, now: float) -> None:
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
            raise InvalidArgument(f"limit must be an int or None, got {limit!r}")
        if limit is not None and limit < 0:
            raise InvalidArgument(f"limit ({limit}) must be >= 0, or None for no limit")
        if timeout_s is not None and not timeout_s >= 0:
            raise InvalidArgument(f"timeout_s ({timeout_s}) must be >= 0, or None to wait forever")
        if timeout_s == math.inf:
            timeout_s = None  # forever
        self._left = limit
        self._deadline = None if timeout_s is None else now + timeout_s

    def exhausted(self, now: float) -> bool:
        return self._left == 0 or (self._deadline is not None and now >= self._deadline)

    def max_block_ms(self, now: float) -> int | None:
        return None if self._deadline is None else _ceil_ms(self._deadline - now)

    @property
    def max_count(self) -> int | None:
        return self._left

    def took_one(self) -> None:
        if self._left is not None:
            self._left -= 1


class _BoundedSet:
    """The most recent ``capacity`` keys, oldest evicted first."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()

    def add(self, key: str) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self._capacity:
            self._keys.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def discard(self, key: str) -> None:
        self._keys.pop(key, None)


class ConsumerState:
    """What one consumer has read, handed out and acknowledged. Not thread-safe.

    ``now`` arguments are ``time.monotonic()`` seconds, passed in so that this class
    does no I/O and reads no clock.
    """

    def __init__(self, config: ConsumerConfig) -> None:
        self.config = config
        self.group_ready = False  # XGROUP CREATE done (or the group was there)
        # The run's deletes counted when the group was made: one more since, and the stream
        # read is gone for good (a Submit of the id makes another run's).
        self.deletes_seen: int | None = None
        self._acked = _BoundedSet(config.dedupe_capacity)
        self._in_hand: dict[str, str] = {}  # entry id -> group id, handed out, not acked
        self._in_hand_groups: dict[str, str] = {}  # group id -> entry id
        self._unbeaten: set[str] = set()  # in hand, no longer kept claimed (lost)
        # Released by the caller: moved to the parking consumer (``parking_name``) by the
        # next read, idle already, for another consumer to claim at once; one this consumer's
        # own claim scan takes back is parked again, never handed out.
        self._released = _BoundedSet(config.dedupe_capacity)
        self._to_park: dict[str, None] = {}
        # Read for delivery, not handed out yet: entry -> group. Kept claimed until handed out,
        # also when the iteration that read it ends first (a batcher closes its iterator once
        # its batch is complete): the next iteration reads it again from our pending list.
        self._read_ahead: dict[str, str] = {}
        self._lost_ahead: set[str] = set()  # read ahead, then lost: never to be handed out
        # Entry -> times read and not handed out (each read counted a delivery in XPENDING
        # that no trainer saw).
        self._unhanded: OrderedDict[str, int] = OrderedDict()
        self._iteration = 0  # restart() count: which iteration is the current one
        self._pending_cursor: str | None = PENDING_START_ID  # None: pending list done
        self._claim_cursor = CLAIM_START_CURSOR
        self._next_claim_at = 0.0  # claim as soon as our own pending list is read

    # ------------------------------------------------------------ read order

    def restart(self) -> int:
        """A new iteration: read our own pending entries again before anything new.

        Entries left behind by an iterator that stopped early are pending for us; the
        ones still in the caller's hands are recognised and not handed out twice.
        Returns the iteration's number, for :meth:`stop_reading`.
        """
        self._pending_cursor = PENDING_START_ID
        self._iteration += 1
        self._lost_ahead.clear()
        return self._iteration

    def stop_reading(self, iteration: int) -> None:
        """Iteration ``iteration`` ended: entries it read and did not hand out stay pending
        for this consumer, kept claimed (another consumer would take them over while this
        process lives, and the trainer may be counting on them), and the next iteration
        reads them again. A no-op if a later iteration has begun (the old one was collected
        late)."""
        if iteration == self._iteration:
            self._lost_ahead.clear()

    def next_read(self, now: float, budget: Budget) -> NextRead:
        """The next read, within what the caller still wants (``budget``)."""
        max_count, max_block_ms = budget.max_count, budget.max_block_ms(now)
        count = (
            self.config.read_count if max_count is None else min(max_count, self.config.read_count)
        )
        count = max(1, count)
        if self._pending_cursor is not None:
            return ReadPending(self._pending_cursor, count)
        if now >= self._next_claim_at:
            return Claim(self._claim_cursor, self.config.claim_idle_ms, count)
        block_ms = min(self.config.block_ms, _ceil_ms(self._next_claim_at - now))
        if max_block_ms is not None:
            block_ms = min(block_ms, max_block_ms)
        return ReadNew(count, max(1, block_ms))

    def on_read(
        self,
        op: NextRead,
        entries: Sequence[RawEntry],
        now: float,
        *,
        next_cursor: str = CLAIM_START_CURSOR,
    ) -> Batch:
        """What ``op`` returned (and, for a claim, XAUTOCLAIM's next cursor): advances
        the read order and decides what to do with each entry."""
        if isinstance(op, Claim):
            self.on_claim(next_cursor, entries, now)
            source = Source.CLAIMED
        elif isinstance(op, ReadPending):
            self.on_pending_read(entries)
            source = Source.PENDING
        else:
            source = Source.NEW
        batch = self.classify(entries, source)
        for item in batch.items:
            if isinstance(item, Deliver):
                self._read_ahead[item.entry_id] = item.key
        for drop in batch.drop:
            self._read_ahead.pop(drop.entry_id, None)
            self._unhanded.pop(drop.entry_id, None)
            log.info(
                "stream %s: acking entry %s unread: %s",
                self.config.stream,
                drop.entry_id,
                drop.reason,
            )
        return batch

    def on_pending_read(self, entries: Sequence[RawEntry]) -> None:
        if not entries:
            self._pending_cursor = None
            return
        last = entries[-1].entry_id
        self._pending_cursor = last if last is not None else PENDING_START_ID

    def on_claim(self, next_cursor: str, entries: Sequence[RawEntry], now: float) -> None:
        self._claim_cursor = next_cursor
        if next_cursor == CLAIM_START_CURSOR:  # the scan reached the end
            self._next_claim_at = now + self.config.claim_idle_ms / 2000
        if any(e.entry_id is None for e in entries):
            # Redis 6.2 claimed trimmed entries without naming them; they are pending
            # for us now, and a read of our pending list names them so we can ack them.
            self._pending_cursor = PENDING_START_ID

    def deleted_since(self, deletes: int) -> bool:
        """Whether the run was deleted since this consumer made its group, ``deletes`` being
        the count of its deletes now."""
        return self.deletes_seen is not None and deletes != self.deletes_seen

    def group_lost(self) -> None:
        """The stream or the group was deleted (NOGROUP): create it again, start over."""
        log.warning(
            "stream %s: consumer group %r is gone: made again, unless the run was deleted "
            "(then RunDeleted is raised)",
            self.config.stream,
            self.config.consumer_group,
        )
        self.group_ready = False
        self._pending_cursor = PENDING_START_ID
        self._claim_cursor = CLAIM_START_CURSOR
        self._read_ahead.clear()  # (pending no more, for anyone)
        self._to_park.clear()  # (nothing left to give up: the entries went with the group)

    # ------------------------------------------------------------- decisions

    def classify(self, entries: Sequence[RawEntry], source: Source) -> Batch:
        items: list[Deliver | UndecodableEntry] = []
        drop: list[Drop] = []
        in_batch: set[str] = set()
        for entry in entries:
            entry_id = entry.entry_id
            if entry_id is None or entry_id in self._in_hand:
                continue
            if entry_id in self._released:  # our claim scan took it back: park it again
                self._to_park[entry_id] = None
                continue
            if not entry.fields:
                drop.append(Drop(entry_id, "trimmed from the stream before it was acknowledged"))
                continue
            try:
                result: GroupResult | SampleResult
                if self.config.reads == "samples":
                    result = decode_sample_entry(entry.fields)
                    key = result.sample_id
                else:
                    result = decode_entry(entry.fields)
                    key = result.group_id
            except SchemaError as exc:
                items.append(
                    UndecodableEntry(
                        f"stream entry {entry_id}: {exc}", entry_id=entry_id, fields=entry.fields
                    )
                )
                continue
            if key in self._acked or key in self._in_hand_groups or key in in_batch:
                drop.append(Drop(entry_id, f"duplicate of {_KIND[self.config.reads]} {key!r}"))
                continue
            in_batch.add(key)
            unhanded = self._unhanded.get(entry_id, 0)
            if entry_id in self._read_ahead:  # read before, never handed out: not a delivery
                unhanded = self._read_again(entry_id)
            items.append(Deliver(entry_id, result, key, source is not Source.NEW, unhanded))
        return Batch(items, drop)

    def _read_again(self, entry_id: str) -> int:
        """Counts one more read of an entry not handed out; returns the count."""
        count = self._unhanded.pop(entry_id, 0) + 1
        self._unhanded[entry_id] = count
        while len(self._unhanded) > self.config.dedupe_capacity:
            self._unhanded.popitem(last=False)
        return count

    def handed_out(self, entry_id: str, group_id: str) -> bool:
        """The caller now holds the entry; call it just before giving it out. False: do
        not give it out, a heartbeat found it lost while it waited (see :meth:`on_heartbeat`)."""
        self._read_ahead.pop(entry_id, None)
        if entry_id in self._lost_ahead:
            self._lost_ahead.discard(entry_id)
            return False
        if entry_id in self._in_hand or group_id in self._in_hand_groups or group_id in self._acked:
            # Another iteration of this consumer handed it out meanwhile (two ``groups()``
            # iterators at once), or its group was acknowledged: not handed out twice.
            return False
        self._unhanded.pop(entry_id, None)
        self._in_hand[entry_id] = group_id
        self._in_hand_groups[group_id] = entry_id
        return True

    def acked(self, entry_id: str) -> None:
        group_id = self._in_hand.pop(entry_id, None)
        self._unbeaten.discard(entry_id)
        self._released.discard(entry_id)
        self._to_park.pop(entry_id, None)
        if group_id is not None:
            self._in_hand_groups.pop(group_id, None)
            self._acked.add(group_id)

    def release(self, entry_id: str) -> None:
        """Gives an entry in the caller's hands up, unacknowledged, for another consumer:
        the next read parks it (``to_park``), idle, so that the first claim scan of another
        consumer takes it. It is not handed out here again (the caller may still ack it,
        which acknowledges it for the group). (Kept pending here, it was read again with
        this consumer's pending list at every ``groups()``, which kept it from going idle,
        and this consumer's own claim scans took it back.)"""
        group_id = self._in_hand.pop(entry_id, None)
        if group_id is None:
            return
        self._in_hand_groups.pop(group_id, None)
        self._unbeaten.discard(entry_id)
        self._released.add(entry_id)
        self._to_park[entry_id] = None

    @property
    def parking_name(self) -> str:
        """The consumer released entries are moved to (it never reads)."""
        return f"{self.config.consumer_name}.released"

    def to_park(self) -> list[str]:
        """The released entries to move to the parking consumer now (the caller does, with
        PARK_SCRIPT and ``park_args``)."""
        ids, self._to_park = list(self._to_park), {}
        return ids

    def park_failed(self, ids: Sequence[str]) -> None:
        """The move of ``ids`` did not reach Redis (an outage): the next read tries again
        for those still released (not acknowledged meanwhile)."""
        for entry_id in ids:
            if entry_id in self._released:
                self._to_park[entry_id] = None

    def park_args(self, ids: Sequence[str]) -> list[str | int]:
        """PARK_SCRIPT's arguments (its one key is the stream) for moving ``ids``."""
        config = self.config
        return [
            config.consumer_group,
            config.consumer_name,
            self.parking_name,
            config.claim_idle_ms,
            *ids,
        ]

    # ------------------------------------------------------------- heartbeat

    @property
    def needs_heartbeat(self) -> bool:
        """Entries are held that a heartbeat must keep claimed (and it is enabled)."""
        return bool(self.beat_ids())

    def beat_ids(self) -> list[str]:
        """The ids the next heartbeat re-claims: the entries in the caller's hands, except
        those lost or released, and those read ahead; none if the heartbeat is off."""
        if not self.config.heartbeat:
            return []
        held = [i for i in self._in_hand if i not in self._unbeaten]
        return held + list(self._read_ahead)

    def on_heartbeat(self, asked: Sequence[str], reply: HeartbeatReply) -> list[Lost]:
        """What a heartbeat for ``asked`` re-claimed. The ids it did not re-claim are
        no longer beaten and, read ahead, not handed out; logged here, returned."""
        claimed = set(reply.claimed)
        lost: list[Lost] = []
        for entry_id in asked:
            if entry_id in claimed:
                continue
            holder = reply.taken.get(entry_id)
            if entry_id in self._in_hand and entry_id not in self._unbeaten:
                self._unbeaten.add(entry_id)
                lost.append(Lost(entry_id, self._in_hand[entry_id], holder, in_hand=True))
            elif entry_id in self._read_ahead:
                group_id = self._read_ahead.pop(entry_id)
                self._lost_ahead.add(entry_id)
                lost.append(Lost(entry_id, group_id, holder, in_hand=False))
            # else: acknowledged (or released) since the heartbeat began
        for item in lost:
            self._log_lost(item)
        return lost

    def _log_lost(self, lost: Lost) -> None:
        stream, kind = self.config.stream, _KIND[self.config.reads]
        if lost.holder is None:
            log.info(
                "stream %s: entry %s of %s %r is no longer pending (acknowledged or "
                "trimmed); no longer kept claimed%s",
                stream,
                lost.entry_id,
                kind,
                lost.group_id,
                "" if lost.in_hand else ", not handed out",
            )
        elif lost.in_hand:
            log.warning(
                "stream %s: %s %r (entry %s), in this consumer's hands, was taken over by "
                "consumer %r (this process stalled past claim_idle_ms = %d ms?); it may be "
                "trained on twice",
                stream,
                kind,
                lost.group_id,
                lost.entry_id,
                lost.holder,
                self.config.claim_idle_ms,
            )
        else:
            log.warning(
                "stream %s: %s %r (entry %s), read and not yet handed out, was taken over "
                "by consumer %r (this process stalled past claim_idle_ms = %d ms?); "
                "not handed out here",
                stream,
                kind,
                lost.group_id,
                lost.entry_id,
                lost.holder,
                self.config.claim_idle_ms,
            )

    @property
    def in_hand(self) -> int:
        """Entries handed out and not yet acknowledged."""
        return len(self._in_hand)


class _Received(Generic[_Result]):
    __slots__ = ("delivery_count", "entry_id", "result")

    def __init__(self, result: _Result, entry_id: str, delivery_count: int) -> None:
        self.result: _Result = result
        self.entry_id = entry_id
        self.delivery_count = delivery_count  # 1 on first delivery

    @property
    def group_id(self) -> str:
        return str(self.result.group_id)

    @property
    def redelivered(self) -> bool:
        """Delivered before: to a consumer that died, or to this name before a restart.
        The trainer may have used it already if it died after training, before acking."""
        return self.delivery_count > 1


class ReceivedBase(_Received[GroupResult]):
    """A finished group read from the stream, not yet acknowledged."""

    __slots__ = ()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(group_id={self.group_id!r}, entry_id={self.entry_id!r}, "
            f"delivery_count={self.delivery_count}, status={self.result.status.value})"
        )


class ReceivedSampleBase(_Received[SampleResult]):
    """A finished sample read from the samples stream, not yet acknowledged."""

    __slots__ = ()

    @property
    def sample_id(self) -> str:
        return self.result.sample_id

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(sample_id={self.sample_id!r}, entry_id={self.entry_id!r}, "
            f"delivery_count={self.delivery_count})"
        )


def _ceil_ms(seconds: float) -> int:
    return max(0, int(seconds * 1000 + 0.999))


def is_nogroup(exc: Exception) -> bool:
    """A read found no stream or no consumer group (someone deleted them); also where a
    script met it (Redis 6.2 words that "Error running script (...): @user_script:4: NOGROUP
    ...")."""
    text = str(exc)
    return text.startswith("NOGROUP") or ": NOGROUP " in text


def is_busygroup(exc: Exception) -> bool:
    """XGROUP CREATE found the group already there."""
    return str(exc).startswith("BUSYGROUP")


def parse_entries(raw: Any) -> list[RawEntry]:
    """redis-py's ``[(id, {field: value}), ...]`` (ids and fields as bytes)."""
    return [
        RawEntry(
            entry_id=_as_str(entry_id) if entry_id is not None else None,
            fields=dict(fields) if fields else {},
        )
        for entry_id, fields in raw or ()
    ]


def parse_xreadgroup(raw: Any) -> list[RawEntry]:
    """XREADGROUP's reply for one stream, as redis-py gives it: ``[[key, entries]]``
    (RESP2) or ``{key: [entries]}`` (RESP3); empty or None when it timed out."""
    if not raw:
        return []
    if isinstance(raw, dict):  # RESP3: {key: [[entries]]}
        (wrapped,) = raw.values()
        return parse_entries(wrapped[0] if wrapped else ())
    ((_key, entries),) = raw
    return parse_entries(entries)


def parse_xautoclaim(raw: Any) -> tuple[str, list[RawEntry]]:
    """XAUTOCLAIM's reply: ``[next_cursor, entries]`` (+ deleted ids on Redis >= 7,
    which Redis already removed from the pending list)."""
    return _as_str(raw[0]), parse_entries(raw[1])


def heartbeat_chunks(ids: Sequence[str]) -> list[list[str]]:
    """The ids of one heartbeat, in script calls of at most :data:`HEARTBEAT_CHUNK`."""
    return [list(ids[i : i + HEARTBEAT_CHUNK]) for i in range(0, len(ids), HEARTBEAT_CHUNK)]


def parse_heartbeat(raw: Any) -> HeartbeatReply:
    """:data:`HEARTBEAT_SCRIPT`'s reply: ``[claimed ids, [id, holder, id, holder, ...]]``."""
    claimed, taken = raw
    flat = [_as_str(x) for x in taken or ()]
    return HeartbeatReply(
        claimed=[_as_str(x) for x in claimed or ()],
        taken=dict(zip(flat[::2], flat[1::2], strict=True)),
    )


def parse_delivery_count(raw: Any) -> int:
    """The delivery count in redis-py's XPENDING range reply for one id (0: not pending)."""
    if not raw:
        return 0
    return int(raw[0]["times_delivered"])


def _as_str(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)
