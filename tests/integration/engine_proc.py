"""Start a real engine (`python -m rollserve.engine`) as a subprocess for integration tests.

The engine runs in its own session, so its process group holds it and every child it starts
(vLLM's engine core); `stop()` sends SIGTERM to the engine, waits, and kills whatever of the
group is left, so no test leaves processes behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["EngineProcess", "EngineStartError", "free_port", "start_engine_process"]

REPO_ROOT = Path(__file__).resolve().parents[2]
PYTHON_PATHS = (REPO_ROOT / "clients" / "python", REPO_ROOT / "services" / "engine")
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0
POLL_INTERVAL_S = 0.5
LEFTOVER_GRACE_S = 5.0


class EngineStartError(RuntimeError):
    """The engine exited or did not become SERVING in time; the message holds its log."""


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class EngineProcess:
    """A running engine subprocess, leader of its own process group."""

    engine_id: str
    address: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    leftover_pids: list[int] = field(default_factory=list)

    @property
    def pgid(self) -> int:
        return self.proc.pid  # start_new_session=True: the engine leads its group

    def group_pids(self) -> list[int]:
        """Live processes of the engine's process group (the engine and its children)."""
        pids = []
        for process in psutil.process_iter():
            with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
                if os.getpgid(process.pid) == self.pgid and process.status() != "zombie":
                    pids.append(process.pid)
        return pids

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM the engine and wait for it; returns its exit code.

        Processes of its group still alive a few seconds after it exited are recorded in
        `leftover_pids` and killed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        deadline = time.monotonic() + LEFTOVER_GRACE_S
        while (pids := self.group_pids()) and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL_S / 5)
        self.leftover_pids = pids
        self._kill_group()
        return int(self.proc.wait())

    def kill(self) -> None:
        """SIGKILL the whole process group."""
        self._kill_group()
        self.proc.wait()

    def _kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signal.SIGKILL)


def start_engine_process(
    model_dir: Path,
    engine_id: str = "engine-test",
    extra_args: Sequence[str] = (),
    *,
    log_dir: Path | None = None,
    timeout_s: float = START_TIMEOUT_S,
) -> EngineProcess:
    """Starts an engine on a free port and returns once its health says SERVING."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="rollserve-engine-"))
    log_path = log_dir / f"{engine_id}.log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [*(str(p) for p in PYTHON_PATHS), *filter(None, [env.get("PYTHONPATH")])]
    )
    command = [
        sys.executable,
        "-m",
        "rollserve.engine",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--engine-id",
        engine_id,
        *extra_args,
    ]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=REPO_ROOT,
            start_new_session=True,
        )
    engine = EngineProcess(engine_id, address, proc, log_path)
    try:
        _wait_serving(engine, timeout_s)
    except BaseException:
        engine.kill()
        raise
    return engine


def _wait_serving(engine: EngineProcess, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(engine.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if engine.proc.poll() is not None:
                raise EngineStartError(
                    f"engine {engine.engine_id} exited with {engine.proc.returncode} "
                    f"before serving; log:\n{engine.log_tail()}"
                )
            with contextlib.suppress(grpc.RpcError):
                reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            time.sleep(POLL_INTERVAL_S)
    raise EngineStartError(
        f"engine {engine.engine_id} did not serve within {timeout_s:.0f} s; "
        f"log:\n{engine.log_tail()}"
    )
