"""CPU priority of the control plane next to a CPU-bound engine core.

On a machine where vLLM's engine core runs the model on the CPU, every other busy thread
(the engine's gRPC server and output handling, the scheduler, Redis) competes with the
core's model thread: the kernel places a woken thread on any free-looking CPU, preempting the
core for a slice and evicting its caches. Measured on a 2-core machine, that alone cost ~7% of
engine throughput (``rollserve bench overhead``). Raising the niceness of the control plane's
threads, and leaving the core's alone, makes the kernel prefer the model when they compete;
the control plane keeps whatever the model leaves, which is plenty (a few percent of a core).

Raising niceness needs no privilege. On Linux niceness is per thread, so every thread of the
process is set, and threads created later inherit it from their creator.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["MAX_NICE", "renice_threads"]

MAX_NICE = 19


def renice_threads(nice: int, pid: int | None = None) -> int:
    """Sets every thread of process ``pid`` (default: this one) to at least ``nice``.

    Never lowers a thread's niceness (that would need privileges); returns how many threads
    were changed. A no-op where the platform has no per-thread priorities.
    """
    if not 0 <= nice <= MAX_NICE:
        raise ValueError(f"nice ({nice}) must be between 0 and {MAX_NICE}")
    if not hasattr(os, "setpriority"):
        return 0
    target = pid if pid is not None else os.getpid()
    tasks = Path(f"/proc/{target}/task")
    tids = [int(p.name) for p in tasks.iterdir()] if tasks.is_dir() else [target]
    changed = 0
    for tid in tids:
        # A thread may end between listing and setting it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                changed += 1
    return changed
