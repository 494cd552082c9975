"""Trainer steps of ``B`` groups, over-sampled, with the tail carried over within a staleness bound.

A synchronous trainer submits ``B`` groups a step and waits for the slowest: with long-tailed
response lengths the engines idle through the tail of every step. The step batcher keeps more
groups in flight than a step needs, hands the trainer the first ``B`` that finish, and carries the
others over into later steps, where they run first:

```python
with RolloutClient("scheduler:50051", "redis://redis:6379/0", "grpo-7") as client:
    batcher = StepBatcher(client, prompt_groups(), batch_size=64, oversample=0.5, max_staleness=1)
    for step, batch in zip(range(steps), batcher):
        train_on([g.result for g in batch.groups])  # g.staleness: policy versions behind
        batcher.ack(batch)
        load_weights_into_engines(step + 1)  # the trainer's own weight sync
        client.publish_version(step + 1)  # tokens from now on are of version step + 1
    batcher.cancel_outstanding()
```

The algorithm, step ``s`` (the number of batches handed out so far), with ``B = batch_size``:

1. **Top up.** Take groups from the trainer's iterator until ``ceil(B * (1 + oversample))`` are
   outstanding (launched, not yet in a batch) and submit them with ``priority = s``: the
   scheduler runs lower values first, so groups carried over from earlier steps go first.
2. **Wait** on the run's stream until at least ``B`` outstanding groups have finished *and* every
   group launched at step ``s - max_staleness`` or earlier has finished (it is *due*: the
   staleness bound says it must be in this batch).
3. **Hand out** the batch: the due groups first (oldest launch first), then the others in the
   order they finished, ``B`` in all. The rest stay outstanding, finished or not.

Every :class:`BatchedGroup` records its launch step and delivery step; their difference is
its staleness in policy versions when the trainer publishes one version per step. It never
exceeds ``max_staleness``. ``oversample = 0`` is a synchronous trainer: every batch is the
``B`` groups launched at its step. Batches hold exactly ``B`` groups until the iterator runs
out; then the last batches hold what is left, and iteration ends when nothing is outstanding.
A group whose generation failed is handed out like the others (its ``status`` says so).

Delivery keeps the SDK's guarantee: a group is acknowledged only by :meth:`StepBatcher.ack`,
after the trainer has used its batch. Finished groups carried over stay pending in the
consumer group meanwhile, for as many steps as ``max_staleness`` allows; the client's
heartbeat keeps them (and the batch in training) claimed while the process lives, so other
consumers of the group take them over only if it dies. With the client's ``heartbeat=False``,
``claim_idle_ms`` must exceed the time a group may wait if other consumers share the group.
Stream entries of groups this batcher did not launch (another trainer's, in a shared group)
are logged and released (the client's ``release``, where it has one): the client's next
read gives them up, unacknowledged and idle, so that another consumer's next claim scan
takes them over. A trainer that reads its run alone passes ``unknown_groups="discard"``:
such entries (the groups launched before a restart from a checkpoint) are acknowledged
unused instead of staying pending for good.

Dynamic sampling (DAPO's): with ``keep``, a function of a finished group's result, a group it
turns away (for GRPO, one whose samples all got the same reward) is acknowledged unused as it
arrives and leaves the outstanding groups, and the batcher launches another in its place at
once; batches then hold ``B`` groups it kept. It is asked only of the groups the batcher
launched. When the iterator runs out, the last batches hold the kept groups that are left.
An error of ``keep`` reaches the trainer, and the next call asks it again about the same group
(the client hands each entry out once: the batcher keeps what it has not settled).

A launch the scheduler cannot take now (a replacement while it restarts) stays in a backlog
that counts as outstanding: the wait for a batch retries it every ``RETRY_LAUNCH_S``, and so
does the next step. A group whose Submit may have gone through (it ran out of time) is
launched, at the step of that Submit, when its entry arrives or when a retry is told it is
taken already.

Bounds: ``0 <= oversample <= 1`` (more would carry over more than ``B`` groups, and the due
ones could not fit in one batch) and ``max_staleness >= 1`` when ``oversample > 0`` (with 0,
every launched group is due in its own step, so nothing could be carried over).

:class:`BatcherState` decides (no I/O, like :class:`~rollserve.client.consumer.ConsumerState`);
:class:`StepBatcher` (sync) and :class:`AsyncStepBatcher` (asyncio) carry out its decisions
over a :class:`~rollserve.client.RolloutClient` or :class:`~rollserve.client.AsyncRolloutClient`.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import numbers
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, Literal, Protocol, TypeVar, cast

from rollserve.client.consumer import ReceivedBase
from rollserve.client.errors import (
    AlreadySubmitted,
    InvalidArgument,
    ResourceExhausted,
    RolloutError,
)
from rollserve.client.types import CancelResult, PromptGroup
from rollserve.client.wire import GroupResult

__all__ = [
    "AsyncBatchClient",
    "AsyncStepBatcher",
    "BatchClient",
    "BatchTimeout",
    "BatchedGroup",
    "BatcherState",
    "Dropped",
    "GroupsRefused",
    "StepBatch",
    "StepBatcher",
    "StepCounts",
]

log = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT_S = 10.0
# While groups a failed launch left wait for a retry, the wait for a batch reads the stream
# this long at a time and tries the launch again in between.
RETRY_LAUNCH_S = 1.0

R = TypeVar("R", bound=ReceivedBase)

# Over-sampling rates are decimals such as 0.1: 10 * (1 + 0.1) is 11.000000000000002 in binary
# floating point, which must launch 11 groups, not 12.
_ROUNDING_DIGITS = 9


class BatchTimeout(RolloutError, TimeoutError):
    """No batch was complete within ``batch_timeout_s``; nothing was lost (the groups stay
    outstanding and the next call waits for them again)."""


@dataclass(frozen=True, slots=True)
class BatchedGroup(Generic[R]):
    """A finished group in a trainer's batch."""

    received: R  # the stream entry; acknowledged by ``ack`` of the batcher
    launch_step: int  # the step it was submitted in (its priority)
    delivery_step: int  # the step whose batch it is in
    due: bool  # it had reached max_staleness: the batch waited for it

    @property
    def group_id(self) -> str:
        return self.received.group_id

    @property
    def result(self) -> GroupResult:
        return self.received.result

    @property
    def staleness(self) -> int:
        """Steps (policy versions) between its launch and its delivery."""
        return self.delivery_step - self.launch_step


@dataclass(frozen=True, slots=True)
class StepBatch(Generic[R]):
    """One step's groups: due groups first (oldest launch first), then by finish order."""

    step: int
    groups: tuple[BatchedGroup[R], ...]
    launched: int  # groups submitted during this step (replacements of filtered ones too)
    filtered: int = 0  # groups that finished during this step and ``keep`` turned away

    @property
    def results(self) -> list[GroupResult]:
        return [g.result for g in self.groups]

    @property
    def received(self) -> list[R]:
        return [g.received for g in self.groups]

    def __len__(self) -> int:
        return len(self.groups)


@dataclass(frozen=True, slots=True)
class StepCounts:
    """What the step being assembled has done so far, before its batch is handed out. When
    iteration ends these are what came after the last batch: the groups launched and those
    ``keep`` turned away since (a trainer logging the filter rate per step adds them to its
    last step's)."""

    step: int
    launched: int
    filtered: int


@dataclass(frozen=True, slots=True)
class Dropped:
    """What ``cancel_outstanding`` did with the groups launched and not handed out."""

    cancelled: tuple[str, ...]  # were queued or running: never delivered
    discarded: tuple[str, ...]  # had finished: their entries acknowledged unused
    # Finished before the cancel, but their entries were not read within the drain time:
    # still pending in the consumer group.
    unread: tuple[str, ...]

    @property
    def group_ids(self) -> tuple[str, ...]:
        return self.cancelled + self.discarded + self.unread


class Arrival(enum.Enum):
    """What a stream entry was to the batcher."""

    NEW = "new"  # an outstanding group finished
    FILTERED = "filtered"  # an outstanding group finished, and the trainer's keep refused it
    DUPLICATE = "duplicate"  # a second entry of a group it holds already
    UNKNOWN = "unknown"  # a group it did not launch (or handed out long ago)


@dataclass(frozen=True, slots=True)
class _Finished(Generic[R]):
    received: R
    launch_step: int


def _integer(name: str, value: int) -> int:
    """``value`` as an int (numpy's integers pass), or InvalidArgument naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgument(f"{name} ({value!r}) must be an int")
    return int(value)


def _number(name: str, value: float) -> float:
    """``value`` as a float, or InvalidArgument naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgument(f"{name} ({value!r}) must be a number")
    return float(value)


class BatcherState(Generic[R]):
    """The step batcher's bookkeeping, without I/O (see the module's docstring)."""

    def __init__(
        self, batch_size: int, oversample: float, max_staleness: int, start_step: int = 0
    ) -> None:
        batch_size = _integer("batch_size", batch_size)
        max_staleness = _integer("max_staleness", max_staleness)
        if _integer("start_step", start_step) < 0:
            raise InvalidArgument(f"start_step ({start_step!r}) must be an integer >= 0")
        if batch_size < 1:
            raise InvalidArgument(f"batch_size ({batch_size}) must be >= 1")
        oversample = _number("oversample", oversample)
        if not (math.isfinite(oversample) and 0 <= oversample <= 1):
            raise InvalidArgument(
                f"oversample ({oversample}) must be in [0, 1]: more would carry over more "
                "groups than one batch holds, and the due ones could not all be delivered"
            )
        if max_staleness < 0:
            raise InvalidArgument(f"max_staleness ({max_staleness}) must be >= 0")
        self.batch_size = batch_size
        self.oversample = oversample
        self.max_staleness = max_staleness
        self.in_flight = math.ceil(round(batch_size * (1 + oversample), _ROUNDING_DIGITS))
        if self.in_flight > batch_size and max_staleness == 0:
            raise InvalidArgument(
                f"oversample ({oversample}) needs max_staleness >= 1: with 0 every group is "
                "due in the step it was launched in, so none can be carried over"
            )
        # The step being assembled: start_step plus the batches handed out so far
        self.step = start_step
        self.source_done = False  # the trainer's iterator is exhausted
        # Groups taken from the iterator and not launched yet: a Submit of them failed, and
        # the batcher tries again (the launcher's backlog).
        self.backlog = 0
        self.launched_now = 0  # groups launched at the current step
        self.filtered_now = 0  # groups filtered out at the current step
        self.filtered = 0  # groups filtered out, in all
        self._turned_away: set[str] = set()  # filtered out, their entries not yet acked
        self._running: dict[str, int] = {}  # group id -> launch step; not finished yet
        self._finished: dict[str, _Finished[R]] = {}  # in finish order; not handed out yet
        # The client hands an entry out once: what an error left undone with one is done
        # again from here, before the next read. Entry id -> entry: handed to the batcher and
        # not yet judged by ``keep`` (it raised); to be acknowledged unused (its XACK failed).
        self._unjudged: dict[str, R] = {}
        self._to_discard: dict[str, R] = {}

    # ------------------------------------------------------------ launching

    @property
    def outstanding(self) -> int:
        """Groups launched and not yet handed out (running, queued or finished)."""
        return len(self._running) + len(self._finished)

    def to_launch(self) -> int:
        """How many groups to take from the iterator now."""
        return 0 if self.source_done else max(0, self.in_flight - self.outstanding)

    def check_new(self, group_id: str) -> None:
        if group_id in self._running or group_id in self._finished:
            raise InvalidArgument(f"group {group_id!r} is outstanding already; ids must be unique")

    def launched(self, group_id: str, step: int | None = None) -> None:
        """The group was submitted (with ``priority = step``, the current step by default:
        an earlier one for a Submit found out later to have gone through)."""
        self.check_new(group_id)
        self._running[group_id] = self.step if step is None else step
        self.launched_now += 1

    # ------------------------------------------------------------ finishing

    def is_running(self, group_id: str) -> bool:
        """Launched by this batcher and not finished yet."""
        return group_id in self._running

    def judging(self, received: R) -> None:
        """``keep`` is asked about the entry now: until ``on_finished`` it is unjudged, and
        an error of ``keep`` leaves it so (:meth:`unjudged`: judged again at the next call)."""
        self._unjudged[received.entry_id] = received

    def unjudged(self) -> list[R]:
        """The entries whose ``keep`` raised, in the order they came."""
        return list(self._unjudged.values())

    def on_finished(self, received: R, keep: bool = True) -> Arrival:
        """An entry of the stream; ``keep`` False: the group, if it is one of the running,
        is turned away (dynamic sampling): it leaves the outstanding groups, and the next
        top-up launches another in its place."""
        group_id = received.group_id
        self._unjudged.pop(received.entry_id, None)
        if group_id in self._turned_away:  # read again: its ack did not go through
            return Arrival.FILTERED
        launch_step = self._running.pop(group_id, None)
        if launch_step is not None:
            if not keep:
                self.filtered_now += 1
                self.filtered += 1
                self._turned_away.add(group_id)
                return Arrival.FILTERED
            self._finished[group_id] = _Finished(received, launch_step)
            return Arrival.NEW
        if group_id in self._finished:
            return Arrival.DUPLICATE
        return Arrival.UNKNOWN

    def discarding(self, received: R) -> None:
        """The entry is to be acknowledged unused (turned away, a duplicate, not this
        batcher's, the tail): it is in :meth:`to_discard` until :meth:`discarded`."""
        self._to_discard[received.entry_id] = received

    def to_discard(self) -> list[R]:
        """The entries to acknowledge unused whose XACK has not gone through yet."""
        return list(self._to_discard.values())

    def discarded(self, received: Sequence[R]) -> None:
        """These entries were acknowledged unused."""
        for r in received:
            self._to_discard.pop(r.entry_id, None)
            self._turned_away.discard(r.group_id)

    def is_due(self, launch_step: int) -> bool:
        """A group of this launch step must be in the current step's batch."""
        return launch_step + self.max_staleness <= self.step

    def waiting_for(self) -> list[str]:
        """Due groups that have not finished yet."""
        return [g for g, launch in self._running.items() if self.is_due(launch)]

    def ready(self) -> bool:
        """The current step's batch can be handed out."""
        if self.waiting_for():
            return False
        if len(self._finished) >= self.batch_size:
            return True
        return self.source_done and not self.backlog and not self._running and bool(self._finished)

    @property
    def exhausted(self) -> bool:
        """Nothing left to launch or to hand out: iteration ends."""
        return self.source_done and not self.backlog and not self.outstanding

    def take_batch(self) -> StepBatch[R]:
        """Hands out the current step's batch and moves to the next step."""
        if not self.ready():
            raise RuntimeError("take_batch() before ready()")
        finished = list(self._finished.values())
        due = sorted((f for f in finished if self.is_due(f.launch_step)), key=_launch_step)
        rest = [f for f in finished if not self.is_due(f.launch_step)]
        # Validation bounds the carried-over groups by batch_size, so every due group fits.
        assert len(due) <= self.batch_size, "more due groups than a batch holds"
        chosen = (due + rest)[: self.batch_size]
        batch = StepBatch(
            step=self.step,
            groups=tuple(
                BatchedGroup(
                    received=f.received,
                    launch_step=f.launch_step,
                    delivery_step=self.step,
                    due=self.is_due(f.launch_step),
                )
                for f in chosen
            ),
            launched=self.launched_now,
            filtered=self.filtered_now,
        )
        for f in chosen:
            del self._finished[f.received.group_id]
        self.step += 1
        self.launched_now = 0
        self.filtered_now = 0
        return batch

    def counts_now(self) -> StepCounts:
        """The current step's counts so far (:class:`StepCounts`)."""
        return StepCounts(self.step, self.launched_now, self.filtered_now)

    def outstanding_groups(self) -> tuple[list[str], list[R]]:
        """Every outstanding group: (ids still running, finished entries held, those not
        judged yet included)."""
        judging = {r.group_id for r in self._unjudged.values()}
        running = [g for g in self._running if g not in judging]
        return running, [f.received for f in self._finished.values()] + self.unjudged()

    def drop_outstanding(self) -> tuple[list[str], list[R]]:
        """Forgets every outstanding group: (ids still running, finished entries held)."""
        running, held = self.outstanding_groups()
        self._running.clear()
        self._finished.clear()
        self._unjudged.clear()
        return running, held


def _launch_step(f: _Finished[R]) -> int:
    return f.launch_step


def _with_priority(group: PromptGroup, step: int) -> PromptGroup:
    return dataclasses.replace(group, priority=step)


# ---------------------------------------------------------------- the edges


class BatchClient(Protocol[R]):
    """What :class:`StepBatcher` uses of a client (:class:`~rollserve.client.RolloutClient`)."""

    def submit(self, groups: Sequence[PromptGroup]) -> int: ...

    def groups(
        self, *, limit: int | None = None, timeout_s: float | None = None
    ) -> Iterator[R]: ...

    def ack(self, *received: R) -> int: ...

    def cancel(self, group_ids: Sequence[str]) -> CancelResult: ...


class AsyncBatchClient(Protocol[R]):
    """What :class:`AsyncStepBatcher` uses of :class:`~rollserve.client.AsyncRolloutClient`."""

    async def submit(self, groups: Sequence[PromptGroup]) -> int: ...

    def groups(
        self, *, limit: int | None = None, timeout_s: float | None = None
    ) -> AsyncIterator[R]: ...

    async def ack(self, *received: R) -> int: ...

    async def cancel(self, group_ids: Sequence[str]) -> CancelResult: ...


class GroupsRefused(InvalidArgument):
    """The scheduler refused some groups of a launch (``refused``: each group with its
    error, which names the field and the limit); the batcher dropped them and launched the
    others. Iterate on: the next step takes new groups in their place."""

    def __init__(self, refused: Sequence[tuple[PromptGroup, RolloutError]]) -> None:
        listed = "; ".join(f"{g.group_id!r}: {e.message}" for g, e in refused[:5])
        more = f" (and {len(refused) - 5} more)" if len(refused) > 5 else ""
        super().__init__(f"the scheduler refused {len(refused)} groups: {listed}{more}")
        self.refused = tuple(refused)


class _Launcher(Generic[R]):
    """Takes groups from the trainer's iterator; keeps those a failed Submit did not queue.

    Submit is all or none: when the scheduler refuses a launch as invalid, its groups are
    sent one by one, those it takes are launched and those it refuses dropped (kept, the
    same launch was refused at every step). A group whose earlier Submit failed in a way that
    may have queued it (it ran out of time) was accepted then if the scheduler says it is
    taken already, or if its entry arrives: it is launched, at the step of that Submit."""

    def __init__(self, state: BatcherState[R], groups: Iterable[PromptGroup]) -> None:
        self._state = state
        self._source = iter(groups)
        self._backlog: list[PromptGroup] = []  # taken from the iterator, not submitted yet
        # Ids of the backlog a Submit may have queued -> the step (priority) of the first.
        self._unsure: dict[str, int] = {}
        self._refused: list[tuple[PromptGroup, RolloutError]] = []  # not said yet

    def next_launch(self) -> list[PromptGroup]:
        """The groups to submit now, with the current step as their priority."""
        state = self._state
        while len(self._backlog) < state.to_launch():
            group = next(self._source, None)
            if group is None:
                state.source_done = True
                break
            state.check_new(group.group_id)
            if any(g.group_id == group.group_id for g in self._backlog):
                raise InvalidArgument(f"group {group.group_id!r} repeats; ids must be unique")
            self._backlog.append(group)
        state.backlog = len(self._backlog)
        return [_with_priority(g, state.step) for g in self._backlog]

    def submitted(self, groups: Sequence[PromptGroup]) -> None:
        for group in groups:
            self._state.launched(group.group_id)
        self._backlog.clear()
        self._state.backlog = 0
        self._unsure.clear()
        self.say_refused()  # (refused groups of an earlier launch, cut off part way)

    def landed(self, group_id: str) -> None:
        """An entry of ``group_id`` arrived. If it is of the backlog, a Submit that failed
        queued it after all: it is launched at that Submit's step, not submitted again (it
        was taken as another trainer's and let go, and its next Submit, told it was taken,
        had the batch wait for it forever)."""
        step = self._unsure.pop(group_id, None)
        if step is None:
            return
        self._backlog = [g for g in self._backlog if g.group_id != group_id]
        self._state.backlog = len(self._backlog)
        self._state.launched(group_id, step)

    def failed(self, launch: Sequence[PromptGroup], exc: BaseException) -> bool:
        """A Submit of ``launch`` failed with ``exc``; True when the groups are to be sent one
        by one (the scheduler refused the launch as invalid), else they stay in the backlog
        for the next try. Unless the queue was full, they may have been queued: a call that
        ran out of time, broke or was cancelled (the scheduler carries a Submit through)."""
        if isinstance(exc, InvalidArgument):
            return True
        if not isinstance(exc, ResourceExhausted):
            for group in launch:
                self._unsure.setdefault(group.group_id, group.priority)
        return False

    def sent_alone(self, group: PromptGroup, exc: InvalidArgument | None) -> None:
        """A group of a refused launch, sent alone, was taken (``exc`` None) or refused."""
        self._backlog = [g for g in self._backlog if g.group_id != group.group_id]
        self._state.backlog = len(self._backlog)
        unsure_step = self._unsure.pop(group.group_id, None)
        if exc is None:
            self._state.launched(group.group_id)
        elif isinstance(exc, AlreadySubmitted) and unsure_step is not None:
            self._state.launched(group.group_id, unsure_step)  # queued by the earlier Submit
        else:
            self._refused.append((group, exc))

    def say_refused(self) -> None:
        """Raises GroupsRefused for the groups refused since it last did."""
        refused, self._refused = self._refused, []
        if refused:
            raise GroupsRefused(refused)


UnknownGroups = Literal["release", "discard"]


def _check_unknown_groups(value: str) -> UnknownGroups:
    if value not in ("release", "discard"):
        raise InvalidArgument(
            f"unknown_groups ({value!r}) must be 'release' (another trainer reads the same "
            "consumer group) or 'discard' (this trainer reads the run alone)"
        )
    return cast(UnknownGroups, value)


def _note(arrival: Arrival, received: ReceivedBase, unknown: UnknownGroups) -> None:
    if arrival is Arrival.UNKNOWN:
        log.warning(
            "stream entry %s of group %r: not launched by this batcher; %s",
            received.entry_id,
            received.group_id,
            "acked unused (unknown_groups='discard')"
            if unknown == "discard"
            else "released for another consumer",
        )
    elif arrival is Arrival.DUPLICATE:
        log.info(
            "stream entry %s: duplicate of group %r; acked", received.entry_id, received.group_id
        )


Keep = Callable[[GroupResult], bool]


def _kept(state: BatcherState[R], keep: Keep | None, received: R) -> bool:
    """Whether ``keep`` keeps the entry's group; asked only of a group this batcher runs."""
    return keep is None or not state.is_running(received.group_id) or bool(keep(received.result))


def _release(client: object, received: ReceivedBase) -> None:
    """Stops the client's heartbeat for an entry left pending for another consumer. The
    clients of this SDK have ``release``; a client without one holds no claims to drop."""
    release = getattr(client, "release", None)
    if release is not None:
        release(received)


def _close(stream: Iterator[R]) -> None:
    """Closes the client's ``groups()`` generator now, not in the garbage collector."""
    close = getattr(stream, "close", None)
    if close is not None:
        close()


async def _aclose(stream: AsyncIterator[R]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


def _discards(arrival: Arrival, unknown: UnknownGroups) -> bool:
    """Whether the entry is acknowledged unused."""
    if arrival is Arrival.UNKNOWN:
        return unknown == "discard"
    return arrival is Arrival.FILTERED or arrival is Arrival.DUPLICATE


def _deadline(timeout_s: float | None) -> float | None:
    return None if timeout_s is None else time.monotonic() + timeout_s


def _passed(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _read_time(deadline: float | None, retrying: bool) -> float | None:
    """How long the next read of the stream may take: what is left of the wait, or, while
    a launch waits for a retry, ``RETRY_LAUNCH_S`` at most."""
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    if not retrying:
        return left
    return RETRY_LAUNCH_S if left is None else min(left, RETRY_LAUNCH_S)


def _timeout(state: BatcherState[R], timeout_s: float | None) -> BatchTimeout:
    waiting = state.waiting_for()
    return BatchTimeout(
        f"step {state.step}: no batch of {state.batch_size} within {timeout_s} s "
        f"({state.outstanding} outstanding; waiting for due groups {waiting[:5]})"
    )


class StepBatcher(Generic[R]):
    """Batches of ``batch_size`` groups from a sync client; iterate it, ``ack`` each batch.

    client: a :class:`~rollserve.client.RolloutClient` of the run (or anything with its
        ``submit``, ``groups``, ``ack`` and ``cancel``).
    groups: the trainer's prompt groups, taken as needed; their ``priority`` is replaced
        by the launch step.
    batch_size: groups per batch (``B``).
    oversample: keep ``ceil(B * (1 + oversample))`` groups outstanding; 0 is synchronous.
    max_staleness: steps a group may wait between launch and delivery.
    batch_timeout_s: longest wait for one batch before :class:`BatchTimeout`; None waits
        as long as it takes.
    unknown_groups: what to do with stream entries of groups this batcher did not launch:
        ``"release"`` them for the other trainers of a shared consumer group, or
        ``"discard"`` them (acknowledged unused) when this trainer reads the run alone, as
        after a restart from a checkpoint: the groups launched before the restart are then
        not left pending for good (they held back the stream's trim).
    keep: dynamic sampling (as DAPO's): called with the result of each group this batcher
        launched as it finishes (a failed one too); a group it returns False for is
        acknowledged unused and another is launched in its place, so that batches hold the
        groups it kept (for GRPO, those whose rewards differ). None keeps every group.
        ``StepBatch.filtered`` counts the groups it turned away during the step; those
        turned away after the last batch, when iteration ends, are in
        ``state.counts_now()``.
    start_step: the step its first batch is (a trainer restarted from the checkpoint made
        after step ``k`` passes ``k + 1``): steps, launch steps and priorities count from it,
        as the policy versions a trainer publishes by step do.
    """

    def __init__(
        self,
        client: BatchClient[R],
        groups: Iterable[PromptGroup],
        *,
        batch_size: int,
        oversample: float = 0.0,
        max_staleness: int = 1,
        batch_timeout_s: float | None = None,
        unknown_groups: UnknownGroups = "release",
        keep: Keep | None = None,
        start_step: int = 0,
    ) -> None:
        self._client = client
        self.state: BatcherState[R] = BatcherState(
            batch_size, oversample, max_staleness, start_step
        )
        self._launcher = _Launcher(self.state, groups)
        self._timeout_s = batch_timeout_s
        self._unknown = _check_unknown_groups(unknown_groups)
        self._keep = keep

    def __iter__(self) -> Iterator[StepBatch[R]]:
        return self

    def __next__(self) -> StepBatch[R]:
        self._settle()
        self._top_up()
        if self.state.exhausted:
            raise StopIteration
        self._wait_ready()
        if not self.state.ready():  # keep turned the last groups away
            raise StopIteration
        return self.state.take_batch()

    def ack(self, batch: StepBatch[R]) -> int:
        """Acknowledges the batch's groups (one XACK): call it once the trainer used them."""
        return self._client.ack(*batch.received) if batch.groups else 0

    def cancel_outstanding(self, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> Dropped:
        """Ends the run's tail: cancels the outstanding groups still running and acknowledges,
        unused, those that finished, reading the stream up to ``drain_timeout_s`` for the
        entries of groups that finished before the cancel reached the scheduler. If the
        cancel fails, nothing is forgotten (call it again); the finished groups it holds are
        acknowledged whatever the drain meets (an ack that fails is tried again at the next
        call), and entries not its own are let go."""
        state = self.state
        running, held = state.outstanding_groups()
        cancelled: Sequence[str] = ()
        unread: set[str] = set()
        if running:
            result = self._client.cancel(running)
            cancelled, unread = result.cancelled, set(result.unknown)
        state.drop_outstanding()
        for received in held:
            state.discarding(received)
        try:
            if unread and drain_timeout_s > 0:
                stream = self._client.groups(timeout_s=drain_timeout_s)
                try:
                    for received in stream:
                        if received.group_id in unread:
                            unread.discard(received.group_id)
                            held.append(received)
                            state.discarding(received)
                        elif self._unknown == "discard":
                            state.discarding(received)
                        else:  # another trainer's: its own takes it over
                            _release(self._client, received)
                        if not unread:
                            break
                finally:
                    _close(stream)
        finally:
            self._ack_discards()
        return Dropped(tuple(cancelled), tuple(r.group_id for r in held), tuple(sorted(unread)))

    def _top_up(self) -> None:
        launch = self._launcher.next_launch()
        if not launch:
            return
        try:
            self._client.submit(launch)
        except BaseException as exc:
            if not self._launcher.failed(launch, exc):
                raise
            for group in launch:
                try:
                    self._client.submit([group])
                except InvalidArgument as refused:
                    self._launcher.sent_alone(group, refused)
                except BaseException as other:
                    self._launcher.failed([group], other)
                    raise
                else:
                    self._launcher.sent_alone(group, None)
            self._launcher.say_refused()
            return
        self._launcher.submitted(launch)

    def _replace(self) -> None:
        """Launches a group in the place of one filtered out; a scheduler that cannot take it
        now does not end the wait (the batch may fill without it): the wait tries again
        every ``RETRY_LAUNCH_S``, and so does the next step."""
        try:
            self._top_up()
        except GroupsRefused:
            raise
        except RolloutError as exc:
            log.warning("launching in the place of a group filtered out: %s; retried later", exc)

    def _wait_ready(self) -> None:
        """Reads the stream until the batch is ready. While a failed launch waits for a
        retry, it reads ``RETRY_LAUNCH_S`` at a time and retries in between (nothing else
        does while it waits: with nothing outstanding it waited forever)."""
        state = self.state
        deadline = _deadline(self._timeout_s)
        while not (state.ready() or state.exhausted):
            retrying = state.backlog > 0
            stream = self._client.groups(timeout_s=_read_time(deadline, retrying))
            try:
                for received in stream:
                    self._arrive(received)
                    if state.ready() or state.exhausted or (state.backlog and not retrying):
                        break
                else:  # the read ran its time: all that was left, or the deadline passed
                    if not retrying or _passed(deadline):
                        raise _timeout(state, self._timeout_s)
            finally:
                _close(stream)
            if state.backlog and not (state.ready() or state.exhausted):
                self._replace()

    def _arrive(self, received: R) -> None:
        """What the batcher does with an entry the client handed it."""
        state = self.state
        self._launcher.landed(received.group_id)
        state.judging(received)
        arrival = state.on_finished(received, _kept(state, self._keep, received))
        _note(arrival, received, self._unknown)
        if _discards(arrival, self._unknown):
            self._discard(received)
            if arrival is Arrival.FILTERED:
                self._replace()
        elif arrival is Arrival.UNKNOWN:
            _release(self._client, received)

    def _discard(self, received: R) -> None:
        self.state.discarding(received)
        self._ack_discards()

    def _ack_discards(self) -> None:
        """Acknowledges the entries to discard (one XACK); if it fails, the next call of the
        batcher tries again (the client hands them out no more)."""
        discard = self.state.to_discard()
        if discard:
            self._client.ack(*discard)
            self.state.discarded(discard)

    def _settle(self) -> None:
        """Finishes what an error left undone with entries the client handed out, which it
        hands out once (they were lost, and the batch waited for them forever): acknowledges
        those to discard, and asks ``keep`` again of those it raised on."""
        self._ack_discards()
        for received in self.state.unjudged():
            self._arrive(received)


class AsyncStepBatcher(Generic[R]):
    """The asyncio twin of :class:`StepBatcher`, over an
    :class:`~rollserve.client.AsyncRolloutClient`: ``async for batch in batcher``,
    ``await batcher.ack(batch)`` (``keep`` is a plain function, as there)."""

    def __init__(
        self,
        client: AsyncBatchClient[R],
        groups: Iterable[PromptGroup],
        *,
        batch_size: int,
        oversample: float = 0.0,
        max_staleness: int = 1,
        batch_timeout_s: float | None = None,
        unknown_groups: UnknownGroups = "release",
        keep: Keep | None = None,
        start_step: int = 0,
    ) -> None:
        self._client = client
        self.state: BatcherState[R] = BatcherState(
            batch_size, oversample, max_staleness, start_step
        )
        self._launcher = _Launcher(self.state, groups)
        self._timeout_s = batch_timeout_s
        self._unknown = _check_unknown_groups(unknown_groups)
        self._keep = keep

    def __aiter__(self) -> AsyncIterator[StepBatch[R]]:
        return self

    async def __anext__(self) -> StepBatch[R]:
        await self._settle()
        await self._top_up()
        if self.state.exhausted:
            raise StopAsyncIteration
        await self._wait_ready()
        if not self.state.ready():  # keep turned the last groups away
            raise StopAsyncIteration
        return self.state.take_batch()

    async def ack(self, batch: StepBatch[R]) -> int:
        """Acknowledges the batch's groups (one XACK): call it once the trainer used them."""
        return await self._client.ack(*batch.received) if batch.groups else 0

    async def cancel_outstanding(self, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> Dropped:
        """See :meth:`StepBatcher.cancel_outstanding`."""
        state = self.state
        running, held = state.outstanding_groups()
        cancelled: Sequence[str] = ()
        unread: set[str] = set()
        if running:
            result = await self._client.cancel(running)
            cancelled, unread = result.cancelled, set(result.unknown)
        state.drop_outstanding()
        for received in held:
            state.discarding(received)
        try:
            if unread and drain_timeout_s > 0:
                stream = self._client.groups(timeout_s=drain_timeout_s)
                try:
                    async for received in stream:
                        if received.group_id in unread:
                            unread.discard(received.group_id)
                            held.append(received)
                            state.discarding(received)
                        elif self._unknown == "discard":
                            state.discarding(received)
                        else:  # another trainer's: its own takes it over
                            _release(self._client, received)
                        if not unread:
                            break
                finally:
                    await _aclose(stream)
        finally:
            await self._ack_discards()
        return Dropped(tuple(cancelled), tuple(r.group_id for r in held), tuple(sorted(unread)))

    async def _top_up(self) -> None:
        launch = self._launcher.next_launch()
        if not launch:
            return
        try:
            await self._client.submit(launch)
        except BaseException as exc:
            if not self._launcher.failed(launch, exc):
                raise
            for group in launch:
                try:
                    await self._client.submit([group])
                except InvalidArgument as refused:
                    self._launcher.sent_alone(group, refused)
                except BaseException as other:
                    self._launcher.failed([group], other)
                    raise
                else:
                    self._launcher.sent_alone(group, None)
            self._launcher.say_refused()
            return
        self._launcher.submitted(launch)

    async def _replace(self) -> None:
        """See :meth:`StepBatcher._replace`."""
        try:
            await self._top_up()
        except GroupsRefused:
            raise
        except RolloutError as exc:
            log.warning("launching in the place of a group filtered out: %s; retried later", exc)

    async def _wait_ready(self) -> None:
        """See :meth:`StepBatcher._wait_ready`."""
        state = self.state
        deadline = _deadline(self._timeout_s)
        while not (state.ready() or state.exhausted):
            retrying = state.backlog > 0
            stream = self._client.groups(timeout_s=_read_time(deadline, retrying))
            try:
                async for received in stream:
                    await self._arrive(received)
                    if state.ready() or state.exhausted or (state.backlog and not retrying):
                        break
                else:  # the read ran its time: all that was left, or the deadline passed
                    if not retrying or _passed(deadline):
                        raise _timeout(state, self._timeout_s)
            finally:
                await _aclose(stream)
            if state.backlog and not (state.ready() or state.exhausted):
                await self._replace()

    async def _arrive(self, received: R) -> None:
        """See :meth:`StepBatcher._arrive`."""
        state = self.state
        self._launcher.landed(received.group_id)
        state.judging(received)
        arrival = state.on_finished(received, _kept(state, self._keep, received))
        _note(arrival, received, self._unknown)
        if _discards(arrival, self._unknown):
            await self._discard(received)
            if arrival is Arrival.FILTERED:
                await self._replace()
        elif arrival is Arrival.UNKNOWN:
            _release(self._client, received)

    async def _discard(self, received: R) -> None:
        self.state.discarding(received)
        await self._ack_discards()

    async def _ack_discards(self) -> None:
        """See :meth:`StepBatcher._ack_discards`."""
        discard = self.state.to_discard()
        if discard:
            await self._client.ack(*discard)
            self.state.discarded(discard)

    async def _settle(self) -> None:
        """See :meth:`StepBatcher._settle`."""
        await self._ack_discards()
        for received in self.state.unjudged():
            await self._arrive(received)
