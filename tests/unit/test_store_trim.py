"""The stream trim: entries every consumer group has acknowledged leave a run's stream once
older than the retention; nothing a reader has not acknowledged (or not read) ever does.
Redis is real (a database of each test's own); the scheduler's tests fake its engine."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
import redis.exceptions
from rollserve.client import AsyncRolloutClient
from rollserve.client.wire import stream_key
from rollserve.scheduler.lease import LEASE_KEY, LeaseLost
from rollserve.scheduler.store import Store, history_keys

from tests.unit.fakes import FakeEngine
from tests.unit.test_runtime import WAIT_S, eventually, make_runtime, new_run, specs


@pytest.fixture
async def store(other_redis_url: str) -> AsyncIterator[tuple[Store, aioredis.Redis]]:
    client = aioredis.Redis.from_url(other_redis_url)
    store = Store.from_url(other_redis_url)
    try:
        yield store, client
    finally:
        await store.close()
        await client.aclose()


# (redis-py's types of stream replies are unions of every protocol's; these are RESP2's)


async def written(client: aioredis.Redis, run: str, count: int) -> list[bytes]:
    ids: list[Any] = [await client.xadd(stream_key(run), {"i": str(i)}) for i in range(count)]
    return ids


async def read(client: aioredis.Redis, run: str, group: str, count: int) -> list[bytes]:
    """``count`` new entries for ``group`` (made at the stream's start), unacknowledged."""
    await client.xgroup_create(stream_key(run), group, id="0", mkstream=True)
    reply: Any = await client.xreadgroup(group, "c", {stream_key(run): ">"}, count=count)
    return [entry_id for entry_id, _ in reply[0][1]] if reply else []


async def read_more(client: aioredis.Redis, run: str, group: str) -> list[bytes]:
    reply: Any = await client.xreadgroup(group, "c", {stream_key(run): ">"}, count=100)
    return [entry_id for entry_id, _ in reply[0][1]] if reply else []


async def left(client: aioredis.Redis, run: str) -> list[bytes]:
    entries: Any = await client.xrange(stream_key(run))
    return [entry_id for entry_id, _ in entries]


async def test_entries_every_group_acknowledged_go(store: tuple[Store, aioredis.Redis]) -> None:
    s, client = store
    run = f"trim-{uuid.uuid4().hex[:8]}"
    ids = await written(client, run, 6)
    got = await read(client, run, "trainer", 4)
    assert got == ids[:4]
    await client.xack(stream_key(run), "trainer", ids[0], ids[1], ids[3])  # ids[2] pending
    assert await s.trim_acked(run, retention_s=0) == (2, 4)
    assert await left(client, run) == ids[2:]
    # Once ids[2] is acknowledged too, all it read goes; what it has not read stays.
    await client.xack(stream_key(run), "trainer", ids[2])
    assert await s.trim_acked(run, retention_s=0) == (2, 2)
    assert await left(client, run) == ids[4:]
    await client.xack(stream_key(run), "trainer", *await read_more(client, run, "trainer"))
    assert await s.trim_acked(run, retention_s=0) == (2, 0)


async def test_a_group_that_read_less_keeps_what_it_has_not_acknowledged(
    store: tuple[Store, aioredis.Redis],
) -> None:
    s, client = store
    run = f"trim-{uuid.uuid4().hex[:8]}"
    ids = await written(client, run, 5)
    await client.xack(stream_key(run), "trainer", *await read(client, run, "trainer", 5))
    await read(client, run, "monitor", 2)  # ids[0] and ids[1], not acknowledged
    assert await s.trim_acked(run, retention_s=0) == (0, 5)
    await client.xack(stream_key(run), "monitor", ids[0])
    assert await s.trim_acked(run, retention_s=0) == (1, 4)
    assert await left(client, run) == ids[1:]
    await client.xgroup_create(stream_key(run), "late", id="0")  # has read nothing yet
    assert await s.trim_acked(run, retention_s=0) == (0, 4)


async def test_nothing_goes_without_a_group_or_within_the_retention(
    store: tuple[Store, aioredis.Redis],
) -> None:
    s, client = store
    run = f"trim-{uuid.uuid4().hex[:8]}"
    assert await s.trim_acked(run, retention_s=0) == (0, 0)  # no stream
    ids = await written(client, run, 3)
    assert await s.trim_acked(run, retention_s=0) == (0, 3)  # no reader yet
    await client.xack(stream_key(run), "trainer", *await read(client, run, "trainer", 2))
    assert await s.trim_acked(run, retention_s=3600) == (0, 3)  # written just now
    assert await s.trim_acked(run, retention_s=0) == (2, 1)
    assert await left(client, run) == ids[2:]


async def test_the_scheduler_trims_what_its_readers_acknowledged(other_redis_url: str) -> None:
    """The runtime's trim: entries the trainer acknowledged leave the stream, the one it
    holds stays until it is acknowledged too; Status counts them. Faked: the engine."""
    engine = await FakeEngine("e0").start()
    runtime = await make_runtime(
        other_redis_url, [engine], trim_interval_s=0.05, acked_retention_s=0
    )
    redis_client = aioredis.Redis.from_url(other_redis_url)
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 3))
        # (the reader needs no scheduler: it reads Redis)
        async with AsyncRolloutClient("127.0.0.1:1", other_redis_url, run) as reader:
            got = [g async for g in reader.groups(limit=3, timeout_s=WAIT_S)]
            for item in got[:2]:
                await item.done()

            def trimmed(count: int) -> Callable[[], Awaitable[bool]]:
                async def check() -> bool:
                    return runtime.status().stream_entries_trimmed == count

                return check

            await eventually(trimmed(2), "the acknowledged entries to go")
            assert await left(redis_client, run) == [got[2].entry_id.encode()]
            await got[2].done()
            await eventually(trimmed(3), "the last entry to go once acknowledged")
            assert await left(redis_client, run) == []
    finally:
        await runtime.stop()
        await engine.stop()
        await redis_client.aclose()


async def test_a_scheduler_told_to_keep_acknowledged_entries_keeps_them(
    other_redis_url: str,
) -> None:
    engine = await FakeEngine("e0").start()
    runtime = await make_runtime(
        other_redis_url, [engine], trim_interval_s=0.05, acked_retention_s=0, trim_acked=False
    )
    redis_client = aioredis.Redis.from_url(other_redis_url)
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 2))
        async with AsyncRolloutClient("127.0.0.1:1", other_redis_url, run) as reader:
            async for item in reader.groups(limit=2, timeout_s=WAIT_S):
                await item.done()
        await asyncio.sleep(0.5)  # ten trim periods, had it trimmed
        assert len(await left(redis_client, run)) == 2
        assert runtime.status().stream_entries_trimmed == 0
        assert not runtime._delivered_to  # (runs for the trim to look at: none kept)
    finally:
        await runtime.stop()
        await engine.stop()
        await redis_client.aclose()


async def test_a_trim_redis_refuses_is_tried_again_and_fails_nothing(
    other_redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis refuses the first trims (a busy script, a failover, an ACL fixed later): the
    scheduler says so once, goes on serving and trims once Redis lets it (its trim loop
    returned, which stopped the scheduler). Faked: the refusals, and the engine."""
    engine = await FakeEngine("e0").start()
    runtime = await make_runtime(
        other_redis_url, [engine], trim_interval_s=0.05, acked_retention_s=0
    )
    real_trim = runtime._store.trim_acked
    refused: list[str] = []

    async def trim_acked(
        run_id: str, retention_s: float, *, samples: bool = False
    ) -> tuple[int, int]:
        if len(refused) < 3:
            refused.append(run_id)
            raise redis.exceptions.ResponseError("BUSY Redis is busy running a script")
        return await real_trim(run_id, retention_s, samples=samples)

    runtime._store.trim_acked = trim_acked  # type: ignore[method-assign]
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 1))
        async with AsyncRolloutClient("127.0.0.1:1", other_redis_url, run) as reader:
            async for item in reader.groups(limit=1, timeout_s=WAIT_S):
                await item.done()

        async def trimmed() -> bool:
            return runtime.status().stream_entries_trimmed == 1

        await eventually(trimmed, "the entry to go once Redis lets the trim run")
        failed = runtime.failed.is_set()
    finally:
        await runtime.stop()
        await engine.stop()
    assert len(refused) == 3 and not failed
    said = [r for r in caplog.records if "refused to trim" in r.getMessage()]
    assert len(said) == 1


async def test_a_store_that_lost_its_lease_trims_and_forgets_nothing(
    store: tuple[Store, aioredis.Redis],
) -> None:
    """The trim and the drop of unloadable history are fenced by the lease as every other
    write is: a scheduler that stalled while another took over removes nothing once it
    wakes (LeaseLost, as for a delivery)."""
    s, client = store
    run = f"trim-{uuid.uuid4().hex[:8]}"
    ids = await written(client, run, 3)
    await client.xack(stream_key(run), "trainer", *await read(client, run, "trainer", 3))
    records_key, used_key, _, _ = history_keys("default")
    await client.hset(records_key, "k", b"record")
    await client.zadd(used_key, {"k": 1})
    s.lease(ttl_s=10, wait_s=1)  # (the store writes as its holder from now on)
    await client.set(LEASE_KEY, "successor")
    try:
        with pytest.raises(LeaseLost, match="refused this scheduler's write"):
            await s.trim_acked(run, retention_s=0)
        with pytest.raises(LeaseLost, match="refused this scheduler's write"):
            await s.drop_history_keys(["k"])
        assert await left(client, run) == ids
        assert await client.hkeys(records_key) == [b"k"]
        assert await client.zrange(used_key, 0, -1) == [b"k"]
    finally:
        await client.delete(LEASE_KEY, records_key, used_key)


async def test_history_keys_are_dropped_however_many(store: tuple[Store, aioredis.Redis]) -> None:
    s, client = store
    records_key, used_key, _, _ = history_keys("default")
    keys = [f"k{i}" for i in range(9000)]  # (more than one script's arguments can unpack)
    await client.hset(records_key, mapping=dict.fromkeys([*keys, "kept"], b"record"))
    await client.zadd(used_key, dict.fromkeys([*keys, "kept"], 1))
    try:
        await s.drop_history_keys(keys)
        assert await client.hkeys(records_key) == [b"kept"]
        assert await client.zrange(used_key, 0, -1) == [b"kept"]
    finally:
        await client.delete(records_key, used_key)
