"""The benchmarks' CPU meter, on real child processes (nothing faked)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from rollserve.bench.cpu import CpuMeter, engine_core_time

# A child that names itself as vLLM's engine core does (Linux: PR_SET_NAME), burns about
# half a CPU second, then sleeps until killed; its parent spawns it and sleeps too.
_CHILD = """
import ctypes, sys, time
name = sys.argv[1].encode()
if name:
    ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name), 0, 0, 0)
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


@pytest.fixture
def tree() -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _PARENT, _CHILD, "EngineCore_0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc
    finally:
        import psutil

        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_NAME is Linux's")
def test_a_tree_reads_as_its_engine_core_and_the_rest(tree: subprocess.Popen[str]) -> None:
    meter = CpuMeter({"engine": tree.pid}, {"driver": os.getpid()})
    before = meter.read()
    assert tree.stdout is not None
    assert tree.stdout.readline().strip() == "burnt"
    time.sleep(0.1)  # the kernel's accounting catches up
    spent = CpuMeter.delta(before, meter.read())
    assert set(spent) == {"engine", "engine core", "driver"}
    assert spent["engine core"] >= 0.3  # the child's burn lands on the core part
    assert spent["engine"] < spent["engine core"]  # the parent only slept


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_NAME is Linux's")
def test_engine_core_time_counts_only_the_engine_cores_of_the_trees(
    tree: subprocess.Popen[str],
) -> None:
    before = engine_core_time([tree.pid, os.getpid()])
    assert tree.stdout is not None
    assert tree.stdout.readline().strip() == "burnt"
    time.sleep(0.1)
    # The tree's parent only slept and the test process is no engine core: the child's burn
    # alone, counted once though its tree is listed three times (the test process's holds it).
    spent = engine_core_time([tree.pid, tree.pid, os.getpid()]) - before
    assert 0.3 <= spent.cpu_s < 1.0
    assert spent.wait_s >= 0.0


def test_a_single_process_counts_without_its_children(tree: subprocess.Popen[str]) -> None:
    # The test process is the tree's parent: read alone, the child's burn is not its own.
    meter = CpuMeter({}, {"driver": os.getpid()})
    before = meter.read()["driver"]
    assert tree.stdout is not None
    tree.stdout.readline()
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


# Pins itself to one CPU (the lowest it may use), burns about 0.3 CPU seconds, says so, and
# sleeps until killed (so that it can still be read).
_PINNED = """
import os, time
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
end = time.process_time() + 0.3
while time.process_time() < end:
    pass
print("burnt", flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="needs schedstat")
def test_waiting_for_a_cpu_reads_per_part() -> None:
    """Two processes pinned to one CPU, each burning 0.3 CPU seconds at once: while one runs
    the other waits, runnable, so between them they wait at least as long as the one that
    finished first burned."""
    procs = [
        subprocess.Popen([sys.executable, "-c", _PINNED], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        meter = CpuMeter({"a": procs[0].pid}, {"b": procs[1].pid})
        for proc in procs:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "burnt"
        waits = meter.read_waits()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert set(waits) == {"a", "b"}
    assert waits["a"] + waits["b"] >= 0.2
    assert CpuMeter({"gone": procs[0].pid}).read_waits() == {}


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="needs schedstat")
def test_engine_cores_waiting_for_one_cpu_read_as_busy() -> None:
    """Two engine cores pinned to one CPU burn 0.3 CPU seconds each at once: their main
    threads' computing and waiting add up to at least the time both had work."""
    named = (
        "import ctypes\nctypes.CDLL(None).prctl(15, ctypes.c_char_p(b'EngineCore_0'), 0, 0, 0)\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", named + _PINNED], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        before = engine_core_time([p.pid for p in procs])
        for proc in procs:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "burnt"
        spent = engine_core_time([p.pid for p in procs]) - before
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert spent.cpu_s >= 0.4  # most of the two burns (some ran before the first reading)
    assert spent.wait_s >= 0.1  # one waited while the other burnt
