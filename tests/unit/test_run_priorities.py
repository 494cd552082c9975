"""Priorities order a run's own groups; runs share the engines on equal terms.

Faked: the engine (``FakeEngine``). Real: Redis, the scheduler runtime, its policies.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from rollserve.scheduler.runtime import SchedulerRuntime

from tests.unit.builders import spec
from tests.unit.fakes import AbortOutcome, FakeEngine
from tests.unit.test_runtime import eventually, make_runtime, new_run, read_stream, running


async def order_of_runs(
    redis_url: str, policy: str, groups: list[tuple[str, str, int]]
) -> list[str]:
    """Groups ``(run, group_id, priority)`` queued in that order behind a group that holds
    the only slot of the only engine; the group ids in the order the engine got them."""
    gate = asyncio.Event()
    engine = await FakeEngine("e0", max_num_seqs=1, second_half_gate=gate).start()
    runtime: SchedulerRuntime = await make_runtime(
        redis_url, [engine], policy=policy, capacity_factor=1.0
    )
    blocker = new_run()
    try:
        await runtime.submit(blocker, [spec("first", n=1, run_id=blocker)])
        await eventually(running(runtime, 1), "the first group running")
        for run, group_id, priority in groups:
            given = dataclasses.replace(spec(group_id, n=1, run_id=run), priority=priority)
            await runtime.submit(run, [given])
        gate.set()
        for run in {run for run, _, _ in groups}:
            await read_stream(redis_url, run, sum(1 for r, _, _ in groups if r == run))
    finally:
        await runtime.stop()
        await engine.stop()
    # (a call's request id is "<run>/<group>#<scheduler boot>.<call number>")
    return [request.request_id.split("#")[0].split("/")[-1] for request in engine.requests[1:]]


@pytest.mark.parametrize("policy", ["rl", "least_outstanding", "round_robin"])
async def test_a_run_further_on_is_not_put_behind_one_with_lower_step_numbers(
    redis_url: str, policy: str
) -> None:
    # Trainer a is at step 100, trainer b at step 3 (StepBatcher submits a step's groups with
    # the step as their priority): a's group came first and runs first. Within b, its
    # carried-over group (step 2) goes before its step-3 one, whenever it came.
    a, b = new_run(), new_run()
    got = await order_of_runs(redis_url, policy, [(a, "a100", 100), (b, "b3", 3), (b, "b2", 2)])
    assert got == ["a100", "b2", "b3"], got


async def test_a_run_s_carried_over_work_stays_more_urgent_with_nothing_of_it_queued(
    redis_url: str,
) -> None:
    # Run a runs a100 (carried over from step 100) and a101, with nothing queued; run b
    # queues b3. The engine running a100 must look more urgent than anything queued (rl
    # keeps new work off it), the one running a101 not.
    engines = [
        await FakeEngine(f"e{i}", max_num_seqs=1, holds=(0,), on_abort=AbortOutcome.IGNORED).start()
        for i in range(2)
    ]
    runtime = await make_runtime(redis_url, engines, policy="rl", capacity_factor=1.0)
    a, b = new_run(), new_run()
    try:
        for group_id, priority in (("a100", 100), ("a101", 101)):
            given = dataclasses.replace(spec(group_id, n=1, run_id=a), priority=priority)
            await runtime.submit(a, [given])
        await eventually(running(runtime, 2), "a's two groups running")
        await runtime.submit(b, [dataclasses.replace(spec("b3", n=1, run_id=b), priority=3)])
        snapshot = runtime.snapshot()
        where = {
            call.record.spec.group_id: engine_id
            for calls in runtime._calls.values()
            for call in calls.values()
            for engine_id in [call.engine.engine_id]
        }
        for run in (a, b):  # (nothing left pending for the next tests' schedulers)
            await runtime.delete_run(run)
    finally:
        await runtime.stop()
        for engine in engines:
            await engine.stop()
    [queued] = snapshot.queue
    urgent = {e.engine_id: e.urgent_priority for e in snapshot.engines}
    assert queued.priority == 0
    assert urgent[where["a100"]] == -1 and urgent[where["a101"]] == 0
