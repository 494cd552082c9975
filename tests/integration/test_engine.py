"""The engine over gRPC against real vLLM on CPU, with the tiny random model.

The model's weights are random: tests check structure (counts, reasons, ranges, ids), not text.
Long-running requests use greedy decoding so that they are deterministic.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn, cast

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from rollserve.assets import reasoner_dir
from rollserve.cli.stack import launch_engine
from rollserve.engine.server import ENGINE_DIED_EXIT_CODE
from rollserve.engine.settings import EngineSettings, resolve_dtype
from rollserve.engine.tiny_model import make_tiny_model
from rollserve.v1 import rollserve_pb2 as pb
from rollserve.v1 import rollserve_pb2_grpc as pb_grpc

from tests.integration.engine_proc import (
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    EngineProcess,
    start_engine_process,
)

pytestmark = pytest.mark.integration

MAX_MODEL_LEN = 2048  # the engine's default
LONG = 1500  # max_tokens of requests meant to be interrupted
PROMPT = list(range(100, 164))  # 64 tokens: two full KV blocks of 32
WAIT_S = 30.0
GENERATE_TIMEOUT_S = 600.0
# Tests that generate samples of LONG tokens: a bound above the default 300 s (on a loaded
# 2-core machine one such Generate took over 120 s, and the weights test makes three).
LONG_TEST_TIMEOUT_S = 1200


@dataclass
class Sample:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the weights_version of each token
    complete: pb.Complete | None = None


@dataclass
class Result:
    samples: dict[int, Sample] = field(default_factory=dict)
    messages: int = 0
    chunks: list[pb.Chunk] = field(default_factory=list)
    error: pb.Error | None = None

    def sample(self, index: int) -> Sample:
        return self.samples.setdefault(index, Sample())

    def add(self, message: pb.GenerateResponse) -> None:
        self.messages += 1
        kind = message.WhichOneof("kind")
        if kind == "chunk":
            self.chunks.append(message.chunk)
            for delta in message.chunk.deltas:
                sample = self.sample(delta.index)
                assert sample.complete is None, f"chunk for sample {delta.index} after complete"
                sample.token_ids.extend(delta.token_ids)
                sample.logprobs.extend(delta.logprobs)
                sample.versions.extend([delta.weights_version] * len(delta.token_ids))
        elif kind == "complete":
            done = message.complete
            sample = self.sample(done.index)
            assert sample.complete is None, f"two completes for sample {done.index}"
            sample.token_ids.extend(done.token_ids)
            sample.logprobs.extend(done.logprobs)
            sample.versions.extend([done.weights_version] * len(done.token_ids))
            sample.complete = message.complete
        else:
            self.error = message.error

    @property
    def tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples.values())


def request(
    request_id: str,
    *,
    n: int = 1,
    max_tokens: int = 16,
    prompt: list[int] | None = None,
    **sampling: float | int,
) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=PROMPT if prompt is None else prompt,
        n=n,
        sampling=pb.SamplingParams(max_tokens=max_tokens, **sampling),  # type: ignore[arg-type]
    )


@pytest.fixture
async def channel(engine_address: str) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(engine_address) as ch:
        yield ch


@pytest.fixture
def engine(channel: grpc.aio.Channel) -> pb_grpc.EngineAsyncStub:
    return pb_grpc.EngineStub(channel)


async def generate(engine: pb_grpc.EngineAsyncStub, req: pb.GenerateRequest) -> Result:
    result = Result()
    # A bound on the wait only: 8 greedy samples of 1500 tokens took over 120 s on a loaded
    # 2-core machine.
    async for message in engine.Generate(req, timeout=GENERATE_TIMEOUT_S):
        result.add(message)
    return result


async def wait_idle(engine: pb_grpc.EngineAsyncStub) -> pb.StatsResponse:
    """Stats once no request runs; fails after WAIT_S."""
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while True:
        stats = await engine.Stats(pb.StatsRequest())
        if stats.running_requests == 0 and stats.running_samples == 0:
            return stats
        assert asyncio.get_running_loop().time() < deadline, f"still running: {stats}"
        await asyncio.sleep(0.1)


def check_sample(sample: Sample, max_tokens: int, eos_token_id: int) -> None:
    assert sample.complete is not None
    assert len(sample.token_ids) == len(sample.logprobs)
    assert 1 <= len(sample.token_ids) <= max_tokens
    assert all(lp <= 1e-6 for lp in sample.logprobs), sample.logprobs
    reason = sample.complete.finish_reason
    if reason == pb.FINISH_REASON_LENGTH:
        assert len(sample.token_ids) == max_tokens
    else:
        assert reason == pb.FINISH_REASON_STOP
        assert sample.token_ids[-1] == eos_token_id


async def test_health_serving(channel: grpc.aio.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "rollserve.v1.Engine"):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_reflection_lists_engine(channel: grpc.aio.Channel) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    names: list[str] = []
    call = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    async for reply in call:
        names.extend(s.name for s in reply.list_services_response.service)
    assert "rollserve.v1.Engine" in names
    assert "grpc.health.v1.Health" in names


async def test_generate_n4(engine: pb_grpc.EngineAsyncStub) -> None:
    stats = await engine.Stats(pb.StatsRequest())
    result = await generate(engine, request("n4", n=4, max_tokens=40, seed=7))
    assert result.error is None
    assert sorted(result.samples) == [0, 1, 2, 3]
    for sample in result.samples.values():
        check_sample(sample, 40, stats.eos_token_id)
        assert sample.complete is not None
        assert sample.complete.num_prompt_tokens == len(PROMPT)
    # The four samples share the prompt: all but the first find its blocks in the cache.
    cached = sorted(s.complete.num_cached_tokens for s in result.samples.values() if s.complete)
    assert cached[-1] >= 32


@pytest.mark.timeout(LONG_TEST_TIMEOUT_S)
async def test_chunks_are_batched(engine: pb_grpc.EngineAsyncStub) -> None:
    # Greedy: the eight samples are one sequence and end in the same step, all their tokens
    # since the last flush riding in their Completes. Long enough to span several flush
    # intervals, so that Chunks come before the ends.
    result = await generate(engine, request("batched", n=8, max_tokens=1500, temperature=0.0))
    assert result.error is None
    assert result.tokens > 0
    assert result.messages * 2 <= result.tokens, (result.messages, result.tokens)
    assert max(len(chunk.deltas) for chunk in result.chunks) > 1


async def test_max_tokens_gives_length(engine: pb_grpc.EngineAsyncStub) -> None:
    result = await generate(engine, request("len7", n=2, max_tokens=7, temperature=0.0))
    for sample in result.samples.values():
        assert sample.complete is not None
        assert sample.complete.finish_reason == pb.FINISH_REASON_LENGTH
        assert len(sample.token_ids) == 7 == len(sample.logprobs)


async def test_seed_reproduces_samples(engine: pb_grpc.EngineAsyncStub) -> None:
    first = await generate(engine, request("seed-a", n=2, max_tokens=24, seed=123))
    second = await generate(engine, request("seed-b", n=2, max_tokens=24, seed=123))
    for index in (0, 1):
        assert first.samples[index].token_ids == second.samples[index].token_ids
    assert first.samples[0].token_ids != first.samples[1].token_ids  # seed + i per sample


async def test_sample_indices_give_exactly_those_samples_of_the_group(
    engine: pb_grpc.EngineAsyncStub,
) -> None:
    whole = await generate(engine, request("whole", n=4, max_tokens=24, seed=41))
    part_req = request("part", n=4, max_tokens=24, seed=41)
    part_req.sample_indices.extend([1, 3])
    part = await generate(engine, part_req)
    assert whole.error is None and part.error is None
    assert sorted(part.samples) == [1, 3]
    for index in (1, 3):
        assert part.samples[index].token_ids == whole.samples[index].token_ids
        assert part.samples[index].complete is not None
    assert whole.samples[1].token_ids != whole.samples[3].token_ids  # seed + i per sample


def with_indices(req: pb.GenerateRequest, indices: list[int]) -> pb.GenerateRequest:
    req.sample_indices.extend(indices)
    return req


INVALID = {
    "request_id": request(""),
    "prompt_token_ids is empty": request("bad", prompt=[]),
    "n (0)": request("bad", n=0),
    "max_tokens (0)": request("bad", max_tokens=0),
    "max_tokens (1985)": request("bad", max_tokens=MAX_MODEL_LEN - len(PROMPT) + 1),
    "temperature (-1.0)": request("bad", temperature=-1.0),
    "top_p (0.0)": request("bad", top_p=0.0),
    "top_p (1.5)": request("bad", top_p=1.5),
    "top_k (-2)": request("bad", top_k=-2),
    "prompt_token_ids[1] (-1)": request("bad", prompt=[5, -1]),
    "prompt_token_ids[2] (1000000)": request("bad", prompt=[5, 6, 1_000_000]),
    "sample_indices[1] (4) must be below n (4)": with_indices(request("bad", n=4), [0, 4]),
    "sample_indices[2] (1) repeats sample_indices[0]": with_indices(request("bad", n=4), [1, 2, 1]),
}


@pytest.mark.parametrize("problem", list(INVALID))
async def test_invalid_argument(engine: pb_grpc.EngineAsyncStub, problem: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(engine, INVALID[problem])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert problem in (info.value.details() or "")


async def test_stop_token_outside_vocab_is_invalid(engine: pb_grpc.EngineAsyncStub) -> None:
    req = request("bad-stop", max_tokens=4)
    req.sampling.stop_token_ids.append(99_999)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(engine, req)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stop_token_ids[0] (99999)" in (info.value.details() or "")


async def test_duplicate_request_id_is_rejected(engine: pb_grpc.EngineAsyncStub) -> None:
    first = engine.Generate(request("dup", max_tokens=LONG, temperature=0.0))
    try:
        await first.read()  # running now
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(engine, request("dup", max_tokens=4))
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    finally:
        first.cancel()
    await wait_idle(engine)


@pytest.mark.timeout(LONG_TEST_TIMEOUT_S)
async def test_client_cancel_aborts(engine: pb_grpc.EngineAsyncStub) -> None:
    before = await wait_idle(engine)
    call = engine.Generate(request("cancel", n=4, max_tokens=LONG, temperature=0.0))
    message = await call.read()
    assert isinstance(message, pb.GenerateResponse)
    assert message.WhichOneof("kind") == "chunk"
    running = await engine.Stats(pb.StatsRequest())
    assert running.running_requests >= 1
    assert running.running_samples >= 1
    call.cancel()
    await wait_idle(engine)
    # vLLM stopped generating for it: the token count settles below 4 full samples. (How far
    # below depends on how soon the cancel came, which a loaded machine makes late: a bound
    # on it would be a timed test.)
    previous = -1
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while (current := (await engine.Stats(pb.StatsRequest())).generation_tokens) != previous:
        assert asyncio.get_running_loop().time() < deadline
        previous = current
        await asyncio.sleep(0.3)
    # Uncancelled, each greedy sample runs to max_tokens (it meets no EOS before), so 4 of
    # them would make 4 * LONG tokens.
    full = await generate(engine, request("uncancelled", max_tokens=LONG, temperature=0.0))
    assert len(full.sample(0).token_ids) == LONG
    assert current - before.generation_tokens < 4 * LONG


async def test_abort_rpc(engine: pb_grpc.EngineAsyncStub) -> None:
    call = engine.Generate(request("to-abort", n=3, max_tokens=LONG, temperature=0.0))
    result = Result()
    first = await call.read()
    assert isinstance(first, pb.GenerateResponse)
    result.add(first)
    reply = await engine.Abort(pb.AbortRequest(request_id="to-abort"))
    assert reply.found
    while (message := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
        assert isinstance(message, pb.GenerateResponse)
        result.add(message)
    assert result.error is None
    assert sorted(result.samples) == [0, 1, 2]
    for sample in result.samples.values():
        assert sample.complete is not None
        assert sample.complete.finish_reason == pb.FINISH_REASON_ABORT
        assert len(sample.token_ids) == len(sample.logprobs) < LONG
    await wait_idle(engine)
    missing = await engine.Abort(pb.AbortRequest(request_id="to-abort"))
    assert not missing.found


async def test_stats(engine: pb_grpc.EngineAsyncStub, tiny_model_dir: Path) -> None:
    await generate(engine, request("for-stats", n=2, max_tokens=8))
    stats = await wait_idle(engine)
    assert stats.engine_id == "engine-it"
    assert stats.model == str(tiny_model_dir)
    assert stats.max_model_len == MAX_MODEL_LEN
    assert stats.max_num_seqs == 64
    # vLLM sized its KV cache at start-up: blocks x block size, enough for a full context.
    assert stats.kv_capacity_tokens >= MAX_MODEL_LEN
    assert stats.eos_token_id == 1  # "</s>" in the tiny model's tokenizer
    assert stats.prompt_tokens >= 2 * len(PROMPT)
    assert stats.generation_tokens >= 16
    assert stats.prefix_cache_queries >= stats.prefix_cache_hits > 0
    assert stats.preemptions >= 0
    # The dtype it resolved its "auto" to: float32 where the CPU emulates bfloat16 (the tiny
    # bfloat16 checkpoint upcast); else vLLM's choice, the checkpoint's bfloat16.
    resolved = resolve_dtype(EngineSettings(model=tiny_model_dir), "cpu")
    assert stats.dtype == (resolved if resolved != "auto" else "bfloat16")


async def scrape_engine(port: int) -> dict[str, float]:
    """The engine's metrics endpoint, each metric's samples summed over their labels."""
    url = f"http://127.0.0.1:{port}/metrics"
    async with aiohttp.ClientSession() as http, http.get(url) as reply:
        assert reply.status == 200
        text = await reply.text()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


async def test_vllms_metrics_are_served_for_prometheus(
    engine: pb_grpc.EngineAsyncStub, engine_metrics_port: int
) -> None:
    """``--metrics-port`` serves the engine process's registry over HTTP: vLLM's own
    metrics, as its OpenAI server serves them. A call's tokens show in them."""
    await wait_idle(engine)
    before = await scrape_engine(engine_metrics_port)
    result = await generate(engine, request("for-metrics", n=2, max_tokens=8))
    made = sum(len(s.token_ids) for s in result.samples.values())
    assert made > 0
    generated = "vllm:generation_tokens_total"
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while True:  # (vLLM's stat logger records a step just after handing its outputs over)
        after = await scrape_engine(engine_metrics_port)
        if after[generated] - before[generated] >= made:
            break
        assert asyncio.get_running_loop().time() < deadline, (before[generated], after)
        await asyncio.sleep(0.1)
    assert after[generated] - before[generated] == made
    assert after["vllm:prompt_tokens_total"] > before["vllm:prompt_tokens_total"]
    assert "vllm:num_requests_running" in after  # what a dashboard of vLLM shows


class FakeScheduler(pb_grpc.SchedulerServicer):
    """Records RegisterEngine and Heartbeat calls; the rest of the Scheduler is unimplemented."""

    HEARTBEAT_INTERVAL_MS = 100

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.registrations: list[pb.RegisterEngineRequest] = []
        self.heartbeats = 0

    def RegisterEngine(
        self, request: pb.RegisterEngineRequest, context: grpc.ServicerContext
    ) -> pb.RegisterEngineResponse:
        with self.lock:
            self.registrations.append(request)
        return pb.RegisterEngineResponse(heartbeat_interval_ms=self.HEARTBEAT_INTERVAL_MS)

    def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.ServicerContext
    ) -> pb.HeartbeatResponse:
        with self.lock:
            self.heartbeats += 1
        return pb.HeartbeatResponse()

    def _unimplemented(self, request: object, context: grpc.ServicerContext) -> NoReturn:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "fake scheduler")
        raise AssertionError("unreachable")

    Submit = Cancel = Status = PublishVersion = DeleteRun = _unimplemented


def test_second_engine_registers_and_stops_cleanly(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A second engine: registers with a scheduler that comes up late, heartbeats, and on
    SIGTERM exits 0 leaving no process of its group behind."""
    # The scheduler's port stays bound (connections refused, not listening) while the engine
    # starts: a port only picked, then free for seconds, was once taken meanwhile.
    reserved = socket.socket()
    reserved.bind(("127.0.0.1", 0))
    scheduler_port = reserved.getsockname()[1]
    try:
        engine = start_engine_process(
            tiny_model_dir,
            "engine-second",
            ["--scheduler-address", f"127.0.0.1:{scheduler_port}", "--omp-num-threads", "1"],
            log_dir=tmp_path,
        )
    finally:
        reserved.close()
    scheduler = FakeScheduler()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_SchedulerServicer_to_server(scheduler, server)
    try:  # the engine is killed whatever fails from here on (it outlived a failed bind once)
        server.add_insecure_port(f"127.0.0.1:{scheduler_port}")
        server.start()
        assert len(engine.group_pids()) >= 2, "expected the engine and vLLM's engine core"
        deadline = time.monotonic() + WAIT_S
        while scheduler.heartbeats < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert scheduler.heartbeats >= 2, engine.log_tail()
        first = scheduler.registrations[0]
        assert (first.engine_id, first.address) == ("engine-second", engine.address)

        code = engine.stop()
        assert code == 0, engine.log_tail()
        assert "rollserve-engine ready engine_id=engine-second" in engine.log_tail(10**6)
        assert engine.leftover_pids == [], engine.log_tail()
    finally:
        server.stop(None)
        engine.kill()


def test_engine_whose_vllm_core_dies_stops_serving_and_exits(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """When vLLM's engine core dies under it, the engine does not go on answering SERVING to
    health checks: it shuts down and exits with ENGINE_DIED_EXIT_CODE for a supervisor."""
    engine = start_engine_process(
        tiny_model_dir, "engine-doomed", ["--omp-num-threads", "1"], log_dir=tmp_path
    )
    try:
        core = [pid for pid in engine.group_pids() if pid != engine.proc.pid]
        assert core, "expected vLLM's engine core next to the engine"
        for pid in core:
            os.kill(pid, signal.SIGKILL)
        code = engine.proc.wait(timeout=STOP_TIMEOUT_S)
        assert code == ENGINE_DIED_EXIT_CODE, engine.log_tail()
        assert "engine core died" in engine.log_tail(10**6)
    finally:
        engine.kill()


def test_engine_stopped_while_its_model_loads_exits_at_once_and_cleanly(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A SIGTERM while vLLM loads the model (which blocks the event loop) interrupts the load:
    the engine exits 0 without serving, leaving no process of its group behind. Without
    `signals_interrupt_load` the stop would wait for the whole load and the warm-up."""
    engine = EngineProcess(
        "engine-loading", launch_engine(tiny_model_dir, "engine-loading", tmp_path)
    )
    try:
        # (Python's and vLLM's imports come first: tens of seconds on a loaded machine.)
        deadline = time.monotonic() + START_TIMEOUT_S
        # vLLM logs the architecture from inside the load, seconds before the load ends.
        while "Resolved architecture" not in engine.log_tail(10**6):
            assert engine.proc.poll() is None, engine.log_tail()
            assert time.monotonic() < deadline, engine.log_tail()
            time.sleep(0.02)
        code = engine.stop()
        log = engine.log_tail(10**6)
        assert code == 0, log
        assert "stopping: SIGTERM during the model load" in log
        assert "rollserve-engine ready" not in log
        assert engine.leftover_pids == [], log
    finally:
        engine.kill()


@pytest.mark.timeout(LONG_TEST_TIMEOUT_S)
async def test_weights_loaded_in_place_change_what_runs_and_what_comes_next(
    engine: pb_grpc.EngineAsyncStub, tiny_model_dir: Path, tmp_path: Path
) -> None:
    # Another tiny model of the same shape (other random weights) is the "trained" policy.
    other = make_tiny_model(tmp_path / "other", seed=1)
    reference = (await generate(engine, request("w-ref", max_tokens=LONG, temperature=0))).sample(0)
    short = (await generate(engine, request("w-before", max_tokens=32, temperature=0))).sample(0)
    try:
        # The same greedy sample as the reference; the weights change while it runs.
        call = engine.Generate(
            request("w-run", max_tokens=LONG, temperature=0), timeout=GENERATE_TIMEOUT_S
        )
        running = Result()
        running.add(cast(pb.GenerateResponse, await call.read()))
        made_before = running.tokens
        load = await engine.UpdateWeights(
            pb.UpdateWeightsRequest(weights_path=str(other), version=7), timeout=120
        )
        while (message := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
            running.add(cast(pb.GenerateResponse, message))
        stats = await engine.Stats(pb.StatsRequest())
        after = (await generate(engine, request("w-after", max_tokens=32, temperature=0))).sample(0)
        old_part = running.sample(0).token_ids[: running.sample(0).versions.count(0)]
        go_on = request("w-go-on", max_tokens=8, temperature=0, prompt=PROMPT + old_part)
        continued = (await generate(engine, go_on)).sample(0)
    finally:
        await engine.UpdateWeights(
            pb.UpdateWeightsRequest(weights_path=str(tiny_model_dir), version=0), timeout=120
        )
    back = (await generate(engine, request("w-back", max_tokens=32, temperature=0))).sample(0)
    assert load.load_s > 0
    assert (stats.weights_version, stats.weights_path) == (7, str(other))
    sample = running.sample(0)
    assert running.error is None and sample.complete is not None
    assert 0 < made_before < len(reference.token_ids)
    # Labelled with the weights that made them: the old ones' (the reference's), then the
    # new ones', which continue the text as a fresh greedy request under them does.
    old = sample.versions.count(0)
    assert sample.versions == [0] * old + [7] * (len(sample.versions) - old)
    assert made_before <= old < len(sample.token_ids)
    assert sample.token_ids[:old] == reference.token_ids[:old]
    assert sample.token_ids != reference.token_ids
    assert continued.token_ids == sample.token_ids[old : old + len(continued.token_ids)]
    assert after.token_ids != short.token_ids
    assert back.token_ids == short.token_ids  # the original weights again, bit for bit
    assert (await engine.Stats(pb.StatsRequest())).weights_version == 0


async def test_weights_from_a_folder_the_engine_cannot_read_are_refused(
    engine: pb_grpc.EngineAsyncStub, tmp_path: Path
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await engine.UpdateWeights(
            pb.UpdateWeightsRequest(weights_path=str(tmp_path / "nope"), version=1), timeout=30
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is not a folder on this engine" in (info.value.details() or "")
    assert (await engine.Stats(pb.StatsRequest())).weights_version == 0


def test_weights_that_do_not_fit_the_model_are_refused_or_stop_the_engine(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A checkpoint whose config.json gives another shape is refused before the engine pauses
    (it goes on serving). One whose config.json claims the served shape but whose tensors do
    not fit fails part way in vLLM's reload, after some tensors may have changed: the call
    fails with INTERNAL and the engine exits for a supervisor to restart it, rather than serve
    a model in an unknown state."""
    disguised = tmp_path / "disguised"
    disguised.mkdir()
    for part in reasoner_dir().glob("*.safetensors"):
        shutil.copy(part, disguised / part.name)
    shutil.copy(tiny_model_dir / "config.json", disguised / "config.json")
    engine = start_engine_process(
        tiny_model_dir, "engine-misfit", ["--omp-num-threads", "1"], log_dir=tmp_path
    )
    try:
        with grpc.insecure_channel(engine.address) as channel:
            stub = pb_grpc.EngineStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.UpdateWeights(
                    pb.UpdateWeightsRequest(weights_path=str(reasoner_dir()), version=1),
                    timeout=120,
                )
            still = stub.Stats(pb.StatsRequest(), timeout=30)
            with pytest.raises(grpc.RpcError) as info:
                stub.UpdateWeights(
                    pb.UpdateWeightsRequest(weights_path=str(disguised), version=1),
                    timeout=120,
                )
        assert cast(grpc.Call, refused.value).code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "is of another model" in (cast(grpc.Call, refused.value).details() or "")
        assert still.weights_version == 0  # serving its own weights still
        assert cast(grpc.Call, info.value).code() == grpc.StatusCode.INTERNAL
        assert "failed, the engine stops" in (cast(grpc.Call, info.value).details() or "")
        code = engine.proc.wait(timeout=STOP_TIMEOUT_S)
        assert code == ENGINE_DIED_EXIT_CODE, engine.log_tail()
    finally:
        engine.kill()
