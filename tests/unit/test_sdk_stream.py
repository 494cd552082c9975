"""The trainer SDK's clients and step batcher over a real Redis, with the scheduler faked.

Faked: the scheduler's gRPC side. ``StreamRun`` is a ``RolloutClient`` whose ``submit``
writes each group's entry to the run's stream at once (``encode_entry`` + XADD, as the
scheduler does when a group finishes) instead of calling Submit; ``cancel`` cancels nothing.
Real: Redis (the session's), the clients' reads, acknowledgements and heartbeat, and the
batcher. The waits below (past ``claim_idle_ms``, so that another consumer's claim scan
would take idle entries) are lower bounds the tests need, never timings they measure.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator, Sequence

import pytest
import redis
from redis.exceptions import NoPermissionError, ReadOnlyError, ResponseError
from rollserve.cli.redis_server import EmbeddedRedis
from rollserve.client import (
    AsyncRolloutClient,
    CancelResult,
    ClientClosed,
    GroupResult,
    GroupStatus,
    PromptGroup,
    RolloutClient,
    StepBatcher,
    StreamReadOnly,
    StreamRefused,
    StreamUnavailable,
)
from rollserve.client.consumer import heartbeat_error
from rollserve.client.wire import encode_entry, stream_key

SCHEDULER = "127.0.0.1:52701"  # nothing listens there; gRPC connects lazily
CLAIM_IDLE_MS = 1000
PAST_CLAIM_IDLE_S = 2.5 * CLAIM_IDLE_MS / 1000  # long enough for another claim scan to take
WAIT_S = 10.0  # bound on any wait for entries that are there


def new_run_id() -> str:
    return f"sdk-{uuid.uuid4().hex[:12]}"


def publish(r: redis.Redis, run_id: str, *group_ids: str) -> None:
    for group_id in group_ids:
        result = GroupResult(run_id=run_id, group_id=group_id, status=GroupStatus.DELIVERED)
        r.xadd(stream_key(run_id), encode_entry(result))  # type: ignore[arg-type]


class StreamRun(RolloutClient):
    """A client whose Submit finishes each group at once: its entry is in the stream."""

    def __init__(self, redis_url: str, run_id: str, **kwargs: object) -> None:
        super().__init__(SCHEDULER, redis_url, run_id, **kwargs)  # type: ignore[arg-type]
        self.writer = redis.Redis.from_url(redis_url)

    def submit(self, groups: Sequence[PromptGroup]) -> int:
        publish(self.writer, self.run_id, *(g.group_id for g in groups))
        return len(groups)

    def cancel(self, group_ids: Sequence[str]) -> CancelResult:
        return CancelResult(cancelled=(), unknown=tuple(group_ids))

    def close(self) -> None:
        self.writer.close()
        super().close()


def prompt_groups(prefix: str) -> Iterator[PromptGroup]:
    index = 0
    while True:
        yield PromptGroup(group_id=f"{prefix}{index}", prompt_token_ids=[1, 2], n=1)
        index += 1


def test_groups_carried_over_by_a_batcher_stay_its_own_while_it_trains(redis_url: str) -> None:
    """Two trainers share a consumer group. All four groups of A's step 0 finish at once, one
    read takes them, and the batch takes two: the two carried over stay A's while it trains
    longer than claim_idle_ms (B's claim scan took them, B trained on them, and A's next
    step waited for them forever)."""
    run = new_run_id()
    a = StreamRun(redis_url, run, consumer_name="A", claim_idle_ms=CLAIM_IDLE_MS)
    b = RolloutClient(SCHEDULER, redis_url, run, consumer_name="B", claim_idle_ms=CLAIM_IDLE_MS)
    with a, b:
        batcher = StepBatcher(
            a, prompt_groups("a"), batch_size=2, oversample=1.0, batch_timeout_s=WAIT_S
        )
        first = next(batcher)
        assert [g.group_id for g in first.groups] == ["a0", "a1"]
        time.sleep(PAST_CLAIM_IDLE_S)  # A trains on step 0
        assert [g.group_id for g in b.groups(timeout_s=0.5)] == []
        batcher.ack(first)
        second = next(batcher)
        assert [(g.group_id, g.launch_step) for g in second.groups] == [("a2", 0), ("a3", 0)]


async def test_groups_read_ahead_by_an_iterator_left_early_stay_the_clients_own(
    redis_url: str,
) -> None:
    """A trainer breaks out of ``groups()`` (no limit) after one group of a read that brought
    three: the other two stay its own, however long it takes to iterate again."""
    run = new_run_id()
    r = redis.Redis.from_url(redis_url)
    try:
        publish(r, run, "a", "b", "c")
    finally:
        r.close()
    a = AsyncRolloutClient(SCHEDULER, redis_url, run, consumer_name="A", claim_idle_ms=1000)
    b = AsyncRolloutClient(SCHEDULER, redis_url, run, consumer_name="B", claim_idle_ms=1000)
    async with a, b:
        stream = a.groups(timeout_s=WAIT_S)
        first = await anext(stream)
        await stream.aclose()  # type: ignore[attr-defined]
        await a.ack(first)
        await asyncio.sleep(PAST_CLAIM_IDLE_S)
        assert [g.group_id async for g in b.groups(timeout_s=0.5)] == []
        rest = [g async for g in a.groups(limit=2, timeout_s=WAIT_S)]
        assert [(g.group_id, g.delivery_count) for g in rest] == [("b", 1), ("c", 1)]


# ------------------------------------------------------------- Redis says no


@pytest.fixture
def replica() -> Iterator[str]:
    """A Redis that is a replica (of nothing that answers): it refuses every write, as the
    old primary does once a failover has made it a replica."""
    with EmbeddedRedis(unix_socket=True, extra_args=["--replicaof", "127.0.0.1", "52702"]) as rep:
        yield rep.url


def test_a_read_only_replica_is_named_by_both_clients(replica: str) -> None:
    """(redis.exceptions.ReadOnlyError came out of groups(), no RolloutError.)"""
    run = new_run_id()
    client = RolloutClient(SCHEDULER, replica, run)
    with client, pytest.raises(StreamReadOnly, match="point redis_url at the primary"):
        list(client.groups(timeout_s=0.5))

    async def read() -> None:
        async with AsyncRolloutClient(SCHEDULER, replica, run) as aclient:
            with pytest.raises(StreamReadOnly, match="read-only replica"):
                [g async for g in aclient.groups(timeout_s=0.5)]

    asyncio.run(read())
    assert issubclass(StreamReadOnly, StreamUnavailable)  # retried as an outage is


async def test_a_key_of_another_type_is_named_and_not_a_raw_redis_error(redis_url: str) -> None:
    run = new_run_id()
    r = redis.Redis.from_url(redis_url)
    try:
        publish(r, run, "a")
        with RolloutClient(SCHEDULER, redis_url, run, consumer_name="A") as client:
            (got,) = client.groups(limit=1, timeout_s=WAIT_S)
            r.delete(stream_key(run))
            r.set(stream_key(run), "not a stream")
            with pytest.raises(StreamRefused, match="another type than a stream"):
                client.ack(got)
            with pytest.raises(StreamRefused, match="another type"):
                client.discard(got.entry_id)
        async with AsyncRolloutClient(SCHEDULER, redis_url, run) as aclient:
            with pytest.raises(StreamRefused, match="another type"):
                [g async for g in aclient.groups(timeout_s=0.5)]
    finally:
        r.delete(stream_key(run))
        r.close()


def test_a_redis_user_without_permission_is_told_so(redis_url: str) -> None:
    run, user = new_run_id(), f"sdk-{uuid.uuid4().hex[:8]}"
    r = redis.Redis.from_url(redis_url)
    r.acl_setuser(user, enabled=True, nopass=True, keys=["elsewhere:*"], commands=["+@all"])
    try:
        url = redis_url.replace("redis://", f"redis://{user}@", 1)
        client = RolloutClient(SCHEDULER, url, run)
        with client, pytest.raises(StreamRefused, match="no permission"):
            list(client.groups(timeout_s=0.5))
    finally:
        r.acl_deluser(user)
        r.close()


@pytest.mark.parametrize(
    ("error", "kind", "says"),
    [
        (
            NoPermissionError("this user has no permissions to run the 'evalsha' command"),
            StreamUnavailable,
            "scripting",
        ),
        (
            NoPermissionError(
                "this user has no permissions to access one of the keys used as arguments"
            ),
            StreamRefused,
            "no permission",
        ),
        (ReadOnlyError("You can't write against a read only replica."), StreamReadOnly, "primary"),
        (
            ResponseError(
                "Error running script: WRONGTYPE Operation against a key holding the "
                "wrong kind of value"
            ),
            StreamRefused,
            "another type",
        ),
    ],
)
def test_a_refused_heartbeat_is_said_for_its_cause(
    error: redis.RedisError, kind: type[Exception], says: str
) -> None:
    """(Whatever Redis said, the advice was to give the Redis user scripting.)"""
    raised = heartbeat_error(error, "rollserve:{r}:groups")
    assert type(raised) is kind and says in str(raised)
    assert ("scripting" in str(raised)) == (says == "scripting")


# ------------------------------------------------------------------- closed


def test_a_closed_client_says_it_is_closed(redis_url: str) -> None:
    """(Submit raised grpc's ValueError, and groups() opened a new connection to Redis and
    read on, with no heartbeat.)"""
    run = new_run_id()
    client = RolloutClient(SCHEDULER, redis_url, run)
    client.close()
    with pytest.raises(ClientClosed, match="closed"):
        client.submit([PromptGroup(group_id="g", prompt_token_ids=[1], n=1)])
    with pytest.raises(ClientClosed):
        list(client.groups(timeout_s=0.1))
    with pytest.raises(ClientClosed):
        client.status()
    with pytest.raises(ClientClosed):  # (it returned None, as if it had)
        client.release()


async def test_a_closed_async_client_says_it_is_closed(redis_url: str) -> None:
    """(Submit raised grpc's UsageError.)"""
    client = AsyncRolloutClient(SCHEDULER, redis_url, new_run_id())
    await client.close()
    with pytest.raises(ClientClosed, match="closed"):
        await client.submit([PromptGroup(group_id="g", prompt_token_ids=[1], n=1)])
    with pytest.raises(ClientClosed):
        [g async for g in client.groups(timeout_s=0.1)]
    with pytest.raises(ClientClosed):
        await client.discard("1-0")
    with pytest.raises(ClientClosed):
        client.release()


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_group_released_before_its_stream_went_does_not_wedge_the_reader(
    redis_url: str, use_async: bool
) -> None:
    """A group given up (released) is parked at the next read; its stream deleted meanwhile,
    the park script meets NOGROUP, which Redis 6.2 words inside a script error. Taken for
    a refusal, every later read raised StreamRefused; it is the group lost: made again."""
    run = new_run_id()
    r = redis.Redis.from_url(redis_url)
    publish(r, run, "g0")

    async def scenario_async() -> list[list[str]]:
        async with AsyncRolloutClient(SCHEDULER, redis_url, run, claim_idle_ms=CLAIM_IDLE_MS) as c:
            got = [g async for g in c.groups(limit=1, timeout_s=WAIT_S)]
            c.release(*got)
            r.delete(stream_key(run))
            reads = []
            for _ in range(3):
                reads.append([g.group_id async for g in c.groups(timeout_s=0.3)])
            return reads

    try:
        if use_async:
            reads = asyncio.run(scenario_async())
        else:
            with RolloutClient(SCHEDULER, redis_url, run, claim_idle_ms=CLAIM_IDLE_MS) as c:
                got = list(c.groups(limit=1, timeout_s=WAIT_S))
                c.release(*got)
                r.delete(stream_key(run))
                reads = [[g.group_id for g in c.groups(timeout_s=0.3)] for _ in range(3)]
        assert reads == [[], [], []]
    finally:
        r.close()
