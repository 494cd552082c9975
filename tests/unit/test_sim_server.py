"""The sim engine backend: length model, token stream, real-time stepping, the gRPC servicer.

Nothing is faked but the event loop of the stepping tests (a manual clock, so that lateness
can be made exactly); the servicer tests run real grpc.aio servers in this process on real
simulated engines, fast (small ``time_scale``) or slow enough never to finish on their own.
"""

from __future__ import annotations

import asyncio
import math
import re
import statistics
from collections.abc import AsyncIterable, AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import ValidationError
from rollserve.sim.engine_model import Finished, SimEngine, SimRequest
from rollserve.sim.profile import load_profile
from rollserve.sim.realtime import MAX_CATCH_UP_S, RealTimeEngine, StepClock
from rollserve.sim.responses import (
    LengthModel,
    TokenStream,
    load_lengths,
    prompt_digest,
    prompt_hash,
    sample_draw,
)
from rollserve.sim.server import EngineParts, FleetStarted, SimEngineServicer, parse_settings, serve
from rollserve.sim.settings import SimSettings
from rollserve.v1 import rollserve_pb2 as pb
from rollserve.v1 import rollserve_pb2_grpc as pb_grpc

PROMPT = list(range(100, 180))
WAIT_S = 30.0
POLL_S = 0.01

# ---------------------------------------------------------------- length model and tokens


def test_lengths_are_fixed_by_prompt_draw_and_seed() -> None:
    model = LengthModel(median=200, seed=3)
    digest = prompt_digest(PROMPT)
    first = [model.natural_length(digest, sample_draw(i, None, False)) for i in range(8)]
    again = LengthModel(median=200, seed=3)
    assert [again.natural_length(digest, sample_draw(i, None, False)) for i in range(8)] == first
    assert len(set(first)) > 1  # samples of a group differ
    other_seed = LengthModel(median=200, seed=4)
    assert [other_seed.natural_length(digest, sample_draw(i, None, False)) for i in range(8)] != (
        first
    )
    assert all(n >= 1 for n in first)


def test_seeded_sample_i_is_the_draw_of_seed_plus_i_and_greedy_is_one_draw() -> None:
    model = LengthModel()
    assert sample_draw(3, 10, False) == sample_draw(0, 13, False)
    assert sample_draw(3, 10, False) != sample_draw(3, None, False)
    digest = prompt_digest(PROMPT)
    greedy = {model.natural_length(digest, sample_draw(i, None, True)) for i in range(5)}
    assert len(greedy) == 1


def test_lognormal_shape_median_and_group_correlation() -> None:
    """Over many prompts the median is near the setting, and samples of a prompt are closer
    to each other than to other prompts' (prompt_sigma > within_sigma)."""
    model = LengthModel(median=1000, prompt_sigma=0.95, within_sigma=0.6, seed=0)
    groups = []
    for p in range(300):
        digest = prompt_digest([p, p + 1, p + 2])
        groups.append([model.natural_length(digest, sample_draw(i, None, False)) for i in range(8)])
    everything = [n for g in groups for n in g]
    assert 800 < statistics.median(everything) < 1250
    assert max(everything) / statistics.median(everything) > 10  # a long tail
    logs = [[math.log(n) for n in g] for g in groups]
    within = statistics.mean(statistics.pvariance(g) for g in logs)
    assert 0.2 < within < 0.5  # 0.6^2 = 0.36
    assert statistics.pvariance([statistics.mean(g) for g in logs]) > within


def test_lengths_file_replaces_the_model_for_listed_prompts(tmp_path: Path) -> None:
    path = tmp_path / "lengths.csv"
    path.write_text(f"prompt_hash,response_len\n{prompt_hash(PROMPT)},7\n{prompt_hash(PROMPT)},9\n")
    table = load_lengths(path)
    model = LengthModel(median=500, table=table)
    digest = prompt_digest(PROMPT)
    assert [model.natural_length(digest, sample_draw(i, None, False)) for i in range(3)] == [
        7,
        9,
        7,
    ]
    unlisted = prompt_digest([1, 2, 3])
    assert model.natural_length(unlisted, sample_draw(0, None, False)) == LengthModel(
        median=500
    ).natural_length(unlisted, sample_draw(0, None, False))
    path.write_text("prompt_hash,response_len\nnothex,3\n")
    with pytest.raises(ValueError, match=r"lengths.csv:2: prompt_hash 'nothex'"):
        load_lengths(path)


def test_token_slices_agree_and_eos_ends_a_stopped_sample_only() -> None:
    stream = TokenStream(vocab_size=50, eos_token_id=7)
    ids, logprobs = stream.tokens(key=12345, start=0, end=40, eos_at=39)
    head, _ = stream.tokens(12345, 0, 13, eos_at=39)
    tail, tail_lp = stream.tokens(12345, 13, 40, eos_at=39)
    assert head + tail == ids
    assert tail_lp == logprobs[13:]
    assert ids[-1] == 7
    assert 7 not in ids[:-1]
    assert all(0 <= t < 50 for t in ids)
    assert all(lp <= 0 for lp in logprobs)
    cut, _ = stream.tokens(12345, 0, 40, eos_at=None)
    assert 7 not in cut
    banned, _ = stream.tokens(12345, 0, 400, eos_at=None, banned=(0, 1, 2))
    assert not {0, 1, 2} & set(banned)
    assert stream.tokens(1, 5, 5, None) == ([], [])


# ---------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("values", "words"),
    [
        ({"eos_token_id": 10, "vocab_size": 10}, "eos_token_id (10) must be below vocab_size"),
        ({"profile": "nope"}, "no shipped profile of that name"),
        ({"port": 65000, "engines": 600}, "exceeds 65535"),
        ({"time_scale": 0}, "greater than 0"),
        ({"scheduler_address": "nohost"}, "scheduler_address"),
    ],
)
def test_settings_reject_with_a_reason(values: dict[str, object], words: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(words)):
        SimSettings.model_validate(values)


def test_settings_reject_a_context_the_profile_cannot_hold(tmp_path: Path) -> None:
    small = tmp_path / "small.toml"
    lines = [
        'name = "small"',
        'source = "a test"',
        'simulated_hardware = "none"',
        "step_base_s = 0.001",
        "per_decode_seq_s = 0.0",
        "per_prefill_token_s = 0.0",
        "per_kv_token_s = 0.0",
        "kv_capacity_tokens = 4096",
        "block_size = 16",
        "max_num_seqs = 8",
        "max_num_batched_tokens = 2048",
    ]
    small.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValidationError, match=re.escape("max_model_len (8192) exceeds the KV")):
        SimSettings(profile=str(small), max_model_len=8192)
    assert SimSettings(profile=str(small), max_model_len=4096).cost_profile().name == "small"
    # A capacity that is not whole blocks: the engine holds the whole blocks only (a context
    # between the two was taken, and a call that filled it refused as ALREADY_EXISTS).
    small.write_text(
        small.read_text().replace("kv_capacity_tokens = 4096", "kv_capacity_tokens = 4100")
    )
    with pytest.raises(ValidationError, match=re.escape("(4096 tokens in whole blocks)")):
        SimSettings(profile=str(small), max_model_len=4100)


def test_command_line_fleet_has_base_port_and_engine_has_no_engines() -> None:
    fleet = parse_settings(["--engines", "3", "--base-port", "40000", "--time-scale", "0.5"], True)
    assert (fleet.engines, fleet.port, fleet.time_scale) == (3, 40000, 0.5)
    assert [fleet.engine_name(i) for i in range(3)] == ["sim-0", "sim-1", "sim-2"]
    assert fleet.bind_address(2) == "127.0.0.1:40002"
    one = parse_settings(["--engine-id", "e7", "--port", "40000"], False)
    assert one.engine_name(0) == "e7"
    with pytest.raises(SystemExit):
        parse_settings(["--engines", "3"], False)


# ---------------------------------------------------------------- stepping in real time


class _Handle:
    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ManualLoop:
    """The three loop methods RealTimeEngine uses, on a clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0
        self.handles: list[_Handle] = []

    def time(self) -> float:
        return self.now

    def call_soon(self, callback: Callable[[], None]) -> _Handle:
        return self.call_at(self.now, callback)

    def call_at(self, when: float, callback: Callable[[], None]) -> _Handle:
        handle = _Handle(when, callback)
        self.handles.append(handle)
        return handle

    def next_due(self) -> float:
        return min(h.when for h in self.handles if not h.cancelled)

    def fire(self, late_by: float = 0.0) -> None:
        """Runs the earliest callback, ``late_by`` seconds after it was due."""
        handle = min((h for h in self.handles if not h.cancelled), key=lambda h: h.when)
        self.handles.remove(handle)
        self.now = max(self.now, handle.when + late_by)
        handle.callback()


def manual_engine(time_scale: float = 1.0) -> tuple[RealTimeEngine, ManualLoop]:
    loop = ManualLoop()
    engine = SimEngine("e", load_profile("gpu-h100-llama8b"))
    clock = StepClock(cast(asyncio.AbstractEventLoop, loop))
    return RealTimeEngine(engine, time_scale, clock), loop


def test_steps_last_their_duration_and_late_arrivals_join_the_next_step() -> None:
    clock, loop = manual_engine(time_scale=2.0)
    finished: list[Finished] = []
    clock.add(SimRequest("a", 16, 3, 100), finished.append)
    clock.add(SimRequest("b", 16, 1, 100), finished.append)
    assert not clock.stepping
    loop.fire()  # the kick: the first step starts with both; "b" is done after its first token
    assert clock.stepping and clock.engine.stats.prompt_tokens == 32
    assert clock.engine.running == 1 and clock.progress("a") == 1
    first_end = loop.next_due()
    clock.add(SimRequest("c", 16, 5, 100), finished.append)
    assert clock.engine.waiting == 1  # joins the next step
    assert finished == []  # "b" finished in the step in flight, announced at its end
    loop.fire()
    assert [f.request_id for f in finished] == ["b"]
    assert clock.engine.running == 2  # "a" and now "c"
    step = clock.engine.profile.step_time(1, 16, 16 + 1)  # decode "a", prefill "c"
    assert loop.next_due() == pytest.approx(first_end + 2.0 * step)
    while clock.stepping:
        loop.fire()
    assert sorted(f.request_id for f in finished) == ["a", "b", "c"]
    assert clock.clock.late_steps == 0 and clock.clock.behind_s == 0


def test_a_late_step_end_is_caught_up_a_very_late_one_is_given_up() -> None:
    clock, loop = manual_engine()
    clock.add(SimRequest("a", 16, 5000, 10_000), lambda f: None)
    loop.fire()  # the kick: the first step starts at 0
    loop.fire(late_by=MAX_CATCH_UP_S / 2)  # its end runs late: steps run back to back ...
    assert clock.clock.steps > 2
    assert clock.clock.late_steps == 0 and clock.clock.behind_s == 0
    # ... and the schedule keeps its anchor: the step in flight ends when all steps so far sum to.
    assert loop.next_due() == pytest.approx(clock.engine.stats.busy_s)
    assert loop.next_due() > loop.now
    late = 1.0
    loop.fire(late_by=late)  # given up: the schedule restarts now
    assert clock.clock.late_steps == 1
    assert clock.clock.behind_s == pytest.approx(late)
    assert clock.clock.max_lag_s == pytest.approx(late)
    assert loop.next_due() > loop.now


def test_abort_takes_the_request_out_and_close_stops_stepping() -> None:
    clock, loop = manual_engine()
    calls: list[Finished] = []
    clock.add(SimRequest("a", 16, 50, 100), calls.append)
    loop.fire()
    loop.fire()
    aborted = clock.abort("a")
    assert aborted is not None and aborted.finish_reason == "abort"
    assert aborted.output_tokens == clock.engine.stats.steps
    assert clock.abort("a") is None
    loop.fire()
    assert not clock.stepping and calls == []
    clock.add(SimRequest("b", 16, 50, 100), calls.append)
    clock.close()
    assert all(h.cancelled for h in loop.handles)
    with pytest.raises(RuntimeError, match="closed"):
        clock.add(SimRequest("c", 16, 50, 100), calls.append)


def test_a_request_done_in_the_step_in_flight_ends_with_that_step() -> None:
    clock, loop = manual_engine()
    calls: list[Finished] = []
    clock.add(SimRequest("x", 16, 1, 100), calls.append)
    loop.fire()  # its only step is in flight: the engine model is done with it already
    assert clock.abort("x") is None  # too late to abort ...
    with pytest.raises(ValueError, match="'x' is still here"):  # ... or to reuse the id
        clock.add(SimRequest("x", 16, 1, 100), calls.append)
    loop.fire()
    assert [(f.request_id, f.finish_reason) for f in calls] == [("x", "stop")]


# ---------------------------------------------------------------- the servicer over gRPC


@asynccontextmanager
async def sim_engine(
    **values: Any,
) -> AsyncIterator[tuple[SimEngineServicer, pb_grpc.EngineAsyncStub]]:
    """One sim engine behind a real grpc.aio server in this process."""
    settings = SimSettings.model_validate({"time_scale": 0.01, "response_median": 30, **values})
    servicer = EngineParts.from_settings(settings).servicer(0)
    server = grpc.aio.server()
    pb_grpc.add_EngineServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield servicer, pb_grpc.EngineStub(channel)
    finally:
        await server.stop(0)
        servicer.close()


def generate_request(
    request_id: str = "r", n: int = 4, max_tokens: int = 200, **sampling: Any
) -> pb.GenerateRequest:
    indices = sampling.pop("sample_indices", ())
    return pb.GenerateRequest(
        request_id=request_id,
        prompt_token_ids=PROMPT,
        n=n,
        sampling=pb.SamplingParams(max_tokens=max_tokens, **sampling),
        sample_indices=indices,
    )


async def collect(
    call: AsyncIterable[pb.GenerateResponse],
) -> tuple[dict[int, list[int]], dict[int, pb.Complete], int]:
    """Tokens per sample (chunks and completes joined), the completes, the chunk count."""
    tokens: dict[int, list[int]] = {}
    completes: dict[int, pb.Complete] = {}
    chunks = 0
    async for message in call:
        kind = message.WhichOneof("kind")
        if kind == "chunk":
            chunks += 1
            for delta in message.chunk.deltas:
                assert delta.index not in completes
                assert len(delta.logprobs) == len(delta.token_ids)
                tokens.setdefault(delta.index, []).extend(delta.token_ids)
        else:
            assert kind == "complete", message
            done = message.complete
            assert done.index not in completes
            tokens.setdefault(done.index, []).extend(done.token_ids)
            completes[done.index] = done
    return tokens, completes, chunks


def expected(
    settings: SimSettings, index: int, max_tokens: int, seed: int | None = None
) -> tuple[list[int], int]:
    """The tokens sample ``index`` of PROMPT must have, and its finish reason."""
    model = settings.length_model()
    digest = prompt_digest(PROMPT)
    draw = sample_draw(index, seed, False)
    natural = model.natural_length(digest, draw)
    stops = natural <= max_tokens
    length = min(natural, max_tokens)
    ids, _ = TokenStream(settings.vocab_size, settings.eos_token_id).tokens(
        model.token_key(digest, draw), 0, length, natural - 1 if stops else None
    )
    return ids, pb.FINISH_REASON_STOP if stops else pb.FINISH_REASON_LENGTH


async def test_generate_streams_every_sample_as_the_length_model_says() -> None:
    async with sim_engine(response_median=60) as (servicer, stub):
        settings = SimSettings(response_median=60)
        tokens, completes, chunks = await collect(stub.Generate(generate_request(n=6)))
        stats = await stub.Stats(pb.StatsRequest())
    assert sorted(completes) == list(range(6))
    for index, done in completes.items():
        ids, reason = expected(settings, index, 200)
        assert tokens[index] == ids
        assert done.finish_reason == reason
        assert done.num_prompt_tokens == len(PROMPT)
    assert chunks >= 1
    # Siblings share the prompt: all but the first admitted hit the prefix cache.
    assert sum(1 for d in completes.values() if d.num_cached_tokens > 0) >= 5
    assert stats.model == "sim:gpu-h100-llama8b"
    assert stats.boot_id == servicer.boot_id and len(stats.boot_id) == 32
    assert stats.kv_capacity_tokens == servicer.engine.engine.kv_capacity_tokens > 0
    assert stats.engine_id == "sim"
    assert stats.generation_tokens == sum(len(t) for t in tokens.values())
    assert stats.prompt_tokens == 6 * len(PROMPT)
    assert stats.running_requests == 0
    assert servicer.totals.completes == 6


async def test_max_tokens_cuts_with_length_and_seeded_samples_are_one_draw() -> None:
    async with sim_engine(response_median=400) as (_, stub):
        settings = SimSettings(response_median=400)
        tokens, completes, _ = await collect(
            stub.Generate(generate_request(n=3, max_tokens=50, seed=10))
        )
        shifted, _, _ = await collect(
            stub.Generate(generate_request("s", n=2, max_tokens=50, seed=11))
        )
    for index in range(3):
        ids, reason = expected(settings, index, 50, seed=10)
        assert tokens[index] == ids
        assert completes[index].finish_reason == reason
    assert any(d.finish_reason == pb.FINISH_REASON_LENGTH for d in completes.values())
    assert all(len(t) <= 50 for t in tokens.values())
    assert shifted[0] == tokens[1] and shifted[1] == tokens[2]


async def test_sample_indices_generate_those_samples_and_the_same_draws() -> None:
    async with sim_engine() as (_, stub):
        whole, _, _ = await collect(stub.Generate(generate_request("all", n=8)))
        some, completes, _ = await collect(
            stub.Generate(generate_request("some", n=8, sample_indices=[5, 2]))
        )
    assert sorted(completes) == [2, 5]
    assert some == {2: whole[2], 5: whole[5]}


@pytest.mark.parametrize(
    ("request_", "words"),
    [
        (
            generate_request(n=4, sample_indices=[0, 4]),
            r"sample_indices\[1\] \(4\) must be below n \(4\)",
        ),
        (generate_request(n=4, sample_indices=[-1]), r"sample_indices\[0\] \(-1\)"),
        (
            generate_request(n=4, sample_indices=[1, 2, 1]),
            r"sample_indices\[2\] \(1\) repeats sample_indices\[0\]",
        ),
        (generate_request(max_tokens=40_000), "exceeds the model's context"),
        (generate_request(n=0), r"n \(0\) must be at least 1"),
        (generate_request(max_tokens=4, top_p=1.5), "top_p"),
    ],
)
async def test_invalid_requests_are_rejected_naming_the_field(
    request_: pb.GenerateRequest, words: str
) -> None:
    async with sim_engine() as (_, stub):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(stub.Generate(request_))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(words, info.value.details() or "")


async def test_weights_are_taken_as_named_and_reported_in_stats() -> None:
    async with sim_engine() as (servicer, stub):
        before = await stub.Stats(pb.StatsRequest())
        reply = await stub.UpdateWeights(
            pb.UpdateWeightsRequest(weights_path="/ckpt/step-2", version=2)
        )
        after = await stub.Stats(pb.StatsRequest())
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.UpdateWeights(pb.UpdateWeightsRequest(weights_path="", version=3))
    assert (before.weights_version, before.weights_path) == (0, "")
    # Paused for the profile's load time (x time_scale 0.01).
    assert reply.load_s >= servicer.engine.engine.profile.weights_load_s * 0.01
    assert (after.weights_version, after.weights_path) == (2, "/ckpt/step-2")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "weights_path is empty" in (info.value.details() or "")


HAND_FLUSHED_MS = 60_000.0  # the longest flush interval the settings take


def long_samples() -> AbstractAsyncContextManager[
    tuple[SimEngineServicer, pb_grpc.EngineAsyncStub]
]:
    """A sim engine in real time whose samples run thousands of steps. Its own flush tick
    is a minute away: the test flushes by hand (``flush_now``), when it has seen what it
    waits for, however slowly the machine runs."""
    return sim_engine(
        time_scale=1.0,
        response_median=100_000,
        prompt_sigma=0,
        within_sigma=0,
        flush_interval_ms=HAND_FLUSHED_MS,
    )


def flush_now(servicer: SimEngineServicer) -> None:
    """Runs the engine's flush tick now (every call sends its new tokens), in place of the
    one scheduled."""
    scheduled = servicer._tick
    servicer._flush_tick()  # schedules the next one
    if scheduled is not None:
        scheduled.cancel()


def received(messages: list[pb.GenerateResponse], n: int) -> list[int]:
    """Tokens of each of ``n`` samples that the chunks of ``messages`` carried."""
    counts = [0] * n
    for message in messages:
        for delta in message.chunk.deltas:
            counts[delta.index] += len(delta.token_ids)
    return counts


def made_past(servicer: SimEngineServicer, request_id: str, counts: list[int]) -> bool:
    """Whether each sample ``i`` of call ``request_id`` has made more than ``counts[i]``
    tokens (0 for a sample the engine has not been given yet)."""
    return all(
        servicer.engine.progress(f"{request_id}/{i}") > count for i, count in enumerate(counts)
    )


async def test_tokens_made_before_a_weight_update_keep_the_old_version() -> None:
    async with long_samples() as (servicer, stub):
        call = stub.Generate(generate_request("long", n=2, max_tokens=20_000))
        await eventually(lambda: made_past(servicer, "long", [0, 0]), "a token of each sample")
        flush_now(servicer)
        messages = [cast(pb.GenerateResponse, await call.read())]
        sent = received(messages, 2)
        await eventually(
            lambda: made_past(servicer, "long", sent), "tokens made after the first chunk"
        )
        await stub.UpdateWeights(pb.UpdateWeightsRequest(weights_path="/ckpt/step-2", version=2))
        # What was made before the update goes out at once, labelled with the old version.
        messages.append(cast(pb.GenerateResponse, await call.read()))
        sent = received(messages, 2)
        await eventually(
            lambda: made_past(servicer, "long", sent), "tokens made with the new weights"
        )
        flush_now(servicer)
        messages.append(cast(pb.GenerateResponse, await call.read()))
        await stub.Abort(pb.AbortRequest(request_id="long"))
        while (message := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
            messages.append(cast(pb.GenerateResponse, message))
    labels: dict[int, list[int]] = {}
    for message in messages:
        for delta in message.chunk.deltas:
            made = [delta.weights_version] * len(delta.token_ids)
            labels.setdefault(delta.index, []).extend(made)
        if message.WhichOneof("kind") == "complete":
            done = message.complete
            labels.setdefault(done.index, []).extend([done.weights_version] * len(done.token_ids))
    first = {d.index: len(d.token_ids) for d in messages[0].chunk.deltas}
    for index, versions in labels.items():
        # The old version until the update (past the first chunk: tokens were made after
        # it, before the update), the new one after.
        old = versions.count(0)
        assert old > first[index]
        assert versions == [0] * old + [2] * (len(versions) - old)
        assert len(versions) > old
    stats = servicer.engine.engine.stats
    # The running samples were recomputed under the new weights (vLLM drops their KV and
    # empties the prefix cache): the prompt, and every token made before, prefilled again.
    made_before = sum(versions.count(0) for versions in labels.values())
    assert stats.weight_updates == 1
    assert stats.recomputed_tokens >= len(PROMPT) + made_before


async def test_progress_counts_each_running_samples_tokens_sent_or_not() -> None:
    async with long_samples() as (servicer, stub):
        call = stub.Generate(generate_request("long", n=2, max_tokens=20_000))
        await eventually(lambda: made_past(servicer, "long", [0, 0]), "a token of each sample")
        flush_now(servicer)
        first = cast(pb.GenerateResponse, await call.read())
        await eventually(
            lambda: made_past(servicer, "long", received([first], 2)),
            "more tokens made, not sent until the next flush",
        )
        stats = await stub.Stats(pb.StatsRequest(with_progress=True))
        flush_now(servicer)
        second = cast(pb.GenerateResponse, await call.read())
        await stub.Abort(pb.AbortRequest(request_id="long"))
        while await call.read() is not grpc.aio.EOF:  # type: ignore[attr-defined]
            pass
        after = await stub.Stats(pb.StatsRequest(with_progress=True))
    sent = {d.index: len(d.token_ids) for d in first.chunk.deltas}
    then = {d.index: sent[d.index] + len(d.token_ids) for d in second.chunk.deltas}
    progress = {p.index: p.tokens for p in stats.progress}
    assert {p.request_id for p in stats.progress} == {"long"}
    for index, tokens in progress.items():
        assert sent[index] < tokens <= then[index]  # past the flush, not past the next one
    assert not after.progress


async def eventually(predicate: Callable[[], bool], what: str) -> None:
    for _ in range(int(WAIT_S / POLL_S)):
        if predicate():
            return
        await asyncio.sleep(POLL_S)
    pytest.fail(f"timed out waiting for {what}")


async def test_abort_ends_samples_with_the_tokens_so_far() -> None:
    # Real time, samples of thousands of steps: none finishes during the test.
    async with sim_engine(
        time_scale=1.0, response_median=100_000, prompt_sigma=0, within_sigma=0
    ) as (
        servicer,
        stub,
    ):
        call = stub.Generate(generate_request("long", n=3, max_tokens=20_000))
        first = cast(pb.GenerateResponse, await call.read())
        assert first.WhichOneof("kind") == "chunk"
        duplicate = stub.Generate(generate_request("long", n=1))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await duplicate.read()
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
        reply = await stub.Abort(pb.AbortRequest(request_id="long"))
        assert reply.found
        rest: list[pb.GenerateResponse] = []
        while (message := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
            rest.append(cast(pb.GenerateResponse, message))
        assert not (await stub.Abort(pb.AbortRequest(request_id="long"))).found
        assert not servicer.engine.engine.has_work()
    completes = [m.complete for m in rest if m.WhichOneof("kind") == "complete"]
    assert sorted(c.index for c in completes) == [0, 1, 2]
    assert all(c.finish_reason == pb.FINISH_REASON_ABORT for c in completes)
    tokens: dict[int, list[int]] = {}
    for message in [first, *rest]:
        for delta in message.chunk.deltas:
            tokens.setdefault(delta.index, []).extend(delta.token_ids)
    for c in completes:
        tokens.setdefault(c.index, []).extend(c.token_ids)
    assert all(0 < len(t) < 20_000 for t in tokens.values())
    assert all(128001 not in t for t in tokens.values())


async def test_abort_of_named_samples_ends_only_those_and_the_call_goes_on() -> None:
    async with sim_engine(
        time_scale=1.0, response_median=100_000, prompt_sigma=0, within_sigma=0
    ) as (
        servicer,
        stub,
    ):
        call = stub.Generate(generate_request("long", n=4, max_tokens=20_000))
        messages = [cast(pb.GenerateResponse, await call.read())]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Abort(pb.AbortRequest(request_id="long", sample_indices=[1, 7]))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sample_indices[1] (7) is not a sample of call long" in (info.value.details() or "")
        reply = await stub.Abort(pb.AbortRequest(request_id="long", sample_indices=[2, 0]))
        assert reply.found
        while True:
            message = cast(pb.GenerateResponse, await call.read())
            messages.append(message)
            completes = [m.complete for m in messages if m.WhichOneof("kind") == "complete"]
            if len(completes) == 2:
                break
        assert servicer.engine.engine.running == 2  # samples 1 and 3 go on
        call.cancel()
    assert sorted(c.index for c in completes) == [0, 2]
    assert all(c.finish_reason == pb.FINISH_REASON_ABORT for c in completes)
    tokens: dict[int, list[int]] = {}
    for message in messages:
        for delta in message.chunk.deltas:
            tokens.setdefault(delta.index, []).extend(delta.token_ids)
    for c in completes:
        tokens.setdefault(c.index, []).extend(c.token_ids)
    assert all(0 < len(tokens[i]) < 20_000 for i in (0, 2))


async def test_cancelling_the_call_aborts_its_samples_in_the_engine() -> None:
    async with sim_engine(
        time_scale=1.0, response_median=100_000, prompt_sigma=0, within_sigma=0
    ) as (
        servicer,
        stub,
    ):
        call = stub.Generate(generate_request("gone", n=4, max_tokens=20_000))
        await call.read()
        assert servicer.engine.engine.running == 4
        call.cancel()
        await eventually(lambda: servicer.running_requests == 0, "the call to end")
        assert not servicer.engine.engine.has_work()
        stats = await stub.Stats(pb.StatsRequest())
    assert stats.running_requests == 0 and stats.running_samples == 0


async def test_serve_runs_a_fleet_each_engine_on_its_own_port(tmp_path: Path) -> None:
    settings = SimSettings(engines=3, engine_id="f", stats_path=tmp_path / "stats.json")
    stop = asyncio.Event()
    started: asyncio.Future[FleetStarted] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(settings, ready=started.set_result, stop=stop))
    try:
        fleet = await asyncio.wait_for(started, WAIT_S)
        assert sorted(fleet.addresses) == ["f-0", "f-1", "f-2"]
        assert len(set(fleet.addresses.values())) == 3
        for engine_id, address in fleet.addresses.items():
            async with grpc.aio.insecure_channel(address) as channel:
                health = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest()
                )
                stats = await pb_grpc.EngineStub(channel).Stats(pb.StatsRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            assert (stats.engine_id, stats.model) == (engine_id, "sim:gpu-h100-llama8b")
    finally:
        stop.set()
        report = await asyncio.wait_for(task, WAIT_S)
    assert report["simulated"] is True and report["engines"] == 3
    assert "simulated" in (tmp_path / "stats.json").read_text()


async def test_add_outputs_are_checked_as_vllm_checks_them_and_taken_by_none() -> None:
    """The simulated engine does not draft from outputs: it checks them and takes none."""
    outputs = [pb.EarlierOutput(token_ids=[5, 6])]
    request = pb.AddOutputsRequest(
        prompts=[pb.PromptOutputs(prompt_token_ids=PROMPT, outputs=outputs)]
    )
    bad = pb.AddOutputsRequest(prompts=[pb.PromptOutputs(prompt_token_ids=[], outputs=outputs)])
    async with sim_engine() as (_, stub):
        reply = await stub.AddOutputs(request)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.AddOutputs(bad)
    assert reply.taken == 0
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompts[0].prompt_token_ids is empty" in (info.value.details() or "")


async def test_a_weight_update_whose_caller_goes_still_loads_and_generation_goes_on() -> None:
    """UpdateWeights' deadline passes while the engine pauses for the load: the load still
    ends (the weights are the new ones) and the running calls go on (the engine stayed
    paused, with work and no step due, and every call on it waited)."""
    async with sim_engine(
        time_scale=0.1,
        profile="gpu-h100-llama8b",
        response_median=200,
        prompt_sigma=0,
        within_sigma=0,
        max_model_len=4096,
    ) as (servicer, stub):
        call = stub.Generate(generate_request(n=2, max_tokens=300))
        calling = asyncio.create_task(collect(call))
        await eventually(lambda: servicer.engine.stepping, "the engine to run the call")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.UpdateWeights(
                pb.UpdateWeightsRequest(weights_path="/ckpt/step-1", version=1), timeout=0.05
            )
        _, completes, _ = await asyncio.wait_for(calling, 30)
        stats = await stub.Stats(pb.StatsRequest())
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert sorted(completes) == [0, 1]
    assert (stats.weights_version, stats.weights_path) == (1, "/ckpt/step-1")
