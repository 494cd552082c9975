"""The HTTP API's OpenAPI 3.1 document (``GET /openapi.json``), made from the proto's
descriptors as ``rest`` maps them (proto3's JSON mapping), so that it says what the server
takes and answers and cannot drift from it: a tool (Swagger UI, an OpenAPI client generator)
reads it as it is.

Each message is a schema of ``components/schemas`` named as in the proto. A request's
schema is what the parser takes: each field by its proto name or its lowerCamelCase one,
numbers as numbers or as text, enums by name or number, null for a field's default, and no
other property (the server refuses an unknown field). A response's is what the server
writes: every field without presence (required), by its proto name; 64-bit integers as
numbers, or as decimal strings beyond 2**53; enums by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor
from google.protobuf.message import Message
from rollserve.v1 import rollserve_pb2 as pb

__all__ = ["ROUTES", "Route", "openapi_document"]

_JSON = "application/json"


@dataclass(frozen=True)
class Route:
    """A call of the HTTP API: ``rest`` serves it, the document describes it."""

    method: str
    path: str
    summary: str
    request: type[Message] | None  # the body (the path's run_id goes into it); None: no body
    response: type[Message]
    call: str  # the method of ``SchedulerApi`` that carries it out
    body_required: bool = True  # (a request's body: may be left out where False)
    refusals: tuple[str, ...] = ("400", "409", "413", "422", "429", "503", "500")

    @property
    def rpc(self) -> str:
        """The name of the gRPC method it is (``publish_version``: ``PublishVersion``), which
        a token's role names (``rollserve.scheduler.roles``)."""
        return "".join(word.capitalize() for word in self.call.split("_"))


ROUTES: tuple[Route, ...] = (
    Route(
        "post",
        "/v1/runs/{run_id}/groups",
        "Submit prompt groups; each arrives on the run's Redis stream once its samples end",
        pb.SubmitRequest,
        pb.SubmitResponse,
        "submit",
    ),
    Route(
        "post",
        "/v1/runs/{run_id}/cancel",
        "Cancel groups of the run that are queued or running",
        pb.CancelRequest,
        pb.CancelResponse,
        "cancel",
    ),
    Route(
        "post",
        "/v1/runs/{run_id}/versions",
        "Publish the run's next policy version, with weights for the engines to load or not",
        pb.PublishVersionRequest,
        pb.PublishVersionResponse,
        "publish_version",
    ),
    Route(
        "delete",
        "/v1/runs/{run_id}",
        "End the run for good: cancel its groups, delete its streams and state in Redis",
        pb.DeleteRunRequest,
        pb.DeleteRunResponse,
        "delete_run",
        body_required=False,
        refusals=("400", "413", "422", "503", "500"),
    ),
    Route(
        "get",
        "/v1/status",
        "The queue, what runs, the engines and the length predictor",
        None,
        pb.StatusResponse,
        "status",
    ),
)

# Every refusal a call with a body may answer (rest.HTTP_STATUS and the server's own).
_REFUSALS = {
    "400": "the body is not JSON; or weights no engine could load (FAILED_PRECONDITION)",
    "409": "a group id the run has taken already (ALREADY_EXISTS)",
    "413": "the body is larger than the scheduler's --max-http-body-bytes",
    "422": "a field out of its bounds, unknown, or of another type (INVALID_ARGUMENT)",
    "429": "the scheduler's queue is full (RESOURCE_EXHAUSTED): retry later",
    "503": "Redis is unreachable or cannot take writes for now, the scheduler lost its lease, "
    "or it is stopping",
    "500": "a bug: the handler raised (its traceback is in the scheduler's log), or Redis "
    "refused a write no retry passes",
}

_UNAUTHENTICATED = (
    "no bearer token, or one the scheduler does not accept (only a scheduler started with "
    "--auth-tokens-file asks for one)"
)
_FORBIDDEN = (
    "the token's role does not take this call, or its runs= does not cover the path's run "
    "(PERMISSION_DENIED)"
)
_BEARER = {
    "type": "http",
    "scheme": "bearer",
    "description": "a token of the scheduler's --auth-tokens-file, where it was started with "
    "one; /healthz, /metrics and /openapi.json need none",
}

_INT32: dict[str, Any] = {"format": "int32", "minimum": -(2**31), "maximum": 2**31 - 1}
_UINT32: dict[str, Any] = {"format": "int32", "minimum": 0, "maximum": 2**32 - 1}
_INT64: dict[str, Any] = {"format": "int64"}
_INTEGERS = {
    FieldDescriptor.TYPE_INT32: _INT32,
    FieldDescriptor.TYPE_SINT32: _INT32,
    FieldDescriptor.TYPE_SFIXED32: _INT32,
    FieldDescriptor.TYPE_UINT32: _UINT32,
    FieldDescriptor.TYPE_FIXED32: _UINT32,
    FieldDescriptor.TYPE_INT64: _INT64,
    FieldDescriptor.TYPE_SINT64: _INT64,
    FieldDescriptor.TYPE_SFIXED64: _INT64,
    FieldDescriptor.TYPE_UINT64: _INT64,
    FieldDescriptor.TYPE_FIXED64: _INT64,
}
_FLOATS = {FieldDescriptor.TYPE_FLOAT: "float", FieldDescriptor.TYPE_DOUBLE: "double"}
_OTHERS: dict[int, dict[str, Any]] = {
    FieldDescriptor.TYPE_BOOL: {"type": "boolean"},
    FieldDescriptor.TYPE_STRING: {"type": "string"},
    FieldDescriptor.TYPE_BYTES: {"type": "string", "contentEncoding": "base64"},
}
# What proto3's JSON parser takes as a number in a string ("1e3" is an integer to it)
# Numbers as text, as protobuf's JSON parser reads them (Python's int() and float(): a sign,
# a dot with digits on either side, an exponent); an integer's text must have an integer's
# value ("2.0", "1e2"), which no pattern says.
_NUMBER_TEXT = "[-+]?([0-9]+[.]?[0-9]*|[.][0-9]+)([eE][-+]?[0-9]+)?"
_INTEGER_TEXT = f"^{_NUMBER_TEXT}$"
_FLOAT_TEXT = f"^(NaN|-?Infinity|{_NUMBER_TEXT})$"


def openapi_document(version: str) -> dict[str, Any]:
    """The document of the API that scheduler ``version`` serves."""
    schemas: dict[str, Any] = {"Error": _ERROR}
    paths: dict[str, Any] = {}
    for route in ROUTES:
        path = route.path
        response = cast(Descriptor, route.response.DESCRIPTOR)
        request = None if route.request is None else cast(Descriptor, route.request.DESCRIPTOR)
        operation: dict[str, Any] = {
            "summary": route.summary,
            "operationId": route.call,
            "responses": {"200": {"description": "done", "content": _content(response.name)}},
        }
        _add_schema(response, schemas, closed=False)
        if request is not None:
            _add_schema(request, schemas, closed=True)
            operation["parameters"] = [_RUN_ID]
            operation["requestBody"] = {
                "required": route.body_required,
                "content": _content(request.name),
            }
            for status in route.refusals:
                why = _REFUSALS[status]
                operation["responses"][status] = {"description": why, "content": _content("Error")}
        else:
            operation["responses"]["503"] = {
                "description": "the scheduler is stopping",
                "content": _content("Error"),
            }
        operation["responses"]["401"] = {
            "description": _UNAUTHENTICATED,
            "content": _content("Error"),
        }
        operation["responses"]["403"] = {"description": _FORBIDDEN, "content": _content("Error")}
        operation["security"] = [{}, {"bearer": []}]  # (a token where the scheduler asks one)
        paths.setdefault(path, {})[route.method] = operation
    paths["/healthz"] = {"get": _HEALTH}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "rollserve scheduler",
            "version": version,
            "description": "The Scheduler service's calls as JSON (proto3's JSON mapping of "
            "proto/rollserve/v1/rollserve.proto); docs/http-api.md says more.",
        },
        "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": {"bearer": _BEARER}},
    }


def _add_schema(message: Descriptor, schemas: dict[str, Any], *, closed: bool) -> None:
    """``message``'s schema and those of the messages it holds, into ``schemas``: a request's
    (``closed``) as the parser takes it, a response's as the server writes it."""
    if message.name in schemas:
        if schemas[message.name].get("additionalProperties", True) is not (not closed):
            raise ValueError(f"{message.name} is both a request's and a response's")
        return
    properties: dict[str, Any] = {}
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if closed:
        schema["additionalProperties"] = False
    else:  # (the server writes every field without presence, each by its proto name)
        schema["required"] = [f.name for f in message.fields if not f.has_presence]
    schemas[message.name] = schema
    for field in message.fields:
        properties[field.name] = _field_schema(field, schemas, closed=closed)
        if closed and field.json_name != field.name:  # (the parser takes either name)
            properties[field.json_name] = properties[field.name]


def _field_schema(field: FieldDescriptor, schemas: dict[str, Any], *, closed: bool) -> Any:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        value = field.message_type.fields_by_name["value"]
        schema = {"type": "object", "additionalProperties": _one(value, schemas, closed=closed)}
    elif field.is_repeated:
        schema = {"type": "array", "items": _one(field, schemas, closed=closed)}
    else:
        schema = _one(field, schemas, closed=closed)
    # (the parser takes null for any field: its default)
    return {"anyOf": [schema, {"type": "null"}]} if closed else schema


def _one(field: FieldDescriptor, schemas: dict[str, Any], *, closed: bool) -> Any:
    if field.message_type is not None:
        _add_schema(field.message_type, schemas, closed=closed)
        return {"$ref": f"#/components/schemas/{field.message_type.name}"}
    if field.enum_type is not None:
        return _enum(field.enum_type, closed=closed)
    if field.type in _INTEGERS:
        bounds = _INTEGERS[field.type]
        is_64 = bounds is _INT64
        if closed or is_64:  # (taken as text; written as text beyond 2**53)
            return {"type": ["integer", "string"], "pattern": _INTEGER_TEXT, **bounds}
        return {"type": "integer", **bounds}
    if field.type in _FLOATS:
        schema: dict[str, Any] = {"type": "number", "format": _FLOATS[field.type]}
        return schema | {"type": ["number", "string"], "pattern": _FLOAT_TEXT} if closed else schema
    return dict(_OTHERS[field.type])


def _enum(enum: EnumDescriptor, *, closed: bool) -> dict[str, Any]:
    names: list[Any] = [v.name for v in enum.values]
    if closed:  # (by name or number)
        return {"enum": names + [v.number for v in enum.values]}
    return {"type": "string", "enum": names}


def _content(schema: str) -> dict[str, Any]:
    return {_JSON: {"schema": {"$ref": f"#/components/schemas/{schema}"}}}


_RUN_ID = {
    "name": "run_id",
    "in": "path",
    "required": True,
    "description": "the run: its finished groups go to the Redis stream rollserve:{run_id}:groups",
    "schema": {"type": "string", "minLength": 1},
}

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "status", "message"],
            "properties": {
                "code": {"type": "integer", "description": "the HTTP status"},
                "status": {"type": "string", "description": "e.g. INVALID_ARGUMENT"},
                "message": {"type": "string", "description": "why; names the field and limit"},
            },
        }
    },
}

_HEALTH = {
    "summary": "Whether the scheduler serves (503 once it begins to stop)",
    "operationId": "healthz",
    "responses": {
        status: {
            "description": what,
            "content": {
                _JSON: {
                    "schema": {
                        "type": "object",
                        "properties": {"status": {"type": "string", "enum": [what]}},
                    }
                }
            },
        }
        for status, what in (("200", "SERVING"), ("503", "NOT_SERVING"))
    },
}
