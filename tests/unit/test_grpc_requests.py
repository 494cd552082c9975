"""Requests whose bytes are no message of their method are refused with INVALID_ARGUMENT
(``rollserve.common.grpc_requests``), by the scheduler and the engine servers as they run
(the sim engine's server is the engine service's, with its servicer): gRPC answered UNKNOWN
and logged an ERROR with a traceback for each. Nothing faked."""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from rollserve.sim.settings import SimSettings
from rollserve.v1 import rollserve_pb2 as pb
from rollserve.v1 import rollserve_pb2_grpc as pb_grpc

from tests.unit.test_access import SECRET, TOKEN, scheduler, sim_engine

TIMEOUT_S = 10.0
REFLECTION = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"

# Bytes that are no message: a string field (1) of bad UTF-8, a field cut short, a varint
# that never ends.
UNDECODABLE = (b"\x0a\x03\xff\xfe\xfd", b"\x0a\x09abc", b"\x08" + b"\xff" * 11)


async def refused_as_invalid(channel: grpc.aio.Channel, method: str, raw: bytes) -> str:
    call = channel.unary_unary(method, None, None)  # (bytes sent as they are)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call(raw, timeout=TIMEOUT_S)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
    return refused.value.details() or ""


async def test_the_scheduler_refuses_undecodable_requests_as_invalid(
    other_redis_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text(f"alice:{TOKEN} role=trainer runs=alice-*\nops:{SECRET} role=admin\n")
    async with (
        scheduler(other_redis_url, auth_tokens_file=str(tokens_file)) as (served, _),
        grpc.aio.insecure_channel(f"127.0.0.1:{served.port}") as channel,
    ):
        for token in (SECRET, TOKEN):  # (alice's is scoped: her calls' run ids are read)
            auth = (("authorization", f"Bearer {token}"),)
            for name, message in (("Cancel", "CancelRequest"), ("Submit", "SubmitRequest")):
                for raw in UNDECODABLE:
                    call = channel.unary_unary(f"/rollserve.v1.Scheduler/{name}", None, None)
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await call(raw, timeout=TIMEOUT_S, metadata=auth)
                    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    details = refused.value.details() or ""
                    assert "the request does not decode" in details, details
                    assert f"rollserve.v1.{message}" in details, details
        # No token: still UNAUTHENTICATED first (the request is never read).
        call = channel.unary_unary("/rollserve.v1.Scheduler/Cancel", None, None)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call(UNDECODABLE[0], timeout=TIMEOUT_S)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Reflection (open without a token) takes a stream of requests: refused at the
        # first that does not decode; a good one is answered.
        reflect = channel.stream_stream(REFLECTION, None, None)
        for raw in UNDECODABLE:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                [r async for r in reflect(iter([raw]), timeout=TIMEOUT_S)]
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "ServerReflectionRequest" in (refused.value.details() or "")
        ask = reflection_pb2.ServerReflectionRequest(list_services="").SerializeToString()
        [raw_answer] = [r async for r in reflect(iter([ask]), timeout=TIMEOUT_S)]
        answer = reflection_pb2.ServerReflectionResponse.FromString(raw_answer)
        names = {s.name for s in answer.list_services_response.service}
        assert "rollserve.v1.Scheduler" in names
        # It serves on.
        stub = pb_grpc.SchedulerStub(channel)
        status = await stub.Status(
            pb.StatusRequest(),
            timeout=TIMEOUT_S,
            metadata=(("authorization", f"Bearer {SECRET}"),),
        )
        assert status.queue_depth == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_an_engine_refuses_undecodable_requests_and_streams_good_ones(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = SimSettings.model_validate({"time_scale": 0.01, "response_median": 8})
    async with sim_engine(settings) as address, grpc.aio.insecure_channel(address) as channel:
        for method in ("Generate", "Abort", "UpdateWeights", "AddOutputs"):
            for raw in UNDECODABLE:
                details = await refused_as_invalid(channel, f"/rollserve.v1.Engine/{method}", raw)
                assert "the request does not decode" in details, details
        stub = pb_grpc.EngineStub(channel)
        request = pb.GenerateRequest(
            request_id="r",
            prompt_token_ids=[1, 2, 3],
            n=2,
            sampling=pb.SamplingParams(max_tokens=8),
        )
        done = [
            response.complete.index
            async for response in stub.Generate(request, timeout=TIMEOUT_S)
            if response.WhichOneof("kind") == "complete"
        ]
        assert sorted(done) == [0, 1]
        # (health's Watch, a stream of another kind, goes through as before)
        health = health_pb2_grpc.HealthStub(channel)
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT_S)
        first = await watch.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
