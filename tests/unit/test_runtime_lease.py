"""The runtime and the scheduler lease: one scheduler per Redis database.

Faked: the engines (see fakes.py). Real: the session's Redis, the runtime, its store and lease.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis.asyncio as aioredis
from rollserve.client.wire import WEIGHTS_KEY, ended_key, pending_key, stream_key, version_key
from rollserve.scheduler.lease import LEASE_KEY, LeaseHeld, LeaseLost
from rollserve.scheduler.runtime import SchedulerRuntime

from tests.unit.builders import spec
from tests.unit.fakes import Behaviour, FakeEngine
from tests.unit.test_runtime import (
    WAIT_S,
    eventually,
    make_runtime,
    new_run,
    read_stream,
    running,
    specs,
)
from tests.unit.test_runtime_weights import asked_to_load

# Long enough that no stall of a loaded machine loses a lease for want of a renewal; a
# runtime sees its lease taken at its next renewal, a third of the ttl later at most.
LEASE_TTL_S = 30.0


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    c = aioredis.Redis.from_url(redis_url)
    yield c
    await c.aclose()


async def test_a_second_runtime_is_refused_naming_the_holder_and_starts_after_it(
    redis_url: str, client: aioredis.Redis
) -> None:
    first = await make_runtime(redis_url, [])  # no engine: its group stays pending
    engine = await FakeEngine("e").start()
    run = new_run()
    try:
        await first.submit(run, specs(run, 1))
        holder = await client.get(LEASE_KEY)
        assert isinstance(holder, bytes)
        with pytest.raises(LeaseHeld, match=re.escape(f"another scheduler ({holder.decode()})")):
            await make_runtime(redis_url, [engine], lease_wait_s=0)
        assert engine.requests == []  # it touched nothing: the pending group did not run
        # One that waits starts as soon as the first one stops (and releases the lease).
        waiting = asyncio.create_task(make_runtime(redis_url, [engine]))
        await asyncio.sleep(0.2)
        assert not waiting.done()
    finally:
        await first.stop()
    second = await asyncio.wait_for(waiting, WAIT_S)
    try:
        [result] = await read_stream(redis_url, run, 1)  # it recovered the first's group
        assert result.group_id == "g0"
    finally:
        await second.stop()
        await engine.stop()
    assert await client.get(LEASE_KEY) is None  # released at stop


async def test_a_runtime_whose_lease_is_taken_stops_acting_and_fails(
    other_redis_url: str,
) -> None:
    # A database of its own: the groups it leaves pending are no other test's to run.
    client = aioredis.Redis.from_url(other_redis_url)
    hanging = await FakeEngine("slow", behaviour=Behaviour.HANG).start()
    runtime = await make_runtime(
        other_redis_url, [hanging], lease_ttl_s=LEASE_TTL_S, lease_wait_s=LEASE_TTL_S
    )
    run = new_run()
    try:
        try:
            await runtime.submit(run, specs(run, 2))
            await eventually(running(runtime, 2), "2 running groups")
            await client.set(LEASE_KEY, "intruder")
            await asyncio.wait_for(runtime.failed.wait(), LEASE_TTL_S / 3 + WAIT_S)
            assert runtime.lost is not None and "no longer held" in str(runtime.lost)

            async def aborted() -> bool:
                return hanging.cancelled >= 2

            await eventually(aborted, "the engine to see both calls cancelled")

            async def unwatched() -> bool:  # (a watch's probe could load weights into one)
                return all(w.done() for w in runtime._watches.values())

            await eventually(unwatched, "the engines' health watches to stop")
            with pytest.raises(LeaseLost, match="lost its lease"):
                await runtime.submit(run, specs(run, 1, max_tokens=4))
            with pytest.raises(LeaseLost, match="lost its lease"):
                await runtime.cancel(run, ["g0"])
            with pytest.raises(LeaseLost, match="lost its lease"):
                await runtime.register_engine("late", "127.0.0.1:1")
            assert "late" not in {e.engine_id for e in runtime.status().engines}
        finally:
            await runtime.stop()
            await hanging.stop()
        assert await client.get(LEASE_KEY) == b"intruder"  # not its own: left alone
        assert await client.xlen(stream_key(run)) == 0
        assert await client.hlen(pending_key(run)) == 2  # for the new holder to run
    finally:
        await client.aclose()


# Long enough that the runtime's own renewal does not come while a test runs: what refuses
# its writes is Redis, fencing them by the lease.
STALLED_TTL_S = 600.0


async def successor_takes_over(client: aioredis.Redis) -> None:
    """What a scheduler started while this one stalled past its ttl does: the lease ended in
    Redis and the successor took it."""
    await client.set(LEASE_KEY, "successor")


async def test_a_runtime_that_stalled_past_its_lease_delivers_nothing_after(
    other_redis_url: str,
) -> None:
    """A group that finishes after a successor took the lease, before this runtime's renewal
    would find out: Redis refuses its delivery, the runtime stops all work and fails, and
    the group stays pending for the successor (which delivers it once)."""
    client = aioredis.Redis.from_url(other_redis_url)
    gate = asyncio.Event()
    engine = await FakeEngine("e0", second_half_gate=gate).start()
    runtime = await make_runtime(
        other_redis_url, [engine], lease_ttl_s=STALLED_TTL_S, lease_wait_s=STALLED_TTL_S
    )
    run = new_run()
    try:
        try:
            await runtime.submit(run, specs(run, 1))
            await eventually(running(runtime, 1), "the group to run")
            await successor_takes_over(client)
            gate.set()
            await asyncio.wait_for(runtime.failed.wait(), WAIT_S)
            lost = runtime.lost
            with pytest.raises(LeaseLost, match="lost its lease"):
                await runtime.submit(run, [spec("later", run_id=run)])
        finally:
            await runtime.stop()
            await engine.stop()
        assert lost is not None and "refused this scheduler's write" in str(lost)
        assert await client.xlen(stream_key(run)) == 0
        assert await client.hkeys(pending_key(run)) == [b"g0"]
        assert await client.get(LEASE_KEY) == b"successor"  # not its own: left alone
    finally:
        await client.aclose()


async def test_a_runtime_that_stalled_past_its_lease_accepts_and_publishes_nothing(
    other_redis_url: str,
) -> None:
    """A Submit, a Cancel or a PublishVersion that reaches a runtime after a successor took
    the lease: Redis refuses the write (UNAVAILABLE to the caller, who retries on the
    successor); accepted, the groups sat in Redis unseen by the scheduler that runs, and a
    version was stored that it did not know."""
    client = aioredis.Redis.from_url(other_redis_url)
    engine = await FakeEngine("e0").start()
    writes: dict[str, Callable[[SchedulerRuntime, str], Awaitable[object]]] = {
        "submit": lambda r, run: r.submit(run, specs(run, 1)),
        "cancel": lambda r, run: r.cancel(run, ["g0"]),
        "publish": lambda r, run: r.publish_version(run, 4),
        "publish weights": lambda r, run: r.publish_version(run, 4, "/ckpt/step-4"),
    }
    try:
        for name, write in writes.items():
            await client.flushdb()
            run = new_run()
            runtime = await make_runtime(
                other_redis_url, [engine], lease_ttl_s=STALLED_TTL_S, lease_wait_s=STALLED_TTL_S
            )
            # A pending group (that the successor recovered) for cancel to end.
            await client.hset(pending_key(run), "g0", b"kept")
            try:
                await successor_takes_over(client)
                with pytest.raises(LeaseLost, match="refused this scheduler's write"):
                    await write(runtime, run)
                assert runtime.failed.is_set(), name
            finally:
                await runtime.stop()
            assert await client.hgetall(pending_key(run)) == {b"g0": b"kept"}, name
            assert await client.smembers(ended_key(run)) == set(), name
            assert await client.get(version_key(run)) is None, name
            assert await client.exists(WEIGHTS_KEY) == 0, name
    finally:
        await engine.stop()
        await client.aclose()


async def test_a_publish_under_way_when_the_lease_is_found_taken_answers_lease_lost(
    other_redis_url: str,
) -> None:
    """A PublishVersion whose engines still load when another write finds the lease taken:
    the runtime stops it, and its caller is told the lease was lost (UNAVAILABLE, to retry
    on the successor) rather than that the call was cancelled."""
    gate = asyncio.Event()
    engine = await FakeEngine("e0", load_gate=gate).start()
    runtime = await make_runtime(
        other_redis_url, [engine], lease_ttl_s=STALLED_TTL_S, lease_wait_s=STALLED_TTL_S
    )
    client = aioredis.Redis.from_url(other_redis_url)
    run = new_run()
    try:
        publishing = asyncio.create_task(runtime.publish_version(run, 2, "/ckpt/step-2"))

        await eventually(asked_to_load(engine), "the engine to load step 2")
        await successor_takes_over(client)
        with pytest.raises(LeaseLost, match="refused this scheduler's write"):
            await runtime.submit(run, specs(run, 1))
        with pytest.raises(LeaseLost, match="lost its lease"):
            await asyncio.wait_for(publishing, WAIT_S)
    finally:
        gate.set()
        await runtime.stop()
        await engine.stop()
        await client.aclose()


async def test_no_work_starts_while_the_lease_is_in_doubt(other_redis_url: str) -> None:
    """While a late renewal asks Redis whether the lease is still this scheduler's (it
    stalled past the part of the ttl it counts on), nothing is sent to the engines: another
    scheduler may be running the same groups there. Faked: the engine; and the doubt itself,
    set on the runtime's lease as a late renewal sets it."""
    engine = await FakeEngine("e0").start()
    runtime = await make_runtime(
        other_redis_url, [engine], lease_ttl_s=LEASE_TTL_S, lease_wait_s=LEASE_TTL_S
    )
    run = new_run()
    lease = runtime._lease
    assert lease is not None
    doubt = lease._doubt = asyncio.Event()
    try:
        await runtime.submit(run, specs(run, 2))
        await asyncio.sleep(0.3)
        assert engine.requests == [] and runtime.status().inflight_groups == 0
        lease._doubt = None
        doubt.set()  # (Redis said it is still its own)
        assert len(await read_stream(other_redis_url, run, 2)) == 2
    finally:
        await runtime.stop()
        await engine.stop()
