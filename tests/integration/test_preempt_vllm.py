"""Partial-rollout preemption on real vLLM on CPU: the scheduler runtime (in this process, so
that a test policy can drive it) stops a running sample on one engine, keeps its tokens and
resumes it on the other, where vLLM continues from prompt + partial response.

The session has one engine process; the runtime knows it under two engine ids, so it sees two
engines and the resumed call is a new Generate call with its own request id (as in
test_rollout_e2e). Real: Redis, vLLM, the engine service and the runtime; the policy is the
test's own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Callable
from typing import cast

import pytest
import redis.asyncio as aioredis
from rollserve.client.wire import FinishReason, GroupResult, GroupStatus, decode_entry, stream_key
from rollserve.scheduler.core.snapshot import Assign, Plan, Preempt, Snapshot
from rollserve.scheduler.runtime import SchedulerRuntime
from rollserve.scheduler.settings import EngineEndpoint, SchedulerSettings
from rollserve.scheduler.state import GroupSpec, SamplingSpec
from rollserve.scheduler.store import Store

pytestmark = pytest.mark.integration

PROMPT = (11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22)
N = 4
MAX_TOKENS = 1000  # long enough that the group still runs when the test pokes the scheduler
WAIT_S = 120.0  # under pytest's 300 s timeout, so that a stall fails with what it waited for
POLL_S = 0.01


class MoveOneToE1:
    """Places queued groups on e0. The first time it sees a sample running on e0 with tokens,
    it moves the one furthest along to e1 (once)."""

    name = "move-one"
    whole_groups = True
    moves_running = True
    uses_predictions = False

    def __init__(self) -> None:
        self.preempted: Preempt | None = None

    def plan(self, snapshot: Snapshot) -> Plan:
        assigns = tuple(Assign(group.key, "e0") for group in snapshot.queue)
        candidates = [s for s in snapshot.running if s.engine_id == "e0" and s.progress]
        if self.preempted is not None or not candidates:
            return Plan(assigns)
        victim = max(candidates, key=lambda s: s.progress)
        self.preempted = Preempt(victim.group_key, victim.index, "e0", "e1")
        return Plan(assigns, (self.preempted,))


async def test_a_sample_moved_to_another_engine_resumes_there_and_the_group_arrives_once(
    redis_url: str, engine_address: str
) -> None:
    settings = SchedulerSettings(
        redis_url=redis_url,
        engines=(
            EngineEndpoint(engine_id="e0", address=engine_address),
            EngineEndpoint(engine_id="e1", address=engine_address),
        ),
        health_interval_s=0.25,
        health_timeout_s=30.0,  # a busy engine on a loaded machine answers late
        predictor_namespace=f"ns-{uuid.uuid4().hex[:10]}",
    )
    store = Store.from_url(redis_url, predictor_namespace=settings.predictor_namespace)
    policy = MoveOneToE1()
    runtime = SchedulerRuntime(settings, store, policy)
    await runtime.start()
    run = f"p-{uuid.uuid4().hex[:10]}"
    sampling = SamplingSpec(max_tokens=MAX_TOKENS, temperature=1.0, seed=7)
    long = GroupSpec(run, "long", PROMPT, N, sampling, prompt_key="long")
    poke = dataclasses.replace(
        long, group_id="poke", n=1, sampling=SamplingSpec(max_tokens=4), prompt_key="poke"
    )
    redis = aioredis.Redis.from_url(redis_url)
    try:
        await runtime.submit(run, [long])
        # Tokens are flowing; a Submit makes the runtime plan, and the policy sees them.
        await until(lambda: _generated(runtime) > 0, "the first tokens")
        await runtime.submit(run, [poke])
        await until(lambda: policy.preempted is not None, "the preempt")
        entries = await _entries(redis, run, 2)
        await asyncio.sleep(0.5)
        assert len(await _entries(redis, run, 2)) == 2  # each group once
        status = runtime.status()
    finally:
        await redis.aclose()
        await runtime.stop()
    [result] = [r for r in entries if r.group_id == "long"]
    assert result.status == GroupStatus.DELIVERED and result.attempts == 1
    assert [s.index for s in result.samples] == list(range(N))
    assert policy.preempted is not None
    moved = result.samples[policy.preempted.index]
    assert moved.preemptions == 1 and moved.engine_id == "e1"
    assert 0 < moved.resumed_tokens < len(moved.token_ids) <= MAX_TOKENS
    assert len(moved.logprobs) == len(moved.token_ids)
    assert all(lp <= 0.0 for lp in moved.logprobs)
    assert moved.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    # vLLM saw the kept tokens as part of the prompt of the resumed call.
    assert moved.num_prompt_tokens == len(PROMPT) + moved.resumed_tokens
    others = [s for s in result.samples if s is not moved]
    assert all(s.preemptions == 0 and s.engine_id == "e0" for s in others)
    assert all(1 <= len(s.token_ids) == len(s.logprobs) <= MAX_TOKENS for s in others)
    assert status.samples_preempted == 1 and status.inflight_samples == 0


def _generated(runtime: SchedulerRuntime) -> int:
    """Tokens the running samples have generated so far (from the engines' outstanding)."""
    [e0, _] = runtime.status().engines
    return e0.inflight_samples * MAX_TOKENS - e0.outstanding_tokens


async def until(predicate: Callable[[], bool], what: str) -> None:
    """Polls until ``predicate`` holds; fails the test after WAIT_S."""
    for _ in range(int(WAIT_S / POLL_S)):
        if predicate():
            return
        await asyncio.sleep(POLL_S)
    pytest.fail(f"timed out waiting for {what}")


async def _entries(redis: aioredis.Redis, run: str, count: int) -> list[GroupResult]:
    """The run's stream entries once there are ``count``; fails the test after WAIT_S."""
    for _ in range(int(WAIT_S / POLL_S)):
        if int(await redis.xlen(stream_key(run))) >= count:
            break
        await asyncio.sleep(POLL_S)
    else:
        pytest.fail(f"timed out waiting for {count} stream entries")
    entries = cast(list[tuple[bytes, dict[bytes, bytes]]], await redis.xrange(stream_key(run)))
    return [decode_entry(fields) for _, fields in entries]
