"""The trainer SDK's stream reader against a real redis-server.

Entries are written as the scheduler writes them (``encode_entry`` + XADD); no
scheduler runs here, so the gRPC side is checked only for argument validation and
for an unreachable scheduler. Timeouts below are upper bounds for a loaded
machine, never timings that the tests measure.
"""

from __future__ import annotations

import asyncio
import math
import socket
import threading
import time
import uuid

import pytest
import redis
from rollserve.client import (
    AsyncRolloutClient,
    GroupResult,
    GroupStatus,
    InvalidArgument,
    PromptGroup,
    ReceivedGroup,
    RolloutClient,
    Sample,
    SamplingParams,
    SchedulerUnavailable,
    StreamUnavailable,
    UndecodableEntry,
)
from rollserve.client.types import cancel_request, submit_request
from rollserve.client.wire import (
    FinishReason,
    SampleResult,
    encode_entry,
    encode_sample_entry,
    samples_stream_key,
    stream_key,
)

GROUP = "trainer"
CLAIM_IDLE_MS = 200  # small, so that a dead consumer's entries are claimable soon
BLOCK_MS = 50
WAIT_S = 10.0  # bound on any wait for entries that are there or due


def new_run_id() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def unused_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


SCHEDULER = unused_address()  # nothing listens there


def make_result(run_id: str, group_id: str, n: int = 2) -> GroupResult:
    return GroupResult(
        run_id=run_id,
        group_id=group_id,
        status=GroupStatus.DELIVERED,
        samples=[
            Sample(
                sample_id=f"{group_id}/{i}",
                index=i,
                token_ids=[1, 2, 3],
                logprobs=[-0.1, -0.2, -0.3],
                finish_reason=FinishReason.STOP,
                engine_id="engine-0",
            )
            for i in range(n)
        ],
    )


def xadd(r: redis.Redis, run_id: str, fields: dict[str, bytes] | dict[str, str]) -> str:
    entry_id = r.xadd(stream_key(run_id), fields)  # type: ignore[arg-type]
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)


def publish(r: redis.Redis, run_id: str, *group_ids: str) -> list[str]:
    """XADDs one entry per group id, as the scheduler does; returns the entry ids."""
    return [xadd(r, run_id, encode_entry(make_result(run_id, g))) for g in group_ids]


def pending_count(r: redis.Redis, run_id: str) -> int:
    return int(r.xpending(stream_key(run_id), GROUP)["pending"])


def client(redis_url: str, run_id: str, **kwargs: object) -> RolloutClient:
    kwargs.setdefault("claim_idle_ms", CLAIM_IDLE_MS)
    kwargs.setdefault("block_ms", BLOCK_MS)
    return RolloutClient(SCHEDULER, redis_url, run_id, consumer_group=GROUP, **kwargs)  # type: ignore[arg-type]


def aclient(redis_url: str, run_id: str, **kwargs: object) -> AsyncRolloutClient:
    kwargs.setdefault("claim_idle_ms", CLAIM_IDLE_MS)
    kwargs.setdefault("block_ms", BLOCK_MS)
    return AsyncRolloutClient(SCHEDULER, redis_url, run_id, consumer_group=GROUP, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def r(redis_client: redis.Redis) -> redis.Redis:
    return redis_client


# --------------------------------------------------------------------- sync


def test_each_group_is_received_once(r: redis.Redis, redis_url: str) -> None:
    run = new_run_id()
    publish(r, run, *(f"g{i}" for i in range(5)))
    with client(redis_url, run) as c:
        received = list(c.groups(limit=5, timeout_s=WAIT_S))
        assert [g.group_id for g in received] == [f"g{i}" for i in range(5)]
        assert all(not g.redelivered and g.delivery_count == 1 for g in received)
        assert received[0].result == make_result(run, "g0")
        assert c.ack(*received) == 5
        assert list(c.groups(timeout_s=0.3)) == []
    with client(redis_url, run) as other:  # another consumer of the group gets nothing
        assert list(other.groups(timeout_s=0.3)) == []


def test_groups_published_while_reading_arrive(r: redis.Redis, redis_url: str) -> None:
    run = new_run_id()
    with client(redis_url, run) as c:
        assert list(c.groups(timeout_s=0.1)) == []  # creates the consumer group
        publish(r, run, "late")
        (got,) = c.groups(limit=1, timeout_s=WAIT_S)
        assert got.group_id == "late"


def test_ack_happens_only_on_done(r: redis.Redis, redis_url: str) -> None:
    run = new_run_id()
    publish(r, run, "a", "b")
    with client(redis_url, run) as c:
        a, b = c.groups(limit=2, timeout_s=WAIT_S)
        assert pending_count(r, run) == 2
        assert c.in_hand == 2
        assert a.done() is True
        assert pending_count(r, run) == 1
        assert a.done() is False  # already acknowledged
        assert b.done() is True
        assert pending_count(r, run) == 0
        assert c.in_hand == 0


def test_dead_consumer_entries_go_to_another_consumer(r: redis.Redis, redis_url: str) -> None:
    run = new_run_id()
    publish(r, run, "a", "b", "c")
    dead = client(redis_url, run, consumer_name="dead")
    taken = list(dead.groups(limit=3, timeout_s=WAIT_S))
    assert len(taken) == 3
    dead.close()  # dies without done()

    with client(redis_url, run, consumer_name="alive") as alive:
        got = list(alive.groups(limit=3, timeout_s=WAIT_S))
        assert sorted(g.group_id for g in got) == ["a", "b", "c"]
        assert all(g.redelivered and g.delivery_count == 2 for g in got)
        assert alive.ack(*got) == 3
    assert pending_count(r, run) == 0


def test_duplicate_group_ids_are_acked_and_skipped(r: redis.Redis, redis_url: str) -> None:
    run = new_run_id()
    publish(r, run, "a", "a", "b")
    with client(redis_url, run) as c:
        got = list(c.groups(limit=2, timeout_s=WAIT_S))
        assert [g.group_id for g in got] == ["a", "b"]
        assert pending_count(r, run) == 2  # the duplicate entry was acked at once
        c.ack(*got)
        publish(r, run, "a", "c")  # a duplicate after the original was acknowledged
        (next_one,) = c.groups(limit=1, timeout_s=WAIT_S)
        assert next_one.group_id == "c"
        next_one.done()
    assert pending_count(r, run) == 0


def test_restart_with_same_name_resumes_pending(r: redis.Redis, redis_url: str) -> None:
    run = new_run_id()
    publish(r, run, "a", "b", "c")
    first = client(redis_url, run, consumer_name="trainer-0", claim_idle_ms=600_000)
    a, _b = first.groups(limit=2, timeout_s=WAIT_S)
    a.done()
    first.close()  # b was taken and never acknowledged

    # claim_idle_ms is long: what comes back now is this name's own pending list.
    with client(redis_url, run, consumer_name="trainer-0", claim_idle_ms=600_000) as again:
        got = list(again.groups(limit=2, timeout_s=WAIT_S))
        assert [g.group_id for g in got] == ["b", "c"]
        assert got[0].redelivered and got[0].delivery_count == 2
        assert not got[1].redelivered
        again.ack(*got)
    assert pending_count(r, run) == 0


def test_stopping_early_leaves_the_rest_for_the_next_call(r: redis.Redis, redis_url: str) -> None:
    run = new_run_id()
    publish(r, run, "a", "b", "c")
    with client(redis_url, run, read_count=2) as c:
        (first,) = c.groups(limit=1, timeout_s=WAIT_S)
        rest = list(c.groups(limit=2, timeout_s=WAIT_S))  # `first` is not handed out again
        assert [first.group_id] + [g.group_id for g in rest] == ["a", "b", "c"]
        assert c.ack(first, *rest) == 3


def test_undecodable_entry_is_raised_and_stays_pending(r: redis.Redis, redis_url: str) -> None:
    run = new_run_id()
    bad_id = xadd(r, run, {"v": "99", "group_id": "x", "body": "{}"})
    publish(r, run, "good")
    with client(redis_url, run) as c:
        with pytest.raises(UndecodableEntry, match="schema version") as info:
            list(c.groups(limit=1, timeout_s=WAIT_S))
        assert info.value.entry_id == bad_id
        assert info.value.fields[b"v"] == b"99"
        assert pending_count(r, run) >= 1
        with pytest.raises(UndecodableEntry):  # not skipped on the next call either
            list(c.groups(limit=1, timeout_s=WAIT_S))
        assert c.discard(bad_id) is True
        (good,) = c.groups(limit=1, timeout_s=WAIT_S)
        assert good.group_id == "good"
        good.done()
    assert pending_count(r, run) == 0


def test_entry_trimmed_while_pending_is_acked(r: redis.Redis, redis_url: str) -> None:
    run = new_run_id()
    (entry_id,) = publish(r, run, "a")
    first = client(redis_url, run, consumer_name="c0")
    assert len(list(first.groups(limit=1, timeout_s=WAIT_S))) == 1
    first.close()
    r.xdel(stream_key(run), entry_id)
    with client(redis_url, run, consumer_name="c0") as again:
        assert list(again.groups(timeout_s=0.3)) == []
    assert pending_count(r, run) == 0


def test_deleted_stream_and_group_are_recreated(r: redis.Redis, redis_url: str) -> None:
    run = new_run_id()
    with client(redis_url, run) as c:
        assert list(c.groups(timeout_s=0.1)) == []
        r.delete(stream_key(run))
        publish(r, run, "after")
        (got,) = c.groups(limit=1, timeout_s=WAIT_S)
        assert got.group_id == "after"


def test_timeout_ends_iteration_quietly(redis_url: str) -> None:
    with client(redis_url, new_run_id()) as c:
        assert list(c.groups(timeout_s=0.2)) == []
        assert list(c.groups(limit=0)) == []


# ------------------------------------------------------- arguments, scheduler


@pytest.mark.parametrize(
    "kwargs",
    [
        {"run_id": ""},
        {"run_id": "has space"},
        {"run_id": "x" * 129},
        {"consumer_group": ""},
        {"consumer_name": ""},
        {"claim_idle_ms": 0},
        {"block_ms": 0},
        {"claim_idle_ms": 30e3},  # (passed, and failed at the first claim with Redis's error)
        {"block_ms": 1000.0},
        {"read_count": True},
    ],
)
def test_client_arguments_are_checked(redis_url: str, kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {"run_id": new_run_id(), **kwargs}
    with pytest.raises(InvalidArgument):
        RolloutClient(SCHEDULER, redis_url, **args)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        AsyncRolloutClient(SCHEDULER, redis_url, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("url", "kwargs", "match"),
    [
        ("http://localhost:6379/0", {}, r"redis_url \('http://localhost:6379/0'\)"),
        ("{base}?decode_responses=True", {}, "decode_responses"),
        ("{base}?socket_timeout=1", {}, r"block_ms \(1000\) must be below .*socket_timeout"),
    ],
)
def test_redis_url_is_checked(
    redis_url: str, url: str, kwargs: dict[str, object], match: str
) -> None:
    url = url.format(base=redis_url.split("?", maxsplit=1)[0])
    with pytest.raises(InvalidArgument, match=match):
        RolloutClient(SCHEDULER, url, new_run_id(), block_ms=1000, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=match):
        AsyncRolloutClient(SCHEDULER, url, new_run_id(), block_ms=1000, **kwargs)  # type: ignore[arg-type]


def test_a_read_may_wait_longer_than_redis_py_s_default_socket_timeout(
    r: redis.Redis, redis_url: str
) -> None:
    """block_ms of 6 s (redis-py 8 cuts a read off after 5 s by default: every idle wait
    then ended in StreamUnavailable against a healthy Redis); the group published during
    the wait arrives."""
    run = new_run_id()
    with client(redis_url, run, block_ms=6000, claim_idle_ms=60_000) as c:
        stream = c.groups(timeout_s=WAIT_S)
        publish(r, run, "warm")
        assert next(stream).group_id == "warm"
        timer = threading.Timer(5.5, publish, (r, run, "late"))
        timer.start()
        try:
            assert next(stream).group_id == "late"
        finally:
            timer.cancel()
            stream.close()  # type: ignore[attr-defined]


def test_groups_given_as_a_generator_are_all_sent() -> None:
    groups = (PromptGroup(group_id=f"g{i}", prompt_token_ids=[1], n=1) for i in range(3))
    assert len(submit_request("run", groups).groups) == 3  # type: ignore[arg-type]
    assert list(cancel_request("run", (g for g in ["a", "b"])).group_ids) == ["a", "b"]  # type: ignore[arg-type]


def test_groups_arguments_are_checked(r: redis.Redis, redis_url: str) -> None:
    run = new_run_id()
    publish(r, run, "a")
    with client(redis_url, run) as c:
        with pytest.raises(InvalidArgument, match="limit"):
            list(c.groups(limit=-1))
        with pytest.raises(InvalidArgument, match="limit must be an int"):
            list(c.groups(limit=2.0))  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="timeout_s"):
            list(c.groups(timeout_s=-1.0))
        [got] = c.groups(limit=1, timeout_s=math.inf)  # inf: no deadline (it overflowed)
        assert got.group_id == "a"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"group_id": "", "prompt_token_ids": [1], "n": 1}, "group_id"),
        ({"group_id": "g", "n": 1}, "exactly one"),
        ({"group_id": "g", "prompt_token_ids": [1], "prompt_text": "hi", "n": 1}, "exactly one"),
        ({"group_id": "g", "prompt_token_ids": [-1], "n": 1}, "prompt_token_ids"),
        ({"group_id": "g", "prompt_token_ids": [1], "n": 0}, r"n \(0\)"),
    ],
)
def test_prompt_group_is_checked(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        PromptGroup(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ],
)
def test_sampling_params_are_checked(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_prompt_group_to_proto() -> None:
    group = PromptGroup(
        group_id="g",
        prompt_token_ids=[5, 6],
        n=4,
        sampling=SamplingParams(temperature=0.7, max_tokens=32, seed=11, stop=["\n\n"]),
        prompt_key="row-9",
        metadata={"epoch": "2"},
    )
    msg = group.to_proto()
    assert (msg.group_id, list(msg.prompt_token_ids), msg.n) == ("g", [5, 6], 4)
    assert msg.sampling.temperature == pytest.approx(0.7)
    assert (msg.sampling.max_tokens, msg.sampling.seed, list(msg.sampling.stop)) == (
        32,
        11,
        ["\n\n"],
    )
    assert msg.sampling.top_k == -1
    assert not SamplingParams().to_proto().HasField("seed")
    assert (msg.prompt_key, dict(msg.metadata)) == ("row-9", {"epoch": "2"})


def test_submit_rejects_repeated_group_ids_before_sending(redis_url: str) -> None:
    group = PromptGroup(group_id="g", prompt_token_ids=[1], n=1)
    with client(redis_url, new_run_id()) as c, pytest.raises(InvalidArgument, match="repeats"):
        c.submit([group, group])


def test_unreachable_scheduler_raises_scheduler_unavailable(redis_url: str) -> None:
    group = PromptGroup(group_id="g", prompt_token_ids=[1], n=1)
    with client(redis_url, new_run_id(), rpc_timeout_s=WAIT_S) as c:
        with pytest.raises(SchedulerUnavailable, match="Submit") as info:
            c.submit([group])
        assert info.value.code is not None
        with pytest.raises(SchedulerUnavailable, match="Status"):
            c.status()
        with pytest.raises(SchedulerUnavailable, match="Cancel"):
            c.cancel(["g"])


# -------------------------------------------------------------------- async


async def test_async_each_group_is_received_once(r: redis.Redis, redis_url: str) -> None:
    run = new_run_id()
    publish(r, run, "a", "b", "c")
    async with aclient(redis_url, run) as c:
        got = [g async for g in c.groups(limit=3, timeout_s=WAIT_S)]
        assert [g.group_id for g in got] == ["a", "b", "c"]
        assert pending_count(r, run) == 3
        assert await got[0].done() is True
        assert await c.ack(*got[1:]) == 2
        assert [g async for g in c.groups(timeout_s=0.3)] == []
    assert pending_count(r, run) == 0


async def test_async_consumers_of_a_group_share_the_work(r: redis.Redis, redis_url: str) -> None:
    run = new_run_id()
    ids = [f"g{i}" for i in range(40)]
    publish(r, run, *ids)
    first: list[str] = []
    second: list[str] = []
    deadline = asyncio.get_running_loop().time() + WAIT_S

    async def drain(c: AsyncRolloutClient, got: list[str]) -> None:
        # groups() ends at its deadline however many groups are left: short calls, again and
        # again, until the two have read every group between them.
        while len(first) + len(second) < len(ids):
            assert asyncio.get_running_loop().time() < deadline, (
                f"{len(first) + len(second)} of {len(ids)} groups read in {WAIT_S} s"
            )
            async for g in c.groups(timeout_s=0.2):
                got.append(g.group_id)
                await g.done()

    # An entry held unacknowledged longer than claim_idle_ms is taken over by the
    # other consumer: here nobody holds one long, and nobody is presumed dead.
    async with (
        aclient(redis_url, run, read_count=4, claim_idle_ms=600_000) as one,
        aclient(redis_url, run, read_count=4, claim_idle_ms=600_000) as two,
    ):
        await asyncio.gather(drain(one, first), drain(two, second))
    assert sorted(first + second) == sorted(ids)
    assert not set(first) & set(second)


async def test_async_dead_consumer_entries_go_to_another(r: redis.Redis, redis_url: str) -> None:
    run = new_run_id()
    publish(r, run, "a", "b")
    dead = aclient(redis_url, run, consumer_name="dead")
    assert len([g async for g in dead.groups(limit=2, timeout_s=WAIT_S)]) == 2
    await dead.close()

    async with aclient(redis_url, run, consumer_name="alive") as alive:
        got = [g async for g in alive.groups(limit=2, timeout_s=WAIT_S)]
        assert sorted(g.group_id for g in got) == ["a", "b"]
        assert all(g.redelivered for g in got)
        await alive.ack(*got)
    assert pending_count(r, run) == 0


async def test_async_duplicates_and_restart(r: redis.Redis, redis_url: str) -> None:
    run = new_run_id()
    publish(r, run, "a", "a", "b")
    first = aclient(redis_url, run, consumer_name="t0", claim_idle_ms=600_000)
    got = [g async for g in first.groups(limit=2, timeout_s=WAIT_S)]
    assert [g.group_id for g in got] == ["a", "b"]
    await got[0].done()
    await first.close()

    async with aclient(redis_url, run, consumer_name="t0", claim_idle_ms=600_000) as again:
        resumed = [g async for g in again.groups(limit=1, timeout_s=WAIT_S)]
        assert [g.group_id for g in resumed] == ["b"]
        assert resumed[0].delivery_count == 2
        await resumed[0].done()
    assert pending_count(r, run) == 0


async def test_async_undecodable_entry_is_raised(r: redis.Redis, redis_url: str) -> None:
    run = new_run_id()
    bad_id = xadd(r, run, {"v": "1", "group_id": "x", "body": "nope"})
    async with aclient(redis_url, run) as c:
        with pytest.raises(UndecodableEntry, match="does not decode"):
            _ = [g async for g in c.groups(limit=1, timeout_s=WAIT_S)]
        assert await c.discard(bad_id) is True
        assert [g async for g in c.groups(timeout_s=0.2)] == []


async def test_async_unreachable_scheduler(redis_url: str) -> None:
    group = PromptGroup(group_id="g", prompt_token_ids=[1], n=1)
    async with aclient(redis_url, new_run_id(), rpc_timeout_s=WAIT_S) as c:
        with pytest.raises(SchedulerUnavailable, match="Submit"):
            await c.submit([group])
        with pytest.raises(SchedulerUnavailable, match="Status"):
            await c.status()


def test_group_held_past_claim_idle_goes_to_another_consumer(
    r: redis.Redis, redis_url: str
) -> None:
    """Without the heartbeat, claim_idle_ms must exceed the time a trainer holds a group
    before done() (test_stream_heartbeat.py covers the default, with it)."""
    run = new_run_id()
    publish(r, run, "a")
    with (
        client(redis_url, run, consumer_name="slow", heartbeat=False) as slow,
        client(redis_url, run, consumer_name="fast") as fast,
    ):
        (held,) = slow.groups(limit=1, timeout_s=WAIT_S)
        (taken,) = fast.groups(limit=1, timeout_s=WAIT_S)  # after claim_idle_ms
        assert taken.group_id == "a"
        assert taken.redelivered
        assert held.done() is True  # XACK is for the whole consumer group ...
        assert taken.done() is False  # ... so the second one finds it acknowledged


def test_groups_read_ahead_and_left_unseen_are_not_called_redelivered(
    r: redis.Redis, redis_url: str
) -> None:
    """An iterator closed after one group (as a batcher does each step): the groups its read
    brought along come in the next iteration as first deliveries (they came with
    delivery_count 2, "may have been used already", though no trainer had seen them)."""
    run = new_run_id()
    publish(r, run, "a", "b", "c")
    with client(redis_url, run, read_count=3) as c:
        stream = c.groups(timeout_s=WAIT_S)  # no limit: one read takes all three
        first = next(stream)
        stream.close()  # type: ignore[attr-defined]
        rest = list(c.groups(limit=2, timeout_s=WAIT_S))
        assert [(g.group_id, g.delivery_count) for g in [first, *rest]] == [
            ("a", 1),
            ("b", 1),
            ("c", 1),
        ]
        assert c.ack(first, *rest) == 3


async def test_async_groups_read_ahead_and_left_unseen_are_not_called_redelivered(
    r: redis.Redis, redis_url: str
) -> None:
    run = new_run_id()
    publish(r, run, "a", "b", "c")
    async with aclient(redis_url, run, read_count=3) as c:
        stream = c.groups(timeout_s=WAIT_S)  # no limit: one read takes all three
        first = [await anext(stream)]
        await stream.aclose()  # type: ignore[attr-defined]
        rest = [g async for g in c.groups(limit=2, timeout_s=WAIT_S)]
        assert [g.delivery_count for g in first + rest] == [1, 1, 1]
        assert not any(g.redelivered for g in first + rest)


def test_two_iterators_of_one_client_never_hand_out_a_group_twice(
    r: redis.Redis, redis_url: str
) -> None:
    """A long-lived iterator and a bounded read elsewhere on the same client: each group
    reaches the trainer once (the long-lived one handed out again what the other had)."""
    run = new_run_id()
    publish(r, run, "a", "b", "c", "d")
    with client(redis_url, run, read_count=3) as c:
        stream = c.groups(timeout_s=WAIT_S)
        first = next(stream)  # "b" and "c" read ahead
        extra = list(c.groups(limit=2, timeout_s=WAIT_S))  # the other read hands them out
        later = next(stream)
        stream.close()  # type: ignore[attr-defined]
        seen = [g.group_id for g in [first, *extra, later]]
        assert sorted(seen) == ["a", "b", "c", "d"]
        assert all(g.done() for g in [first, *extra, later])


def reader_url(redis_url: str, user: str) -> str:
    parts = redis_url.split("://", 1)
    return f"{parts[0]}://{user}:pw@{parts[1]}"


def test_a_redis_that_refuses_the_heartbeat_is_said_not_swallowed(
    r: redis.Redis, redis_url: str
) -> None:
    """A Redis user without scripting: the first read says so, naming the way out (the
    heartbeat's failures were only logged, and held groups were taken over by other
    consumers while the trainer used them); scripting taken away later stops the reader
    at its next step. With heartbeat=False the same user reads."""
    if "@" in redis_url or not redis_url.startswith("redis://"):
        pytest.skip("needs the embedded server's plain redis:// URL")
    user = f"reader-{uuid.uuid4().hex[:8]}"
    r.acl_setuser(
        user, enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-@scripting"]
    )
    run = new_run_id()
    publish(r, run, "a", "b")
    try:
        with (
            client(reader_url(redis_url, user), run) as c,
            pytest.raises(InvalidArgument, match="refuses the heartbeat script"),
        ):
            next(c.groups(timeout_s=WAIT_S))
        with client(reader_url(redis_url, user), run, heartbeat=False) as c:
            got = list(c.groups(limit=2, timeout_s=WAIT_S))
            assert [g.group_id for g in got] == ["a", "b"]
        publish(r, run, "c", "d")
        r.acl_setuser(user, enabled=True, commands=["+@scripting"])
        with client(reader_url(redis_url, user), run, read_count=1) as c:
            stream = c.groups(timeout_s=WAIT_S)
            assert next(stream).group_id == "c"  # held: the heartbeat keeps it claimed
            r.acl_setuser(user, enabled=True, commands=["-@scripting"])
            with pytest.raises(StreamUnavailable, match="refuses the heartbeat script"):
                for _ in range(int(WAIT_S / 0.05)):
                    next(stream)  # (d, then reads until the refusal is seen)
                    time.sleep(0.05)
    finally:
        r.acl_deluser(user)


def test_a_released_group_goes_to_another_consumer_while_this_one_reads_on(
    r: redis.Redis, redis_url: str
) -> None:
    """Consumer X releases a group that is another trainer's and keeps reading (as a batcher
    does each step): consumer Y takes it over (X's reads of its own pending list kept it
    from going idle, and X's claim scans took it back: Y never got it)."""
    run = new_run_id()
    publish(r, run, "mine", "theirs")
    with (
        client(redis_url, run, consumer_name="X") as x,
        client(redis_url, run, consumer_name="Y") as y,
    ):
        got = list(x.groups(limit=2, timeout_s=WAIT_S))
        x.release(*[g for g in got if g.group_id == "theirs"])
        assert x.in_hand == 1
        taken: list[ReceivedGroup] = []
        deadline = time.monotonic() + WAIT_S
        while not taken and time.monotonic() < deadline:
            assert list(x.groups(limit=1, timeout_s=0.05)) == []  # never handed out again
            taken = list(y.groups(limit=1, timeout_s=0.05))
        assert [g.group_id for g in taken] == ["theirs"]
        assert taken[0].done()
        assert x.ack(*[g for g in got if g.group_id == "mine"]) == 1


def test_parking_a_released_group_leaves_it_to_a_consumer_that_took_it_over(
    r: redis.Redis, redis_url: str
) -> None:
    """X releases a group and reads again only after claim_idle_ms (a long training step);
    Y took the group over meanwhile: X's parking leaves it with Y (moved away, it went to a
    third consumer too and was trained on twice)."""
    run = new_run_id()
    publish(r, run, "theirs")
    with (
        client(redis_url, run, consumer_name="X") as x,
        client(redis_url, run, consumer_name="Y") as y,
        client(redis_url, run, consumer_name="Z") as z,
    ):
        (held,) = x.groups(limit=1, timeout_s=WAIT_S)
        x.release(held)  # no read of X's for a while: not parked yet
        taken: list[ReceivedGroup] = []
        deadline = time.monotonic() + WAIT_S
        while not taken and time.monotonic() < deadline:  # once idle past claim_idle_ms
            taken = list(y.groups(limit=1, timeout_s=0.05))
        assert [g.group_id for g in taken] == ["theirs"]
        assert list(x.groups(limit=1, timeout_s=0.05)) == []  # parks nothing: Y holds it
        [entry] = r.xpending_range(stream_key(run), GROUP, "-", "+", 10)
        assert entry["consumer"] == b"Y"
        assert list(z.groups(limit=1, timeout_s=CLAIM_IDLE_MS / 1000 * 3)) == []
        assert taken[0].done()


def test_a_heartbeat_refused_once_is_said_once(r: redis.Redis, redis_url: str) -> None:
    """Redis refused a heartbeat for a while, then took them again: the reader says it once
    and reads on (it raised at every later read: the flag was cleared only by a beat, and
    beats run only while groups are held)."""
    run = new_run_id()
    publish(r, run, "a", "b")
    with client(redis_url, run, read_count=1) as c:
        c._heartbeat_refused = redis.ResponseError("NOPERM this user has no permissions")
        with pytest.raises(StreamUnavailable, match="refuses the heartbeat script"):
            next(c.groups(timeout_s=WAIT_S))
        got = list(c.groups(limit=2, timeout_s=WAIT_S))
        assert [g.group_id for g in got] == ["a", "b"]


# ------------------------------------------------------------- samples stream


def publish_samples(r: redis.Redis, run_id: str, *sample_ids: str) -> None:
    """XADDs one samples-stream entry per ``group/index``, as the scheduler does."""
    for sample_id in sample_ids:
        group_id, index = sample_id.split("/")
        sample = make_result(run_id, group_id, n=int(index) + 1).samples[int(index)]
        result = SampleResult(run_id=run_id, group_id=group_id, n=4, sample=sample)
        r.xadd(samples_stream_key(run_id), encode_sample_entry(result))  # type: ignore[arg-type]


def test_samples_are_read_once_each_and_taken_over_from_a_dead_reader(
    r: redis.Redis, redis_url: str
) -> None:
    run = new_run_id()
    publish_samples(r, run, "a/0", "a/1", "b/0")
    dead = client(redis_url, run, consumer_name="dead", reads="samples")
    taken = list(dead.samples(limit=2, timeout_s=WAIT_S))
    assert [s.sample_id for s in taken] == ["a/0", "a/1"]
    dead.close()  # dies without done()
    with client(redis_url, run, consumer_name="alive", reads="samples") as alive:
        got = list(alive.samples(limit=3, timeout_s=WAIT_S))
        redelivered = {s.sample_id: s.redelivered for s in got}
        assert redelivered == {"a/0": True, "a/1": True, "b/0": False}
        assert alive.ack(*got) == 3
        publish_samples(r, run, "c/0", "c/0", "a/1")  # a duplicate, then one acked already
        [again] = alive.samples(timeout_s=0.5)
        assert again.sample_id == "c/0" and again.done()
        with pytest.raises(InvalidArgument, match="reads the run's samples stream"):
            list(alive.groups(limit=1))
    assert int(r.xpending(samples_stream_key(run), GROUP)["pending"]) == 0
    assert r.exists(stream_key(run)) == 0  # the groups stream was never touched
    with pytest.raises(InvalidArgument, match="reads"):
        client(redis_url, run, reads="sample")
