"""A service's HTTP server (aiohttp), on the event loop of the service that owns it: its Prometheus
endpoint, ``GET /metrics``, and the routes it is given. Each scrape takes a registry on that loop (a
snapshot of the service's state, or a registry safe to read from any thread) and formats it in
Prometheus's text format on a worker thread: at 512 engines the scheduler's formatting took 28 ms,
which the loop does not wait for.

Other paths answer 404, other methods 405, what is not HTTP 400 (aiohttp's answers); the metrics
route reads nothing from a request but its method and path. The scheduler serves its Status figures
this way (``rollserve.scheduler.metrics``) and its HTTP API on the same server (routes given to it,
``rollserve.scheduler.rest``); the engine vLLM's own metrics.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Middleware
from prometheus_client import CollectorRegistry, generate_latest
from rollserve.client.address import join_host_port

__all__ = ["CONTENT_TYPE", "HttpServer", "Middleware", "Snapshot", "start_http"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LEAST_DRAIN_S = 0.01

log = logging.getLogger(__name__)


class _ClientErrorsAtDebug(logging.Filter):
    """aiohttp logs a request it cannot parse with its traceback at ERROR, though it is the
    client's fault (answered 400) and a scanner sends thousands: those go at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return log.isEnabledFor(logging.DEBUG)


log.addFilter(_ClientErrorsAtDebug())


Snapshot = Callable[[], CollectorRegistry]
"""Called on the event loop at each scrape; what it returns is formatted on another thread,
so it must not read the service's live state then."""


class HttpServer:
    """``GET /metrics`` on ``host:port`` (0 picks a free port), each scrape formatting what
    ``snapshot()`` returns (see `Snapshot`); and ``routes`` besides, through ``middlewares``,
    which read bodies of ``max_body_bytes`` at most (larger ones answer 413). ``stop`` waits
    ``drain_s`` at most for requests in progress (then cancels them). With ``ssl_context``
    it takes HTTPS only."""

    def __init__(
        self,
        snapshot: Snapshot,
        host: str,
        port: int,
        *,
        routes: Sequence[web.RouteDef] = (),
        middlewares: Sequence[Middleware] = (),
        max_body_bytes: int = 1024**2,
        drain_s: float = 5.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._snapshot = snapshot
        self.host = host
        self.wanted_port = port  # (0: a free one)
        # Handlers running (their requests' bodies may still be arriving) -> their tasks.
        self._running: dict[asyncio.Task[object], None] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._drain_s = drain_s
        app = web.Application(
            middlewares=(self._counted, *middlewares), client_max_size=max_body_bytes
        )
        app.router.add_get("/metrics", self._metrics)
        app.router.add_routes(routes)
        # (aiohttp takes a timeout of 0 as none at all: "no grace" is the least it waits)
        drain = max(drain_s, _LEAST_DRAIN_S)
        self._runner = web.AppRunner(
            app, access_log=None, handle_signals=False, logger=log, shutdown_timeout=drain
        )
        self.port = 0  # the bound port, once started
        self._ssl_context = ssl_context
        self.scheme = "http" if ssl_context is None else "https"

    async def start(self) -> int:
        """Binds and serves; returns the port. Raises OSError when the port cannot be bound.
        ``host`` may be an IPv6 address, bracketed or not; ``::`` takes IPv4 too where the
        system can (as gRPC's ``[::]`` does)."""
        host = self.host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        dualstack = host == "::" and socket.has_dualstack_ipv6()
        await self._runner.setup()
        try:
            sock = socket.create_server(
                (host, self.wanted_port), family=family, dualstack_ipv6=dualstack
            )
        except BaseException:
            await self._runner.cleanup()
            raise
        sock.setblocking(False)
        self.port = int(sock.getsockname()[1])
        try:
            await web.SockSite(self._runner, sock, ssl_context=self._ssl_context).start()
        except BaseException:
            sock.close()
            await self._runner.cleanup()
            raise
        return self.port

    async def stop(self) -> None:
        """Stops taking connections, waits ``drain_s`` at most for the handlers running
        (a request whose body is still arriving among them), cancels those left, and closes
        every connection. (aiohttp's own shutdown reads nothing more of a connection once it
        begins: a body still arriving was never read, and its call went unanswered.)"""
        for site in list(self._runner.sites):
            await site.stop()
        if self._running:
            try:
                await asyncio.wait_for(self._idle.wait(), self._drain_s)
            except TimeoutError:
                for task in list(self._running):
                    task.cancel()
        await self._runner.cleanup()

    @web.middleware
    async def _counted(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._running[task] = None
        self._idle.clear()
        try:
            return await handler(request)
        finally:
            del self._running[task]
            if not self._running:
                self._idle.set()

    async def _metrics(self, request: web.Request) -> web.Response:
        body = await asyncio.to_thread(generate_latest, self._snapshot())
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def start_http(server: HttpServer, service: str, field: str = "metrics_port") -> HttpServer:
    """``server`` serving; its URL logged. A port that cannot be bound is a SystemExit naming
    ``field`` (the settings field that gave the port)."""
    try:
        bound = await server.start()
    except OSError as exc:
        raise SystemExit(
            f"{field} {server.wanted_port}: could not bind {server.host}: {exc}"
        ) from exc
    url = f"{server.scheme}://{join_host_port(server.host, bound)}"
    log.info("%s: Prometheus metrics at %s/metrics", service, url)
    return server
