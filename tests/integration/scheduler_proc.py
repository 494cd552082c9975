"""Starts the real scheduler as a child process for tests (so a test can kill it)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from rollserve.cli.stack import ManagedProcess, free_port, wait_serving


def start_scheduler(
    redis_url: str,
    engines: Sequence[str],
    log_dir: Path,
    *extra: str,
    name: str = "scheduler",
    port: int | None = None,
) -> ManagedProcess:
    """``engines`` are ``ID=HOST:PORT`` strings. Waits until health says SERVING."""
    port = port or free_port()
    proc = ManagedProcess.start(
        name,
        [
            sys.executable,
            "-m",
            "rollserve.scheduler",
            "--port",
            str(port),
            "--redis-url",
            redis_url,
            "--health-interval-s",
            "0.25",
            # A real engine, busy on a loaded machine, may answer a probe late: only a test
            # of engine failures (which refuse connections) wants them found.
            "--health-timeout-s",
            "30",
            *(f"--engine={e}" for e in engines),
            *extra,
        ],
        log_dir,
    )
    proc.address = f"127.0.0.1:{port}"
    try:
        wait_serving(proc.address, 60, proc)
    except BaseException:
        proc.stop()  # one that never served is not left running
        raise
    return proc
