"""Which of Redis's refusals of a scheduler write may pass if tried again: the scheduler
retries those until Redis takes the group, and gives up (logged, the group pending in Redis
for a restart) on the others. The refusals are Redis's own, from a redis-server of this
test's own (its memory limit and replication are changed)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
import redis.exceptions
from rollserve.cli.redis_server import EmbeddedRedis
from rollserve.client.wire import (
    GroupResult,
    GroupStatus,
    deletes_key,
    pending_key,
    stream_key,
)
from rollserve.scheduler.store import Store, may_pass_later

from tests.unit.builders import spec


@pytest.fixture
async def own_redis() -> AsyncIterator[tuple[Store, aioredis.Redis]]:
    with EmbeddedRedis() as server:
        store = Store.from_url(server.url)
        client = aioredis.Redis.from_url(server.url)
        try:
            yield store, client
        finally:
            await store.close()
            await client.aclose()


def result(group_id: str) -> GroupResult:
    return GroupResult(run_id="refusals", group_id=group_id, status=GroupStatus.DELIVERED)


async def test_out_of_memory_and_a_read_only_replica_may_pass_later(
    own_redis: tuple[Store, aioredis.Redis],
) -> None:
    """Redis 6 wraps an error of a command inside a script ("ERR Error running script ...
    -OOM ..."): redis-py raises a plain ResponseError, which the scheduler took for one no
    retry passes, and gave the group up."""
    store, client = own_redis
    await store.add_pending("refusals", [spec("g0", run_id="refusals")])
    await client.config_set("maxmemory-policy", "noeviction")
    await client.config_set("maxmemory", "1")
    with pytest.raises(redis.exceptions.RedisError) as out_of_memory:
        await store.deliver(result("g0"))
    await client.config_set("maxmemory", "0")
    await client.replicaof("127.0.0.1", 1)  # (no primary there)
    with pytest.raises(redis.exceptions.RedisError) as read_only:
        await store.deliver(result("g0"))
    await client.replicaof("NO", "ONE")
    assert "OOM" in str(out_of_memory.value) and "READONLY" in str(read_only.value)
    assert may_pass_later(out_of_memory.value) and may_pass_later(read_only.value)
    assert await store.deliver(result("g0")) is not None  # taken once Redis can


async def test_a_run_is_deleted_from_a_redis_out_of_memory(
    own_redis: tuple[Store, aioredis.Redis],
) -> None:
    """DeleteRun is how a full Redis is given memory back: its script deletes first, and
    only then sets the mark that tells readers the run was deleted (Redis refuses a script
    whose first write needs memory)."""
    store, client = own_redis
    await store.add_pending("refusals", [spec("g0", run_id="refusals")])
    await client.xadd(stream_key("refusals"), {"entry": "x" * 100})
    await client.config_set("maxmemory-policy", "noeviction")
    await client.config_set("maxmemory", "1")
    try:
        with pytest.raises(redis.exceptions.RedisError, match="OOM"):
            await store.add_pending("refusals", [spec("g1", run_id="refusals")])
        assert await store.delete_run("refusals") is True
        assert await client.exists(stream_key("refusals"), pending_key("refusals")) == 0
        assert await client.exists(deletes_key("refusals")) == 1
    finally:
        await client.config_set("maxmemory", "0")


async def test_a_wrong_type_never_passes(own_redis: tuple[Store, aioredis.Redis]) -> None:
    store, client = own_redis
    await store.add_pending("refusals", [spec("g0", run_id="refusals")])
    await client.set(stream_key("refusals"), "not a stream")
    with pytest.raises(redis.exceptions.ResponseError) as wrong_type:
        await store.deliver(result("g0"))
    assert "WRONGTYPE" in str(wrong_type.value) and not may_pass_later(wrong_type.value)


@pytest.mark.parametrize(
    ("exc", "later"),
    [
        (redis.exceptions.ConnectionError("Connection refused"), True),
        (redis.exceptions.BusyLoadingError("Redis is loading the dataset in memory"), True),
        (redis.exceptions.TimeoutError("Timeout reading from socket"), True),
        (redis.exceptions.TryAgainError("Multiple keys request during rehashing"), True),
        (redis.exceptions.MasterDownError("Link with MASTER is down"), True),
        (redis.exceptions.ResponseError("BUSY Redis is busy running a script"), True),
        (redis.exceptions.ResponseError("MISCONF Redis is configured to save RDB"), True),
        (redis.exceptions.ResponseError("NOREPLICAS Not enough good replicas"), True),
        (redis.exceptions.ResponseError("BUSYGROUP Consumer Group name already exists"), False),
        (redis.exceptions.ResponseError("ERR Error compiling script (new function)"), False),
        (redis.exceptions.NoPermissionError("NOPERM this user has no permissions"), False),
    ],
)
def test_refusals_are_told_apart_by_their_code(
    exc: redis.exceptions.RedisError, later: bool
) -> None:
    assert may_pass_later(exc) is later
