"""The dev stack: Redis, N engines and the scheduler as child processes.

Each child runs in its own session (process group) so that stopping it also stops
whatever it started (vLLM runs its engine core in a grandchild process). Every
child's output goes to a log file under the stack's directory; when a child fails
to become healthy, the tail of its log is in the error.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rollserve.cli.redis_server import EmbeddedRedis
from rollserve.engine.cpu_priority import renice_threads

_STOP_GRACE_S = 20.0
_ENGINE_START_TIMEOUT_S = 300.0
_SCHEDULER_START_TIMEOUT_S = 60.0
_SIM_START_TIMEOUT_S = 120.0
_LOG_TAIL_BYTES = 4000
# A process of the stack that ran this long before it exited is restarted as if for the
# first time (its backoff and count begin again), as Kubernetes resets a crash loop's.
STABLE_RUN_S = 300.0


class StackError(RuntimeError):
    pass


def engine_threads(engines: int) -> int:
    """OpenMP threads per CPU engine when ``engines`` share this machine.

    One core is left to the engines' front ends, the scheduler and Redis: OpenMP
    threads spin while they wait, and a model step that holds every core starves
    the processes that feed it.
    """
    cores = os.cpu_count() or 1
    return max(1, (cores - 1) // max(1, engines))


def engines_with_room(cores: int | None = None) -> int:
    """Engines this machine runs side by side with a CPU left for each one's control plane.

    An engine core takes a whole CPU; its front end (vLLM's output handling and the engine
    service) needs a quarter to a third of another while the core is busy, and the scheduler
    and Redis share what is left. With more engines than that, niceness lets the cores crowd
    out the front ends, which then report finished samples in late bursts
    (docs/calibration.md). One engine per two CPUs: 1 on a 2-core machine.
    """
    return max(1, (cores if cores is not None else os.cpu_count() or 1) // 2)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_serving(address: str, timeout_s: float, proc: ManagedProcess | None = None) -> None:
    """Polls the standard gRPC health service until it answers SERVING."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc is not None and proc.popen.poll() is not None:
                raise StackError(
                    f"{proc.name} exited with code {proc.popen.returncode} before it was "
                    f"healthy; log {proc.log_path}:\n{proc.log_tail()}"
                )
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                tail = f"; log {proc.log_path}:\n{proc.log_tail()}" if proc else ""
                raise StackError(f"{address} not healthy after {timeout_s:.0f}s{tail}")
            time.sleep(0.25)


_ENGINE_ACCESS_FLAGS = (
    "--tls-cert-file",
    "--tls-key-file",
    "--tls-client-ca-file",
    "--auth-tokens-file",
)


@dataclass
class ManagedProcess:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    address: str = ""
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None
    started_at: float = field(default_factory=time.monotonic)
    restarts: int = 0  # quick exits in a row that were restarted (``next_restart``)

    @classmethod
    def start(
        cls,
        name: str,
        argv: list[str],
        log_dir: Path,
        env: dict[str, str] | None = None,
        *,
        restart: int = 0,
    ) -> ManagedProcess:
        """Starts ``argv``, its output to ``<log_dir>/<name>.log`` (appended to, and the
        restart noted there, when ``restart`` counts one)."""
        log_path = log_dir / f"{name}.log"
        with log_path.open("ab" if restart else "wb") as log:
            if restart:
                log.write(f"\n--- rollserve up: {name} restarted ({restart}) ---\n".encode())
                log.flush()
            popen = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        return cls(name, popen, log_path, argv=list(argv), env=env, restarts=restart)

    def next_restart(self) -> int:
        """Which restart in a row starting it again would be: one that ran
        ``STABLE_RUN_S`` or more before it exited begins the count again."""
        if time.monotonic() - self.started_at >= STABLE_RUN_S:
            return 1
        return self.restarts + 1

    def restarted(self) -> ManagedProcess:
        """The same command started again, at the same address (its log goes on)."""
        proc = ManagedProcess.start(
            self.name, self.argv, self.log_path.parent, self.env, restart=self.next_restart()
        )
        proc.address = self.address
        return proc

    def log_tail(self, limit: int = _LOG_TAIL_BYTES) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-limit:].decode(errors="replace")

    def stop(self, grace_s: float = _STOP_GRACE_S) -> None:
        """SIGTERM to the process group, then SIGKILL to whatever is left of it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(grace_s)
        # The group may hold grandchildren (vLLM's engine core) even after the leader exits.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(10)


def launch_engine(
    model: Path,
    engine_id: str,
    log_dir: Path,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> ManagedProcess:
    """Starts ``python -m rollserve.engine`` on a free port; does not wait for it."""
    port = free_port()
    proc = ManagedProcess.start(
        engine_id,
        [
            sys.executable,
            "-m",
            "rollserve.engine",
            "--model",
            str(model),
            "--engine-id",
            engine_id,
            "--port",
            str(port),
            *extra_args,
        ],
        log_dir,
        env,
    )
    proc.address = f"127.0.0.1:{port}"
    return proc


CONTROL_PLANE_NICE = 10


@dataclass(frozen=True)
class StackConfig:
    model: Path
    engines: int = 1
    redis_url: str | None = None  # None starts the embedded Redis
    scheduler_port: int = 0  # 0 picks a free port
    engine_args: tuple[str, ...] = ()  # extra flags for every engine (they win over the stack's)
    scheduler_args: tuple[str, ...] = ()
    # HTTP: the scheduler's API and metrics on this port, engine i's metrics on port + 1 + i
    http_port: int | None = None
    # vLLM engines on this machine, the stack's included (its engines resolve dtype auto
    # counting them: --engines-per-host); 0: the stack's own
    engines_per_host: int = 0
    # The engines simulated instead, by this cost profile (rollserve sim fleet, one process;
    # the engine flags and metrics do not apply), stepping at this many real seconds per
    # simulated one: the scheduler at fleet scale without a GPU
    sim_profile: str | None = None
    sim_time_scale: float = 1.0
    omp_threads: int = 0  # OpenMP threads per engine; 0: the cores left after one, shared
    # Niceness of the control plane (engine frontends, scheduler, embedded Redis): on one
    # machine with CPU engines, the engine cores' model threads go first (see
    # rollserve.engine.cpu_priority); 0 leaves every process at its start priority.
    control_plane_nice: int = CONTROL_PLANE_NICE
    run_dir: Path | None = None  # logs; a temp dir when None

    def __post_init__(self) -> None:
        if self.sim_profile is not None and self.engine_args:
            raise ValueError(
                f"engine_args {list(self.engine_args)}: simulated engines take no vLLM flags"
            )
        secured = [a for a in self.engine_args if a.split("=")[0] in _ENGINE_ACCESS_FLAGS]
        if secured:
            raise ValueError(
                f"engine_args {secured}: the dev stack's scheduler reaches its engines in "
                "plaintext without a token; run the engines and the scheduler yourself for "
                "that (docs/access.md)"
            )
        if self.http_port is None:
            return
        last = self.http_port + (0 if self.sim_profile is not None else self.engines)
        if last > 65535:
            raise ValueError(
                f"http_port {self.http_port}: the engines' metrics would take ports up to "
                f"{last}, past 65535; give a lower one"
            )
        if self.http_port <= self.scheduler_port <= last:
            raise ValueError(
                f"http_port {self.http_port}: the scheduler's and the engines' take ports "
                f"{self.http_port}-{last}, which hold the scheduler's gRPC port "
                f"{self.scheduler_port}; give another"
            )


def engine_flags(config: StackConfig, index: int) -> tuple[str, ...]:
    """The flags the stack gives engine ``index``: its own first, so that ``engine_args``
    can override them. The engines share this machine's memory (``--engines-per-host``: each
    resolves ``dtype auto`` knowing of the others)."""
    metrics = (
        ()
        if config.http_port is None
        else ("--metrics-port", str(engine_metrics_port(config, index)))
    )
    return (
        "--frontend-nice",
        str(config.control_plane_nice),
        "--engines-per-host",
        str(config.engines_per_host or config.engines),
        *metrics,
        *config.engine_args,
    )


def engine_metrics_port(config: StackConfig, index: int) -> int:
    """The port of engine ``index``'s Prometheus endpoint (``config.http_port`` set)."""
    assert config.http_port is not None
    return config.http_port + 1 + index


@dataclass
class DevStack:
    """Starts and stops the whole stack; use as a context manager."""

    config: StackConfig
    redis_url: str = ""
    scheduler_address: str = ""
    engines: list[ManagedProcess] = field(default_factory=list)
    scheduler: ManagedProcess | None = None
    sim_fleet: ManagedProcess | None = None
    sim_engines: dict[str, str] = field(default_factory=dict)  # engine id -> address
    redis: EmbeddedRedis | None = None
    log_dir: Path = field(default_factory=Path)
    _tmp: tempfile.TemporaryDirectory[str] | None = None
    _scheduler_port: int = 0

    def __enter__(self) -> DevStack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        cfg = self.config
        if cfg.run_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="rollserve-stack-")
            self.log_dir = Path(self._tmp.name)
        else:
            self.log_dir = cfg.run_dir
            self.log_dir.mkdir(parents=True, exist_ok=True)
        if cfg.redis_url is None:
            self.redis = EmbeddedRedis()
            self.redis.start()
            self.redis_url = self.redis.url
            if self.control_plane_nice and self.redis.pid is not None:
                renice_threads(self.control_plane_nice, self.redis.pid)
        else:
            self.redis_url = cfg.redis_url
        if cfg.sim_profile is not None:
            self.start_sim_fleet(cfg.sim_profile)
            self.start_scheduler()
            return
        threads = cfg.omp_threads or engine_threads(cfg.engines)
        for i in range(cfg.engines):
            self.engines.append(
                launch_engine(
                    cfg.model,
                    f"engine-{i}",
                    self.log_dir,
                    engine_flags(cfg, i),
                    env={"OMP_NUM_THREADS": str(threads)},
                )
            )
        for proc in self.engines:  # they load in parallel
            wait_serving(proc.address, _ENGINE_START_TIMEOUT_S, proc)
        self.start_scheduler()

    def start_sim_fleet(self, profile: str, restart: int = 0) -> None:
        """The stack's engines, simulated in one process; their addresses once all serve."""
        from rollserve.sim.server import ENGINE_LINE_PREFIX, READY_PREFIX

        cfg = self.config
        log_file = self.log_dir / "sim-fleet.log"
        start = log_file.stat().st_size if restart and log_file.exists() else 0  # (this start's)
        self.sim_fleet = ManagedProcess.start(
            "sim-fleet",
            [
                sys.executable,
                "-m",
                "rollserve.sim",
                "fleet",
                "--engines",
                str(cfg.engines),
                "--profile",
                profile,
                "--time-scale",
                str(cfg.sim_time_scale),
            ],
            self.log_dir,
            restart=restart,
        )
        deadline = time.monotonic() + _SIM_START_TIMEOUT_S
        while READY_PREFIX not in (log := self._log_since(self.sim_fleet, start)):
            if self.sim_fleet.popen.poll() is not None or time.monotonic() > deadline:
                raise StackError(
                    f"the simulated engines did not start; log {self.sim_fleet.log_path}:\n"
                    f"{self.sim_fleet.log_tail()}"
                )
            time.sleep(0.1)
        line = re.compile(rf"^{ENGINE_LINE_PREFIX} engine_id=(\S+) address=(\S+)$", re.M)
        self.sim_engines = dict(line.findall(log))
        if len(self.sim_engines) != cfg.engines:
            raise StackError(
                f"the simulated engines said {len(self.sim_engines)} addresses of "
                f"{cfg.engines}; log {self.sim_fleet.log_path}:\n{self.sim_fleet.log_tail()}"
            )

    @staticmethod
    def _log_since(proc: ManagedProcess, offset: int) -> str:
        """What ``proc`` wrote to its log from byte ``offset`` on (this start's, after a
        restart)."""
        with contextlib.suppress(OSError), proc.log_path.open("rb") as log:
            log.seek(offset)
            return log.read(1 << 22).decode(errors="replace")
        return ""

    def start_scheduler(self, restart: int = 0) -> None:
        cfg = self.config
        # (the port it took first, when restarted: its clients know that one)
        port = self._scheduler_port = self._scheduler_port or cfg.scheduler_port or free_port()
        endpoints = [f"--engine={p.name}={p.address}" for p in self.engines]
        endpoints += [f"--engine={e}={address}" for e, address in self.sim_engines.items()]
        self.scheduler = ManagedProcess.start(
            "scheduler",
            [
                sys.executable,
                "-m",
                "rollserve.scheduler",
                "--port",
                str(port),
                "--redis-url",
                self.redis_url,
                "--tokenizer",
                str(cfg.model),
                *endpoints,
                "--nice",
                str(self.control_plane_nice),
                # (rl's cost model then is the simulated engines')
                *(() if cfg.sim_profile is None else ("--cost-profile", cfg.sim_profile)),
                *(() if cfg.http_port is None else ("--http-port", str(cfg.http_port))),
                *cfg.scheduler_args,
            ],
            self.log_dir,
            restart=restart,
        )
        self.scheduler.address = f"127.0.0.1:{port}"
        self.scheduler_address = self.scheduler.address
        wait_serving(self.scheduler_address, _SCHEDULER_START_TIMEOUT_S, self.scheduler)

    def stop(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
            self.scheduler = None
        for proc in self.engines:
            proc.stop()
        self.engines.clear()
        if self.sim_fleet is not None:
            self.sim_fleet.stop()
            self.sim_fleet = None
        self.sim_engines.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    @property
    def control_plane_nice(self) -> int:
        """The niceness of the control plane: none beside simulated engines, which are no
        model threads to give the CPU to (the scheduler would run behind the fleet)."""
        return 0 if self.config.sim_profile is not None else self.config.control_plane_nice

    def scheduler_pid(self) -> int:
        if self.scheduler is None:
            raise RuntimeError("the scheduler is not running")
        return self.scheduler.popen.pid

    def _processes(self) -> list[ManagedProcess]:
        return [*self.engines, *(p for p in (self.scheduler, self.sim_fleet) if p is not None)]

    def pids(self) -> list[int]:
        """Process ids of the stack's processes (the engines' cores are their children)."""
        redis = [self.redis.pid] if self.redis is not None and self.redis.pid else []
        return [p.popen.pid for p in self._processes()] + redis

    def restart(self, proc: ManagedProcess) -> None:
        """Starts ``proc`` (one of the stack's, exited) again as it was started. An engine
        and the scheduler keep their addresses: the scheduler's next probe finds the engine
        serving again, and a scheduler started again takes over the runs in Redis (once the
        lease of the one that died has ended: ``--lease-ttl-s``). The simulated engines come
        back at other ports, so the scheduler is started again with them (it does not wait
        for the lease: stopped, the old one gives it up). StackError if it cannot be
        started."""
        if proc is self.sim_fleet:
            assert self.config.sim_profile is not None
            self.start_sim_fleet(self.config.sim_profile, proc.next_restart())
            if self.scheduler is not None:  # (it did not exit: its count stays)
                self.scheduler.stop()
                self.start_scheduler(max(1, self.scheduler.restarts))
        elif proc is self.scheduler:
            self.scheduler = proc.restarted()
        else:
            index = next((i for i, p in enumerate(self.engines) if p is proc), None)
            if index is None:
                raise ValueError(f"{proc.name} is not a process of this stack")
            self.engines[index] = proc.restarted()

    def exited(self) -> ManagedProcess | None:
        """The first of the stack's processes that has exited (a scheduler that lost its
        lease, an engine that crashed), or None while all run."""
        return next((p for p in self._processes() if p.popen.poll() is not None), None)

    def describe(self) -> list[tuple[str, str]]:
        rows = [("redis", self.redis_url)]
        rows += [(p.name, p.address) for p in self.engines]
        if self.sim_engines:
            cfg = self.config
            first, *_ = self.sim_engines.values()
            rows.append(
                (
                    "engines",
                    f"{len(self.sim_engines)} SIMULATED ({cfg.sim_profile}, "
                    f"x{cfg.sim_time_scale:g} real time) from {first}",
                )
            )
        if self.scheduler is not None:
            rows.append(("scheduler", self.scheduler.address))
        rows.append(("logs", str(self.log_dir)))
        return rows
