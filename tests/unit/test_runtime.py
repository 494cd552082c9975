"""The scheduler runtime against fake engines (see fakes.py for what is faked) and the
session's real Redis."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import cast

import pytest
import redis.asyncio as aioredis
from rollserve.client.wire import GroupResult, GroupStatus, decode_entry, stream_key
from rollserve.scheduler.core.policy import create_policy
from rollserve.scheduler.runtime import QueueFull, SchedulerRuntime
from rollserve.scheduler.settings import EngineEndpoint, SchedulerSettings
from rollserve.scheduler.state import GroupSpec
from rollserve.scheduler.store import DuplicateGroup, Store

from tests.unit.builders import spec
from tests.unit.fakes import Behaviour, FakeEngine

WAIT_S = 30.0
POLL_S = 0.01


def new_run() -> str:
    return f"u-{uuid.uuid4().hex[:10]}"


async def make_runtime(
    redis_url: str, engines: Sequence[FakeEngine], **overrides: object
) -> SchedulerRuntime:
    settings = SchedulerSettings.model_validate(
        {
            "redis_url": redis_url,
            "engines": [EngineEndpoint(engine_id=e.engine_id, address=e.address) for e in engines],
            "health_interval_s": 0.1,
            "health_timeout_s": 1.0,
            **overrides,
        }
    )
    runtime = SchedulerRuntime(settings, Store.from_url(redis_url), create_policy(settings.policy))
    await runtime.start()
    return runtime


async def eventually(predicate: Callable[[], Awaitable[bool]], what: str) -> None:
    """Polls until ``predicate`` holds; fails the test after WAIT_S."""
    for _ in range(int(WAIT_S / POLL_S)):
        if await predicate():
            return
        await asyncio.sleep(POLL_S)
    pytest.fail(f"timed out waiting for {what}")


async def read_stream(redis_url: str, run_id: str, count: int) -> list[GroupResult]:
    client = aioredis.Redis.from_url(redis_url)
    try:

        async def arrived() -> bool:
            return int(await client.xlen(stream_key(run_id))) >= count

        await eventually(arrived, f"{count} stream entries")
        entries = cast(
            list[tuple[bytes, dict[bytes, bytes]]], await client.xrange(stream_key(run_id))
        )
        return [decode_entry(fields) for _, fields in entries]
    finally:
        await client.aclose()


def running(runtime: SchedulerRuntime, count: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return runtime.status().inflight_groups >= count

    return check


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    fake = await FakeEngine("e0").start()
    yield fake
    await fake.stop()


def specs(run_id: str, count: int, n: int = 2, max_tokens: int = 8) -> list[GroupSpec]:
    return [spec(f"g{i}", n=n, max_tokens=max_tokens, run_id=run_id) for i in range(count)]


async def test_groups_are_delivered_whole_and_once(redis_url: str, engine: FakeEngine) -> None:
    runtime = await make_runtime(redis_url, [engine])
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 5, n=3))
        results = await read_stream(redis_url, run, 5)
        await asyncio.sleep(0.2)
        assert len(await read_stream(redis_url, run, 5)) == 5
    finally:
        await runtime.stop()
    assert sorted(r.group_id for r in results) == [f"g{i}" for i in range(5)]
    for r in results:
        assert r.status == GroupStatus.DELIVERED and len(r.samples) == 3
        assert all(s.token_ids == [100 + t for t in range(6)] for s in r.samples)
        assert all(len(s.logprobs) == 6 for s in r.samples)
    assert runtime.counters.groups_delivered == 5
    assert runtime.counters.samples_delivered == 15


async def test_engine_dying_midstream_requeues_to_another_engine(redis_url: str) -> None:
    dying = await FakeEngine("dying", behaviour=Behaviour.DIE_MID_STREAM).start()
    healthy = await FakeEngine("healthy", step_s=0.01).start()
    # Only the dying engine at first, so the group surely lands there.
    runtime = await make_runtime(redis_url, [dying])
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 1))

        async def engine_failed() -> bool:
            return runtime.counters.engine_failures > 0

        await eventually(engine_failed, "the engine failure")
        await runtime.register_engine("healthy", healthy.address)
        [result] = await read_stream(redis_url, run, 1)
    finally:
        await runtime.stop()
        await dying.stop()
        await healthy.stop()
    assert result.status == GroupStatus.DELIVERED
    assert result.attempts == 2
    assert {s.engine_id for s in result.samples} == {"healthy"}
    # Partial tokens from the dead engine were dropped, not glued to the new run.
    assert all(s.token_ids == [100 + t for t in range(6)] for s in result.samples)


async def test_group_fails_with_reason_after_max_attempts(redis_url: str) -> None:
    dying = await FakeEngine("dying", behaviour=Behaviour.DIE_MID_STREAM).start()
    runtime = await make_runtime(redis_url, [dying], max_attempts=2, health_failures=100)
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 1))
        # It comes back healthy at the next probe, fails again, and then the group fails.
        [result] = await read_stream(redis_url, run, 1)
    finally:
        await runtime.stop()
        await dying.stop()
    assert result.status == GroupStatus.FAILED
    assert "2 attempts failed" in result.error and "fake engine died" in result.error
    assert result.samples == []
    assert runtime.counters.groups_failed == 1


async def test_engine_rejection_fails_the_group_without_retry(redis_url: str) -> None:
    rejecting = await FakeEngine("picky", behaviour=Behaviour.REJECT).start()
    runtime = await make_runtime(redis_url, [rejecting])
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 1))
        [result] = await read_stream(redis_url, run, 1)
    finally:
        await runtime.stop()
        await rejecting.stop()
    assert result.status == GroupStatus.FAILED and "fake engine rejects it" in result.error
    assert len(rejecting.requests) == 1


async def test_cancel_running_group_aborts_engine_call_and_never_delivers(
    redis_url: str,
) -> None:
    hanging = await FakeEngine("slow", behaviour=Behaviour.HANG).start()
    runtime = await make_runtime(redis_url, [hanging])
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 2))
        await eventually(running(runtime, 2), "2 running groups")
        cancelled, unknown = await runtime.cancel(run, ["g0", "g1", "nope"])
        assert sorted(cancelled) == ["g0", "g1"] and unknown == ["nope"]

        async def aborted() -> bool:
            return hanging.cancelled >= 2

        await eventually(aborted, "the engine to see both calls cancelled")
        status = runtime.status()
    finally:
        await runtime.stop()
        await hanging.stop()
    assert status.inflight_groups == 0 and status.groups_cancelled == 2
    client = aioredis.Redis.from_url(redis_url)
    assert await client.xlen(stream_key(run)) == 0
    await client.aclose()


async def test_restart_recovers_pending_groups_and_never_duplicates(
    redis_url: str, engine: FakeEngine
) -> None:
    hanging = await FakeEngine("slow", behaviour=Behaviour.HANG).start()
    first = await make_runtime(redis_url, [hanging])
    run = new_run()
    await first.submit(run, specs(run, 3))
    await eventually(running(first, 3), "3 running groups")
    await first.stop()  # as if the process died: nothing was delivered
    await hanging.stop()
    second = await make_runtime(redis_url, [engine])
    try:
        results = await read_stream(redis_url, run, 3)
        with pytest.raises(DuplicateGroup):
            await second.submit(run, specs(run, 1))
    finally:
        await second.stop()
    assert sorted(r.group_id for r in results) == ["g0", "g1", "g2"]


async def test_store_delivery_is_idempotent(redis_url: str) -> None:
    store = Store.from_url(redis_url)
    run = new_run()
    [group] = specs(run, 1)
    await store.add_pending(run, [group])
    result = GroupResult(run_id=run, group_id="g0", status=GroupStatus.DELIVERED)
    try:
        first = await store.deliver(result)
        again = await store.deliver(result)
        assert first is not None and again is None
        assert all(s.run_id != run for s in await store.load_pending())
        with pytest.raises(DuplicateGroup):
            await store.add_pending(run, [group])
    finally:
        await store.close()
    client = aioredis.Redis.from_url(redis_url)
    assert await client.xlen(stream_key(run)) == 1
    await client.aclose()


async def test_queue_full_refuses_whole_batch(redis_url: str) -> None:
    runtime = await make_runtime(redis_url, [], max_queued_groups=3)
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 2))
        with pytest.raises(QueueFull, match="room for 1"):
            await runtime.submit(run, [spec(f"x{i}", run_id=run) for i in range(2)])
        assert runtime.status().queue_depth == 2
    finally:
        await runtime.stop()


async def test_many_small_groups_through_a_narrow_engine_all_arrive(redis_url: str) -> None:
    # Two groups fit at a time, so every completion is followed by a dispatch: the dispatch
    # loop keeps running while groups end, and must survive every interleaving of the two.
    narrow = await FakeEngine("narrow", max_num_seqs=4, tokens_per_sample=2).start()
    runtime = await make_runtime(redis_url, [narrow], capacity_factor=1.0)
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 150, n=2, max_tokens=4))
        results = await read_stream(redis_url, run, 150)
        status = runtime.status()
    finally:
        await runtime.stop()
        await narrow.stop()
    assert len({r.group_id for r in results}) == 150
    assert status.queue_depth == 0 and status.inflight_groups == 0
