"""The heartbeat period grows with the fleet: the scheduler tells it, the engine follows it.

Edges faked: the engines the runtime registers (FakeEngine over real gRPC) and, for the
engine's side, a scheduler (an aio gRPC server answering RegisterEngine and Heartbeat);
``asyncio.sleep`` in the engine's module is replaced to record the periods it waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

import grpc
import pytest
from rollserve.engine import server as engine_server
from rollserve.scheduler.core.policy import create_policy
from rollserve.scheduler.runtime import SchedulerRuntime
from rollserve.scheduler.settings import SchedulerSettings
from rollserve.scheduler.store import Store
from rollserve.v1 import rollserve_pb2 as pb
from rollserve.v1 import rollserve_pb2_grpc as pb_grpc

from tests.unit.fakes import FakeEngine


async def test_the_scheduler_lengthens_the_period_as_engines_register(redis_url: str) -> None:
    settings = SchedulerSettings.model_validate(
        {
            "redis_url": redis_url,
            "heartbeat_interval_ms": 2000,
            "max_heartbeats_per_s": 1.0,
            "predictor_namespace": f"ns-{uuid.uuid4().hex[:10]}",
        }
    )
    store = Store.from_url(redis_url, predictor_namespace=settings.predictor_namespace)
    runtime = SchedulerRuntime(settings, store, create_policy(settings.policy))
    await runtime.start()
    engines = [await FakeEngine(f"e{i}").start() for i in range(3)]
    periods = [runtime.heartbeat_interval_ms()]
    try:
        for e in engines:
            await runtime.register_engine(e.engine_id, e.address)
            periods.append(runtime.heartbeat_interval_ms())
        # Registering again, at the same address or a new one, is still one engine.
        await runtime.register_engine("e0", engines[0].address)
        await runtime.register_engine("e1", engines[2].address)
        periods.append(runtime.heartbeat_interval_ms())
    finally:
        await runtime.stop()
        for e in engines:
            await e.stop()
    # 1 heartbeat a second for the fleet: 2 s (the least) up to 2 engines, then 1 s each.
    assert periods == [2000, 2000, 2000, 3000, 3000]


class _Scheduler(pb_grpc.SchedulerServicer):
    """Registers at 100 ms, then tells a period of 300 ms with every heartbeat."""

    def __init__(self) -> None:
        self.heartbeats = 0

    async def RegisterEngine(self, request: Any, context: Any) -> pb.RegisterEngineResponse:
        return pb.RegisterEngineResponse(heartbeat_interval_ms=100)

    async def Heartbeat(self, request: Any, context: Any) -> pb.HeartbeatResponse:
        self.heartbeats += 1
        return pb.HeartbeatResponse(heartbeat_interval_ms=300)

    async def _unimplemented(self, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "fake scheduler")

    Submit = Cancel = Status = PublishVersion = DeleteRun = _unimplemented


async def test_the_engine_heartbeats_at_the_period_each_heartbeat_tells(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scheduler = _Scheduler()
    server = grpc.aio.server()
    pb_grpc.add_SchedulerServicer_to_server(scheduler, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    waits: list[float] = []
    enough = asyncio.Event()
    real_sleep = asyncio.sleep

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) >= 3:
            enough.set()
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    task = asyncio.create_task(
        engine_server.stay_registered(f"127.0.0.1:{port}", "e0", "127.0.0.1:1")
    )
    try:
        await asyncio.wait_for(enough.wait(), 30)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await server.stop(None)
    assert waits[:3] == [0.1, 0.3, 0.3]
    assert scheduler.heartbeats >= 2
