"""A burst of calls larger than gRPC's default pending-call limit (1,000) is taken, not
cancelled: 2,000 Generate streams opened at once on one simulated engine, served as
``rollserve sim`` serves it (the options are the engine service's: ``SERVER_OPTIONS``), all
finish. Before the options, about a tenth of them ended CANCELLED with no reason, and the
scheduler took the engine for failed. Nothing faked."""

from __future__ import annotations

import asyncio
import collections

import grpc
from rollserve.v1 import rollserve_pb2 as pb
from rollserve.v1 import rollserve_pb2_grpc as pb_grpc

from tests.unit.test_fuzz_api import sim_fleet

CALLS = 2_000


async def test_a_burst_past_grpcs_default_pending_calls_is_taken() -> None:
    async with sim_fleet() as (_, address, _task), grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.EngineStub(channel)

        async def generate(i: int) -> str:
            request = pb.GenerateRequest(
                request_id=f"burst-{i}",
                prompt_token_ids=[1 + i % 50] * 100,
                n=1,
                sampling=pb.SamplingParams(max_tokens=1),
            )
            try:
                async for _ in stub.Generate(request, timeout=120):
                    pass
            except grpc.aio.AioRpcError as exc:
                return f"{exc.code().name}: {exc.details()}"
            return "OK"

        outcomes = collections.Counter(await asyncio.gather(*(generate(i) for i in range(CALLS))))
    assert outcomes == {"OK": CALLS}, outcomes
