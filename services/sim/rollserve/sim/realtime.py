"""A :class:`~rollserve.sim.engine_model.SimEngine` stepping in real time on the event loop.

The simulated engine takes no time to compute a step; this makes its steps last. While the
engine has work, a step starts when the previous one ends: ``SimEngine.step()`` is called at the
step's start (so it takes the requests added until then; requests added while it runs join the
next one, as in vLLM) and its end is due ``duration_s * time_scale`` later, when the step's
finished samples are announced and the next step starts. An idle engine starts a step at the
next turn of the loop after a request arrives, so the samples of one call start together.

**One clock for many engines.** The step ends of every engine of a process wait in one
:class:`StepClock`: a heap of (due time, engine) under a single loop timer, set for the
earliest. A fleet of hundreds of engines costs no task and no timer per engine, a heap push per
step, and nothing while idle. The clock runs the ends that are due in one callback, for about
``MAX_BATCH_S`` at most, then lets the loop serve I/O before it goes on.

**Keeping time.** Steps are anchored to the schedule, not to when their end ran: an end that runs
late starts the next step at the scheduled time, and steps run back to back until the engine is
on time again. When an end runs more than ``MAX_CATCH_UP_S`` late (the process could not keep
up: too many engines or too small a ``time_scale`` for its CPU, or it was not scheduled), the
engine gives the time up and restarts its schedule from now; ``behind_s`` adds what was given
up, so a run can say how much slower than the simulated hardware it really was.

**Weight updates.** ``update_weights`` lets the step in flight end, starts no step for the
profile's ``weights_load_s`` (simulated), then has the engine recompute its running requests
with an empty prefix cache (``SimEngine.new_weights``), as vLLM's in-place reload does.

**Tokens between step ends.** ``progress()`` counts the tokens of the step in flight (the
engine model has already taken it), so a reader sees a running sample's tokens up to one step
early; finished samples are announced only when their last step ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from heapq import heappop, heappush

from rollserve.sim.engine_model import Finished, SimEngine, SimRequest, StepResult

__all__ = ["MAX_BATCH_S", "MAX_CATCH_UP_S", "ClockStats", "RealTimeEngine", "StepClock"]

MAX_CATCH_UP_S = 0.25
"""Real seconds a step end may run late and still be caught up (steps back to back)."""
MAX_BATCH_S = 0.005
"""Seconds the clock spends on due step ends before it lets the loop serve I/O."""
_BATCH_CHECK_EVERY = 16  # step ends between two looks at the time spent


class StepClock:
    """Due callbacks of many engines on one loop timer (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop or asyncio.get_running_loop()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0  # ties in due time keep the order of scheduling
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = 0.0
        self._firing = False

    def schedule(self, due: float, callback: Callable[[], None]) -> None:
        """Calls ``callback`` at loop time ``due`` (or as soon after as the loop allows)."""
        self._seq += 1
        heappush(self._heap, (due, self._seq, callback))
        if not self._firing and (self._timer is None or due < self._timer_due):
            self._arm()

    def close(self) -> None:
        """Drops every pending callback."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._heap.clear()

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._heap:
            self._timer_due = self._heap[0][0]
            self._timer = self.loop.call_at(self._timer_due, self._fire)

    def _fire(self) -> None:
        self._timer = None
        heap = self._heap
        now = self.loop.time()
        stop_at = time.perf_counter() + MAX_BATCH_S
        count = 0
        self._firing = True
        try:
            while heap and heap[0][0] <= now:
                heappop(heap)[2]()
                count += 1
                if count % _BATCH_CHECK_EVERY == 0 and time.perf_counter() > stop_at:
                    break
        finally:
            self._firing = False
            self._arm()


@dataclass(slots=True)
class ClockStats:
    """How well the engine kept time (real seconds)."""

    steps: int = 0
    late_steps: int = 0  # steps whose end ran more than MAX_CATCH_UP_S late
    behind_s: float = 0.0  # time given up by those: the engine ran this much slower
    max_lag_s: float = 0.0  # the latest a step end ran


class RealTimeEngine:
    """One simulated engine in real time; see the module docstring."""

    def __init__(self, engine: SimEngine, time_scale: float, clock: StepClock) -> None:
        if not time_scale > 0:
            raise ValueError(f"time_scale ({time_scale}) must be greater than 0")
        self.engine = engine
        self.time_scale = time_scale
        self.clock = ClockStats()
        self._steps = clock
        self._loop = clock.loop
        self._listeners: dict[str, Callable[[Finished], None]] = {}
        self._step: StepResult | None = None  # the step in flight
        self._due = 0.0  # loop time its end is due
        self._kick: asyncio.Handle | None = None
        self._closed = False
        self._paused = False  # a weight update: no step starts
        self._idle = asyncio.Event()  # set when a step ends while paused

    @property
    def stepping(self) -> bool:
        return self._step is not None

    def add(self, request: SimRequest, on_finish: Callable[[Finished], None]) -> None:
        """Queues a request; ``on_finish`` is called when its last step ends.

        Raises ValueError for a request the engine cannot take or an id it still has."""
        if self._closed:
            raise RuntimeError(f"engine {self.engine.engine_id} is closed")
        if request.request_id in self._listeners:  # ended, but its last step has not
            raise ValueError(
                f"engine {self.engine.engine_id}: request {request.request_id!r} is still here"
            )
        self.engine.add(request)
        self._listeners[request.request_id] = on_finish
        if self._step is None and self._kick is None:
            self._kick = self._loop.call_soon(self._start_idle)

    def abort(self, request_id: str) -> Finished | None:
        """Takes the request out of the engine now; None when the engine no longer has it
        (unknown, or finished in the step in flight: its ``on_finish`` still comes)."""
        finished = self.engine.abort(request_id)
        if finished is not None:
            del self._listeners[request_id]
        return finished

    def progress(self, request_id: str) -> int:
        return self.engine.progress(request_id)

    async def update_weights(self, loaded: Callable[[], None]) -> float:
        """A weight update: waits for the step in flight, pauses for the profile's
        ``weights_load_s``, calls ``loaded`` (the tokens made so far are the old weights'),
        then the engine recomputes its running requests and goes on. Returns the real
        seconds generation was paused. One at a time."""
        start = self._loop.time()
        self._paused = True
        try:
            if self._step is not None:
                self._idle.clear()
                await self._idle.wait()
            await asyncio.sleep(self.engine.profile.weights_load_s * self.time_scale)
            loaded()
            self.engine.new_weights()
        finally:
            # (even when the load was cut off: paused with work and no step due, every call
            # on the engine waited for a new one to start it)
            self._paused = False
            if not self._closed and self._step is None and self.engine.has_work():
                self._begin(self._loop.time())
        return self._loop.time() - start

    def close(self) -> None:
        """Stops stepping; the engine keeps its state, the listeners are dropped."""
        self._closed = True
        if self._kick is not None:
            self._kick.cancel()
            self._kick = None
        self._step = None
        self._listeners.clear()
        self._idle.set()

    def _start_idle(self) -> None:
        self._kick = None
        if self._step is None and not self._closed and not self._paused and self.engine.has_work():
            self._begin(self._loop.time())

    def _begin(self, start: float) -> None:
        step = self.engine.step()
        self._step = step
        self._due = start + step.duration_s * self.time_scale
        self._steps.schedule(self._due, self._end)

    def _end(self) -> None:
        step, self._step = self._step, None
        if step is None:  # closed since
            return
        clock = self.clock
        clock.steps += 1
        now = self._loop.time()
        lag = now - self._due
        clock.max_lag_s = max(clock.max_lag_s, lag)
        start = self._due
        if lag > MAX_CATCH_UP_S:
            clock.late_steps += 1
            clock.behind_s += lag
            start = now
        for finished in step.finished:
            listener = self._listeners.pop(finished.request_id, None)
            if listener is not None:
                listener(finished)
        if self._paused:
            self._idle.set()
        elif self.engine.has_work():
            self._begin(start)
