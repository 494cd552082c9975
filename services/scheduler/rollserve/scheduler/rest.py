"""The scheduler's HTTP API: the ``Scheduler`` service's calls as JSON over HTTP, for
trainers and tools that speak no gRPC (curl, a notebook, a dashboard). Served with the
Prometheus endpoint on ``--http-port``.

Bodies and answers are the proto messages in proto3's JSON mapping, the one grpc-gateway and
Envoy's transcoder use, so that the HTTP and gRPC contracts cannot drift apart: field names
as in the proto (lowerCamelCase is taken too), 64-bit integers as numbers wherever a double
holds them exactly (as strings beyond 2**53), a field the message does not have refused.

    POST /v1/runs/{run_id}/groups    SubmitRequest (its run_id the path's)  SubmitResponse
    POST /v1/runs/{run_id}/cancel    CancelRequest                          CancelResponse
    POST /v1/runs/{run_id}/versions  PublishVersionRequest                  PublishVersionResponse
    DELETE /v1/runs/{run_id}         DeleteRunRequest (no body needed)      DeleteRunResponse
    GET  /v1/status                                                         StatusResponse
    GET  /healthz                    {"status": "SERVING"}, or 503 "NOT_SERVING" while stopping
    GET  /openapi.json               the OpenAPI 3.1 document of these (``openapi``)

Once the scheduler begins to stop, calls answer 503 (as gRPC takes no new call then).
A scheduler with a tokens file answers 401 to a call without one of its tokens in
``Authorization: Bearer``, but for the paths of ``OPEN_PATHS``, and 403 to a call its token's
role or runs do not cover (``call_of`` says which call a request makes); one with TLS takes
HTTPS only.

A body may leave ``run_id`` out; one that gives it must give the path's. Engines register
over gRPC only (they speak it anyway).

Every refusal answers ``{"error": {"code": HTTP status, "status": name, "message": why}}``.
A call the API refuses gets the HTTP status of its gRPC code (``HTTP_STATUS``: 422 for an
invalid argument, 429 for a full queue, 409 for a group already submitted, 503 while Redis
or the lease is lost, or Redis takes no writes for now) and the gRPC message, which names the
field and the limit. A body that is not JSON answers 400, one over the settings'
``max_http_body_bytes`` 413, one whose JSON the message cannot take (an unknown field, a
string for a number) 422, naming the field. Nothing of a refused call was done.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any, TypeVar, cast

import grpc
from aiohttp import web
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from rollserve.client.wire import status_details
from rollserve.scheduler.api import Refused, SchedulerApi
from rollserve.scheduler.openapi import ROUTES, Route, openapi_document
from rollserve.v1 import rollserve_pb2 as pb

__all__ = ["HTTP_STATUS", "RestApi", "json_errors"]

log = logging.getLogger(__name__)

# The HTTP status of each gRPC code a call of the API may be refused with.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: HTTPStatus.UNPROCESSABLE_ENTITY,
    grpc.StatusCode.ALREADY_EXISTS: HTTPStatus.CONFLICT,
    grpc.StatusCode.RESOURCE_EXHAUSTED: HTTPStatus.TOO_MANY_REQUESTS,
    grpc.StatusCode.FAILED_PRECONDITION: HTTPStatus.BAD_REQUEST,  # (as Google's APIs map it)
    grpc.StatusCode.UNAVAILABLE: HTTPStatus.SERVICE_UNAVAILABLE,
}

_Request = TypeVar("_Request", bound=Message)


class RestApi:
    """The routes of the HTTP API over ``api``; ``serving`` is what ``/healthz`` says (set
    False when the scheduler begins to stop)."""

    def __init__(self, api: SchedulerApi) -> None:
        self._api = api
        self.serving = True
        self._openapi = openapi_document(_version())
        # One large body decoded at a time: json.loads and protobuf hold the interpreter's
        # lock for a large body's whole decode (about a second at 32 MiB), and sixteen at
        # once on the worker threads left the event loop none for 7 s, past the scheduler's
        # lease; one at a time, it runs between them.
        self._decoding = asyncio.Semaphore(1)

    def routes(self) -> list[web.RouteDef]:
        """The API's calls (``openapi.ROUTES``, which the document describes), health and
        the document."""
        calls = [web.route(r.method.upper(), r.path, self._handler(r)) for r in ROUTES]
        return [
            *calls,
            web.get("/healthz", self._health),
            web.get("/openapi.json", self._openapi_document),
        ]

    def _handler(self, route: Route) -> Callable[[web.Request], Awaitable[web.Response]]:
        message = route.request
        if message is None:

            async def answer(request: web.Request) -> web.Response:
                if not self.serving:  # (as gRPC's Status, which a stopping server refuses)
                    return _error(
                        HTTPStatus.SERVICE_UNAVAILABLE, "UNAVAILABLE", "the scheduler is stopping"
                    )
                return await _json(getattr(self._api, route.call)())

        else:

            async def answer(request: web.Request) -> web.Response:
                return await self._call(request, message, getattr(self._api, route.call))

        return answer

    async def _call(
        self,
        request: web.Request,
        message: type[_Request],
        call: Callable[[_Request], Awaitable[Message]],
    ) -> web.Response:
        try:
            if not self.serving:  # (as gRPC, whose server takes no new call once stopping)
                raise Refused(grpc.StatusCode.UNAVAILABLE, "the scheduler is stopping")
            parsed = await _parse(request, message, self._decoding)
            return await _json(await call(parsed))
        except Refused as exc:
            status = HTTP_STATUS.get(exc.code, HTTPStatus.INTERNAL_SERVER_ERROR)
            return _error(status, exc.code.name, exc.message)

    async def _openapi_document(self, request: web.Request) -> web.Response:
        return web.json_response(self._openapi)

    async def _health(self, request: web.Request) -> web.Response:
        if self.serving:
            return web.json_response({"status": "SERVING"})
        return web.json_response({"status": "NOT_SERVING"}, status=HTTPStatus.SERVICE_UNAVAILABLE)


@web.middleware
async def json_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every error of the HTTP server as the API's JSON error: a route not there (404), a
    method it does not take (405), a body too large (413), and an exception a handler let
    out (500, logged with its traceback)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        phrase = HTTPStatus(exc.status).name if exc.status in _KNOWN else exc.reason
        response = _error(exc.status, phrase, exc.text or exc.reason)
        if exc.status == HTTPStatus.METHOD_NOT_ALLOWED and "Allow" in exc.headers:
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except Exception as exc:  # a bug: answered, logged, and the server goes on
        log.exception("%s %s failed", request.method, request.path)
        status = HTTPStatus.INTERNAL_SERVER_ERROR
        return _error(
            status, "INTERNAL", f"the scheduler failed: {type(exc).__name__} (see its log)"
        )


_KNOWN = {s.value for s in HTTPStatus}


def _version() -> str:
    try:
        return importlib.metadata.version("rollserve")
    except importlib.metadata.PackageNotFoundError:  # (run from a source tree)
        return "0+unknown"


async def _parse(
    request: web.Request, message: type[_Request], decoding: asyncio.Semaphore
) -> _Request:
    """The request's JSON body as ``message``, its ``run_id`` the path's, decoded on a
    worker thread (a large Submit takes a second or more, which the event loop, renewing
    the scheduler's lease, does not wait for), a large body at a time (``decoding``). Raises
    Refused (INVALID_ARGUMENT) for JSON the message cannot take, and the HTTP error itself
    for a body that is no JSON (400) or too large (413)."""
    try:
        body = await request.read()  # (raises 413 past the server's client_max_size)
    except web.RequestPayloadError as exc:  # (a gzip body that does not inflate)
        # (aiohttp then logs the error again, as it reads what is left of the body.)
        why = getattr(exc.__cause__, "message", None) or str(exc)
        raise web.HTTPBadRequest(text=status_details(f"the body cannot be read: {why}")) from exc
    except ConnectionResetError as exc:  # (no bug of the server's: nobody hears the answer)
        raise web.HTTPBadRequest(text="the client went away before its body was read") from exc
    run_id = request.match_info["run_id"]
    if len(body) < _LARGE_BODY_BYTES:  # (a Cancel waits for no large Submit's decode)
        return await asyncio.to_thread(_decode, body, message, run_id)
    async with decoding:
        return await asyncio.to_thread(_decode, body, message, run_id)


# A body from which on decodes go one at a time (1 MiB: some 150,000 prompt tokens, 30 ms).
_LARGE_BODY_BYTES = 1 << 20


class _DuplicateKey(ValueError):
    pass


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refused if it gives a key twice (json.loads keeps the last silently:
    ``"n": 100, "n": 1`` would sample 1)."""
    document = dict(pairs)
    if len(document) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return document


def _decode(body: bytes, message: type[_Request], run_id: str) -> _Request:
    try:
        document = json.loads(body, object_pairs_hook=_object) if body.strip() else {}
    except _DuplicateKey as exc:
        raise Refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the body gives the key {str(exc)[:80]!r} twice in one object; give it once",
        ) from exc
    except ValueError as exc:
        if "integer string conversion" not in str(exc):
            raise web.HTTPBadRequest(text=status_details(f"the body is not JSON: {exc}")) from exc
        # (JSON, with a number longer than any field takes: parsed by a hook, every
        # integer of a large Submit would cost a call of Python's)
        raise Refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            "the body holds an integer of more than 4,300 digits; no field takes one",
        ) from exc
    except RecursionError as exc:  # (no message of the API nests that deep)
        raise web.HTTPBadRequest(text="the body's JSON nests deeper than any call's") from exc
    if not isinstance(document, dict):
        raise Refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the body must be a JSON object (a {message.DESCRIPTOR.name}), not a "
            f"{type(document).__name__}",
        )
    if document.get("run_id") is not None and document.get("runId") is not None:
        raise Refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the body: {message.DESCRIPTOR.name}.run_id is given twice, also as runId; give "
            "it once (or not: the path names the run)",
        )
    for name in ("run_id", "runId"):
        given = document.pop(name, None)  # (null is the default, as protobuf reads it)
        if given is not None and given != run_id:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{name} {given!r} in the body is not the path's ({run_id!r}); give it once",
            )
    document["run_id"] = run_id
    # (the plain token lists out first: they hold no bool, and are not read twice)
    token_ids = _plain_token_ids(document)
    _check_fields(document, cast(Descriptor, message.DESCRIPTOR), message.DESCRIPTOR.name)
    parsed = message()
    try:
        json_format.ParseDict(document, parsed)
    except (json_format.ParseError, RecursionError) as exc:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"the body: {exc}") from exc
    if isinstance(parsed, pb.SubmitRequest):
        for index, ids in token_ids.items():
            parsed.groups[index].prompt_token_ids.extend(ids)
    return parsed


def _check_fields(document: dict[str, Any], message: Descriptor, where: str) -> None:
    """Refuses what protobuf's JSON parser would take unseen: a field given under both its
    names (``group_id`` and ``groupId``: it keeps one, silently), and true or false where
    the message has a number (taken as 1 and 0, so that ``"temperature": true`` would
    sample at 1.0)."""
    names = {name for field in message.fields for name in (field.name, field.json_name)}
    unknown = sorted(key for key in document if key not in names)
    if unknown:
        raise Refused(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the body: {where} has no field {unknown[0]!r}; its fields are "
            f"{', '.join(field.name for field in message.fields)} (or in camelCase)",
        )
    for field in message.fields:
        if field.name != field.json_name and field.name in document and field.json_name in document:
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the body: {where}.{field.name} is given twice, also as {field.json_name}; "
                "give it once",
            )
        for name in {field.name, field.json_name}:
            value = document.get(name)
            if value is None:
                continue
            path = f"{where}.{name}"
            if field.message_type is not None:
                if field.message_type.GetOptions().map_entry:  # (string keys and values)
                    _check_strings(value, path)
                    continue
                kind = field.message_type.name
                if field.is_repeated and not isinstance(value, list):
                    raise Refused(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"the body: {path} must be a list of {kind}, not {json.dumps(value)[:80]}",
                    )
                children = value if field.is_repeated else [value]
                for i, child in enumerate(children):
                    where_child = f"{path}[{i}]" if field.is_repeated else path
                    if isinstance(child, dict):
                        _check_fields(child, field.message_type, where_child)
                    elif not field.message_type.full_name.startswith("google.protobuf."):
                        # (well-known types, which JSON writes as text or numbers, aside)
                        raise Refused(
                            grpc.StatusCode.INVALID_ARGUMENT,
                            f"the body: {where_child} must be an object (a {kind}), not "
                            f"{json.dumps(child)[:80]}",
                        )
                continue
            if field.cpp_type == FieldDescriptor.CPPTYPE_BOOL or field.cpp_type in _TEXT:
                continue
            values = value if isinstance(value, list) else [value]
            if bool in set(map(type, values)):  # (50 ms a million tokens; a generator: 65)
                raise Refused(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"the body: {path} is a number, not {json.dumps(value)[:80]}",
                )


_TEXT = (FieldDescriptor.CPPTYPE_STRING,)


def _check_strings(value: object, path: str) -> None:
    """A map of strings (``metadata``): each value that is not a string refused by its key
    (protobuf's parser says only that one failed to parse)."""
    if not isinstance(value, dict):
        return  # (the parser refuses it, naming the field)
    for key, item in value.items():
        if not isinstance(item, str):
            raise Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the body: {path}[{json.dumps(key)[:80]}] is {json.dumps(item)[:80]}, not a "
                "string (its values are strings)",
            )


def _plain_token_ids(document: dict[str, Any]) -> dict[int, list[int]]:
    """Takes out of a Submit's groups each ``prompt_token_ids`` that is a list of plain
    int32 numbers, by group index, for the caller to put in the message at once: the bulk of
    a Submit, which protobuf's JSON parser reads a hundred times slower (1.45 s for a
    million tokens here). Any other value stays for the parser to take or refuse."""
    taken: dict[int, list[int]] = {}
    groups = document.get("groups")
    if not isinstance(groups, list):
        return taken
    for index, group in enumerate(groups):
        ids = group.get("prompt_token_ids") if isinstance(group, dict) else None
        if (
            isinstance(ids, list)
            and "promptTokenIds" not in group
            and set(map(type, ids)) <= {int}
            and (not ids or (min(ids) >= _INT32_MIN and max(ids) <= _INT32_MAX))
        ):
            taken[index] = group.pop("prompt_token_ids")
    return taken


_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


async def _json(response: Message) -> web.Response:
    """``response`` (a message of its own, not the scheduler's live state) as JSON, made on
    a worker thread: at 512 engines a Status takes 10 ms, which the event loop does not wait
    for (building the Status itself, on the loop, takes 1.8 ms)."""
    text = await asyncio.to_thread(_dumps, response)
    return web.Response(text=text, content_type="application/json")


def _dumps(response: Message) -> str:
    document = json_format.MessageToDict(
        response,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
        unquote_int64_if_possible=True,
    )
    return json.dumps(document)


OPEN_PATHS = frozenset({"/healthz", "/metrics", "/openapi.json"})
"""Paths answered without a token when the scheduler asks for one (probes, scrapers, tools)."""


def unauthenticated(reason: str) -> web.Response:
    """The answer to a call without an accepted token (401)."""
    return _error(HTTPStatus.UNAUTHORIZED, "UNAUTHENTICATED", reason)


def forbidden(reason: str) -> web.Response:
    """The answer to a call its token does not cover (403)."""
    return _error(HTTPStatus.FORBIDDEN, "PERMISSION_DENIED", reason)


_CALLS = {(route.method.upper(), route.path): route for route in ROUTES}


def call_of(request: web.Request) -> tuple[str, str | None] | None:
    """The call ``request`` makes, as a token's grant names it, and the run it names:
    (``Submit``, the path's run_id); None for a path that is no call of the API."""
    resource = request.match_info.route.resource
    method = "GET" if request.method == "HEAD" else request.method  # (aiohttp serves HEAD so)
    route = None if resource is None else _CALLS.get((method, resource.canonical))
    if route is None:
        return None
    return route.rpc, request.match_info.get("run_id")


def _error(status: int, name: str, message: str) -> web.Response:
    error: dict[str, Any] = {"code": int(status), "status": name, "message": message}
    return web.json_response({"error": error}, status=status)
