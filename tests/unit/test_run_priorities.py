"""Priorities order a run's own groups; runs share the engines on equal terms.

Faked: the engine (``FakeEngine``). Real: Redis, the scheduler runtime, its policies.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from rollserve.scheduler.runtime import SchedulerRuntime

from tests.unit.builders import spec
from tests.unit.fakes import FakeEngine
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
