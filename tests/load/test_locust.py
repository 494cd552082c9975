"""The load test (``locustfile.py``) run as CI can afford: Locust, headless, four trainers
for a few seconds against a real scheduler (``serve``, its HTTP port open, the session's
Redis) on four simulated engines (``rollserve sim``, a hundred times real time). Every step
a trainer began within the run is delivered whole, no call is refused, and Locust's own
figures say so.

Faked: nothing but the engines, which are the product's simulated ones."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import redis
from rollserve.cli.stack import free_port
from rollserve.client.wire import DELETES_KEPT_S, RUNS_KEY
from rollserve.scheduler.settings import EngineEndpoint, SchedulerSettings
from rollserve.sim.server import FleetStarted
from rollserve.sim.server import serve as serve_sim
from rollserve.sim.settings import SimSettings

from tests.served import served_scheduler

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
TIMEOUT_S = 60.0
RUN_S = 8
ENGINES = 4


@asynccontextmanager
async def fleet() -> AsyncIterator[dict[str, str]]:
    """Simulated engines served as ``rollserve sim fleet`` serves them; yields id -> address."""
    settings = SimSettings(engines=ENGINES, port=0, time_scale=0.01, response_median=30)
    started: asyncio.Future[FleetStarted] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    task = asyncio.create_task(serve_sim(settings, ready=started.set_result, stop=stop))
    try:
        yield (await asyncio.wait_for(asyncio.shield(started), TIMEOUT_S)).addresses
    finally:
        stop.set()
        await asyncio.wait_for(task, TIMEOUT_S)


@asynccontextmanager
async def scheduler(redis_url: str, engines: dict[str, str]) -> AsyncIterator[str]:
    """A scheduler served as ``rollserve scheduler --http-port`` serves it; yields its URL."""
    http_port = free_port()
    settings = SchedulerSettings(
        port=0,
        http_port=http_port,
        redis_url=redis_url,
        engines=tuple(EngineEndpoint(engine_id=e, address=a) for e, a in engines.items()),
        policy="rl",
        predictor_namespace=f"ns-{uuid.uuid4().hex[:10]}",
        shutdown_grace_s=0.0,
    )
    async with served_scheduler(settings, TIMEOUT_S):
        yield f"http://127.0.0.1:{http_port}"


async def test_trainers_under_locust_get_every_group_of_every_step(other_redis_url: str) -> None:
    async with fleet() as engines, scheduler(other_redis_url, engines) as url:
        locust = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "locust",
            "-f",
            str(LOCUSTFILE),
            "--headless",
            "--host",
            url,
            "--redis-url",
            other_redis_url,
            "--users",
            "4",
            "--spawn-rate",
            "4",
            "--run-time",
            f"{RUN_S}s",
            "--stop-timeout",
            "60",  # (a step under way when the time is up finishes)
            "--groups-per-step",
            "8",
            "--group-size",
            "4",
            "--max-tokens",
            "64",
            "--step-timeout-s",
            "60",
            "--json",
            "--only-summary",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(locust.communicate(), RUN_S + 120)
    log = err.decode(errors="replace")[-3000:]
    assert locust.returncode == 0, log  # (Locust exits 1 when a request failed)
    stats: dict[tuple[str, str], Any] = {(s["method"], s["name"]): s for s in json.loads(out)}
    submits = stats[("POST", "/v1/runs/[run]/groups")]
    delivered = stats[("stream", "group delivered")]
    steps = stats[("step", "all groups delivered")]
    assert steps["num_requests"] >= 4, log  # (each of the four trainers finished one at least)
    assert submits["num_requests"] >= steps["num_requests"]
    assert delivered["num_requests"] == 8 * steps["num_requests"]
    assert delivered["total_content_length"] > 0  # (output tokens)
    for entry in stats.values():
        assert entry["num_failures"] == 0, entry
    # Each trainer deleted its run as it stopped: nothing of the load is left in Redis but
    # the marks that say so to late readers, which expire.
    assert stats[("DELETE", "/v1/runs/[run]")]["num_requests"] == 4
    client = redis.Redis.from_url(other_redis_url)
    try:
        runs = cast(set[bytes], client.smembers(RUNS_KEY))
        assert [run for run in runs if run.startswith(b"load-")] == []
        left = list(client.scan_iter(match="rollserve:{load-*"))
        assert [key for key in left if not key.endswith(b":deletes")] == []
        assert all(0 < client.ttl(key) <= DELETES_KEPT_S for key in left)
    finally:
        client.close()
