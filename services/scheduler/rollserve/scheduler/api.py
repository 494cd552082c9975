"""The scheduler's calls, as its gRPC and HTTP edges both carry them out: each validates its
request, asks the runtime, and answers with the proto response or raises `Refused` with the
gRPC status code and a message that names the field and the limit. Nothing of a refused call
was done. The edges only translate: gRPC aborts with the code, HTTP answers the status that
``rest.HTTP_STATUS`` gives it."""

from __future__ import annotations

import asyncio

import grpc
import redis.exceptions
from rollserve.client.address import is_host_port
from rollserve.client.wire import (
    MAX_GROUP_ID_LEN,
    MAX_POLICY_VERSION,
    MAX_WEIGHTS_PATH_LEN,
    quoted,
    status_details,
    stream_key,
)
from rollserve.common.access import CALLER
from rollserve.scheduler.lease import LeaseLost
from rollserve.scheduler.runtime import (
    FleetFull,
    QueueFull,
    SchedulerRuntime,
    VersionBehind,
    WeightsNotLoaded,
)
from rollserve.scheduler.store import DuplicateGroup, may_pass_later
from rollserve.scheduler.validation import (
    ValidationError,
    submit_size,
    validate_run_id,
    validate_submit,
)
from rollserve.v1 import rollserve_pb2 as pb

MAX_ENGINE_ID_LEN = 128
# A Submit whose prompts pass this many characters (``submit_size``: a token id counts as
# several) is checked on a worker thread: about 10 ms of work and more.
_CHECKED_ON_THE_LOOP = 2**20


class Refused(Exception):
    """A call refused (or that cannot be carried out now): ``code`` is its gRPC status,
    ``message`` (already cut to ``status_details``'s length) says why."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = status_details(message)


class SchedulerApi:
    """The calls of the ``Scheduler`` service, on a runtime."""

    def __init__(self, runtime: SchedulerRuntime) -> None:
        self._runtime = runtime

    async def submit(self, request: pb.SubmitRequest) -> pb.SubmitResponse:
        try:
            limits, tokenize = self._runtime.limits(), self._runtime.tokenize
            if submit_size(request) > _CHECKED_ON_THE_LOOP:
                # Seconds of work for millions of tokens, which the event loop (renewing the
                # scheduler's lease, answering other calls) does not wait for.
                specs = await asyncio.to_thread(validate_submit, request, limits, tokenize)
            else:
                specs = validate_submit(request, limits, tokenize)
            await self._runtime.submit(request.run_id, specs)
        except REFUSALS as exc:
            raise refused(exc) from exc
        return pb.SubmitResponse(accepted=len(specs), stream=stream_key(request.run_id))

    async def cancel(self, request: pb.CancelRequest) -> pb.CancelResponse:
        _check_run_id(request.run_id)
        if not request.group_ids:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "group_ids is empty")
        limit = self._runtime.settings.max_groups_per_submit
        if len(request.group_ids) > limit:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"group_ids has {len(request.group_ids)} ids; the limit per call is {limit} "
                "(max_groups_per_submit)",
            )
        if any(not g for g in request.group_ids):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "group_ids holds an empty id")
        longest = max(len(g) for g in request.group_ids)
        if longest > MAX_GROUP_ID_LEN:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"group_ids holds an id of {longest} characters; the limit is {MAX_GROUP_ID_LEN}",
            )
        try:
            # (an id given twice is one group, answered once)
            ids = list(dict.fromkeys(request.group_ids))
            cancelled, unknown = await self._runtime.cancel(request.run_id, ids)
        except REFUSALS as exc:
            raise refused(exc) from exc
        return pb.CancelResponse(cancelled=cancelled, unknown=unknown)

    def status(self) -> pb.StatusResponse:
        """The runtime's status; to a caller whose token is limited to runs, with only those
        runs in ``runs`` (the fleet and the queue's totals stay whole)."""
        status = self._runtime.status()
        caller = CALLER.get()
        if caller is not None and caller.runs:
            shown = [run for run in status.runs if caller.covers(run.run_id)]
            del status.runs[:]
            status.runs.extend(shown)
        return status

    async def delete_run(self, request: pb.DeleteRunRequest) -> pb.DeleteRunResponse:
        _check_run_id(request.run_id)
        try:
            cancelled, existed = await self._runtime.delete_run(request.run_id)
        except REFUSALS as exc:
            raise refused(exc) from exc
        return pb.DeleteRunResponse(cancelled=cancelled, existed=existed)

    async def publish_version(self, request: pb.PublishVersionRequest) -> pb.PublishVersionResponse:
        _check_run_id(request.run_id)
        if not 0 <= request.version <= MAX_POLICY_VERSION:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"version ({request.version}) must be in 0..{MAX_POLICY_VERSION}",
            )
        if len(request.weights_path) > MAX_WEIGHTS_PATH_LEN:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"weights_path is {len(request.weights_path)} characters; "
                f"the limit is {MAX_WEIGHTS_PATH_LEN}",
            )
        if not request.weights_path.isprintable():
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"weights_path {quoted(request.weights_path)} holds a character that does not "
                "print (a newline, a NUL, a control character): no checkpoint folder's path "
                "has one",
            )
        try:
            published = await self._runtime.publish_version(
                request.run_id, request.version, request.weights_path
            )
        except REFUSALS as exc:
            raise refused(exc) from exc
        return pb.PublishVersionResponse(
            version=published.version,
            engines_updated=published.engines_updated,
            engines_failed=published.engines_failed,
        )

    async def register_engine(self, request: pb.RegisterEngineRequest) -> pb.RegisterEngineResponse:
        engine_id = request.engine_id
        if not 0 < len(engine_id) <= MAX_ENGINE_ID_LEN or not engine_id.isprintable():
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"engine_id {quoted(engine_id)} must be 1 to {MAX_ENGINE_ID_LEN} printable "
                "characters (it names the engine in logs and metrics)",
            )
        if not is_host_port(request.address):
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"address {quoted(request.address)} is not host:port (a host name, an IPv4 "
                "address or a bracketed IPv6 one) with a port in 1..65535",
            )
        try:
            await self._runtime.register_engine(request.engine_id, request.address)
        except REFUSALS as exc:
            raise refused(exc) from exc
        return pb.RegisterEngineResponse(
            heartbeat_interval_ms=self._runtime.heartbeat_interval_ms()
        )

    def heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        if not self._runtime.heartbeat(request.engine_id):
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"engine_id {quoted(request.engine_id)} is unknown: call RegisterEngine first",
            )
        return pb.HeartbeatResponse(heartbeat_interval_ms=self._runtime.heartbeat_interval_ms())


def _check_run_id(run_id: str) -> None:
    try:
        validate_run_id(run_id)
    except ValidationError as exc:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc


# What the runtime raises for a call it refuses (or cannot carry out now); `refused` gives
# each its status.
REFUSALS = (
    ValidationError,
    FleetFull,
    DuplicateGroup,
    VersionBehind,
    QueueFull,
    WeightsNotLoaded,
    LeaseLost,
    redis.exceptions.RedisError,
)


# The status of each kind of refusal but Redis's (``_redis_refused``); any other is
# INVALID_ARGUMENT.
_CODES: tuple[tuple[tuple[type[Exception], ...], grpc.StatusCode], ...] = (
    ((QueueFull, FleetFull), grpc.StatusCode.RESOURCE_EXHAUSTED),
    ((WeightsNotLoaded,), grpc.StatusCode.FAILED_PRECONDITION),
    ((LeaseLost,), grpc.StatusCode.UNAVAILABLE),
    # (a retry of a Submit whose answer was lost, often)
    ((DuplicateGroup,), grpc.StatusCode.ALREADY_EXISTS),
)


def refused(exc: Exception) -> Refused:
    """The `Refused` of one of ``REFUSALS``, its message kept."""
    if isinstance(exc, redis.exceptions.RedisError):
        return _redis_refused(exc)
    code = next((c for kinds, c in _CODES if isinstance(exc, kinds)), None)
    return Refused(code or grpc.StatusCode.INVALID_ARGUMENT, str(exc))


def _redis_refused(exc: redis.exceptions.RedisError) -> Refused:
    """UNAVAILABLE (retry) for an outage or a refusal of the moment (a timeout, out of
    memory, a replica a failover made read-only); INTERNAL for one no retry passes."""
    if isinstance(exc, redis.exceptions.ConnectionError):
        return Refused(grpc.StatusCode.UNAVAILABLE, f"Redis is unreachable: {exc}")
    if may_pass_later(exc):
        return Refused(grpc.StatusCode.UNAVAILABLE, f"Redis cannot take it now: {exc}")
    return Refused(grpc.StatusCode.INTERNAL, f"Redis refused it: {exc}")
