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
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

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


def proc_stat(text: str) -> tuple[int, float]:
    """(parent pid, CPU seconds user + system) from the text of a /proc ``stat`` file (of a
    process or of one of its threads)."""
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _task_wait_s(pid: int, tid: int | str) -> float:
    """Seconds thread ``tid`` of process ``pid`` has waited, runnable, for a CPU (OSError,
    ValueError or IndexError where the kernel does not say)."""
    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
        return int(f.read().split()[1]) / 1e9


def _wait_s(pid: int) -> float:
    """Seconds the threads of process ``pid`` have waited, runnable, for a CPU (0 where the
    kernel does not say)."""
    total = 0.0
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += _task_wait_s(pid, tid)
    return total


def _cpu_s(proc: psutil.Process) -> float:
    with contextlib.suppress(psutil.Error):
        times = proc.cpu_times()
        return float(times.user + times.system)
    return 0.0


@dataclass(frozen=True)
class CoreTime:
    """Seconds the main threads of some vLLM engine cores spent computing (``cpu_s``) and
    runnable but waiting for a CPU (``wait_s``). The main thread runs the engine's steps (the
    model too, with one OpenMP thread) and sleeps on the input queue while there is no work
    (about 1% of a CPU), so over a window their sum is close to the engine's busy time. Its
    other threads (the output thread, gloo's and ZeroMQ's loops) wake often and briefly: their
    waits for a CPU would count many times over, so they are left out."""

    cpu_s: float = 0.0
    wait_s: float = 0.0

    def __sub__(self, other: CoreTime) -> CoreTime:
        return CoreTime(self.cpu_s - other.cpu_s, self.wait_s - other.wait_s)


def _main_thread(pid: int) -> CoreTime:
    """The main thread's CPU and wait seconds (zero where /proc does not say)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/task/{pid}/stat") as f:
            _, cpu = proc_stat(f.read())
        wait = 0.0
        with contextlib.suppress(OSError):
            wait = _task_wait_s(pid, pid)
        return CoreTime(cpu, wait)
    return CoreTime()


def engine_core_time(pids: Iterable[int]) -> CoreTime:
    """The engine cores among ``pids`` and every process below them, each counted once."""
    seen: set[int] = set()
    cpu = wait = 0.0
    for pid in pids:
        for proc in _tree(pid):
            if proc.pid not in seen and _is_engine_core(proc):
                seen.add(proc.pid)
                main = _main_thread(proc.pid)
                cpu, wait = cpu + main.cpu_s, wait + main.wait_s
    return CoreTime(cpu, wait)


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
