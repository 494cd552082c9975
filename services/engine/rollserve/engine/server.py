"""The engine process: gRPC server, model start-up, scheduler registration, clean shutdown.

Start-up order: bind the port and serve health as NOT_SERVING, import vLLM and load the model,
warm it up, switch health to SERVING, print the ready line, register with the scheduler.
Shutdown (SIGTERM or SIGINT): health NOT_SERVING, stop the gRPC server with a grace period
(running Generate calls may finish; the rest are cancelled, which aborts their vLLM requests),
shut vLLM down, then make sure no child process is left (vLLM's engine core runs in one).
When vLLM's engine core dies on its own, health goes NOT_SERVING and the process shuts down
the same way and exits with ENGINE_DIED_EXIT_CODE.

Children and abrupt death: vLLM's engine-core child does not notice its parent's death. On
Linux the engine core is started with PR_SET_PDEATHSIG (SIGKILL), so it dies with this
process even on SIGKILL; elsewhere, whoever starts the engine should start it in its own
process group (session) and kill that group.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import importlib
import logging
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any, Literal, get_args, get_origin

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from pydantic import ValidationError
from rollserve.client.credentials import NO_CREDENTIALS, SchedulerCredentials
from rollserve.common.access import GrpcTokenCheck
from rollserve.common.grpc_requests import RequestCheck
from rollserve.common.http import HttpServer, start_http
from rollserve.common.logs import configure_logging
from rollserve.v1 import rollserve_pb2 as pb
from rollserve.v1 import rollserve_pb2_grpc as pb_grpc

from .cpu_priority import renice_threads
from .service import SERVER_OPTIONS, EngineServicer, VllmBackend
from .settings import EngineSettings, apply_environment, choose_dtype, resolve_device

__all__ = [
    "ENGINE_SERVICE",
    "READY_PREFIX",
    "AioHealthServicer",
    "build_parser",
    "main",
    "parse_settings",
    "serve",
    "set_health",
    "stay_registered",
]

logger = logging.getLogger(__name__)

ENGINE_SERVICE: str = pb.DESCRIPTOR.services_by_name["Engine"].full_name
READY_PREFIX = "rollserve-engine ready"
"""Start of the line printed on stdout once the engine serves."""

CHILD_EXIT_TIMEOUT_S = 10.0
"""How long vLLM's children may take to exit after shutdown before they are killed."""
INTERRUPTED_CHILD_EXIT_TIMEOUT_S = 1.0
"""The same after a stop during the model load: the half-started engine core has nothing to
finish."""
ENGINE_CHECK_INTERVAL_S = 0.5
"""How often the process checks that vLLM's engine core is alive."""
ENGINE_DIED_EXIT_CODE = 3
"""Exit status when vLLM's engine core died (a supervisor should restart the engine)."""
SCHEDULER_RPC_TIMEOUT_S = 5.0
SCHEDULER_RETRY_MIN_S = 0.5
SCHEDULER_RETRY_MAX_S = 10.0
MIN_HEARTBEAT_INTERVAL_S = 0.05
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0

_PR_SET_PDEATHSIG = 1

# The asyncio health servicer (grpc_health.v1.health.aio); grpc-stubs does not describe it.
AioHealthServicer: Any = health.aio.HealthServicer  # type: ignore[attr-defined]


async def serve(settings: EngineSettings, ready: Callable[[int], None] | None = None) -> None:
    """Runs the engine until SIGTERM or SIGINT; `ready(port)` is called once it serves."""
    device = resolve_device(settings)
    apply_environment(settings, device)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    health_servicer = AioHealthServicer()
    engine_servicer = EngineServicer(settings.engine_id, settings.flush_interval_ms / 1000)
    tokens = settings.api_tokens()
    server = grpc.aio.server(
        options=SERVER_OPTIONS,
        # (the request check first: the token check reads a scoped call's request)
        interceptors=(RequestCheck(), *(() if tokens is None else (GrpcTokenCheck(tokens),))),
    )
    pb_grpc.add_EngineServicer_to_server(engine_servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (ENGINE_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    try:
        tls = settings.api_tls()
        port = (
            server.add_insecure_port(settings.address)
            if tls is None
            else server.add_secure_port(settings.address, tls.grpc_credentials())
        )
    except RuntimeError as exc:  # grpcio raises where it cannot bind
        raise SystemExit(f"port {settings.port}: could not bind {settings.address}: {exc}") from exc
    await set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    dtype = choose_dtype(settings, device)
    logger.info(
        "listening on %s; loading %s on %s (dtype %s)",
        settings.address,
        settings.model,
        device,
        dtype.dtype,
    )
    (logger.warning if dtype.slower else logger.info)("dtype %s: %s", dtype.dtype, dtype.why)

    backend: VllmBackend | None = None
    link: asyncio.Task[None] | None = None
    died = False
    children_exit_s = CHILD_EXIT_TIMEOUT_S
    metrics: HttpServer | None = None
    try:
        metrics = await serve_metrics(settings, health_servicer)
        # The import takes seconds and needs no event loop; model loading must run on this
        # thread (vLLM starts its engine-core child from the calling thread and binds its
        # output handler to the running loop), so it blocks the loop while it runs.
        await asyncio.to_thread(importlib.import_module, "vllm")
        await asyncio.sleep(0)  # a signal that came with the import's end sets stop first
        if stop.is_set():
            return
        _start_engine_core_with_parent_death_signal()
        try:
            with signals_interrupt_load(stop):
                backend = VllmBackend.create(settings, device)
        except LoadInterrupted as exc:
            logger.info("stopping: %s", exc)
            children_exit_s = INTERRUPTED_CHILD_EXIT_TIMEOUT_S
            return
        if settings.frontend_nice:
            # The engine core has started (with this process's priority): from now on the
            # threads of this process yield to it when they compete for a CPU.
            changed = renice_threads(settings.frontend_nice)
            logger.info("niceness %d on %d frontend threads", settings.frontend_nice, changed)
        if await warm_up_unless_stopped(backend, stop):
            engine_servicer.attach(backend)
            await set_health(health_servicer, health_pb2.HealthCheckResponse.SERVING)

            address = settings.advertised_address(port)
            print(f"{READY_PREFIX} engine_id={settings.engine_id} address={address}", flush=True)
            if ready is not None:
                ready(port)
            if settings.scheduler_address is not None:
                link = asyncio.create_task(
                    stay_registered(
                        settings.scheduler_address,
                        settings.engine_id,
                        address,
                        settings.scheduler_credentials,
                    ),
                    name="scheduler-link",
                )
            died = await _until_stop_or_death(stop, backend)
        else:
            died = backend.dead
        if died:
            # A dead engine core never serves again: say so to health checks (the scheduler
            # stops placing work here) and exit non-zero so a supervisor restarts the engine.
            logger.error("vLLM's engine core died; NOT_SERVING and exiting")
            await set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
        else:
            logger.info("stopping: draining for up to %.1f s", settings.shutdown_grace_s)
    finally:
        await health_servicer.enter_graceful_shutdown()
        if link is not None:
            link.cancel()
            # (whatever it ended with, the engine still stops its server and its vLLM)
            await asyncio.gather(link, return_exceptions=True)
        await server.stop(settings.shutdown_grace_s)
        if metrics is not None:
            await metrics.stop()
        engine_servicer.detach()
        if backend is not None:
            backend.shutdown()
        _reap_children(children_exit_s)
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        logger.info("stopped")
    if died:
        raise SystemExit(ENGINE_DIED_EXIT_CODE)


async def serve_metrics(
    settings: EngineSettings, health_servicer: AioHealthServicer | None = None
) -> HttpServer | None:
    """The Prometheus endpoint of ``settings.metrics_port``, serving this process's registry
    (where vLLM's stat logger keeps its ``vllm:`` metrics once the engine is built), and
    ``GET /healthz``: what ``health_servicer`` says of the engine (200 SERVING, else 503), in
    plaintext for probes that cannot speak to a gRPC port serving TLS. None without a port.
    A port that cannot be bound stops the engine, naming it."""
    if settings.metrics_port is None:
        return None
    from prometheus_client import REGISTRY

    async def healthz(request: web.Request) -> web.Response:
        status = "NOT_SERVING"
        if health_servicer is not None:
            try:
                reply = await health_servicer.Check(health_pb2.HealthCheckRequest(service=""), None)
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except Exception:  # (no status set yet: not serving)
                pass
        code = 200 if status == "SERVING" else 503
        return web.json_response({"status": status}, status=code)

    # (vLLM's metrics are prometheus_client's own, safe to read from the formatting thread)
    server = HttpServer(
        lambda: REGISTRY,
        settings.host,
        settings.metrics_port,
        routes=[web.get("/healthz", healthz)],
    )
    return await start_http(server, "engine")


class LoadInterrupted(BaseException):
    """A stop signal came while the model loaded (a BaseException, as KeyboardInterrupt is, so
    that vLLM's own ``except Exception`` clean-ups let it through)."""


@contextlib.contextmanager
def signals_interrupt_load(stop: asyncio.Event) -> Iterator[None]:
    """While the model loads, SIGTERM and SIGINT interrupt the load and set ``stop``.

    The load runs on the event loop's thread and blocks it (vLLM binds its output handler to
    the running loop), so the loop's own signal handlers wait for the load to end: seconds
    for a small model on a CPU, minutes for a large one on a GPU. A Python-level handler runs
    in this thread between bytecodes instead. vLLM's engine-core child dies with this process
    (``_run_engine_core``). The loop's handlers are back on leaving the block.
    """

    def interrupt(signum: int, _frame: object) -> None:
        stop.set()
        raise LoadInterrupted(f"{signal.Signals(signum).name} during the model load")

    previous = {
        signum: signal.signal(signum, interrupt) for signum in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


async def warm_up_unless_stopped(backend: VllmBackend, stop: asyncio.Event) -> bool:
    """Runs the backend's warm-up; False, the warm-up abandoned, if a stop came or the engine
    core died first. (A SIGTERM to the engine's process group also ends vLLM's engine core,
    and a warm-up request then waits forever: without this race the service never exits.)"""
    warm = asyncio.create_task(backend.warm_up(), name="warm-up")
    watch = asyncio.create_task(_until_stop_or_death(stop, backend), name="warm-up-watch")
    done, _ = await asyncio.wait({warm, watch}, return_when=asyncio.FIRST_COMPLETED)
    if warm in done:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
        warm.result()  # a warm-up that failed fails the start
        return True
    warm.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await warm
    logger.warning("warm-up abandoned: %s", "engine core died" if backend.dead else "stopping")
    return False


async def _until_stop_or_death(stop: asyncio.Event, backend: VllmBackend) -> bool:
    """Waits for ``stop``; True if vLLM's engine core died first."""
    while not stop.is_set():
        if backend.dead:
            return True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), ENGINE_CHECK_INTERVAL_S)
    return False


async def set_health(servicer: Any, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
    """Sets the serving status of the whole server and of the Engine service (the sim's engines
    share this code)."""
    for service in ("", ENGINE_SERVICE):
        await servicer.set(service, status)


def _heartbeat_period_s(told_ms: int, otherwise_s: float) -> float:
    """The heartbeat period a scheduler told (at least MIN_HEARTBEAT_INTERVAL_S);
    ``otherwise_s`` when it told none (0)."""
    return max(told_ms / 1000, MIN_HEARTBEAT_INTERVAL_S) if told_ms > 0 else otherwise_s


async def stay_registered(
    scheduler_address: str,
    engine_id: str,
    address: str,
    credentials: Callable[[], SchedulerCredentials] = lambda: NO_CREDENTIALS,
) -> None:
    """Registers with the scheduler and heartbeats, showing what ``credentials()`` gives;
    on failure logs, backs off, and registers again with ``credentials()`` called again (so a
    token file that was rotated counts from the next registration).

    Runs until cancelled; a scheduler that is down or restarting, or refuses the credentials,
    or credentials that cannot be read for a while, are never fatal to the engine.
    """
    retry_s = SCHEDULER_RETRY_MIN_S
    while True:
        try:
            shown = credentials()
        except ValueError as exc:  # (a file that cannot be read now: its error names it)
            logger.error(
                "scheduler %s: %s; registering again in %.1f s", scheduler_address, exc, retry_s
            )
            shown = None
        if shown is not None:
            async with shown.aio_channel(scheduler_address) as channel:
                stub = pb_grpc.SchedulerStub(channel)
                try:
                    reply = await stub.RegisterEngine(
                        pb.RegisterEngineRequest(engine_id=engine_id, address=address),
                        timeout=SCHEDULER_RPC_TIMEOUT_S,
                        metadata=shown.metadata,
                    )
                    interval_s = _heartbeat_period_s(
                        reply.heartbeat_interval_ms, DEFAULT_HEARTBEAT_INTERVAL_S
                    )
                    logger.info(
                        "registered with scheduler %s; heartbeat every %.2f s",
                        scheduler_address,
                        interval_s,
                    )
                    retry_s = SCHEDULER_RETRY_MIN_S
                    while True:
                        await asyncio.sleep(interval_s)
                        beat = await stub.Heartbeat(
                            pb.HeartbeatRequest(engine_id=engine_id),
                            timeout=SCHEDULER_RPC_TIMEOUT_S,
                            metadata=shown.metadata,
                        )
                        # The scheduler's fleet may have grown or shrunk since.
                        interval_s = _heartbeat_period_s(beat.heartbeat_interval_ms, interval_s)
                except grpc.aio.AioRpcError as exc:
                    logger.warning(
                        "scheduler %s: %s (%s); registering again in %.1f s",
                        scheduler_address,
                        exc.code().name,
                        exc.details(),
                        retry_s,
                    )
                except Exception:  # (a broken channel's own error): never the end of the link
                    logger.exception(
                        "scheduler %s: the link broke; registering again in %.1f s",
                        scheduler_address,
                        retry_s,
                    )
        await asyncio.sleep(retry_s)
        retry_s = min(retry_s * 2, SCHEDULER_RETRY_MAX_S)


# ---------------------------------------------------------------- command line

_FLAG_NAMES = {"enable_prefix_caching": "--prefix-caching"}
"""Flags whose name is not the field's (`--prefix-caching` / `--no-prefix-caching`)."""


def build_parser() -> argparse.ArgumentParser:
    """One flag per `EngineSettings` field; values are validated by the settings model."""
    parser = argparse.ArgumentParser(
        prog="python -m rollserve.engine",
        description="Serve one vLLM engine over the rollserve.v1.Engine gRPC API.",
        argument_default=argparse.SUPPRESS,
    )
    for name, field in EngineSettings.model_fields.items():
        flag = _FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
        default = "required" if field.is_required() else f"default: {field.default}"
        help_text = f"{field.description} ({default})"
        if field.annotation is bool:
            parser.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, help=help_text
            )
            continue
        choices = _literal_choices(field.annotation)
        parser.add_argument(flag, dest=name, metavar=name.upper(), choices=choices, help=help_text)
    return parser


def _literal_choices(annotation: Any) -> tuple[Any, ...] | None:
    """The values of a `Literal[...]` or `Literal[...] | None` field; None for other types."""
    if get_origin(annotation) is Literal:
        return get_args(annotation)
    literals = [arg for arg in get_args(annotation) if get_origin(arg) is Literal]
    return get_args(literals[0]) if len(literals) == 1 else None


def parse_settings(argv: list[str] | None = None) -> EngineSettings:
    """Settings from command-line arguments; raises pydantic's ValidationError."""
    values = vars(build_parser().parse_args(argv))
    return EngineSettings.model_validate(values)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m rollserve.engine`; returns the exit status."""
    try:
        settings = parse_settings(argv)
    except ValidationError as exc:
        print("rollserve-engine: invalid settings:", file=sys.stderr)
        for error in exc.errors():
            field = ".".join(str(part) for part in error["loc"])
            if not field:  # a check across settings: its message names them
                print(f"  {error['msg']}", file=sys.stderr)
                continue
            flag = _FLAG_NAMES.get(field, "--" + field.replace("_", "-"))
            given = f" (got {error['input']!r})" if error.get("input") else ""
            print(f"  {flag}: {error['msg']}{given}", file=sys.stderr)
        return 2
    configure_logging(logging.INFO, "%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(settings))
    except Exception:
        logger.exception("engine %s failed", settings.engine_id)
        return 1
    return 0


# ---------------------------------------------------------------- child processes

_ORIGINAL_ATTR = "_rollserve_unguarded_run_engine_core"


def _start_engine_core_with_parent_death_signal() -> None:
    """Makes vLLM start its engine-core process through `_run_engine_core`, which asks the
    kernel to kill it when this process dies (Linux only; a no-op elsewhere).

    vLLM starts `EngineCoreProc.run_engine_core` in a child process; with the spawn method
    the target is pickled by name, so pointing that attribute at a function of this module
    makes the child run it first. The original stays on the class under `_ORIGINAL_ATTR`.
    """
    if not sys.platform.startswith("linux"):
        return
    from vllm.v1.engine.core import EngineCoreProc

    if hasattr(EngineCoreProc, _ORIGINAL_ATTR):
        return
    original = getattr(EngineCoreProc, "run_engine_core", None)
    if original is None:
        logger.warning("vLLM has no EngineCoreProc.run_engine_core; engine core not guarded")
        return
    setattr(EngineCoreProc, _ORIGINAL_ATTR, staticmethod(original))
    EngineCoreProc.run_engine_core = staticmethod(_run_engine_core)


def _run_engine_core(*args: Any, **kwargs: Any) -> None:
    """Entry point of the engine-core child: die with the parent, then run vLLM's loop."""
    parent = multiprocessing.parent_process()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if parent is not None and os.getppid() != parent.pid:
        os._exit(1)  # the parent died before the signal was armed
    from vllm.v1.engine.core import EngineCoreProc

    # Forked: the class is patched and holds the original. Spawned: vLLM was imported afresh.
    run = getattr(EngineCoreProc, _ORIGINAL_ATTR, EngineCoreProc.run_engine_core)
    run(*args, **kwargs)


def _reap_children(timeout_s: float) -> None:
    """Waits for this process's children to exit and kills those that do not.

    multiprocessing's resource tracker is left alone: it exits when this process does.
    """
    import psutil

    children = [
        child
        for child in psutil.Process().children(recursive=True)
        if not _is_resource_tracker(child)
    ]
    if not children:
        return
    _, alive = psutil.wait_procs(children, timeout=timeout_s)
    for child in alive:
        logger.warning("child process %d outlived shutdown; killing it", child.pid)
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    psutil.wait_procs(alive, timeout=timeout_s)


def _is_resource_tracker(process: Any) -> bool:
    import psutil

    try:
        return any("resource_tracker" in part for part in process.cmdline())
    except psutil.Error:  # gone or inaccessible
        return False
