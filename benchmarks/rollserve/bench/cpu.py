"""CPU seconds spent by each part of a benchmark's processes, round by round.

Wall time on a shared 2-vCPU machine moves with the machine; CPU seconds for the same
work move much less, and they say where a difference comes from: the engine core doing
the work, or the processes around it (an engine's frontend, the scheduler, Redis, the
driver). A :class:`CpuMeter` reads the cumulative user+system time of named process
trees (each root and all its descendants) and splits every tree into its vLLM engine
core (a process whose name carries ``EngineCore``, as vLLM names it) and the rest.
:meth:`CpuMeter.read_waits` reads, for the same parts, the time their threads spent runnable
but waiting for a CPU (Linux's ``/proc/<pid>/task/<tid>/schedstat``): a niced front end
starved by busy engine cores shows there, not in its CPU seconds.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping

import psutil

ENGINE_CORE_MARK = "EngineCore"


def _tree(pid: int) -> Iterator[psutil.Process]:
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(pid)
        yield root
        yield from root.children(recursive=True)


def _is_engine_core(proc: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        if ENGINE_CORE_MARK in proc.name():
            return True
        return any(ENGINE_CORE_MARK in part for part in proc.cmdline()[:1])
    return False


def _wait_s(pid: int) -> float:
    """Seconds the threads of process ``pid`` have waited, runnable, for a CPU (0 where the
    kernel does not say)."""
    total = 0
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with (
                contextlib.suppress(OSError, ValueError, IndexError),
                open(f"/proc/{pid}/task/{tid}/schedstat") as f,
            ):
                total += int(f.read().split()[1])
    return total / 1e9


def _cpu_s(proc: psutil.Process) -> float:
    with contextlib.suppress(psutil.Error):
        times = proc.cpu_times()
        return float(times.user + times.system)
    return 0.0


class CpuMeter:
    """Cumulative CPU seconds per part: process trees and single processes, by name.

    A tree named ``engine`` (a root pid and all its descendants) reads as two parts,
    ``engine core`` (its engine-core processes) and ``engine`` (the rest of it); a tree
    with no engine core reads as one. A single process (``processes``) counts alone,
    without its children: the benchmark's own driver, whose children are the services.
    A process that ended between two readings drops out of the later one, so use it on
    long-lived processes.
    """

    def __init__(
        self, trees: Mapping[str, int], processes: Mapping[str, int] | None = None
    ) -> None:
        self._trees = dict(trees)
        self._processes = dict(processes or {})

    def read(self) -> dict[str, float]:
        """Cumulative CPU seconds per part."""
        return self._sum(_cpu_s)

    def read_waits(self) -> dict[str, float]:
        """Cumulative seconds per part that its threads waited, runnable, for a CPU (summed
        over threads, so a part can wait more than the wall time); empty where the kernel
        keeps no schedstat."""
        if not os.path.exists(f"/proc/{os.getpid()}/schedstat"):
            return {}
        return self._sum(lambda proc: _wait_s(proc.pid))

    def _sum(self, measure: Callable[[psutil.Process], float]) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, pid in self._trees.items():
            for proc in _tree(pid):
                part = f"{name} core" if _is_engine_core(proc) else name
                out[part] = out.get(part, 0.0) + measure(proc)
        for name, pid in self._processes.items():
            with contextlib.suppress(psutil.NoSuchProcess):
                out[name] = out.get(name, 0.0) + measure(psutil.Process(pid))
        return out

    @staticmethod
    def delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
        """CPU seconds spent per part between two readings (parts seen in either)."""
        parts = dict.fromkeys([*before, *after])
        return {part: max(0.0, after.get(part, 0.0) - before.get(part, 0.0)) for part in parts}
