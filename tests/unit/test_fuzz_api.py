"""No request crashes a service: each RPC of the scheduler, the engine service and the
simulated engine is sent a few hundred requests made from a valid one changed at the edges
of its fields' types (``fuzz.py``), and every answer is OK or a refusal with a message that
names a field; the service still serves afterwards and a valid request still works.

Faked: the engines behind the scheduler (``fakes.FakeEngine``) and the engine service's
backend (the scripted one of ``test_engine_service``); the servers, gRPC, the tokenizer and
Redis are real.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Any

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rollserve.client.wire import GroupStatus
from rollserve.scheduler.settings import EngineEndpoint, SchedulerSettings
from rollserve.sim.server import FleetStarted
from rollserve.sim.server import serve as serve_sim
from rollserve.sim.settings import SimSettings
from rollserve.v1 import rollserve_pb2 as pb
from rollserve.v1 import rollserve_pb2_grpc as pb_grpc

from tests.served import served_scheduler
from tests.unit.fakes import FakeEngine
from tests.unit.fuzz import Call, Campaign
from tests.unit.test_engine_service import HoldingBackend, ScriptedBackend, served
from tests.unit.test_runtime import read_stream

CALL_TIMEOUT_S = 20.0
FUZZ = Campaign.from_env(count=150, seed=1)
DRAIN_S = 600.0  # for the groups a scheduler took to end
HELD_SAMPLES = 8  # of the running call an Abort names

# The bundled reasoner: a tokenizer for prompt_text, a checkpoint for UpdateWeights.
REASONER = resources.files("rollserve.assets") / "reasoner"


# ---------------------------------------------------------------- the scheduler


@dataclass(frozen=True)
class Served:
    stub: Any  # the Scheduler service's
    task: asyncio.Task[None]  # serving it
    health: Any  # its gRPC health service's stub
    address: str


@asynccontextmanager
async def scheduler(redis_url: str, engine: FakeEngine) -> AsyncIterator[Served]:
    """A scheduler served as ``rollserve scheduler`` serves it (``serve``), with the bundled
    reasoner's tokenizer, on one fake engine."""
    settings = SchedulerSettings(
        port=0,
        redis_url=redis_url,
        engines=(EngineEndpoint(engine_id=engine.engine_id, address=engine.address),),
        tokenizer=str(REASONER),
        health_interval_s=0.1,
        health_timeout_s=30.0,  # a real engine, busy on a loaded machine, answers late
        max_queued_groups=2_000,
        predictor_namespace=f"ns-{uuid.uuid4().hex[:10]}",
        shutdown_grace_s=0.0,
    )
    async with served_scheduler(settings, CALL_TIMEOUT_S) as served:
        address = f"127.0.0.1:{served.port}"
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.SchedulerStub(channel)
            yield Served(stub, served.task, health_pb2_grpc.HealthStub(channel), address)


def valid_group(group_id: str) -> pb.PromptGroup:
    return pb.PromptGroup(
        group_id=group_id,
        prompt_token_ids=[5, 6, 7, 8],
        n=2,
        sampling=pb.SamplingParams(temperature=1.0, top_p=0.9, top_k=20, max_tokens=8, seed=3),
        prompt_key="k0",
        priority=1,
        metadata={"row": "0"},
        epoch=0,
    )


async def test_no_request_crashes_the_scheduler(other_redis_url: str) -> None:
    """(A Redis database of its own: the weights a fuzzed PublishVersion makes the fleet's
    stay in it, and engines that cannot load them get no work from a later scheduler.)"""
    redis_url = other_redis_url
    engine = await FakeEngine("e0", step_s=0.001).start()
    try:
        async with scheduler(redis_url, engine) as running:
            stub, task, health = running.stub, running.task, running.health

            async def alive() -> None:
                assert not task.done(), "the scheduler stopped"
                reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                await stub.Status(pb.StatusRequest(), timeout=5)

            run = f"fuzz-{uuid.uuid4().hex[:8]}"
            counter = iter(range(10**9))

            async def submit(request: Message) -> Any:
                assert isinstance(request, pb.SubmitRequest)
                # fresh group ids, so that a mutant is refused for what was changed in it
                # rather than as a duplicate of an earlier one
                for group in request.groups:
                    if group.group_id == "g":
                        group.group_id = f"g{next(counter)}"
                return await stub.Submit(request, timeout=CALL_TIMEOUT_S)

            valid_submit = pb.SubmitRequest(run_id=run, groups=[valid_group("g")])
            seen = {
                "Submit": await FUZZ.check("Submit", submit, valid_submit, alive),
                "Cancel": await FUZZ.check(
                    "Cancel",
                    lambda r: stub.Cancel(r, timeout=CALL_TIMEOUT_S),
                    pb.CancelRequest(run_id=run, group_ids=["g0", "nope"]),
                    alive,
                    offset=2,
                ),
                "PublishVersion": await FUZZ.check(
                    "PublishVersion",
                    lambda r: stub.PublishVersion(r, timeout=CALL_TIMEOUT_S),
                    pb.PublishVersionRequest(run_id=run, version=1, weights_path="/w/1"),
                    alive,
                    offset=3,
                ),
                "RegisterEngine": await FUZZ.check(
                    "RegisterEngine",
                    lambda r: stub.RegisterEngine(r, timeout=CALL_TIMEOUT_S),
                    pb.RegisterEngineRequest(engine_id="e9", address="127.0.0.1:1"),
                    alive,
                    offset=4,
                ),
                "Heartbeat": await FUZZ.check(
                    "Heartbeat",
                    lambda r: stub.Heartbeat(r, timeout=CALL_TIMEOUT_S),
                    pb.HeartbeatRequest(engine_id="e0"),
                    alive,
                    offset=5,
                ),
                "Status": await FUZZ.check(
                    "Status",
                    lambda r: stub.Status(r, timeout=CALL_TIMEOUT_S),
                    pb.StatusRequest(),
                    alive,
                    offset=6,
                ),
            }
            print(seen)
            # every RPC took some requests and refused others
            for rpc in ("Submit", "Cancel", "PublishVersion", "RegisterEngine", "Heartbeat"):
                assert seen[rpc].get("OK", 0) > 0, (rpc, seen[rpc])
                assert seen[rpc].get("INVALID_ARGUMENT", 0) > 0, (rpc, seen[rpc])

            # and a valid group of a new run is still delivered
            after = f"after-{uuid.uuid4().hex[:8]}"
            await stub.Submit(pb.SubmitRequest(run_id=after, groups=[valid_group("last")]))
            [delivered] = await read_stream(redis_url, after, 1)
            assert delivered.group_id == "last"
    finally:
        await engine.stop()


async def test_what_the_scheduler_takes_an_engine_runs(other_redis_url: str) -> None:
    """The scheduler's checks cover the engine's: Submit's requests (as above) go to a
    scheduler on a simulated engine, which refuses a call as the vLLM engine service does
    (the same checks), and every group the scheduler took is delivered, none failed."""
    async with sim_fleet() as (engine_id, address, _):
        failed = await taken_then_failed(other_redis_url, engine_id, address, FUZZ, offset=7)
    assert not failed, f"{len(failed)} groups taken then failed: {failed[:5]}"


async def taken_then_failed(
    redis_url: str,
    engine_id: str,
    address: str,
    campaign: Campaign,
    *,
    offset: int = 0,
    max_tokens: int | None = None,
) -> list[str]:
    """Sends the campaign's Submit requests made from a valid one (their samples cut to
    ``max_tokens`` where given) to a scheduler on the engine at ``address``; once every
    group it took has ended, the ones that failed, each with its error."""
    engine = FakeEngine(engine_id)  # (only its id and address are read)
    engine.address = address
    async with scheduler(redis_url, engine) as running:
        stub, task = running.stub, running.task
        counter = iter(range(10**9))
        taken: dict[str, int] = {}  # run id -> groups taken

        async def alive() -> None:
            assert not task.done(), "the scheduler stopped"

        async def submit(request: Any) -> Any:
            assert isinstance(request, pb.SubmitRequest)
            for group in request.groups:
                if group.group_id == "g":
                    group.group_id = f"g{next(counter)}"
                if max_tokens is not None:
                    group.sampling.max_tokens = min(group.sampling.max_tokens, max_tokens)
            reply = await stub.Submit(request, timeout=CALL_TIMEOUT_S)
            taken[request.run_id] = taken.get(request.run_id, 0) + reply.accepted
            return reply

        valid = pb.SubmitRequest(run_id=f"takes-{uuid.uuid4().hex[:8]}", groups=[valid_group("g")])
        seen = await campaign.check("Submit", submit, valid, alive, offset=offset)
        assert seen.get("OK", 0) > 0 and seen.get("INVALID_ARGUMENT", 0) > 0, seen

        async def drained() -> None:
            while True:
                status = await stub.Status(pb.StatusRequest(), timeout=CALL_TIMEOUT_S)
                if status.queue_depth == 0 and status.inflight_groups == 0:
                    return
                await asyncio.sleep(0.2)

        await asyncio.wait_for(drained(), DRAIN_S)
        return [
            f"{run_id}/{result.group_id}: {result.error}"
            for run_id, taken_there in taken.items()
            for result in await read_stream(redis_url, run_id, taken_there)
            if result.status != GroupStatus.DELIVERED
        ]


# ---------------------------------------------------------------- the engines


def valid_generate() -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id="r",
        prompt_token_ids=[5, 6, 7, 8],
        n=2,
        sampling=pb.SamplingParams(
            temperature=1.0, top_p=0.9, top_k=20, max_tokens=8, seed=3, stop_token_ids=[9]
        ),
        priority=1,
        sample_indices=[0, 1],
        earlier_outputs=[pb.EarlierOutput(token_ids=[10, 11, 12])],
    )


def valid_add_outputs() -> pb.AddOutputsRequest:
    return pb.AddOutputsRequest(
        prompts=[
            pb.PromptOutputs(
                prompt_token_ids=[5, 6, 7, 8], outputs=[pb.EarlierOutput(token_ids=[10, 11])]
            )
        ]
    )


async def check_engine(
    stub: Any,
    alive: Callable[[], Awaitable[None]],
    refusing: tuple[str, ...],
    *,
    campaign: Campaign = FUZZ,
    max_tokens: int | None = None,
    update_weights: bool = True,
    timeout_s: float = CALL_TIMEOUT_S,
) -> None:
    """Every RPC of the Engine API, each from a valid request (a request id of ``r`` is made
    unique per call: a duplicate of a running one is refused for that alone; a Generate
    call's samples are cut to ``max_tokens`` where given, and each call is read to its end:
    one that never ends fails at ``timeout_s``); the RPCs ``refusing`` took some requests
    and refused others; a valid call still generates. ``update_weights=False`` leaves
    UpdateWeights out (a valid one changes the weights version of an engine other tests
    share)."""
    counter = iter(range(10**9))

    async def generate(request: Message) -> None:
        assert isinstance(request, pb.GenerateRequest)
        if request.request_id == "r":
            request.request_id = f"r{next(counter)}"
        if max_tokens is not None:
            request.sampling.max_tokens = min(request.sampling.max_tokens, max_tokens)
        async for reply in stub.Generate(request, timeout=timeout_s):
            if reply.WhichOneof("kind") == "error":
                assert reply.error.message, f"an in-band error without a message: {request}"

    checks: list[tuple[str, Call, Message]] = [
        ("Generate", generate, valid_generate()),
        (
            "Abort",
            lambda r: stub.Abort(r, timeout=timeout_s),
            pb.AbortRequest(request_id="r0", sample_indices=[0]),
        ),
        ("AddOutputs", lambda r: stub.AddOutputs(r, timeout=timeout_s), valid_add_outputs()),
        (
            "UpdateWeights",
            lambda r: stub.UpdateWeights(r, timeout=timeout_s),
            pb.UpdateWeightsRequest(weights_path=str(REASONER), version=1),
        ),
        ("Stats", lambda r: stub.Stats(r, timeout=timeout_s), pb.StatsRequest(with_progress=True)),
    ]
    seen = {
        name: await campaign.check(name, call, valid, alive, offset=offset)
        for offset, (name, call, valid) in enumerate(checks)
        if update_weights or name != "UpdateWeights"
    }
    print(seen)
    for rpc in refusing:
        assert seen[rpc].get("OK", 0) > 0, (rpc, seen[rpc])
        assert seen[rpc].get("INVALID_ARGUMENT", 0) > 0, (rpc, seen[rpc])
    request = valid_generate()
    request.request_id = "last"
    replies = [r async for r in stub.Generate(request, timeout=timeout_s)]
    assert sum(r.WhichOneof("kind") == "complete" for r in replies) == 2


async def test_no_request_crashes_the_engine_service() -> None:
    """The vLLM engine's servicer, on a scripted backend that drafts from earlier outputs."""
    backend = ScriptedBackend(takes_earlier_outputs=True)
    async with served(backend) as stub:

        async def alive() -> None:
            await stub.Stats(pb.StatsRequest(), timeout=5)

        await check_engine(stub, alive, refusing=("Generate", "AddOutputs", "UpdateWeights"))


async def test_no_abort_crashes_the_engine_service_while_its_call_runs() -> None:
    """Abort's requests (as above) each name the samples of a call that is running (a
    backend that holds every sample until it is aborted); whatever they abort, the call then
    ends with all its samples once the rest are aborted."""
    backend = HoldingBackend()
    async with served(backend) as stub:
        calls = iter(range(10**9))

        async def abort(request: Any) -> Any:
            assert isinstance(request, pb.AbortRequest)
            held = f"held-{next(calls)}"
            request_id = request.request_id
            request.request_id = held if request_id == "held" else request_id
            call = stub.Generate(
                pb.GenerateRequest(
                    request_id=held,
                    prompt_token_ids=[5, 6],
                    n=HELD_SAMPLES,
                    sampling=pb.SamplingParams(max_tokens=4),
                ),
                timeout=CALL_TIMEOUT_S,
            )
            await asyncio.wait_for(backend.started(len(backend.requests) + HELD_SAMPLES), 10)
            try:
                return await stub.Abort(request, timeout=CALL_TIMEOUT_S)
            finally:
                await stub.Abort(pb.AbortRequest(request_id=held), timeout=CALL_TIMEOUT_S)
                ends = [r.complete async for r in call if r.WhichOneof("kind") == "complete"]
                assert sorted(c.index for c in ends) == list(range(HELD_SAMPLES)), held

        async def alive() -> None:
            await stub.Stats(pb.StatsRequest(), timeout=5)

        valid = pb.AbortRequest(request_id="held", sample_indices=[0, 3])
        seen = await FUZZ.check("Abort", abort, valid, alive, offset=8)
        assert seen.get("OK", 0) > 0 and seen.get("INVALID_ARGUMENT", 0) > 0, seen


async def test_no_request_crashes_a_simulated_engine() -> None:
    """``rollserve sim``'s server (``serve``: one engine, a hundred times real time)."""
    async with sim_fleet() as (_, address, task), grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.EngineStub(channel)
        health = health_pb2_grpc.HealthStub(channel)

        async def alive() -> None:
            assert not task.done(), "the sim engine stopped"
            reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            await stub.Stats(pb.StatsRequest(), timeout=5)

        await check_engine(stub, alive, refusing=("Generate", "AddOutputs"))


@asynccontextmanager
async def sim_fleet() -> AsyncIterator[tuple[str, str, asyncio.Task[dict[str, Any]]]]:
    """One simulated engine served as ``rollserve sim`` serves it, a hundred times real time;
    yields its id, address and the server's task."""
    settings = SimSettings(engines=1, port=0, time_scale=0.01, response_median=30)
    started: asyncio.Future[FleetStarted] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    task = asyncio.create_task(serve_sim(settings, ready=started.set_result, stop=stop))
    try:
        fleet = await asyncio.wait_for(asyncio.shield(started), timeout=CALL_TIMEOUT_S)
        [(engine_id, address)] = fleet.addresses.items()
        yield engine_id, address, task
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=CALL_TIMEOUT_S)
