"""The step batcher (``rollserve.client.batches``) against a fake of the client's edges.

Faked: the client (``RolloutClient`` / ``AsyncRolloutClient``): its ``submit``, ``groups``,
``ack`` and ``cancel``. ``FakeRun`` is a discrete-event stand-in for the scheduler, the
engines and the stream: a group submitted at virtual time ``t`` finishes at ``t + its
duration`` (``durations`` by group id; ``None`` never finishes), and ``groups()`` hands out
finished groups in finish order, advancing the clock to each one, until ``timeout_s``
(virtual seconds) has passed. Real: the batcher, its state and the SDK's types
(``PromptGroup``, ``GroupResult`` and the received-entry base class).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import AsyncIterator, Iterator, Sequence

import pytest
from rollserve.client import (
    AlreadySubmitted,
    AsyncStepBatcher,
    BatchTimeout,
    CancelResult,
    GroupResult,
    GroupsRefused,
    GroupStatus,
    InvalidArgument,
    PromptGroup,
    RolloutError,
    SchedulerUnavailable,
    StepBatch,
    StepBatcher,
    StepCounts,
    StreamUnavailable,
)
from rollserve.client.consumer import ReceivedBase

DEFAULT_DURATION = 1.0


class FakeRun:
    """The run as a trainer's client sees it, on a virtual clock."""

    def __init__(self, durations: dict[str, float | None] | None = None) -> None:
        self.durations = durations or {}
        self.now = 0.0
        self.submitted: list[PromptGroup] = []
        self.acked: list[str] = []
        self.cancelled: list[str] = []
        self.finish_at: dict[str, float] = {}
        self._finishing: list[tuple[float, int, str]] = []  # (finish time, seq, group id)
        self._seq = 0
        self._entries = 0

    # ------------------------------------------------------------- the edges

    def submit(self, groups: Sequence[PromptGroup]) -> int:
        for group in groups:
            self.submitted.append(group)
            duration = self.durations.get(group.group_id, DEFAULT_DURATION)
            if duration is not None:
                self.finish_at[group.group_id] = self.now + duration
                self._push(self.now + duration, group.group_id)
        return len(groups)

    def groups(
        self, *, limit: int | None = None, timeout_s: float | None = None
    ) -> Iterator[ReceivedBase]:
        deadline = None if timeout_s is None else self.now + timeout_s
        while self._finishing and (deadline is None or self._finishing[0][0] <= deadline):
            at, _, group_id = heapq.heappop(self._finishing)
            if group_id in self.cancelled:
                continue
            self.now = max(self.now, at)
            yield self._entry(group_id)
        if deadline is not None:
            self.now = max(self.now, deadline)

    def ack(self, *received: ReceivedBase) -> int:
        self.acked.extend(r.group_id for r in received)
        return len(received)

    def cancel(self, group_ids: Sequence[str]) -> CancelResult:
        """Groups still running are cancelled (never delivered); those finished by now are
        unknown to the scheduler, and their entries stay in the stream."""
        cancelled = [g for g in group_ids if self.finish_at.get(g, math.inf) > self.now]
        self.cancelled.extend(cancelled)
        unknown = [g for g in group_ids if g not in cancelled]
        return CancelResult(cancelled=tuple(cancelled), unknown=tuple(unknown))

    # ------------------------------------------------------------- scripting

    def inject(self, group_id: str, at: float) -> None:
        """A stream entry for ``group_id`` at ``at`` (a duplicate, or a foreign group)."""
        self._push(at, group_id)

    def priority_of(self, group_id: str) -> int:
        return next(g.priority for g in self.submitted if g.group_id == group_id)

    def _push(self, at: float, group_id: str) -> None:
        heapq.heappush(self._finishing, (at, self._seq, group_id))
        self._seq += 1

    def _entry(self, group_id: str) -> ReceivedBase:
        self._entries += 1
        result = GroupResult(run_id="fake", group_id=group_id, status=GroupStatus.DELIVERED)
        return ReceivedBase(result, f"{self._entries}-0", 1)


class AsyncFakeRun:
    """The same run behind the asyncio client's interface."""

    def __init__(self, run: FakeRun) -> None:
        self.run = run

    async def submit(self, groups: Sequence[PromptGroup]) -> int:
        return self.run.submit(groups)

    async def groups(
        self, *, limit: int | None = None, timeout_s: float | None = None
    ) -> AsyncIterator[ReceivedBase]:
        for received in self.run.groups(limit=limit, timeout_s=timeout_s):
            yield received

    async def ack(self, *received: ReceivedBase) -> int:
        return self.run.ack(*received)

    async def cancel(self, group_ids: Sequence[str]) -> CancelResult:
        return self.run.cancel(group_ids)


def prompt_groups(count: int | None = None) -> Iterator[PromptGroup]:
    index = 0
    while count is None or index < count:
        yield PromptGroup(group_id=f"g{index}", prompt_token_ids=[1, 2, 3], n=2, priority=99)
        index += 1


def ids(batch: StepBatch[ReceivedBase]) -> list[str]:
    return [g.group_id for g in batch.groups]


def take(batcher: StepBatcher[ReceivedBase], steps: int) -> list[StepBatch[ReceivedBase]]:
    batches = []
    for _, batch in zip(range(steps), batcher, strict=False):
        batcher.ack(batch)
        batches.append(batch)
    return batches


def check_invariants(
    run: FakeRun,
    batches: Sequence[StepBatch[ReceivedBase]],
    batch_size: int,
    max_staleness: int,
    *,
    tail: Sequence[str] = (),
) -> None:
    """Exact batch sizes, the staleness bound, due groups first, nothing lost or duplicated."""
    delivered = [g.group_id for b in batches for g in b.groups]
    assert len(delivered) == len(set(delivered)), "a group was delivered twice"
    submitted = [g.group_id for g in run.submitted]
    assert sorted(delivered + list(tail)) == sorted(submitted), "a group was lost"
    assert run.acked[: len(delivered)] == delivered  # acked once each, in batch order
    for step, batch in enumerate(batches):
        assert batch.step == step
        assert len(batch) == batch_size
        for group in batch.groups:
            assert group.delivery_step == step
            assert 0 <= group.staleness <= max_staleness
            assert run.priority_of(group.group_id) == group.launch_step
        dues = [g.due for g in batch.groups]
        assert dues == sorted(dues, reverse=True), "due groups come first"


def test_synchronous_batches_are_the_groups_of_their_step() -> None:
    run = FakeRun({f"g{i}": float(8 - i) for i in range(8)})
    batcher = StepBatcher(run, prompt_groups(), batch_size=4, oversample=0.0)
    batches = take(batcher, 3)
    assert [sorted(ids(b)) for b in batches] == [
        ["g0", "g1", "g2", "g3"],
        ["g4", "g5", "g6", "g7"],
        ["g10", "g11", "g8", "g9"],
    ]
    assert ids(batches[0]) == ["g3", "g2", "g1", "g0"]  # in finish order
    assert all(g.staleness == 0 and not g.due for b in batches for g in b.groups)
    assert [b.launched for b in batches] == [4, 4, 4]
    check_invariants(run, batches, 4, 0)


def test_oversampled_batches_carry_the_tail_over() -> None:
    # B=4, oversample 0.5: 6 in flight. g1 and g4 are long: they are carried over.
    run = FakeRun({"g1": 10.0, "g4": 2.5})
    batcher = StepBatcher(run, prompt_groups(), batch_size=4, oversample=0.5, max_staleness=1)
    first = next(batcher)
    assert first.launched == 6
    assert ids(first) == ["g0", "g2", "g3", "g5"]
    assert batcher.state.outstanding == 2
    batcher.ack(first)
    second = next(batcher)  # launches 4 more at priority 1; g1 and g4 are due
    assert second.launched == 4
    assert [g.group_id for g in second.groups if g.due] == ["g4", "g1"]  # finish order
    assert ids(second)[:2] == ["g4", "g1"]
    assert run.now == pytest.approx(10.0)  # it waited for g1
    assert {g.group_id: g.staleness for g in second.groups}["g1"] == 1
    batcher.ack(second)
    check_invariants(run, [first, second], 4, 1, tail=["g8", "g9"])
    assert [run.priority_of(f"g{i}") for i in range(10)] == [0] * 6 + [1] * 4


def test_a_batcher_restarted_at_a_step_counts_from_it() -> None:
    """A trainer restarted from the checkpoint made after step 56 starts at step 57: its
    steps, launch steps and priorities go on from there (counted from 0, they fell behind
    the policy versions it publishes by step); the tail is carried as from step 0."""
    run = FakeRun({"g1": 10.0, "g4": 2.5})
    batcher = StepBatcher(
        run, prompt_groups(), batch_size=4, oversample=0.5, max_staleness=1, start_step=57
    )
    first = next(batcher)
    batcher.ack(first)
    second = next(batcher)
    assert (first.step, second.step) == (57, 58)
    assert ids(first) == ["g0", "g2", "g3", "g5"] and ids(second)[:2] == ["g4", "g1"]
    assert {g.group_id: (g.launch_step, g.staleness) for g in second.groups}["g1"] == (57, 1)
    assert [run.priority_of(f"g{i}") for i in range(10)] == [57] * 6 + [58] * 4
    assert batcher.state.counts_now().step == 59  # (the step being assembled)


def test_a_due_group_is_waited_for_even_when_others_finished() -> None:
    # g0 takes 5 s; B=2, 3 in flight. At step 1 three newer groups finish first, but g0 is due.
    run = FakeRun({"g0": 5.0, "g1": 0.1, "g2": 0.2, "g3": 0.1, "g4": 0.1})
    batcher = StepBatcher(run, prompt_groups(), batch_size=2, oversample=0.5, max_staleness=1)
    batches = take(batcher, 2)
    assert ids(batches[0]) == ["g1", "g2"]
    assert ids(batches[1])[0] == "g0"
    assert batches[1].groups[0].due
    check_invariants(run, batches, 2, 1, tail=batcher.cancel_outstanding().group_ids)


def test_a_larger_staleness_bound_lets_a_group_wait_longer() -> None:
    run = FakeRun({"g0": 25.0})
    batcher = StepBatcher(run, prompt_groups(), batch_size=2, oversample=0.5, max_staleness=2)
    batches = take(batcher, 3)
    where = {g.group_id: (b.step, g.staleness) for b in batches for g in b.groups}
    assert where["g0"] == (2, 2)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize(("oversample", "max_staleness"), [(0.0, 1), (0.25, 1), (0.5, 1), (1.0, 2)])
def test_invariants_hold_for_long_tailed_durations(
    seed: int, oversample: float, max_staleness: int
) -> None:
    rng = random.Random(seed)
    durations: dict[str, float | None] = {f"g{i}": rng.lognormvariate(0.0, 1.2) for i in range(400)}
    run = FakeRun(durations)
    batcher = StepBatcher(
        run, prompt_groups(), batch_size=8, oversample=oversample, max_staleness=max_staleness
    )
    batches = take(batcher, 12)
    tail = batcher.cancel_outstanding(drain_timeout_s=math.inf)
    assert not tail.unread
    check_invariants(run, batches, 8, max_staleness, tail=tail.group_ids)
    assert batcher.state.outstanding == 0


def test_the_iterator_running_out_ends_with_a_partial_batch() -> None:
    run = FakeRun({"g0": 3.0})
    batcher = StepBatcher(run, prompt_groups(7), batch_size=3, oversample=0.5, max_staleness=1)
    batches = take(batcher, 100)
    assert [len(b) for b in batches] == [3, 3, 1]
    delivered = [g for b in batches for g in ids(b)]
    assert sorted(delivered) == sorted(f"g{i}" for i in range(7))
    assert next(batcher, None) is None


def test_cancel_outstanding_cancels_the_running_and_drains_the_finished() -> None:
    # B=2, 4 in flight; g0 and g2 make the first batch at t=1; g3 finished then too, unread.
    run = FakeRun({"g1": 10.0})
    batcher = StepBatcher(run, prompt_groups(), batch_size=2, oversample=1.0, max_staleness=1)
    assert ids(take(batcher, 1)[0]) == ["g0", "g2"]
    dropped = batcher.cancel_outstanding()
    assert dropped.cancelled == ("g1",)
    assert dropped.discarded == ("g3",)  # its entry was read from the stream and acked
    assert dropped.unread == ()
    assert run.acked == ["g0", "g2", "g3"]
    assert batcher.state.outstanding == 0
    assert next(batcher)  # the iterator goes on with new groups


def test_cancel_outstanding_acks_the_finished_groups_it_holds() -> None:
    # Step 1 waits for g1 (due) and reads g3, g4, g5 meanwhile; g4 and g5 are held.
    run = FakeRun({"g1": 10.0})
    batcher = StepBatcher(run, prompt_groups(), batch_size=2, oversample=1.0, max_staleness=1)
    batches = take(batcher, 2)
    assert ids(batches[1]) == ["g3", "g1"]  # both due, in finish order
    dropped = batcher.cancel_outstanding()
    assert (dropped.cancelled, dropped.discarded) == ((), ("g4", "g5"))
    check_invariants(run, batches, 2, 1, tail=dropped.group_ids)


def test_a_batch_that_never_completes_times_out_and_loses_nothing() -> None:
    run = FakeRun({"g0": None})
    batcher = StepBatcher(
        run, prompt_groups(), batch_size=2, oversample=0.5, max_staleness=1, batch_timeout_s=30.0
    )
    first = next(batcher)  # g1 and g2 finish; g0 never does
    batcher.ack(first)
    with pytest.raises(BatchTimeout, match="g0"):
        next(batcher)
    assert batcher.state.waiting_for() == ["g0"]
    assert batcher.state.outstanding == 3  # g0 and the two launched at step 1, finished now


def test_failed_groups_are_handed_out_with_their_status() -> None:
    class FailingRun(FakeRun):
        def _entry(self, group_id: str) -> ReceivedBase:
            received = super()._entry(group_id)
            if group_id == "g1":
                result = GroupResult(
                    run_id="fake", group_id=group_id, status=GroupStatus.FAILED, error="boom"
                )
                return ReceivedBase(result, received.entry_id, 1)
            return received

    run = FailingRun()
    batcher = StepBatcher(run, prompt_groups(), batch_size=2)
    batch = next(batcher)
    assert [r.status for r in batch.results] == [GroupStatus.DELIVERED, GroupStatus.FAILED]


def test_foreign_groups_are_left_pending_and_duplicates_acked() -> None:
    run = FakeRun({"g0": 0.5, "g1": 2.0})
    run.inject("stranger", at=0.1)  # an entry of a group this batcher did not launch
    run.inject("g0", at=1.0)  # a second entry of g0, which the batcher holds by then
    batcher = StepBatcher(run, prompt_groups(), batch_size=2)
    batch = next(batcher)
    assert ids(batch) == ["g0", "g1"]
    assert run.acked == ["g0"]  # the duplicate entry, unused; the stranger stays pending
    batcher.ack(batch)
    assert run.acked == ["g0", "g0", "g1"]


def test_priority_is_the_launch_step_and_group_ids_must_be_unique() -> None:
    run = FakeRun()
    twice = [PromptGroup(group_id="same", prompt_token_ids=[1], n=1)] * 2
    batcher = StepBatcher(run, twice, batch_size=2)
    with pytest.raises(InvalidArgument, match="repeats"):
        next(batcher)
    assert run.submitted == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 4, "oversample": 1.5}, "oversample"),
        ({"batch_size": 4, "oversample": float("nan")}, "oversample"),
        ({"batch_size": 4, "oversample": 0.5, "max_staleness": 0}, "max_staleness >= 1"),
        ({"batch_size": 4, "max_staleness": -1}, "max_staleness"),
        ({"batch_size": 4, "start_step": -1}, "start_step"),
        ({"batch_size": 4, "start_step": 1.5}, "start_step"),
        ({"batch_size": 4, "start_step": True}, "start_step"),
        # (4.0 and True were taken, and the first batch with groups in hand raised TypeError.)
        ({"batch_size": 4.0}, "batch_size .* must be an int"),
        ({"batch_size": True}, "batch_size .* must be an int"),
        ({"batch_size": 4, "max_staleness": 1.5}, "max_staleness .* must be an int"),
        ({"batch_size": 4, "oversample": "0.5"}, "oversample .* must be a number"),
    ],
)
def test_settings_are_checked(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        StepBatcher(FakeRun(), [], **kwargs)  # type: ignore[arg-type]


def test_numpy_integers_pass_as_settings() -> None:
    np = pytest.importorskip("numpy")
    batcher = StepBatcher(FakeRun(), [], batch_size=np.int64(4), max_staleness=np.int32(2))
    assert type(batcher.state.batch_size) is int and batcher.state.max_staleness == 2


def test_in_flight_is_rounded_as_written() -> None:
    batcher = StepBatcher(FakeRun(), [], batch_size=10, oversample=0.1)
    assert batcher.state.in_flight == 11
    assert StepBatcher(FakeRun(), [], batch_size=16, oversample=0.5).state.in_flight == 24


async def test_the_async_batcher_makes_the_same_batches() -> None:
    def durations() -> dict[str, float | None]:
        rng = random.Random(7)
        return {f"g{i}": rng.lognormvariate(0.0, 1.2) for i in range(200)}

    sync_run = FakeRun(durations())
    sync_batches = take(
        StepBatcher(sync_run, prompt_groups(), batch_size=8, oversample=0.5, max_staleness=1), 10
    )
    async_run = FakeRun(durations())
    batcher = AsyncStepBatcher(
        AsyncFakeRun(async_run), prompt_groups(), batch_size=8, oversample=0.5, max_staleness=1
    )
    async_batches = []
    async for batch in batcher:
        await batcher.ack(batch)
        async_batches.append(batch)
        if len(async_batches) == 10:
            break
    tail = await batcher.cancel_outstanding(drain_timeout_s=math.inf)
    assert [ids(b) for b in async_batches] == [ids(b) for b in sync_batches]
    check_invariants(async_run, async_batches, 8, 1, tail=tail.group_ids)


class RefusingRun(FakeRun):
    """A scheduler that refuses the groups named in ``invalid`` (all or none, as Submit
    does), and whose answer to the Submits named in ``lost`` (by call number) is lost after
    it queued them (a deadline)."""

    def __init__(self, invalid: set[str], lost: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        super().__init__()
        self.invalid = invalid
        self.lost = lost
        self.calls = 0

    def submit(self, groups: Sequence[PromptGroup]) -> int:
        self.calls += 1
        taken = {g.group_id for g in self.submitted}
        for i, group in enumerate(groups):
            if group.group_id in self.invalid:
                raise InvalidArgument(f"groups[{i}].sampling.max_tokens (9000) exceeds the model")
            if group.group_id in taken:
                raise AlreadySubmitted(f"group_id {group.group_id!r} was already submitted")
        accepted = super().submit(groups)
        if self.calls in self.lost:
            raise SchedulerUnavailable("Submit: Deadline Exceeded (DEADLINE_EXCEEDED)")
        return accepted


def test_groups_the_scheduler_refuses_are_dropped_and_named_and_the_rest_launched() -> None:
    """One invalid group in a launch (Submit is all or none): the others are launched, the
    refused one is named in GroupsRefused, and the batcher goes on (it sent the same launch
    again at every step, refused each time: training stopped)."""
    run = RefusingRun(invalid={"g2"})
    batcher = StepBatcher(run, prompt_groups(8), batch_size=4)
    with pytest.raises(GroupsRefused) as refused:
        next(batcher)
    first, second = next(batcher), next(batcher)
    assert [g.group_id for g, _ in refused.value.refused] == ["g2"]
    assert "max_tokens (9000)" in str(refused.value)
    assert isinstance(refused.value, InvalidArgument)
    assert sorted(ids(first) + ids(second)) == ["g0", "g1", "g3", "g4", "g5", "g6", "g7"]


def test_groups_queued_by_a_submit_whose_answer_was_lost_are_launched_once() -> None:
    """A Submit runs out of time after the scheduler queued its groups: the retry is told
    they are taken already, and the batcher counts them as launched (every retry was
    refused, for good)."""
    run = RefusingRun(invalid=set(), lost={1})
    batcher = StepBatcher(run, prompt_groups(4), batch_size=4)
    with pytest.raises(SchedulerUnavailable):
        next(batcher)
    batch = next(batcher)
    assert sorted(ids(batch)) == ["g0", "g1", "g2", "g3"]
    assert [g.group_id for g in run.submitted] == ["g0", "g1", "g2", "g3"]


async def test_the_async_batcher_drops_refused_groups_too() -> None:
    run = RefusingRun(invalid={"g0"})
    batcher = AsyncStepBatcher(AsyncFakeRun(run), prompt_groups(3), batch_size=2)
    with pytest.raises(GroupsRefused):
        await anext(batcher)
    batch = await anext(batcher)
    assert ids(batch) == ["g1", "g2"]


class FlakyCancelRun(FakeRun):
    """Its first Cancel fails (the scheduler is unreachable); it records ``release``s."""

    def __init__(self, durations: dict[str, float | None]) -> None:
        super().__init__(durations)
        self.cancels = 0
        self.released: list[str] = []

    def cancel(self, group_ids: Sequence[str]) -> CancelResult:
        self.cancels += 1
        if self.cancels == 1:
            raise SchedulerUnavailable("Cancel: connection refused (UNAVAILABLE)")
        return super().cancel(group_ids)

    def release(self, received: ReceivedBase) -> None:
        self.released.append(received.group_id)


def test_a_cancel_of_the_tail_that_fails_forgets_nothing_and_foreign_entries_are_let_go() -> None:
    """The first cancel_outstanding fails: the second one still cancels the running groups
    and acknowledges the finished ones (the batcher had forgotten them: an empty Dropped,
    and their entries pending for good). An entry of another trainer read while draining is
    released for its own trainer (it was kept claimed for the process's life)."""
    run = FlakyCancelRun({"g1": 10.0})
    batcher = StepBatcher(run, prompt_groups(), batch_size=2, oversample=1.0, max_staleness=1)
    assert ids(take(batcher, 1)[0]) == ["g0", "g2"]
    run.inject("foreign", at=0.9)  # read while draining for g3, before it
    with pytest.raises(SchedulerUnavailable):
        batcher.cancel_outstanding()
    assert batcher.state.outstanding == 2
    dropped = batcher.cancel_outstanding()
    assert (dropped.cancelled, dropped.discarded) == (("g1",), ("g3",))
    assert run.acked == ["g0", "g2", "g3"] and batcher.state.outstanding == 0
    assert run.released == ["foreign"]


class ReleasingRun(FakeRun):
    def __init__(self) -> None:
        super().__init__()
        self.released: list[str] = []

    def release(self, received: ReceivedBase) -> None:
        self.released.append(received.group_id)


def test_groups_launched_before_a_restart_are_released_or_discarded_as_told() -> None:
    """Entries of groups this batcher did not launch (here: an earlier incarnation's, before a
    restart): released by default, for another trainer of a shared group; acknowledged
    unused with unknown_groups='discard' (a trainer alone on its run left them pending for
    good, holding the stream's trim back)."""
    outcomes = {}
    for unknown in ("release", "discard"):
        run = ReleasingRun()
        run.inject("before-restart", at=0.5)
        batcher = StepBatcher(run, prompt_groups(2), batch_size=2, unknown_groups=unknown)
        assert ids(next(batcher)) == ["g0", "g1"]
        outcomes[unknown] = (run.released, run.acked)
    assert outcomes["release"] == (["before-restart"], [])
    assert outcomes["discard"] == ([], ["before-restart"])
    with pytest.raises(InvalidArgument, match="unknown_groups"):
        StepBatcher(ReleasingRun(), prompt_groups(1), batch_size=1, unknown_groups="drop")  # type: ignore[arg-type]


async def test_the_async_batcher_discards_unknown_groups_when_told() -> None:
    run = ReleasingRun()
    run.inject("before-restart", at=0.5)
    batcher = AsyncStepBatcher(
        AsyncFakeRun(run), prompt_groups(2), batch_size=2, unknown_groups="discard"
    )
    assert ids(await anext(batcher)) == ["g0", "g1"]
    assert run.acked == ["before-restart"]


class CutOffRun(RefusingRun):
    """Its first Submit is cut off (a cancel, a broken call) after the scheduler queued it."""

    def submit(self, groups: Sequence[PromptGroup]) -> int:
        accepted = super().submit(groups)
        if self.calls == 1:
            raise RolloutError("Submit: Cancelled (CANCELLED)")
        return accepted


def test_groups_queued_by_a_submit_cut_off_any_way_are_launched_once() -> None:
    """(Only a deadline counted as "may have been queued": after a cancelled Submit the retry
    was told the groups were taken, and the batcher dropped them as refused.)"""
    run = CutOffRun(invalid=set())
    batcher = StepBatcher(run, prompt_groups(2), batch_size=2)
    with pytest.raises(RolloutError, match="CANCELLED"):
        next(batcher)
    assert sorted(ids(next(batcher))) == ["g0", "g1"]


def test_cancel_outstanding_discards_unknown_groups_when_told() -> None:
    run = FlakyCancelRun({"g1": 10.0})
    run.cancels = 1  # (its cancel works)
    batcher = StepBatcher(
        run,
        prompt_groups(),
        batch_size=2,
        oversample=1.0,
        max_staleness=1,
        unknown_groups="discard",
    )
    take(batcher, 1)
    run.inject("before-restart", at=0.9)  # read while draining for g3
    batcher.cancel_outstanding()
    assert "before-restart" in run.acked and run.released == []


# ------------------------------------------------------------- dynamic sampling


def even(result: GroupResult) -> bool:
    """Keeps the groups of even index (stands for: their rewards differ)."""
    return int(result.group_id[1:]) % 2 == 0


@pytest.mark.parametrize(
    ("seed", "oversample", "max_staleness"), [(1, 0.0, 1), (2, 0.5, 1), (3, 1.0, 2)]
)
def test_groups_keep_turns_away_are_replaced_and_never_handed_out(
    seed: int, oversample: float, max_staleness: int
) -> None:
    rng = random.Random(seed)
    durations: dict[str, float | None] = {f"g{i}": rng.lognormvariate(0.0, 1.0) for i in range(400)}
    run = FakeRun(durations)
    batcher = StepBatcher(
        run,
        prompt_groups(),
        batch_size=6,
        oversample=oversample,
        max_staleness=max_staleness,
        keep=even,
    )
    batches = take(batcher, 8)
    delivered = [g.group_id for b in batches for g in b.groups]
    assert [len(b) for b in batches] == [6] * 8  # full batches of kept groups
    assert all(int(g[1:]) % 2 == 0 for g in delivered)
    assert len(delivered) == len(set(delivered))
    assert all(0 <= g.staleness <= max_staleness for b in batches for g in b.groups)
    # Every group turned away was acknowledged unused, once; the kept ones by their batch.
    turned_away = [g for g in run.acked if int(g[1:]) % 2]
    assert len(turned_away) == len(set(turned_away)) == batcher.state.filtered > 0
    assert sorted(set(run.acked) - set(turned_away)) == sorted(delivered)
    assert sum(b.filtered for b in batches) == batcher.state.filtered
    launched = len(run.submitted)
    assert launched == len(delivered) + batcher.state.filtered + batcher.state.outstanding
    assert sum(b.launched for b in batches) == launched


def test_when_keep_turns_every_group_away_iteration_ends_without_a_batch() -> None:
    run = FakeRun()
    batcher = StepBatcher(run, prompt_groups(9), batch_size=4, keep=lambda result: False)
    assert next(batcher, None) is None
    assert sorted(run.acked) == sorted(f"g{i}" for i in range(9))
    assert batcher.state.filtered == 9 and batcher.state.exhausted


def not_the_last_two(result: GroupResult) -> bool:
    return result.group_id not in ("g4", "g5")


def test_the_groups_turned_away_after_the_last_batch_are_counted() -> None:
    run = FakeRun()
    batcher = StepBatcher(run, prompt_groups(6), batch_size=2, keep=not_the_last_two)
    batches = take(batcher, 10)
    assert [ids(b) for b in batches] == [["g0", "g1"], ["g2", "g3"]]
    # Step 2 launched g4 and g5, turned both away, and ended without a batch.
    assert batcher.state.counts_now() == StepCounts(step=2, launched=2, filtered=2)
    assert sum(b.filtered for b in batches) + 2 == batcher.state.filtered == 2
    assert sum(b.launched for b in batches) + 2 == len(run.submitted) == 6


async def test_the_async_batcher_counts_what_came_after_its_last_batch() -> None:
    batcher = AsyncStepBatcher(
        AsyncFakeRun(FakeRun()), prompt_groups(6), batch_size=2, keep=not_the_last_two
    )
    batches = [batch async for batch in batcher]
    assert len(batches) == 2
    assert batcher.state.counts_now() == StepCounts(step=2, launched=2, filtered=2)


async def test_the_async_batcher_keeps_the_same_groups() -> None:
    durations: dict[str, float | None] = {f"g{i}": float((i * 7) % 5 + 1) for i in range(100)}
    sync_run, async_run = FakeRun(dict(durations)), FakeRun(dict(durations))
    sync = take(StepBatcher(sync_run, prompt_groups(), batch_size=4, oversample=0.5, keep=even), 5)
    batcher = AsyncStepBatcher(
        AsyncFakeRun(async_run), prompt_groups(), batch_size=4, oversample=0.5, keep=even
    )
    batches = []
    async for batch in batcher:
        await batcher.ack(batch)
        batches.append(batch)
        if len(batches) == 5:
            break
    assert [ids(b) for b in batches] == [ids(b) for b in sync]
    assert [b.filtered for b in batches] == [b.filtered for b in sync]
    assert sum(b.filtered for b in sync) > 0


class AckFailsOnce(FakeRun):
    """Its first XACK that names ``fails_for`` fails (Redis went away for a moment)."""

    def __init__(self, durations: dict[str, float | None], fails_for: str) -> None:
        super().__init__(durations)
        self.fails_for = fails_for
        self.failed = False

    def ack(self, *received: ReceivedBase) -> int:
        if not self.failed and self.fails_for in [r.group_id for r in received]:
            self.failed = True
            raise StreamUnavailable("XACK: Redis went away")
        return super().ack(*received)


def test_a_group_turned_away_whose_ack_failed_is_acked_by_the_next_call() -> None:
    """The client hands an entry out once, so the batcher tries the ack again itself (it
    waited for the entry to be read again, which never happened: pending for good)."""
    run = AckFailsOnce({f"g{i}": float(i + 1) for i in range(10)}, fails_for="g1")
    batcher = StepBatcher(run, prompt_groups(), batch_size=2, keep=even)
    with pytest.raises(StreamUnavailable):
        next(batcher)
    batch = next(batcher)
    assert ids(batch) == ["g0", "g2"]
    assert run.acked.count("g1") == 1 and batcher.state.filtered == 1


@pytest.mark.parametrize("entry", ["g0", "before-restart"])
def test_a_duplicate_or_unknown_entry_whose_ack_failed_is_acked_by_the_next_call(
    entry: str,
) -> None:
    run = AckFailsOnce({"g0": 0.5, "g1": 2.0}, fails_for=entry)
    run.inject(entry, at=1.0)  # g0's second entry, or a group launched before a restart
    batcher = StepBatcher(run, prompt_groups(), batch_size=2, unknown_groups="discard")
    with pytest.raises(StreamUnavailable):
        next(batcher)
    assert ids(next(batcher)) == ["g0", "g1"]
    assert run.acked == [entry]


def test_the_tail_whose_ack_failed_is_acked_by_the_next_cancel() -> None:
    run = AckFailsOnce({"g1": 10.0}, fails_for="g3")
    batcher = StepBatcher(run, prompt_groups(), batch_size=2, oversample=1.0, max_staleness=1)
    take(batcher, 1)
    with pytest.raises(StreamUnavailable):
        batcher.cancel_outstanding()
    batcher.cancel_outstanding()
    assert run.acked == ["g0", "g2", "g3"]


def test_a_group_whose_keep_raised_is_judged_again_and_handed_out() -> None:
    """keep raises (a reward model timed out) on a group the client has handed out, which
    it does once: the next call asks keep again (the group was lost, and the batcher waited
    for it forever)."""
    asked: list[str] = []

    def flaky_keep(result: GroupResult) -> bool:
        asked.append(result.group_id)
        if asked == ["g0", "g1"]:
            raise TimeoutError("the reward model timed out")
        return True

    run = FakeRun()
    batcher = StepBatcher(run, prompt_groups(8), batch_size=4, keep=flaky_keep, batch_timeout_s=9)
    with pytest.raises(TimeoutError):
        next(batcher)
    assert sorted(ids(next(batcher))) == ["g0", "g1", "g2", "g3"]
    assert asked.count("g1") == 2


async def test_the_async_batcher_judges_again_and_its_tail_takes_the_unjudged() -> None:
    def raising_keep(result: GroupResult) -> bool:
        if result.group_id == "g1":
            raise TimeoutError("the reward model timed out")
        return True

    run = FakeRun()
    batcher = AsyncStepBatcher(AsyncFakeRun(run), prompt_groups(8), batch_size=4, keep=raising_keep)
    for _ in range(2):  # asked again each call, raising again
        with pytest.raises(TimeoutError):
            await anext(batcher)
    dropped = await batcher.cancel_outstanding()
    assert sorted(dropped.discarded) == ["g0", "g1", "g2", "g3"]
    assert sorted(run.acked) == ["g0", "g1", "g2", "g3"] and batcher.state.outstanding == 0


class LaterRun(FakeRun):
    """A scheduler reached through a flaky network: ``outcomes`` by Submit call number say
    ``"lost"`` (queued, then the answer ran past its deadline) or ``"down"`` (not reached);
    a group submitted again is refused as taken (ALREADY_EXISTS)."""

    def __init__(self, durations: dict[str, float | None], outcomes: dict[int, str]) -> None:
        super().__init__(durations)
        self.outcomes = outcomes
        self.calls = 0

    def submit(self, groups: Sequence[PromptGroup]) -> int:
        self.calls += 1
        outcome = self.outcomes.get(self.calls)
        if outcome == "down":
            raise SchedulerUnavailable("Submit: failed to connect (UNAVAILABLE)")
        taken = {g.group_id for g in self.submitted}
        if any(g.group_id in taken for g in groups):
            raise AlreadySubmitted("Submit: group already submitted (ALREADY_EXISTS)")
        accepted = super().submit(groups)
        if outcome == "lost":
            raise SchedulerUnavailable("Submit: Deadline Exceeded (DEADLINE_EXCEEDED)")
        return accepted


def test_a_replacement_whose_submit_timed_out_is_taken_when_its_entry_comes() -> None:
    """The Submit of g4 (in the place of g1, turned away) was queued though it timed out,
    and the retries cannot reach the scheduler: g4's entry is this batcher's, launched at
    step 0 (it was acknowledged unused as another's, and the batch waited for it forever)."""
    run = LaterRun({"g3": 5.0}, outcomes={2: "lost", 3: "down"})
    batcher = StepBatcher(
        run,
        prompt_groups(),
        batch_size=4,
        keep=lambda result: result.group_id != "g1",
        unknown_groups="discard",
        batch_timeout_s=30.0,
    )
    batch = next(batcher)
    assert [(g.group_id, g.launch_step) for g in batch.groups] == [
        ("g0", 0),
        ("g2", 0),
        ("g4", 0),
        ("g3", 0),
    ]
    assert run.acked == ["g1"]
    batcher.ack(batch)
    assert ids(next(batcher)) == ["g5", "g6", "g7", "g8"]
    assert [g.group_id for g in run.submitted].count("g4") == 1


def test_a_group_found_taken_after_a_submit_timed_out_keeps_the_step_of_that_submit() -> None:
    run = LaterRun({"g3": 10.0}, outcomes={2: "lost"})
    batcher = StepBatcher(
        run,
        prompt_groups(),
        batch_size=2,
        oversample=0.5,
        max_staleness=1,
        keep=lambda result: result.group_id != "g1",
    )
    assert ids(next(batcher)) == ["g0", "g2"]
    late = next(batcher)
    assert (late.groups[0].group_id, late.groups[0].launch_step) == ("g3", 0)
    assert late.groups[0].due and late.groups[0].staleness == 1


@pytest.mark.parametrize("count", [5, 6])
def test_groups_whose_launch_failed_are_retried_while_the_batch_waits(count: int) -> None:
    """keep turns the first three groups away while the scheduler restarts: their
    replacements' Submits fail, and with nothing outstanding the wait retries them (the
    batcher ended without launching them, or waited forever)."""
    run = LaterRun({}, outcomes={2: "down", 3: "down", 4: "down", 5: "down"})
    batcher = StepBatcher(
        run,
        prompt_groups(count),
        batch_size=2,
        oversample=0.5,
        keep=lambda result: result.group_id not in ("g0", "g1", "g2"),
    )
    batches = [ids(b) for b in batcher]
    assert batches == [["g3", "g4"], ["g5"]][: count - 4]
    assert sorted(g.group_id for g in run.submitted) == [f"g{i}" for i in range(count)]


async def test_the_async_batcher_retries_a_failed_launch_while_it_waits() -> None:
    run = LaterRun({}, outcomes={2: "down", 3: "down", 4: "down", 5: "down"})
    batcher = AsyncStepBatcher(
        AsyncFakeRun(run),
        prompt_groups(5),
        batch_size=2,
        oversample=0.5,
        keep=lambda result: result.group_id not in ("g0", "g1", "g2"),
    )
    assert [ids(b) async for b in batcher] == [["g3", "g4"]]


def test_a_scheduler_that_cannot_take_a_replacement_does_not_end_the_wait() -> None:
    class SubmitFailsLater(FakeRun):
        def submit(self, groups: Sequence[PromptGroup]) -> int:
            if self.submitted:  # the first launch went through
                raise SchedulerUnavailable("the scheduler is restarting")
            return super().submit(groups)

    run = SubmitFailsLater({f"g{i}": float(i + 1) for i in range(10)})
    batcher = StepBatcher(run, prompt_groups(), batch_size=2, oversample=1.0, keep=even)
    batch = next(batcher)  # g1 turned away; its replacement waits for a retry
    assert ids(batch) == ["g0", "g2"] and batch.filtered == 1
    assert [g.group_id for g in run.submitted] == ["g0", "g1", "g2", "g3"]
