"""A scheduler served in the test's event loop as ``rollserve scheduler`` serves it
(``rollserve.scheduler.server.serve``: its gRPC server, HTTP server if ``http_port`` is set,
runtime and lease), for tests that talk to it over the wire."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from rollserve.scheduler.server import serve
from rollserve.scheduler.settings import SchedulerSettings


@dataclass(frozen=True)
class ServedScheduler:
    port: int  # its gRPC port, bound
    task: asyncio.Task[None]  # serving it: done once it stopped


@asynccontextmanager
async def served_scheduler(
    settings: SchedulerSettings, timeout_s: float
) -> AsyncIterator[ServedScheduler]:
    """Serves ``settings`` until the block is left, then stops it and waits for it to end;
    each wait is ``timeout_s`` at most."""
    port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    task = asyncio.create_task(serve(settings, ready=port.set_result, stop=stop))
    try:
        bound = await asyncio.wait_for(asyncio.shield(port), timeout_s)
        yield ServedScheduler(bound, task)
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout_s)
