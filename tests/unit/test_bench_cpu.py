"""The benchmarks' CPU meter, on real child processes (nothing faked).

Each child says "ready" and waits for its standard input to end before it burns CPU: a test
takes its first reading, then closes the pipe (``go``), so that all of a burn lands between
its two readings and two children's burns start together, however the machine schedules the
test process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from rollserve.bench.cpu import CpuMeter, engine_core_time

# A child that names itself as vLLM's engine core does (Linux: PR_SET_NAME), waits for the
# go, burns about half a CPU second, then sleeps until killed; its parent spawns it (passing
# on its standard input) and sleeps too.
_CHILD = """
import ctypes, sys, time
name = sys.argv[1].encode()
if name:
    ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name), 0, 0, 0)
print("ready", flush=True)
sys.stdin.read()
end = time.process_time() + 0.5
while time.process_time() < end:
    pass
print("burnt", flush=True)
time.sleep(600)
"""

_PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=sys.stdout)
time.sleep(600)
"""


class Gate:
    """One pipe that child processes read as their standard input: ``go()`` closes its
    write end, and every child blocked reading it wakes in that one system call."""

    def __init__(self) -> None:
        self.read_end, self._write_end = os.pipe()

    def spawned(self) -> None:
        """The children have the read end: the test's copy is closed."""
        os.close(self.read_end)

    def go(self) -> None:
        if self._write_end >= 0:
            os.close(self._write_end)
            self._write_end = -1


def ready(*procs: subprocess.Popen[str]) -> None:
    """Waits until each child has said it is ready (and waits for the go)."""
    for proc in procs:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"


def burnt(proc: subprocess.Popen[str]) -> None:
    """Waits until the child has said it has burnt its CPU time."""
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "burnt"


@pytest.fixture
def tree() -> Iterator[tuple[subprocess.Popen[str], Gate]]:
    """A parent and its engine-core child, the child ready to burn at the gate's go."""
    gate = Gate()
    proc = subprocess.Popen(
        [sys.executable, "-c", _PARENT, _CHILD, "EngineCore_0"],
        stdin=gate.read_end,
        stdout=subprocess.PIPE,
        text=True,
    )
    gate.spawned()
    try:
        ready(proc)
        yield proc, gate
    finally:
        import psutil

        gate.go()
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_NAME is Linux's")
def test_a_tree_reads_as_its_engine_core_and_the_rest(
    tree: tuple[subprocess.Popen[str], Gate],
) -> None:
    proc, gate = tree
    meter = CpuMeter({"engine": proc.pid}, {"driver": os.getpid()})
    before = meter.read()
    gate.go()
    burnt(proc)
    spent = CpuMeter.delta(before, meter.read())
    assert set(spent) == {"engine", "engine core", "driver"}
    assert spent["engine core"] >= 0.3  # the child's burn lands on the core part
    assert spent["engine"] < spent["engine core"]  # the parent only slept


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_NAME is Linux's")
def test_engine_core_time_counts_only_the_engine_cores_of_the_trees(
    tree: tuple[subprocess.Popen[str], Gate],
) -> None:
    proc, gate = tree
    before = engine_core_time([proc.pid, os.getpid()])
    gate.go()
    burnt(proc)
    # The tree's parent only slept and the test process is no engine core: the child's burn
    # alone, counted once though its tree is listed three times (the test process's holds it).
    spent = engine_core_time([proc.pid, proc.pid, os.getpid()]) - before
    assert 0.3 <= spent.cpu_s < 1.0
    assert spent.wait_s >= 0.0


def test_a_single_process_counts_without_its_children(
    tree: tuple[subprocess.Popen[str], Gate],
) -> None:
    # The test process is the tree's parent: read alone, the child's burn is not its own.
    proc, gate = tree
    meter = CpuMeter({}, {"driver": os.getpid()})
    before = meter.read()["driver"]
    gate.go()
    burnt(proc)
    assert meter.read()["driver"] - before < 0.3


def test_a_gone_process_reads_as_nothing_and_deltas_never_go_negative() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert CpuMeter({"gone": proc.pid}).read() == {}
    assert CpuMeter.delta({"a": 2.0, "b": 1.0}, {"a": 1.5, "c": 0.5}) == {
        "a": 0.0,
        "b": 0.0,
        "c": 0.5,
    }


# Pins itself to one CPU (the lowest it may use), waits for the go, burns about 0.3 CPU
# seconds, says so, and sleeps until killed (so that it can still be read).
_PINNED = """
import os, sys, time
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
print("ready", flush=True)
sys.stdin.read()
end = time.process_time() + 0.3
while time.process_time() < end:
    pass
print("burnt", flush=True)
time.sleep(600)
"""


@contextmanager
def pinned_pair(code: str) -> Iterator[tuple[list[subprocess.Popen[str]], Gate]]:
    """Two children running ``code`` (``_PINNED`` or the like), both ready, waiting for the
    gate's go; killed at the end."""
    gate = Gate()
    procs: list[subprocess.Popen[str]] = []
    try:
        for _ in range(2):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", code],
                    stdin=gate.read_end,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        gate.spawned()
        ready(*procs)
        yield procs, gate
    finally:
        gate.go()
        for proc in procs:
            proc.kill()
            proc.wait()


# Both pinned children are woken by the same go and run until the first of them has burnt
# its 0.3 CPU seconds; while that one runs, the other waits, runnable, for their one CPU.
_LEAST_WAIT_S = 0.2  # of those 0.3 seconds, with room for the kernel's accounting


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="needs schedstat")
def test_waiting_for_a_cpu_reads_per_part() -> None:
    """Two processes pinned to one CPU, each burning 0.3 CPU seconds at once: while one runs
    the other waits, runnable, so between them they wait at least as long as the one that
    finished first burned."""
    with pinned_pair(_PINNED) as (procs, gate):
        meter = CpuMeter({"a": procs[0].pid}, {"b": procs[1].pid})
        gate.go()
        for proc in procs:
            burnt(proc)
        waits = meter.read_waits()
    assert set(waits) == {"a", "b"}
    assert waits["a"] + waits["b"] >= _LEAST_WAIT_S
    assert CpuMeter({"gone": procs[0].pid}).read_waits() == {}


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="needs schedstat")
def test_engine_cores_waiting_for_one_cpu_read_as_busy() -> None:
    """Two engine cores pinned to one CPU burn 0.3 CPU seconds each at once: their main
    threads' computing and waiting add up to at least the time both had work."""
    named = (
        "import ctypes\nctypes.CDLL(None).prctl(15, ctypes.c_char_p(b'EngineCore_0'), 0, 0, 0)\n"
    )
    with pinned_pair(named + _PINNED) as (procs, gate):
        before = engine_core_time([p.pid for p in procs])
        gate.go()
        for proc in procs:
            burnt(proc)
        spent = engine_core_time([p.pid for p in procs]) - before
    assert spent.cpu_s >= 0.5  # both burns, from the go on (/proc counts in clock ticks)
    assert spent.wait_s >= _LEAST_WAIT_S  # one waited while the other burnt
