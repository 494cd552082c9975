"""Start a real engine (`python -m rollserve.engine`) as a subprocess for integration tests.

Launching, waiting for health and killing the process group are the dev stack's own
(`rollserve.cli.stack`); this adds what the tests check on top: the engine's exit code
after SIGTERM and the processes of its group that outlive it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from rollserve.cli.stack import ManagedProcess, free_port, launch_engine, wait_serving

__all__ = ["EngineProcess", "free_port", "start_engine_process"]

START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0
POLL_INTERVAL_S = 0.1
LEFTOVER_GRACE_S = 30.0  # for vLLM's helpers (its resource tracker) to exit by themselves


@dataclass
class EngineProcess:
    """A running engine subprocess, leader of its own process group."""

    engine_id: str
    managed: ManagedProcess
    leftover_pids: list[int] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.managed.address

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.managed.popen

    def group_pids(self) -> list[int]:
        """Live processes of the engine's process group (the engine and its children)."""
        pgid = self.proc.pid  # start_new_session=True: the engine leads its group
        pids = []
        for process in psutil.process_iter():
            with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
                if os.getpgid(process.pid) == pgid and process.status() != "zombie":
                    pids.append(process.pid)
        return pids

    def log_tail(self, chars: int = 6000) -> str:
        return self.managed.log_tail(chars)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM the engine alone and wait for it; returns its exit code.

        Processes of its group still alive a few seconds after it exited are recorded in
        `leftover_pids` and killed: a clean shutdown leaves none."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        deadline = time.monotonic() + LEFTOVER_GRACE_S
        while (pids := self.group_pids()) and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL_S)
        self.leftover_pids = pids
        self.kill()
        return int(self.proc.wait())

    def kill(self) -> None:
        """SIGKILL the whole process group."""
        self.managed.kill()


def start_engine_process(
    model_dir: Path,
    engine_id: str = "engine-test",
    extra_args: Sequence[str] = (),
    *,
    log_dir: Path | None = None,
    timeout_s: float = START_TIMEOUT_S,
) -> EngineProcess:
    """Starts an engine on a free port and returns once its health says SERVING."""
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="rollserve-engine-"))
    engine = EngineProcess(engine_id, launch_engine(model_dir, engine_id, log_dir, extra_args))
    try:
        wait_serving(engine.address, timeout_s, engine.managed)
    except BaseException:
        engine.kill()
        raise
    return engine


@contextlib.contextmanager
def serving_engine(
    model_dir: Path, engine_id: str, extra_args: Sequence[str], *, log_dir: Path
) -> Iterator[str]:
    """An engine of its own for a test module: yields its host:port while it serves, then
    stops it and checks that none of its processes outlived it."""
    engine = start_engine_process(model_dir, engine_id, extra_args, log_dir=log_dir)
    try:
        yield engine.address
    finally:
        engine.stop()
    assert engine.leftover_pids == [], "processes of the engine outlived it"
