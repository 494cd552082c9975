"""The engine service's start-up gives way to a stop or a dead engine core.

Faked: vLLM's backend (``warm_up`` and ``dead``); real: ``warm_up_unless_stopped`` and the
watch it shares with the serving loop (``rollserve.engine.server``). The model load before it
gives way too (``signals_interrupt_load``; the load is a sleep here)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import cast

import pytest
from rollserve.engine.server import LoadInterrupted, signals_interrupt_load, warm_up_unless_stopped
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


def test_a_stop_signal_during_the_model_load_interrupts_it_and_sets_stop() -> None:
    """The load blocks the event loop, so the loop's own handlers could not run until it
    ends: a SIGTERM inside the block interrupts the blocking call at once (here a sleep that
    would last an hour), sets stop, and the handlers before it are back afterwards."""
    stop = asyncio.Event()
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with (
        pytest.raises(LoadInterrupted, match="SIGTERM during the model load"),
        signals_interrupt_load(stop),
    ):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(3600)
    assert stop.is_set()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before

    quiet = asyncio.Event()
    with signals_interrupt_load(quiet):
        pass  # a load that nothing interrupts
    assert not quiet.is_set()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
