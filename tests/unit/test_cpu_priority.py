"""renice_threads, in a child process (a test process cannot take niceness back)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from rollserve.engine.cpu_priority import renice_threads

CHILD = textwrap.dedent(
    """
    import os, threading
    from rollserve.engine.cpu_priority import renice_threads

    ready, stop = threading.Event(), threading.Event()
    seen = {}

    def worker():
        ready.set()
        stop.wait()
        # A thread started by a reniced thread inherits its niceness.
        t = threading.Thread(target=lambda: seen.setdefault(
            "grandchild", os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        t.start(); t.join()

    t = threading.Thread(target=worker); t.start(); ready.wait()
    changed = renice_threads(7)
    tids = [int(x) for x in os.listdir(f"/proc/{os.getpid()}/task")]
    values = {os.getpriority(os.PRIO_PROCESS, tid) for tid in tids}
    stop.set(); t.join()
    again = renice_threads(3)  # never lowers niceness
    print(changed, sorted(values), seen["grandchild"], again)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness: Linux")
def test_every_thread_is_reniced_and_new_threads_inherit() -> None:
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert out == ["2", "[7]", "7", "0"]


def test_bounds() -> None:
    with pytest.raises(ValueError, match="nice"):
        renice_threads(20)
    with pytest.raises(ValueError, match="nice"):
        renice_threads(-1)
