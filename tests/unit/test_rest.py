"""The scheduler's HTTP API (``rollserve.scheduler.rest``): a real scheduler (``serve``, on
the session's Redis, its HTTP port open) driven over HTTP as curl or a trainer without gRPC
would, beside its gRPC API. What each call answers, what each refusal answers and that it
names the field, and that no body crashes it (fuzzed as ``test_fuzz_api`` fuzzes gRPC).

Faked: the engine behind the scheduler (``fakes.FakeEngine``), and in two tests the API
behind the HTTP edge (they say so); the scheduler, its HTTP and gRPC servers and Redis are
real."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import socket
import struct
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, cast

import aiohttp
import grpc
import jsonschema
import openapi_spec_validator
import pytest
from google.protobuf import json_format
from rollserve.cli.stack import free_port
from rollserve.client.wire import stream_key
from rollserve.common.http import HttpServer
from rollserve.scheduler.api import SchedulerApi
from rollserve.scheduler.metrics import status_registry
from rollserve.scheduler.openapi import openapi_document
from rollserve.scheduler.rest import RestApi, json_errors
from rollserve.scheduler.server import serve
from rollserve.scheduler.settings import EngineEndpoint, SchedulerSettings
from rollserve.v1 import rollserve_pb2 as pb
from rollserve.v1 import rollserve_pb2_grpc as pb_grpc

from tests.served import served_scheduler
from tests.unit.fakes import FakeEngine
from tests.unit.fuzz import Campaign, field_names, json_bodies
from tests.unit.test_runtime import read_stream

TIMEOUT_S = 30.0
FUZZ = Campaign.from_env(count=300, seed=11)
# What an HTTP API may answer, whatever it is sent; 5xx (a handler raised) is not among them.
REFUSED = frozenset({400, 409, 413, 422, 429})


@dataclass(frozen=True)
class Served:
    url: str  # of the HTTP API
    http: aiohttp.ClientSession
    stub: Any  # the Scheduler service's gRPC stub
    task: asyncio.Task[None]  # serving

    async def call(self, method: str, path: str, body: object = None) -> tuple[int, Any]:
        """The status and the JSON of the answer to ``body`` (JSON; bytes sent as they are)."""
        data = body if isinstance(body, bytes) else None if body is None else json.dumps(body)
        async with self.http.request(method, f"{self.url}{path}", data=data) as reply:
            return reply.status, await reply.json()


@asynccontextmanager
async def scheduler(
    redis_url: str, engine: FakeEngine | None, **given: Any
) -> AsyncIterator[Served]:
    """A scheduler served as ``rollserve scheduler --http-port`` serves it, on ``engine``
    (none: what it takes stays queued)."""
    http_port = free_port()
    settings = SchedulerSettings(
        port=0,
        http_port=http_port,
        redis_url=redis_url,
        engines=()
        if engine is None
        else (EngineEndpoint(engine_id=engine.engine_id, address=engine.address),),
        health_interval_s=0.1,
        predictor_namespace=f"ns-{uuid.uuid4().hex[:10]}",
        shutdown_grace_s=0.0,
        **given,
    )
    async with (
        served_scheduler(settings, TIMEOUT_S) as served,
        grpc.aio.insecure_channel(f"127.0.0.1:{served.port}") as channel,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as http,
    ):
        yield Served(
            f"http://127.0.0.1:{http_port}", http, pb_grpc.SchedulerStub(channel), served.task
        )


def group(name: str, n: object = 2, **fields: Any) -> dict[str, Any]:
    """A valid group's JSON, ``fields`` changed."""
    return {
        "group_id": name,
        "prompt_token_ids": [5, 6, 7, 8],
        "n": n,
        "sampling": {"temperature": 1.0, "max_tokens": 8, "seed": 3},
        "prompt_key": "k0",
        "metadata": {"row": "0"},
        **fields,
    }


def fits(schema: str, instance: object) -> None:
    """Asserts ``instance`` fits schema ``schema`` of the served OpenAPI document."""
    root = {"$ref": f"#/components/schemas/{schema}", "components": DOCUMENT["components"]}
    jsonschema.Draft202012Validator(root).validate(instance)


DOCUMENT = openapi_document("test")
REQUESTS = {
    "groups": "SubmitRequest",
    "cancel": "CancelRequest",
    "versions": "PublishVersionRequest",
}


def test_the_openapi_document_is_valid_openapi_and_closes_requests() -> None:
    openapi_spec_validator.validate(DOCUMENT)
    served = {(r.method.lower(), r.path) for r in RestApi(cast(SchedulerApi, None)).routes()}
    documented = {(m, p) for p, calls in DOCUMENT["paths"].items() for m in calls}
    assert documented == served - {("get", "/openapi.json")}
    fits("SubmitRequest", {"groups": [group("a")]})
    # what proto3's JSON parser takes besides: lowerCamelCase names, numbers as text, null
    fits("SubmitRequest", {"runId": "r", "groups": [group("a", n="2", promptKey=None)]})
    fits("SubmitRequest", {"groups": [group("a", n="+2")]})  # (the parser takes both)
    fits("SubmitRequest", {"groups": [group("a", sampling={"max_tokens": 8, "top_p": "1."})]})
    with pytest.raises(jsonschema.ValidationError, match="nn"):  # as the server refuses it
        fits("SubmitRequest", {"groups": [group("a", nn=2)]})
    with pytest.raises(jsonschema.ValidationError):
        fits("SubmitRequest", {"groups": [group("a", n="two")]})


async def test_groups_submitted_over_http_are_delivered_and_the_status_is_grpcs(
    other_redis_url: str,
) -> None:
    engine = await FakeEngine("e0").start()
    try:
        async with scheduler(other_redis_url, engine) as api:
            status, answer = await api.call(
                "POST", "/v1/runs/http-run/groups", {"groups": [group("a"), group("b", n=3)]}
            )
            assert (status, answer) == (200, {"accepted": 2, "stream": stream_key("http-run")})
            fits("SubmitResponse", answer)
            delivered = await read_stream(other_redis_url, "http-run", 2)
            assert {g.group_id: len(g.samples) for g in delivered} == {"a": 2, "b": 3}
            # the status, as gRPC's: field names as in the proto, 64-bit counts as numbers
            status, answer = await api.call("GET", "/v1/status")
            want = await api.stub.Status(pb.StatusRequest(), timeout=TIMEOUT_S)
            assert status == 200
            assert answer["groups_delivered"] == want.groups_delivered == 2
            assert answer["tokens_generated"] == want.tokens_generated > 0
            assert json_format.ParseDict(answer, pb.StatusResponse()) == want
            fits("StatusResponse", answer)
            async with api.http.get(f"{api.url}/openapi.json") as reply:
                served = await reply.json()
            assert (served["paths"], served["components"]) == (
                DOCUMENT["paths"],
                DOCUMENT["components"],
            )
            assert [e["engine_id"] for e in answer["engines"]] == ["e0"]
            assert await api.call("GET", "/healthz") == (200, {"status": "SERVING"})
    finally:
        await engine.stop()


async def test_cancel_and_publish_over_http(other_redis_url: str) -> None:
    """(No engine: the groups stay queued until cancelled.)"""
    async with scheduler(other_redis_url, None) as api:
        groups = {"groups": [group("a"), group("b")]}
        assert (await api.call("POST", "/v1/runs/r/groups", groups))[0] == 200
        status, answer = await api.call(
            "POST", "/v1/runs/r/cancel", {"group_ids": ["a", "zz", "a", "zz"]}
        )
        # (an id given twice is answered once: "a" was listed twice as cancelled)
        assert (status, answer) == (200, {"cancelled": ["a"], "unknown": ["zz"]})
        fits("CancelResponse", answer)
        # lowerCamelCase names are taken too (proto3's JSON mapping), and run_id in the body
        # if it is the path's
        status, answer = await api.call(
            "POST", "/v1/runs/r/cancel", {"groupIds": ["b"], "runId": "r"}
        )
        assert (status, answer) == (200, {"cancelled": ["b"], "unknown": []})
        status, answer = await api.call("POST", "/v1/runs/r/versions", {"version": 3})
        assert (status, answer) == (200, {"version": 3, "engines_updated": 0, "engines_failed": []})
        fits("PublishVersionResponse", answer)
        status, answer = await api.call("POST", "/v1/runs/r/versions", {"version": 2})
        assert status == 422
        assert answer["error"]["status"] == "INVALID_ARGUMENT"
        assert "versions only go up" in answer["error"]["message"]


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        (
            "/v1/runs/r/groups",
            {"groups": [group("a", n=0)]},
            422,
            "n (0, or not given) must be at least 1",
        ),
        (
            "/v1/runs/r/groups",
            {"groups": [group("a", nn=2)]},
            422,
            "SubmitRequest.groups[0] has no field 'nn'; its fields are group_id,",
        ),
        (
            "/v1/runs/r/groups",
            {"groups": [group("a", metadata={"epoch": 3})]},
            422,
            'SubmitRequest.groups[0].metadata["epoch"] is 3, not a string',
        ),
        ("/v1/runs/r/groups", {"groups": [group("a", n="two")]}, 422, "Failed to parse n field"),
        ("/v1/runs/r/groups", {"groups": [group("a", n=2**40)]}, 422, "n field"),
        ("/v1/runs/r/groups", {"groups": [group("a", group_id=None)]}, 422, "group_id"),
        (
            "/v1/runs/r/groups",
            {"groups": [group("a", sampling={"temperature": True, "max_tokens": 8})]},
            422,
            "SubmitRequest.groups[0].sampling.temperature is a number, not true",
        ),
        ("/v1/runs/r/groups", {"groups": []}, 422, "groups"),
        ("/v1/runs/r/groups", {"run_id": "other", "groups": [group("a")]}, 422, "not the path's"),
        ("/v1/runs/r/groups", {"run_id": "r", "runId": "x", "groups": [group("a")]}, 422, "runId"),
        (
            "/v1/runs/r/groups",
            {"run_id": "r", "runId": "r", "groups": [group("a")]},
            422,
            "SubmitRequest.run_id is given twice, also as runId",
        ),
        ("/v1/runs/r/groups", [group("a")], 422, "must be a JSON object"),
        ("/v1/runs/r/groups", b"{not json", 400, "not JSON"),
        ("/v1/runs/r/groups", b"\xff\xfe", 400, "not JSON"),
        ("/v1/runs/r/groups", b"[" * 100_000 + b"]" * 100_000, 400, "nests deeper than any"),
        ("/v1/runs/" + "x" * 300 + "/groups", {"groups": [group("a")]}, 422, "run_id"),
        ("/v1/runs/r/cancel", {"group_ids": []}, 422, "group_ids is empty"),
        (
            "/v1/runs/r/cancel",
            {"group_ids": ["x" * 257]},
            422,
            "group_ids holds an id of 257 characters; the limit is 256",
        ),
        (
            "/v1/runs/r/cancel",
            {"group_ids": [f"g{i}" for i in range(10_001)]},
            422,
            "group_ids has 10001 ids; the limit per call is 10000 (max_groups_per_submit)",
        ),
        (
            "/v1/runs/r/groups",
            {"groups": [group("a", groupId="b")]},
            422,
            "SubmitRequest.groups[0].group_id is given twice, also as groupId; give it once",
        ),
        (
            "/v1/runs/r/groups",
            {"groups": [group("a", promptTokenIds=[9])]},
            422,
            "prompt_token_ids is given twice, also as promptTokenIds",
        ),
        ("/v1/runs/r/versions", {"version": -1}, 422, "version (-1)"),
        (
            "/v1/runs/r/versions",
            {"version": 1, "weights_path": "/x\n2026-12-08 scheduler CRITICAL forged"},
            422,
            "weights_path '/x\\n2026-12-08 scheduler CRITICAL forged' holds a character that",
        ),
        # (json.loads kept the last of a key given twice: n 1, silently)
        (
            "/v1/runs/r/groups",
            b'{"groups": [{"group_id": "a", "prompt_token_ids": [1], "n": 100, "n": 1}]}',
            422,
            "the body gives the key 'n' twice in one object",
        ),
        (
            "/v1/runs/r/groups",
            b'{"groups": [], "groups": [{"group_id": "a", "prompt_token_ids": [1], "n": 1}]}',
            422,
            "the key 'groups' twice",
        ),
        ("/v1/runs/r/groups", {"groups": {"a": 1}}, 422, "SubmitRequest.groups must be a list"),
        (
            "/v1/runs/r/groups",
            {"groups": [[1]]},
            422,
            "SubmitRequest.groups[0] must be an object (a PromptGroup), not [1]",
        ),
        # (Python converts at most 4,300 digits: this was a 400, "not JSON")
        (
            "/v1/runs/r/groups",
            b'{"groups": [{"group_id": "a", "prompt_token_ids": [1], "n": 1' + b"0" * 5000 + b"}]}",
            422,
            "the body holds an integer of more than 4,300 digits",
        ),
    ],
)
async def test_each_refusal_answers_its_status_and_names_the_field(
    other_redis_url: str, path: str, body: object, status: int, words: str
) -> None:
    async with scheduler(other_redis_url, None) as api:
        got, answer = await api.call("POST", path, body)
        assert got == status, answer
        assert answer["error"]["code"] == status
        assert words in answer["error"]["message"], answer
        fits("Error", answer)
        # nothing of it was done
        assert (await api.call("GET", "/v1/status"))[1]["queue_depth"] == 0


async def test_a_body_that_does_not_inflate_is_refused_and_a_null_run_id_is_the_paths(
    other_redis_url: str,
) -> None:
    async with scheduler(other_redis_url, None) as api:
        # (urllib, as curl: aiohttp's client reads no answer once the server closes)
        request = urllib.request.Request(
            f"{api.url}/v1/runs/r/groups",
            data=b"not gzip at all",
            headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        )

        def post() -> tuple[int, Any]:
            try:
                with urllib.request.urlopen(request, timeout=TIMEOUT_S) as reply:
                    return reply.status, json.loads(reply.read())
            except urllib.error.HTTPError as refused:
                return refused.code, json.loads(refused.read())

        status, answer = await asyncio.to_thread(post)
        assert status == 400, answer
        assert answer["error"]["message"] == (
            "the body cannot be read: Can not decode content-encoding: gzip"
        ), answer
        status, answer = await api.call(
            "POST", "/v1/runs/r/groups", {"run_id": None, "groups": [group("a")]}
        )
        assert status == 200 and answer["accepted"] == 1, answer


async def test_a_full_queue_a_duplicate_and_a_large_body_are_refused_as_http_says(
    other_redis_url: str,
) -> None:
    async with scheduler(
        other_redis_url, None, max_queued_groups=2, max_http_body_bytes=4096
    ) as api:
        assert (await api.call("POST", "/v1/runs/r/groups", {"groups": [group("a")]}))[0] == 200
        status, answer = await api.call("POST", "/v1/runs/r/groups", {"groups": [group("a")]})
        assert (status, answer["error"]["status"]) == (409, "ALREADY_EXISTS")
        assert (await api.call("POST", "/v1/runs/r/groups", {"groups": [group("b")]}))[0] == 200
        status, answer = await api.call("POST", "/v1/runs/r/groups", {"groups": [group("c")]})
        assert (status, answer["error"]["status"]) == (429, "RESOURCE_EXHAUSTED")
        assert "the queue holds 2 groups of at most 2" in answer["error"]["message"]
        big = {"groups": [group("d", prompt_token_ids=list(range(2000)))]}
        status, answer = await api.call("POST", "/v1/runs/r/groups", big)
        assert status == 413 and "4096" in answer["error"]["message"]
        # a route not there and a method not taken: JSON errors too
        status, answer = await api.call("GET", "/v1/nothing")
        assert (status, answer["error"]["status"]) == (404, "NOT_FOUND")
        async with api.http.get(f"{api.url}/v1/runs/r/groups") as reply:
            assert reply.status == 405 and reply.headers["Allow"] == "POST"
            assert (await reply.json())["error"]["status"] == "METHOD_NOT_ALLOWED"
        assert (await api.call("GET", "/v1/status"))[1]["queue_depth"] == 2


async def test_no_body_crashes_the_http_api(other_redis_url: str) -> None:
    engine = await FakeEngine("e0", step_s=0.001).start()
    try:
        async with scheduler(other_redis_url, engine, max_queued_groups=2_000) as api:
            calls = {
                "groups": pb.SubmitRequest(
                    groups=[json_format.ParseDict(group("g"), pb.PromptGroup())]
                ),
                "cancel": pb.CancelRequest(group_ids=["g0", "nope"]),
                "versions": pb.PublishVersionRequest(version=1),
            }
            seen: dict[str, dict[int, int]] = {}
            for offset, (route, valid) in enumerate(calls.items()):
                names = field_names(valid.DESCRIPTOR)  # as words ("n" is one), camelCase too
                names |= {re.sub(r"_([a-z])", lambda m: m.group(1).upper(), n) for n in names}
                names_a_field = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
                counts = seen.setdefault(route, {})
                rng = random.Random(FUZZ.seed + offset)
                for i, (body, what) in enumerate(json_bodies(valid, rng, FUZZ.count)):
                    where = f"{route} #{i} (seed {FUZZ.seed + offset}): {what}"
                    if FUZZ.trace:
                        print(where[:300], flush=True)
                    if route == "groups":  # fresh ids: refused for the change, not as a duplicate
                        fresh = f'"group_id": "g{uuid.uuid4().hex}"'.encode()
                        body = body.replace(b'"group_id": "g"', fresh)  # noqa: PLW2901
                    async with api.http.post(f"{api.url}/v1/runs/fuzz/{route}", data=body) as reply:
                        answer = await reply.json()
                        counts[reply.status] = counts.get(reply.status, 0) + 1
                        if reply.status == 200:  # the document takes what the server took
                            fits(REQUESTS[route], json.loads(body))
                            continue
                        assert reply.status in REFUSED, f"{where}: {reply.status} {answer}"
                        message = answer["error"]["message"]
                        # (one about the body as a whole names none; an unknown field's
                        # names the field sent)
                        whole = "the body must be a JSON object" in message
                        unknown = " has no field " in message
                        if reply.status == 422 and not whole and not unknown:
                            assert names_a_field.search(message), (
                                f"{where}: names no field: {message}"
                            )
                    assert not api.task.done(), "the scheduler stopped"
            print(seen)
            for route, counts in seen.items():
                assert counts.get(200, 0) > 0 and counts.get(422, 0) > 0, (route, counts)
            # and it still serves: a valid group of a new run is delivered
            status, _ = await api.call("POST", "/v1/runs/after/groups", {"groups": [group("last")]})
            assert status == 200
            [delivered] = await read_stream(other_redis_url, "after", 1)
            assert delivered.group_id == "last"
    finally:
        await engine.stop()


async def test_a_half_sent_body_does_not_hold_the_scheduler_past_its_grace(
    other_redis_url: str,
) -> None:
    """(aiohttp waits 60 s for a request in progress by default, and for ever given 0; the
    scheduler gives it its shutdown grace, 0 here: stopping must not wait for the body.)"""
    async with scheduler(other_redis_url, None) as api:
        host, port = api.url.removeprefix("http://").split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b'POST /v1/runs/r/groups HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"gro'
        )
        await writer.drain()
        assert (await api.call("GET", "/v1/status"))[0] == 200  # (its handler has started)
    # (left: serve() returned within the context's wait)
    assert api.task.done()
    writer.close()


async def test_a_client_that_goes_before_its_body_is_read_is_no_bug_of_the_server(
    other_redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that promised 1,000 bytes, sent 5 and reset its connection: logged as a
    bug (an ERROR with a traceback) before, which any client could fill the log with."""
    async with scheduler(other_redis_url, None) as api:
        host, port = api.url.removeprefix("http://").split(":")
        for _ in range(3):
            _, writer = await asyncio.open_connection(host, int(port))
            writer.write(
                b'POST /v1/runs/r/groups HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"gro'
            )
            await writer.drain()
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.close()  # (a reset, with SO_LINGER 0)
        assert (await api.call("GET", "/v1/status"))[0] == 200
        await asyncio.sleep(0.2)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


class FailingApi:
    """A SchedulerApi whose submit raises what no refusal is (a bug's exception)."""

    async def submit(self, request: pb.SubmitRequest) -> pb.SubmitResponse:
        raise RuntimeError("a bug")

    def status(self) -> pb.StatusResponse:
        return pb.StatusResponse(queue_depth=4)


@asynccontextmanager
async def rest_server(rest: RestApi) -> AsyncIterator[str]:
    """The scheduler's HTTP server over ``rest`` alone; yields its URL."""
    server = HttpServer(
        lambda: status_registry(pb.StatusResponse()),
        "127.0.0.1",
        0,
        routes=rest.routes(),
        middlewares=(json_errors,),
    )
    port = await server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await server.stop()


async def test_a_handlers_exception_is_a_json_500_and_the_server_serves_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Faked: the API behind the HTTP edge (``FailingApi``)."""
    rest = RestApi(cast(SchedulerApi, FailingApi()))
    async with rest_server(rest) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/runs/r/groups", json={"groups": [group("a")]}) as reply:
            assert reply.status == 500
            error = (await reply.json())["error"]
            assert error["status"] == "INTERNAL" and "RuntimeError" in error["message"]
        assert "a bug" in caplog.text  # (its traceback is in the log)
        async with http.get(f"{url}/v1/status") as reply:
            assert (await reply.json())["queue_depth"] == 4


async def test_calls_answer_503_once_the_scheduler_stops() -> None:
    """(``serve`` sets ``serving`` False as it begins to stop, before its servers drain.)
    Faked: the API behind the HTTP edge, which a stopping edge never reaches."""
    rest = RestApi(cast(SchedulerApi, FailingApi()))
    rest.serving = False
    async with rest_server(rest) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/runs/r/groups", json={"groups": [group("a")]}) as reply:
            assert reply.status == 503
            assert (await reply.json())["error"]["status"] == "UNAVAILABLE"
        async with http.get(f"{url}/v1/status") as reply:  # (it answered 200 until stopped)
            assert reply.status == 503
            assert (await reply.json())["error"]["message"] == "the scheduler is stopping"
        async with http.get(f"{url}/healthz") as reply:
            assert (reply.status, await reply.json()) == (503, {"status": "NOT_SERVING"})


async def test_register_engine_refuses_what_no_engine_is_named_or_found_at(
    other_redis_url: str,
) -> None:
    """(Over gRPC, the only way engines register.) Each was taken before: the engine then
    stayed in the fleet, unreachable, and a NUL went raw into the metrics' labels."""
    async with scheduler(other_redis_url, None) as api:
        for engine_id, address, words in (
            ("e\0", "127.0.0.1:7001", "printable"),
            ("e\n1", "127.0.0.1:7001", "printable"),
            ("e1", "::1:1", "bracketed IPv6"),
            ("e1", "http://h:1", "is not host:port"),
            ("e1", "a b:1", "is not host:port"),
        ):
            request = pb.RegisterEngineRequest(engine_id=engine_id, address=address)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await api.stub.RegisterEngine(request, timeout=TIMEOUT_S)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert words in (refused.value.details() or ""), refused.value.details()
        _, status = await api.call("GET", "/v1/status")
        assert status["engines"] == []


async def test_a_grpc_message_over_the_limit_is_refused_unparsed(other_redis_url: str) -> None:
    """A Submit larger than --max-grpc-message-bytes is RESOURCE_EXHAUSTED, named by its size
    and the limit, before it is parsed (on the event loop, four messages of 250 MiB held it
    past the scheduler's lease); one within it is taken."""
    async with scheduler(other_redis_url, None, max_grpc_message_bytes=64 * 1024) as api:
        large = pb.SubmitRequest(
            run_id="big",
            groups=[pb.PromptGroup(group_id="g", prompt_token_ids=[70_000] * 30_000, n=1)],
        )
        assert large.ByteSize() > 64 * 1024
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await api.stub.Submit(large, timeout=TIMEOUT_S)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert str(64 * 1024) in (refused.value.details() or ""), refused.value.details()
        small = pb.SubmitRequest(
            run_id="big",
            groups=[
                pb.PromptGroup(
                    group_id="g",
                    prompt_token_ids=[5] * 10,
                    n=1,
                    sampling=pb.SamplingParams(max_tokens=4),
                )
            ],
        )
        assert (await api.stub.Submit(small, timeout=TIMEOUT_S)).accepted == 1


async def test_a_call_whose_body_arrives_as_the_scheduler_stops_is_answered(
    other_redis_url: str,
) -> None:
    """A Cancel whose body is still arriving when the scheduler begins to stop (within its
    grace): aiohttp's shutdown read no more of the connection, and the call was closed
    unanswered at the end of the grace. Now the server stops listening, lets the handler
    read its body and answer, then closes."""
    http_port = free_port()
    settings = SchedulerSettings(
        port=0,
        http_port=http_port,
        redis_url=other_redis_url,
        predictor_namespace=f"ns-{uuid.uuid4().hex[:10]}",
        shutdown_grace_s=TIMEOUT_S,
    )
    stop, ready = asyncio.Event(), asyncio.get_running_loop().create_future()
    serving = asyncio.create_task(serve(settings, ready=ready.set_result, stop=stop))
    await asyncio.wait_for(ready, TIMEOUT_S)
    reader, writer = await asyncio.open_connection("127.0.0.1", http_port)
    try:
        body = b'{"group_ids": ["a"]}'
        head = b"POST /v1/runs/r/cancel HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
        writer.write(head % len(body) + body[:5])
        await writer.drain()
        await asyncio.sleep(0.2)  # (its handler has begun: it reads the body)
        stop.set()
        await asyncio.sleep(0.2)
        writer.write(body[5:])
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(4096), TIMEOUT_S)
        assert answer.startswith(b"HTTP/1.1 200 OK"), answer[:200]
        assert answer.endswith(b'{"unknown": ["a"], "cancelled": []}'), answer[-200:]
        await asyncio.wait_for(serving, TIMEOUT_S)
    finally:
        writer.close()
        stop.set()
