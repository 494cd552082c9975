"""The engine service's start-up warm-up gives way to a stop or a dead engine core.

Faked: vLLM's backend (``warm_up`` and ``dead``); real: ``warm_up_unless_stopped`` and the
watch it shares with the serving loop (``rollserve.engine.server``)."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest
from rollserve.engine.server import warm_up_unless_stopped
from rollserve.engine.service import VllmBackend


class FakeBackend:
    def __init__(self, *, hangs: bool = False, fails: bool = False) -> None:
        self.hangs, self.fails = hangs, fails
        self.dead = False
        self.warmed = False
        self.cancelled = False

    async def warm_up(self) -> None:
        try:
            if self.hangs:  # a request to a dead engine core: never answered
                await asyncio.Event().wait()
            await asyncio.sleep(0)
            if self.fails:
                raise RuntimeError("warm-up request failed")
            self.warmed = True
        except asyncio.CancelledError:
            self.cancelled = True
            raise


def run(backend: FakeBackend, stop: asyncio.Event) -> bool:
    async def main() -> bool:
        return await asyncio.wait_for(
            warm_up_unless_stopped(cast(VllmBackend, backend), stop), timeout=30
        )

    return asyncio.run(main())


def test_a_warm_up_that_finishes_lets_the_engine_serve() -> None:
    backend = FakeBackend()
    assert run(backend, asyncio.Event()) is True
    assert backend.warmed


def test_a_stop_during_a_hung_warm_up_abandons_it() -> None:
    backend = FakeBackend(hangs=True)

    async def main() -> bool:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, stop.set)  # the SIGTERM handler's set
        return await asyncio.wait_for(
            warm_up_unless_stopped(cast(VllmBackend, backend), stop), timeout=30
        )

    assert asyncio.run(main()) is False
    assert backend.cancelled and not backend.warmed


def test_a_dead_engine_core_abandons_a_hung_warm_up() -> None:
    backend = FakeBackend(hangs=True)
    backend.dead = True
    assert run(backend, asyncio.Event()) is False
    assert backend.cancelled


def test_a_failed_warm_up_fails_the_start() -> None:
    with pytest.raises(RuntimeError, match="warm-up request failed"):
        run(FakeBackend(fails=True), asyncio.Event())
