"""Fair share between runs (``rollserve.scheduler.core.fairshare``): the turns it gives
queued groups, that every policy places by turn before priority, and the order a real
scheduler runs two runs' groups in.

Faked: nothing in the core tests (they build the records the core reads); the engine
(``FakeEngine``) in the scheduler's test, whose Redis, runtime and policies are real.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from prometheus_client import generate_latest
from rich.console import Console
from rollserve.cli.status import render
from rollserve.client.types import SchedulerStatus
from rollserve.scheduler.core.fairshare import EngineTags, FairShare, Waiting
from rollserve.scheduler.core.policy import create_policy, policy_names
from rollserve.scheduler.metrics import status_registry
from rollserve.scheduler.runtime import SchedulerRuntime
from rollserve.scheduler.state import GroupRecord
from rollserve.v1 import rollserve_pb2 as pb

from tests.unit.builders import engine, queued, snapshot, spec
from tests.unit.fakes import FakeEngine
from tests.unit.test_runtime import eventually, make_runtime, new_run, read_stream, running


def waiting(run_id: str, count: int, samples: int = 1, first_seq: int = 0) -> list[Waiting]:
    return [Waiting(f"{run_id}/g{i}", run_id, 0, first_seq + i, samples) for i in range(count)]


def test_one_run_alone_has_every_group_in_turn_0() -> None:
    share = FairShare()
    assert share.turns(waiting("a", 100), slots=4, running={}) == {}


def test_two_runs_take_turns_of_their_share_of_the_slots() -> None:
    # 8 slots, 2 runs: a share is 4 samples. a's backlog of 12 groups of 2 samples fills
    # turns 0, 0, 1, 1, 2, 2, ...; b's 2 groups come in turn 0 with a's first 4 samples.
    share = FairShare()
    turns = share.turns(
        [*waiting("a", 12, samples=2), *waiting("b", 2, 2, 100)], slots=8, running={}
    )
    assert [turns[f"a/g{i}"][0] for i in range(12)] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert [turns[f"b/g{i}"] for i in range(2)] == [turns["a/g0"]] * 2


def test_a_run_s_own_order_holds_whatever_its_arrival() -> None:
    share = FairShare()
    late_but_urgent = Waiting("a/urgent", "a", -5, 50, 4)
    turns = share.turns(
        [*waiting("a", 3, samples=4), late_but_urgent, *waiting("b", 1)], 4, running={}
    )
    # (quantum 2: 4 slots, 2 runs; each group of a holds 4 samples)
    assert [turns[k] for k in ("a/urgent", "a/g0", "a/g1", "a/g2")] == [
        (0, 0),
        (2, 0),
        (4, 0),
        (6, 0),
    ]


def test_a_run_that_holds_more_than_its_share_waits_for_one_below_its_own() -> None:
    # 8 slots, 2 runs: a share is 4. a holds all 8 (its backlog filled the fleet): b's
    # groups go first, up to its share, and beyond it still before a's.
    share = FairShare()
    share.turns(waiting("a", 20, samples=2), slots=8, running={})
    share.started("a", 8)
    turns = share.turns(
        [*waiting("a", 16, samples=2), *waiting("b", 3, 2, 100)], slots=8, running={"a": 8}
    )
    a_first = min(turns[f"a/g{i}"] for i in range(16))
    assert turns["b/g0"] == turns["b/g1"] < turns["b/g2"] < a_first


def test_of_runs_that_hold_as_much_the_one_served_less_goes_first() -> None:
    # One slot, free: a had 3 samples started, b 1, neither runs anything now. The run
    # served less goes first, so that two runs on one slot alternate.
    share = FairShare()
    share.turns([*waiting("a", 1), *waiting("b", 1, first_seq=1)], slots=1, running={})
    share.started("a", 3)
    share.started("b", 1)
    turns = share.turns([*waiting("a", 1), *waiting("b", 1, first_seq=1)], slots=1, running={})
    assert turns["b/g0"] < turns["a/g0"]


def test_a_run_that_comes_is_owed_nothing_for_the_time_it_had_nothing_queued() -> None:
    share = FairShare()
    share.turns(waiting("a", 10), slots=2, running={})  # a alone, 100 samples started for it
    share.started("a", 100)
    turns = share.turns([*waiting("a", 10), *waiting("b", 3, first_seq=10)], slots=2, running={})
    # quantum 1: b starts level with a's 100 samples, not 100 behind
    assert [turns[f"b/g{i}"] for i in range(3)] == [turns[f"a/g{i}"] for i in range(3)]
    share.started("b", 3)
    share.started("a", 3)
    # b leaves (nothing queued) and comes back: it starts at a's count, not at its own
    share.turns(waiting("a", 7), slots=2, running={})
    share.started("a", 5)
    turns = share.turns([*waiting("a", 2), *waiting("b", 1, first_seq=20)], slots=2, running={})
    assert turns["b/g0"] == turns["a/g0"] < turns["a/g1"]


def test_samples_started_for_a_run_that_has_nothing_queued_count_for_nothing() -> None:
    share = FairShare()
    share.started("a", 1000)  # (a was never seen waiting)
    turns = share.turns([*waiting("a", 2), *waiting("b", 2, first_seq=5)], slots=2, running={})
    assert turns["a/g0"] == turns["b/g0"] and turns["a/g1"] == turns["b/g1"]


def test_a_group_that_fits_nowhere_holds_back_its_run_and_keeps_an_engine_not_the_others() -> None:
    # b's group of 8 fits on neither engine (4 and 6 free); e1, the nearer to taking it, is
    # kept for it; a's group goes on e0. b's next group waits behind its first.
    b0 = dataclasses.replace(queued("b/g0", n=8, seq=0), run_id="b")
    b1 = dataclasses.replace(queued("b/g1", n=1, seq=1), run_id="b")
    a0 = dataclasses.replace(queued("a/g0", n=2, seq=2), run_id="a", turn=(1, 0))
    engines = [engine("e0", capacity=8, inflight=4), engine("e1", capacity=8, inflight=2)]
    for name in ("least_outstanding", "least_loaded"):
        plan = create_policy(name).plan(snapshot([b0, b1, a0], engines))
        assert [(a.group_key, a.engine_id) for a in plan.assignments] == [("a/g0", "e0")]
    # One run (or the same run): strict order, as before.
    same = dataclasses.replace(a0, run_id="b")
    plan = create_policy("least_outstanding").plan(snapshot([b0, b1, same], engines))
    assert plan.assignments == ()


@pytest.mark.parametrize("policy", policy_names())
def test_every_policy_places_by_turn_before_priority(policy: str) -> None:
    # One slot: the group of the lower turn takes it, though its priority is the higher.
    ahead = dataclasses.replace(queued("a/g0", n=1, seq=0, priority=0), turn=(1, 0))
    behind = dataclasses.replace(queued("b/g0", n=1, seq=1, priority=7), turn=(0, 0))
    plan = create_policy(policy).plan(snapshot([ahead, behind], [engine("e0", capacity=1)]))
    assert [a.group_key for a in plan.assignments] == ["b/g0"]


def test_engine_tags_keep_a_run_s_calls_in_order_and_put_one_that_comes_first() -> None:
    tags, slots = EngineTags(), 1000
    # Run a alone sends calls of 8 samples: 0, 8, 16, ... in the order sent.
    assert [tags.tag("a", 8, None if i == 0 else 0, slots) for i in range(4)] == [0, 8, 16, 24]
    # b comes while a's calls from 0 on are in flight: it starts at the oldest, ahead of
    # a's later calls that wait in the engines' queues.
    assert tags.tag("b", 8, 0, slots) == 0
    assert tags.tag("b", 8, 0, slots) == 8
    assert tags.tag("a", 8, 0, slots) == 32
    # a's first calls ended: b, behind the oldest in flight now, catches up to it.
    assert tags.tag("b", 8, 24, slots) == 24
    # Nothing in flight: every counter starts again.
    assert tags.tag("a", 8, None, slots) == 0
    assert tags.tag("b", 8, 0, slots) == 0
    tags.forget("b")
    assert tags.tag("b", 1, 5, slots) == 5


def test_a_straggler_in_flight_hands_a_run_that_comes_back_no_more_than_a_fleet_s_worth() -> None:
    tags, slots = EngineTags(), 100
    assert tags.tag("b", 1, None, slots) == 0  # b's one call, then b goes idle
    assert tags.tag("a", 1, 0, slots) == 0  # a's long-tail sample, in flight for long
    # a's later calls, 1 to 1000, while the straggler pins the oldest tag in flight at 0.
    assert [tags.tag("a", 1, 0, slots) for _ in range(1000)] == list(range(1, 1001))
    # b comes back: ahead of the last fleet's worth a sent (those that may wait in the
    # engines' queues: tags 901 to 1000), not of the 900 a sent before them.
    assert tags.tag("b", 1, 0, slots) == 1001 - slots


async def test_engines_are_sent_the_tags_as_priorities_and_arrival_without_fair_share(
    redis_url: str,
) -> None:
    for fair_share, expected in (
        (True, {"a0": 0, "a1": 1, "a2": 2, "a3": 3, "b0": 0, "a4": 4}),
        (False, {"a0": 0, "a1": 0, "a2": 0, "a3": 0, "b0": 0, "a4": 0}),
    ):
        a, b = new_run(), new_run()
        async with gated(redis_url, 6.0, fair_share) as (runtime, fake, gate):
            await runtime.submit(a, [spec(f"a{i}", n=1, run_id=a) for i in range(4)])
            await eventually(running(runtime, 4), "a's groups running")
            await runtime.submit(b, [spec("b0", n=1, run_id=b)])
            await eventually(running(runtime, 5), "b's group running")
            await runtime.submit(a, [spec("a4", n=1, run_id=a)])
            await eventually(running(runtime, 6), "a's last group running")
            gate.set()
            await read_stream(redis_url, a, 5)
            await read_stream(redis_url, b, 1)
        got = {group_of(r): r.priority for r in fake.requests}
        assert got == expected, (fair_share, got)


async def test_a_group_s_later_calls_keep_its_first_calls_place_in_the_engines_queues(
    redis_url: str,
) -> None:
    """A sample resumed, or requeued after its engine failed, keeps its group's place: a
    run's older work stays ahead of its newer work in the engines' queues."""
    async with gated(redis_url, 6.0, True) as (runtime, _, _):
        run = new_run()
        older, newer = (
            GroupRecord.new(spec(g, n=2, run_id=run), seq) for seq, g in enumerate("on")
        )
        runtime._oldest_tag = None  # (nothing in flight)
        assert runtime._engine_tag(older, 2) == 0
        assert runtime._engine_tag(newer, 2) == 2
        assert runtime._engine_tag(older, 1) == 0  # its resumed sample, placed later
        assert older.engine_tag == 0 and newer.engine_tag == 2
        # Nothing in flight: the counters start again, and a group placed again does not
        # keep a tag from before that would now put it behind every newer call.
        runtime._oldest_tag = None
        assert runtime._engine_tag(newer, 2) == 0 and newer.engine_tag == 0


@asynccontextmanager
async def gated(
    redis_url: str, capacity_factor: float, fair_share: bool
) -> AsyncIterator[tuple[SchedulerRuntime, FakeEngine, asyncio.Event]]:
    """A runtime over one fake engine of one slot, whose calls all wait for the gate after
    their first half: (it, the engine, the gate)."""
    gate = asyncio.Event()
    fake = await FakeEngine("e0", max_num_seqs=1, second_half_gate=gate).start()
    runtime: SchedulerRuntime = await make_runtime(
        redis_url, [fake], capacity_factor=capacity_factor, fair_share=fair_share
    )
    try:
        yield runtime, fake, gate
    finally:
        await runtime.stop()
        await fake.stop()


def group_of(request: pb.GenerateRequest) -> str:
    """The group id of a call (its request id is "<run>/<group>#<boot>.<call number>")."""
    return request.request_id.split("#")[0].split("/")[-1]


async def order_of_runs(redis_url: str, fair_share: bool) -> list[str]:
    """Run a queues a0..a3, then run b queues b0, behind a group that holds the only slot of
    the only engine; the group ids in the order the engine got them."""
    blocker, a, b = new_run(), new_run(), new_run()
    async with gated(redis_url, 1.0, fair_share) as (runtime, fake, gate):
        await runtime.submit(blocker, [spec("first", n=1, run_id=blocker)])
        await eventually(running(runtime, 1), "the first group running")
        await runtime.submit(a, [spec(f"a{i}", n=1, run_id=a) for i in range(4)])
        await runtime.submit(b, [spec("b0", n=1, run_id=b)])
        gate.set()
        await read_stream(redis_url, a, 4)
        await read_stream(redis_url, b, 1)
    return [group_of(request) for request in fake.requests[1:]]


async def test_a_run_that_queued_later_is_not_put_behind_another_s_backlog(
    redis_url: str,
) -> None:
    assert await order_of_runs(redis_url, fair_share=True) == ["a0", "b0", "a1", "a2", "a3"]
    # (as it was before, and is with --no-fair-share)
    assert await order_of_runs(redis_url, fair_share=False) == ["a0", "a1", "a2", "a3", "b0"]


async def test_status_says_what_each_run_has_queued_and_running(redis_url: str) -> None:
    gate = asyncio.Event()
    fake = await FakeEngine("e0", max_num_seqs=1, second_half_gate=gate).start()
    runtime = await make_runtime(redis_url, [fake], capacity_factor=1.0)
    a, b = new_run(), new_run()
    try:
        await runtime.submit(a, [spec("a0", n=1, run_id=a)])
        await eventually(running(runtime, 1), "a0 running")
        await runtime.submit(a, [spec("a1", n=2, run_id=a)])
        await runtime.submit(b, [spec(f"b{i}", n=1, run_id=b) for i in range(3)])
        status = runtime.status()
        gate.set()
        await read_stream(redis_url, a, 2)
        await read_stream(redis_url, b, 3)
        after = runtime.status()
    finally:
        await runtime.stop()
        await fake.stop()
    shown = {
        r.run_id: (r.queued_groups, r.queued_samples, r.running_groups, r.running_samples)
        for r in status.runs
    }
    assert shown == {a: (1, 2, 1, 1), b: (3, 3, 0, 0)}
    assert [r.run_id for r in status.runs] == sorted(shown)
    assert list(after.runs) == []  # (nothing queued or running: no run is listed)

    # rollserve status shows them, and the metrics carry them by run
    console = Console(width=200, record=True)
    render(SchedulerStatus.from_proto(status), console)
    text = console.export_text()
    assert f"{a}  " in text and "1/2" in text and "3/3" in text
    exposition = generate_latest(status_registry(status)).decode()
    assert f'rollserve_run_queued_samples{{run="{a}"}} 2.0' in exposition
    assert f'rollserve_run_running_samples{{run="{b}"}} 0.0' in exposition
