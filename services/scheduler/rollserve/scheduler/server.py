"""The scheduler's gRPC edge: validates input, maps errors to status codes, serves."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import grpc
import redis.exceptions
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry
from rollserve.common.access import GrpcTokenCheck, ServerTls, TokenFile, http_token_check
from rollserve.common.grpc_options import PENDING_CALLS_OPTIONS
from rollserve.common.grpc_requests import RequestCheck
from rollserve.common.http import HttpServer, start_http
from rollserve.common.logs import configure_logging
from rollserve.scheduler.api import Refused, SchedulerApi
from rollserve.scheduler.core.policy import Policy, create_policy, policy_names
from rollserve.scheduler.core.predictor import PredictorSettings
from rollserve.scheduler.engines import CHANNEL_OPTIONS
from rollserve.scheduler.lease import LeaseHeld, LeaseLost
from rollserve.scheduler.metrics import status_registry
from rollserve.scheduler.rest import (
    OPEN_PATHS,
    RestApi,
    call_of,
    forbidden,
    json_errors,
    unauthenticated,
)
from rollserve.scheduler.runtime import SchedulerRuntime
from rollserve.scheduler.settings import EngineEndpoint, SchedulerSettings
from rollserve.scheduler.store import Store
from rollserve.scheduler.validation import MAX_SUBMIT_PROMPT_TOKENS
from rollserve.v1 import rollserve_pb2 as pb
from rollserve.v1 import rollserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Scheduler"].full_name
_PREDICTOR_DEFAULTS = PredictorSettings()
Context = grpc.aio.ServicerContext[Any, Any]
_Response = TypeVar("_Response")


class SchedulerServicer(pb_grpc.SchedulerServicer):
    """The ``Scheduler`` service over gRPC: each call is `SchedulerApi`'s, a refusal the
    abort of its status code."""

    def __init__(self, api: SchedulerApi) -> None:
        self._api = api

    async def Submit(self, request: pb.SubmitRequest, context: Context) -> pb.SubmitResponse:
        return await _answer(context, self._api.submit(request))

    async def Cancel(self, request: pb.CancelRequest, context: Context) -> pb.CancelResponse:
        return await _answer(context, self._api.cancel(request))

    async def DeleteRun(
        self, request: pb.DeleteRunRequest, context: Context
    ) -> pb.DeleteRunResponse:
        return await _answer(context, self._api.delete_run(request))

    async def Status(self, request: pb.StatusRequest, context: Context) -> pb.StatusResponse:
        return self._api.status()

    async def PublishVersion(
        self, request: pb.PublishVersionRequest, context: Context
    ) -> pb.PublishVersionResponse:
        return await _answer(context, self._api.publish_version(request))

    async def RegisterEngine(
        self, request: pb.RegisterEngineRequest, context: Context
    ) -> pb.RegisterEngineResponse:
        return await _answer(context, self._api.register_engine(request))

    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: Context
    ) -> pb.HeartbeatResponse:
        try:
            return self._api.heartbeat(request)
        except Refused as exc:
            await context.abort(exc.code, exc.message)
            raise  # (abort raises; this keeps the type checker told)


async def _answer(context: Context, call: Awaitable[_Response]) -> _Response:
    try:
        return await call
    except Refused as exc:
        await context.abort(exc.code, exc.message)
        raise  # (abort raises; this keeps the type checker told)


def load_tokenizer(model_dir: str) -> Callable[[str], list[int]]:
    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"tokenizer {model_dir!r} has no tokenizer.json")
    tokenizer = Tokenizer.from_file(str(path))

    def tokenize(text: str) -> list[int]:
        return list(tokenizer.encode(text).ids)

    return tokenize


async def serve(
    settings: SchedulerSettings,
    ready: Callable[[int], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Runs the scheduler until ``stop`` is set (or SIGTERM/SIGINT when it is None)."""
    store = Store.from_url(
        settings.redis_url,
        settings.stream_maxlen,
        settings.predictor_namespace,
        max_connections=settings.redis_max_connections,
    )
    try:
        await store.ping()
    except redis.exceptions.ConnectionError as exc:
        await store.close()
        raise SystemExit(f"redis_url {settings.redis_url!r} is unreachable: {exc}") from exc
    tokenize = load_tokenizer(settings.tokenizer) if settings.tokenizer else None
    runtime = SchedulerRuntime(settings, store, build_policy(settings), tokenize)
    try:
        await runtime.start()  # it closed the store if it raised
    except (LeaseHeld, LeaseLost) as exc:
        raise SystemExit(f"rollserve scheduler: {exc}") from exc

    tls, tokens = settings.server_tls(), settings.token_file()
    server = grpc.aio.server(
        options=(
            *(o for o in CHANNEL_OPTIONS if o[0] != "grpc.max_receive_message_length"),
            ("grpc.max_receive_message_length", settings.max_grpc_message_bytes),
            *PENDING_CALLS_OPTIONS,
        ),
        # (the request check first: the token check reads a scoped call's request)
        interceptors=(RequestCheck(), *(() if tokens is None else (GrpcTokenCheck(tokens),))),
    )
    api = SchedulerApi(runtime)
    pb_grpc.add_SchedulerServicer_to_server(SchedulerServicer(api), server)
    health_servicer = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    address = f"{settings.host}:{settings.port}"
    try:
        if tls is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, tls.grpc_credentials())
    except RuntimeError as exc:  # grpcio raises where it cannot bind
        await runtime.stop()
        raise SystemExit(f"port {settings.port}: could not bind {address}: {exc}") from exc
    rest = RestApi(api)
    try:
        http = await _serve_http(settings, runtime, rest, tls, tokens)
    except BaseException:
        await runtime.stop()
        raise
    await server.start()
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    print(
        f"rollserve-scheduler ready address={settings.host}:{port} "
        f"tls={'off' if tls is None else 'mutual' if tls.client_ca_file else 'on'} "
        f"tokens={'off' if tokens is None else len(tokens.names)}",
        flush=True,
    )
    if ready is not None:
        ready(port)

    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    stopped = asyncio.create_task(stop.wait())
    failed = asyncio.create_task(runtime.failed.wait())
    try:
        await asyncio.wait((stopped, failed), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        failed.cancel()
        rest.serving = False
        for service in ("", SERVICE_NAME):
            await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        # (the HTTP server answers 503 to new calls from now, as gRPC's takes none; both
        # drain what they run for the same grace)
        await asyncio.gather(
            server.stop(settings.shutdown_grace_s), *(() if http is None else (http.stop(),))
        )
        await runtime.stop()
    if runtime.lost is not None:
        raise SystemExit(f"rollserve scheduler: stopped: {runtime.lost}")
    if runtime.failed.is_set():
        raise SystemExit("the scheduler stopped after an internal error (see the log)")


async def _serve_http(
    settings: SchedulerSettings,
    runtime: SchedulerRuntime,
    rest: RestApi,
    tls: ServerTls | None,
    tokens: TokenFile | None,
) -> HttpServer | None:
    """The HTTP API and the Prometheus endpoint on ``settings.http_port``, serving, over
    ``tls`` (None: plaintext) and asking for ``tokens`` (None: none); None without a port."""
    if settings.http_port is None:
        return None

    def snapshot() -> CollectorRegistry:  # (on the loop: the runtime's state as it is now)
        return status_registry(runtime.status(), [h.copy() for h in runtime.histograms])

    server = HttpServer(
        snapshot,
        settings.host,
        settings.http_port,
        routes=rest.routes(),
        middlewares=(json_errors,)
        if tokens is None
        else (
            json_errors,
            http_token_check(tokens, OPEN_PATHS, unauthenticated, forbidden, call_of),
        ),
        ssl_context=None if tls is None else tls.ssl_context(),
        max_body_bytes=settings.max_http_body_bytes,
        drain_s=settings.shutdown_grace_s,
    )
    return await start_http(server, "scheduler", "http_port")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollserve scheduler", description="Run the scheduler.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument(
        "--http-port",
        "--metrics-port",
        type=int,
        help="serve the HTTP API (JSON, /v1/...) and Prometheus metrics (GET /metrics) on "
        "this port of --host (0: a free one)",
    )
    p.add_argument(
        "--max-grpc-message-bytes",
        type=int,
        default=64 * 2**20,
        help="largest gRPC message the server reads (larger: RESOURCE_EXHAUSTED, unparsed)",
    )
    p.add_argument(
        "--max-http-body-bytes",
        type=int,
        default=32 * 2**20,
        help="largest request body the HTTP API reads (larger: 413)",
    )
    p.add_argument(
        "--tls-cert-file",
        help="PEM certificate chain: the gRPC and HTTP servers take TLS connections only; "
        "read again when it changes (no restart to renew it)",
    )
    p.add_argument("--tls-key-file", help="PEM key of --tls-cert-file")
    p.add_argument(
        "--tls-client-ca-file",
        help="PEM CA certificates: callers must show a certificate one signed (mutual TLS)",
    )
    p.add_argument(
        "--auth-tokens-file",
        help="file of 'NAME:TOKEN [role=admin|trainer|engine|viewer] [runs=GLOB,...]' lines: "
        "calls must carry one as 'authorization: Bearer TOKEN' and stay within its role and "
        "runs (health checks, /metrics and /openapi.json excepted); read again when it changes "
        "(docs/access.md)",
    )
    p.add_argument(
        "--engine-token-file",
        help="file holding the token (alone) every call to the engines carries, for engines "
        "started with --auth-tokens-file; read again when it changes",
    )
    p.add_argument(
        "--engine-ca-file",
        help="PEM CA certificates that signed the engines' (engines started with "
        "--tls-cert-file): the engines are reached over TLS; read again when it changes",
    )
    p.add_argument(
        "--engine-cert-file",
        help="PEM certificate chain shown to engines that ask for one (engines started with "
        "--tls-client-ca-file: mutual TLS); needs --engine-key-file and --engine-ca-file; read "
        "again when it changes",
    )
    p.add_argument("--engine-key-file", help="PEM key of --engine-cert-file")
    p.add_argument(
        "--engine-tls-server-name",
        help="the name the engines' certificates carry, where it is not their addresses' host",
    )
    p.add_argument("--redis-url", required=True, help="e.g. redis://127.0.0.1:6379/0")
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="[ID=]HOST:PORT",
        help="an engine to use (repeatable)",
    )
    p.add_argument("--policy", default="least_outstanding", choices=policy_names())
    p.add_argument(
        "--cost-profile",
        help="the engines' step-cost profile for rl (cpu-tiny, gpu-h100-llama8b or a TOML file)",
    )
    p.add_argument("--tokenizer", help="model dir used to tokenize prompt_text")
    p.add_argument("--max-queued-groups", type=int, default=100_000)
    p.add_argument("--max-held-prompt-tokens", type=int, default=64 * 2**20)
    p.add_argument(
        "--max-submit-prompt-tokens",
        type=int,
        default=MAX_SUBMIT_PROMPT_TOKENS,
        help="prompt tokens in one Submit call (the scheduler checks and writes them at once)",
    )
    p.add_argument("--max-n", type=int, default=64)
    p.add_argument("--max-engines", type=int, default=4096)
    p.add_argument(
        "--forget-engine-after-s",
        type=float,
        default=300.0,
        help="a registered engine down and silent (no heartbeat) this long leaves the fleet",
    )
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument(
        "--plan-pace-from-s",
        type=float,
        default=0.02,
        help="a plan that took longer is followed by a wait as long (0.25 s at most): plans "
        "of a deep queue leave the scheduler time for its calls and Submits",
    )
    p.add_argument(
        "--no-fair-share",
        dest="fair_share",
        action="store_false",
        help="runs go in arrival order at each priority level, not each its share of the "
        "engines' slots while several have groups queued; the engines take calls in arrival "
        "order, not in fair-queuing order",
    )
    p.add_argument("--health-interval-s", type=float, default=1.0)
    p.add_argument(
        "--health-timeout-s",
        type=float,
        default=2.0,
        help="deadline of one probe (raise it for engines whose server answers late while "
        "they work, as a loaded CPU engine may)",
    )
    p.add_argument(
        "--health-failures",
        type=int,
        default=2,
        help="probes failed in a row that take an engine out of service (its work requeued)",
    )
    p.add_argument(
        "--health-watched-every",
        type=int,
        default=5,
        help="probe an engine whose health watch is open every this many health periods "
        "(status changes and exits come through the watch at once; the probe finds hangs)",
    )
    p.add_argument(
        "--weights-timeout-s",
        type=float,
        default=600.0,
        help="deadline of one engine's weight update (PublishVersion with a weights_path)",
    )
    p.add_argument(
        "--label-on-arrival",
        action="store_true",
        help="a publish without weights labels the tokens received from then on, without "
        "asking the engines what each sample had made (less exact)",
    )
    p.add_argument(
        "--forget-fleet-weights",
        action="store_true",
        help="forget the weights an earlier run published (kept in Redis; without this every "
        "engine that joins loads them): for a new experiment on the same Redis",
    )
    p.add_argument(
        "--lease-ttl-s",
        type=float,
        default=10.0,
        help="life of the scheduler's lease on its Redis database (one scheduler per database)",
    )
    p.add_argument(
        "--lease-wait-s",
        type=float,
        default=15.0,
        help="how long to wait at start for another scheduler's lease to end (0: fail at once)",
    )
    p.add_argument(
        "--nice", type=int, default=0, help="niceness of the scheduler (0-19; CPU engines first)"
    )
    p.add_argument(
        "--predictor-namespace",
        default="default",
        help="Redis namespace of the response-length history (one per model or experiment)",
    )
    p.add_argument(
        "--predictor-half-life-epochs",
        type=float,
        default=_PREDICTOR_DEFAULTS.half_life_epochs,
        help="epochs after which a response length counts half as much in predictions",
    )
    p.add_argument(
        "--predictor-default-len",
        type=int,
        default=_PREDICTOR_DEFAULTS.default_len,
        help="mean response length, tokens, predicted before any length is learnt (the "
        "first step of a new namespace): near your responses' mean, rl keeps short groups "
        "whole from the start",
    )
    p.add_argument(
        "--predictor-max-keys",
        type=int,
        default=_PREDICTOR_DEFAULTS.max_keys,
        help="prompt keys whose length history is kept (least recently used dropped)",
    )
    p.add_argument(
        "--predictor-reuse-tolerance",
        type=float,
        default=_PREDICTOR_DEFAULTS.reuse_tolerance,
        help="how far (log space) the length prior may drift before every queued group is "
        "predicted again; 0: after every finished group",
    )
    p.add_argument(
        "--earlier-outputs-per-prompt",
        type=int,
        default=64,
        help="finished outputs of each prompt kept to hand to engines that draft from them "
        "(--spec-method rollout) and did not make them (0: none)",
    )
    p.add_argument(
        "--no-earlier-outputs-push",
        dest="earlier_outputs_push",
        action="store_false",
        help="hand a finished output to other engines only with their next call of its "
        "prompt, not at once to those running its group's other samples",
    )
    p.add_argument(
        "--earlier-outputs-push-interval-s",
        type=float,
        default=1.0,
        help="an engine gets outputs pushed at most once this often (each push pauses a vLLM "
        "engine for about a step)",
    )
    p.add_argument(
        "--earlier-outputs-tokens",
        type=int,
        default=1 << 26,
        help="tokens of those outputs kept in all (the prompt used least recently goes first)",
    )
    p.add_argument(
        "--redis-max-connections",
        type=int,
        default=64,
        help="connections to Redis at most; more concurrent writes wait for one",
    )
    p.add_argument(
        "--keep-acked-entries",
        action="store_true",
        help="keep every stream entry (by default those every reader acknowledged are "
        "removed once --acked-retention-s old)",
    )
    p.add_argument(
        "--acked-retention-s",
        type=float,
        default=300.0,
        help="how long an entry every reader acknowledged stays in the stream",
    )
    p.add_argument(
        "--stream-maxlen",
        type=int,
        default=0,
        help="approximate cap of a run's stream, read or not (0: none; entries not yet read "
        "can be lost to it)",
    )
    p.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=5.0,
        help="on SIGTERM, how long calls in progress may finish once health says NOT_SERVING",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def build_policy(settings: SchedulerSettings) -> Policy:
    """The configured policy; ``rl`` with the engines' step costs when a profile is given."""
    if settings.policy == "rl" and settings.cost_profile is not None:
        from rollserve.scheduler.core.policies.rl import RLPolicy
        from rollserve.sim.profile import load_profile, rl_settings

        return RLPolicy(rl_settings(load_profile(settings.cost_profile)))
    return create_policy(settings.policy)


def settings_from_args(args: argparse.Namespace) -> SchedulerSettings:
    return SchedulerSettings(
        host=args.host,
        port=args.port,
        http_port=args.http_port,
        max_grpc_message_bytes=args.max_grpc_message_bytes,
        max_http_body_bytes=args.max_http_body_bytes,
        tls_cert_file=args.tls_cert_file,
        tls_key_file=args.tls_key_file,
        tls_client_ca_file=args.tls_client_ca_file,
        auth_tokens_file=args.auth_tokens_file,
        engine_token_file=args.engine_token_file,
        engine_ca_file=args.engine_ca_file,
        engine_cert_file=args.engine_cert_file,
        engine_key_file=args.engine_key_file,
        engine_tls_server_name=args.engine_tls_server_name,
        redis_url=args.redis_url,
        engines=tuple(EngineEndpoint.parse(text, i) for i, text in enumerate(args.engine)),
        policy=args.policy,
        cost_profile=args.cost_profile,
        redis_max_connections=args.redis_max_connections,
        earlier_outputs_per_prompt=args.earlier_outputs_per_prompt,
        earlier_outputs_push=args.earlier_outputs_push,
        earlier_outputs_push_interval_s=args.earlier_outputs_push_interval_s,
        earlier_outputs_tokens=args.earlier_outputs_tokens,
        tokenizer=args.tokenizer,
        max_queued_groups=args.max_queued_groups,
        max_held_prompt_tokens=args.max_held_prompt_tokens,
        max_submit_prompt_tokens=args.max_submit_prompt_tokens,
        max_n=args.max_n,
        max_engines=args.max_engines,
        forget_engine_after_s=args.forget_engine_after_s,
        max_model_len=args.max_model_len,
        capacity_factor=args.capacity_factor,
        plan_pace_from_s=args.plan_pace_from_s,
        fair_share=args.fair_share,
        trim_acked=not args.keep_acked_entries,
        acked_retention_s=args.acked_retention_s,
        stream_maxlen=args.stream_maxlen,
        health_interval_s=args.health_interval_s,
        health_timeout_s=args.health_timeout_s,
        health_failures=args.health_failures,
        health_watched_every=args.health_watched_every,
        weights_timeout_s=args.weights_timeout_s,
        forget_fleet_weights=args.forget_fleet_weights,
        label_on_arrival=args.label_on_arrival,
        lease_ttl_s=args.lease_ttl_s,
        lease_wait_s=args.lease_wait_s,
        nice=args.nice,
        shutdown_grace_s=args.shutdown_grace_s,
        predictor_namespace=args.predictor_namespace,
        predictor=PredictorSettings(
            half_life_epochs=args.predictor_half_life_epochs,
            max_keys=args.predictor_max_keys,
            default_len=args.predictor_default_len,
            reuse_tolerance=args.predictor_reuse_tolerance,
        ),
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level.upper(), "%(asctime)s scheduler %(levelname)s %(message)s")
    try:
        settings = settings_from_args(args)
    except ValueError as exc:  # pydantic's ValidationError is one
        print(f"rollserve scheduler: invalid settings:\n{exc}", file=sys.stderr)
        return 2
    if settings.nice and hasattr(os, "setpriority"):
        # Only this thread exists yet; every thread started later inherits its niceness.
        os.setpriority(os.PRIO_PROCESS, 0, max(settings.nice, os.getpriority(os.PRIO_PROCESS, 0)))
    asyncio.run(serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
