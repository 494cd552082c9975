"""The SDK's heartbeat against a real redis-server: a live consumer keeps the entries it
holds, however long, and loses them only when it stops (closes, as a dead process would).

Entries are written as the scheduler writes them (see test_client_stream.py); no scheduler
runs. claim_idle_ms is small so that holding "longer than claim_idle_ms" takes little time;
waits are for conditions, with generous deadlines, and nothing here measures a duration.

No other consumer reads while a live one holds entries it beats: a heartbeat thread (or
task) that a loaded machine leaves unscheduled for claim_idle_ms loses its entries to the
next claim scan, as it should, so a test that raced the two would fail now and then. What
the heartbeat does is read from XPENDING instead: a held entry's idle time is reset and its
delivery count stays 1.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import pytest
import redis
from rollserve.client import AsyncRolloutClient, RolloutClient
from rollserve.client.wire import stream_key

from tests.integration.test_client_stream import (
    GROUP,
    SCHEDULER,
    WAIT_S,
    new_run_id,
    pending_count,
    publish,
)

CLAIM_IDLE_MS = 400  # beats every ~133 ms; the others' claim scans every 200 ms
HOLD_S = 5 * CLAIM_IDLE_MS / 1000  # how long A holds its entries before they are checked
BLOCK_MS = 50


def client(redis_url: str, run_id: str, name: str, **kwargs: object) -> RolloutClient:
    return RolloutClient(
        SCHEDULER,
        redis_url,
        run_id,
        consumer_group=GROUP,
        consumer_name=name,
        claim_idle_ms=CLAIM_IDLE_MS,
        block_ms=BLOCK_MS,
        **kwargs,  # type: ignore[arg-type]
    )


def aclient(redis_url: str, run_id: str, name: str, **kwargs: object) -> AsyncRolloutClient:
    return AsyncRolloutClient(
        SCHEDULER,
        redis_url,
        run_id,
        consumer_group=GROUP,
        consumer_name=name,
        claim_idle_ms=CLAIM_IDLE_MS,
        block_ms=BLOCK_MS,
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.fixture
def r(redis_client: redis.Redis) -> redis.Redis:
    return redis_client


def owners(r: redis.Redis, run_id: str) -> dict[str, tuple[str, int]]:
    """group entry id -> (consumer holding it, delivery count), from XPENDING."""
    rows = r.xpending_range(stream_key(run_id), GROUP, "-", "+", 100)
    return {
        text(row["message_id"]): (text(row["consumer"]), int(row["times_delivered"]))
        for row in rows
    }


def idle_s(r: redis.Redis, run_id: str) -> dict[str, float]:
    """group entry id -> seconds since it was last delivered or re-claimed, from XPENDING."""
    rows = r.xpending_range(stream_key(run_id), GROUP, "-", "+", 100)
    return {text(row["message_id"]): int(row["time_since_delivered"]) / 1000 for row in rows}


def beaten_while_held(r: redis.Redis, run_id: str, held_since: float) -> bool:
    """Whether HOLD_S have passed since ``held_since`` (a ``time.monotonic()`` taken once
    the pending entries were delivered) and each was re-claimed within the last HOLD_S / 2.
    An entry nobody re-claims is idle at least as long as it has been held, so without
    heartbeats this never holds."""
    if time.monotonic() - held_since < HOLD_S:
        return False
    return max(idle_s(r, run_id).values()) < HOLD_S / 2


def text(raw: object) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def heartbeat_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"rollserve-heartbeat-{name}"]


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


async def await_until(condition: Callable[[], bool], what: str) -> None:
    """wait_until for a test on the event loop: the loop's heartbeat tasks run meanwhile."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.02)


# --------------------------------------------------------------------- sync


def test_live_consumer_keeps_held_entries_until_it_stops(r: redis.Redis, redis_url: str) -> None:
    run = new_run_id()
    ids = publish(r, run, "a", "b", "c")
    a = client(redis_url, run, "A")
    try:
        held = list(a.groups(limit=3, timeout_s=WAIT_S))
        held_since = time.monotonic()
        assert [g.group_id for g in held] == ["a", "b", "c"]
        # Held for several times claim_idle_ms, A's entries were re-claimed lately: a claim
        # scan would not find them idle. Still A's, and delivered once.
        wait_until(lambda: beaten_while_held(r, run, held_since), "A's heartbeat re-claims them")
        assert owners(r, run) == {i: ("A", 1) for i in ids}
        assert len(heartbeat_threads("A")) == 1

        a.close()  # A stops without acknowledging: as if it died
        assert heartbeat_threads("A") == []
        with client(redis_url, run, "B") as b:  # B claims what is idle for claim_idle_ms
            got = list(b.groups(limit=3, timeout_s=WAIT_S))
            assert sorted(g.group_id for g in got) == ["a", "b", "c"]
            assert all(g.redelivered and g.delivery_count == 2 for g in got)
            assert b.ack(*got) == 3
        assert pending_count(r, run) == 0
    finally:
        a.close()


def test_heartbeat_stops_when_nothing_is_held(r: redis.Redis, redis_url: str) -> None:
    run = new_run_id()
    publish(r, run, "a")
    with client(redis_url, run, "A") as a:
        (held,) = a.groups(limit=1, timeout_s=WAIT_S)
        assert len(heartbeat_threads("A")) == 1
        assert held.done() is True
        wait_until(lambda: heartbeat_threads("A") == [], "the heartbeat thread ends")
        publish(r, run, "b")  # held again: a new heartbeat
        (again,) = a.groups(limit=1, timeout_s=WAIT_S)
        assert len(heartbeat_threads("A")) == 1
        again.done()


def test_without_heartbeat_a_held_entry_goes_to_another_consumer(
    r: redis.Redis, redis_url: str
) -> None:
    run = new_run_id()
    publish(r, run, "a", "b")
    with (
        client(redis_url, run, "A", heartbeat=False) as a,
        client(redis_url, run, "B") as b,
    ):
        held = list(a.groups(limit=2, timeout_s=WAIT_S))
        assert heartbeat_threads("A") == []
        got = list(b.groups(limit=2, timeout_s=WAIT_S))  # once idle past claim_idle_ms
        assert sorted(g.group_id for g in got) == ["a", "b"]
        assert all(g.redelivered and g.delivery_count == 2 for g in got)
        assert a.ack(*held) == 2
        assert b.ack(*got) == 0  # acknowledged for the group already


def test_released_entry_goes_to_another_consumer(r: redis.Redis, redis_url: str) -> None:
    run = new_run_id()
    publish(r, run, "a", "b")
    with client(redis_url, run, "A") as a:
        mine, other = a.groups(limit=2, timeout_s=WAIT_S)
        a.release(other)

        def only_mine_beaten() -> bool:
            # The released entry idle past claim_idle_ms, the held one re-claimed since: A
            # beats the one it holds and no longer the one it released (until the release,
            # one script call re-claimed both, leaving them equally idle).
            idle, claim_idle_s = idle_s(r, run), CLAIM_IDLE_MS / 1000
            return idle[other.entry_id] >= claim_idle_s > 2 * idle[mine.entry_id]

        wait_until(only_mine_beaten, "A beats the entry it holds, not the released one")
        assert owners(r, run) == {mine.entry_id: ("A", 1), other.entry_id: ("A", 1)}
        # Acknowledged before B reads: a claim scan of B's must not race A's heartbeat.
        assert mine.done() is True
        with client(redis_url, run, "B") as b:
            (got,) = b.groups(limit=1, timeout_s=WAIT_S)
            assert got.group_id == other.group_id
            assert got.delivery_count == 2
            assert got.done() is True
    assert pending_count(r, run) == 0


def test_entry_taken_over_after_a_stall_is_not_taken_back(
    r: redis.Redis, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="rollserve.client.consumer")
    run = new_run_id()
    (entry_id,) = publish(r, run, "a")
    with client(redis_url, run, "A") as a:
        (held,) = a.groups(limit=1, timeout_s=WAIT_S)
        # What B's claim scan does to the entries of a consumer stalled past claim_idle_ms.
        r.xclaim(stream_key(run), GROUP, "B", 0, [entry_id])
        wait_until(lambda: "taken over by consumer 'B'" in caplog.text, "A warns")
        assert "'a'" in caplog.text
        wait_until(lambda: heartbeat_threads("A") == [], "A stops beating it")
        assert owners(r, run) == {entry_id: ("B", 2)}  # not taken back by A
        assert held.done() is True  # acknowledged for the group all the same


# -------------------------------------------------------------------- async


async def test_async_live_consumer_keeps_held_entries_until_it_stops(
    r: redis.Redis, redis_url: str
) -> None:
    run = new_run_id()
    ids = publish(r, run, "a", "b", "c")
    a = aclient(redis_url, run, "A")
    try:
        held = [g async for g in a.groups(limit=3, timeout_s=WAIT_S)]
        held_since = time.monotonic()
        assert [g.group_id for g in held] == ["a", "b", "c"]
        await await_until(
            lambda: beaten_while_held(r, run, held_since), "A's heartbeat re-claims them"
        )
        assert owners(r, run) == {i: ("A", 1) for i in ids}

        await a.close()  # A stops without acknowledging: as if it died
        async with aclient(redis_url, run, "B") as b:
            got = [g async for g in b.groups(limit=3, timeout_s=WAIT_S)]
            assert sorted(g.group_id for g in got) == ["a", "b", "c"]
            assert all(g.redelivered and g.delivery_count == 2 for g in got)
            assert await b.ack(*got) == 3
        assert pending_count(r, run) == 0
    finally:
        await a.close()


async def test_async_without_heartbeat_a_held_entry_goes_to_another_consumer(
    r: redis.Redis, redis_url: str
) -> None:
    run = new_run_id()
    publish(r, run, "a", "b")
    async with (
        aclient(redis_url, run, "A", heartbeat=False) as a,
        aclient(redis_url, run, "B") as b,
    ):
        held = [g async for g in a.groups(limit=2, timeout_s=WAIT_S)]
        got = [g async for g in b.groups(limit=2, timeout_s=WAIT_S)]
        assert sorted(g.group_id for g in got) == ["a", "b"]
        assert all(g.redelivered and g.delivery_count == 2 for g in got)
        assert await a.ack(*held) == 2


async def test_async_entry_taken_over_after_a_stall_is_not_taken_back(
    r: redis.Redis, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="rollserve.client.consumer")
    run = new_run_id()
    (entry_id,) = publish(r, run, "a")
    async with aclient(redis_url, run, "A") as a:
        (held,) = [g async for g in a.groups(limit=1, timeout_s=WAIT_S)]
        r.xclaim(stream_key(run), GROUP, "B", 0, [entry_id])
        deadline = time.monotonic() + WAIT_S
        while "taken over by consumer 'B'" not in caplog.text:
            assert time.monotonic() < deadline, "timed out waiting until A warns"
            await asyncio.sleep(0.02)
        assert owners(r, run) == {entry_id: ("B", 2)}
        assert await held.done() is True
