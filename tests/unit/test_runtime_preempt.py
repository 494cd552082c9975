"""Partial-rollout preemption in the scheduler runtime: a policy that moves running work
stops a sample, keeps its tokens and resumes it on another engine or from the queue.

Faked: the engines (``FakeEngine``, see fakes.py: scripted tokens; ``holds`` keeps a sample
running after its first chunk until an Abort names it, and ``on_abort`` says what the Abort
does) and the policies, which are small scripted ones of this file. Real: the runtime, its
store on the session's Redis, and the gRPC client code between them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest
import redis.asyncio as aioredis
from rollserve.client.wire import FinishReason, GroupResult, GroupStatus, stream_key
from rollserve.scheduler import runtime as runtime_module
from rollserve.scheduler.core.snapshot import Assign, Plan, Preempt, QueuedGroup, Snapshot
from rollserve.scheduler.runtime import SchedulerRuntime

from tests.unit.builders import spec
from tests.unit.fakes import AbortOutcome, FakeEngine
from tests.unit.test_runtime import eventually, make_runtime, new_run, read_stream

PROMPT = [5, 6, 7, 8, 9]  # the builders' prompt
MAX_TOKENS = 8
KEPT = [100, 101, 102]  # the held sample's first chunk on engine "a": 3 of its 6 tokens
RESUMED = [200, 201, 202, 203, 204]  # engine "b" generates 200 + t, up to max_tokens - 3


class MoveOnce:
    """Preempts one sample once. Before that, it places queued samples on engine "a" (those
    of ``first`` only, when given); once it sees sample ``victim`` running there with tokens,
    it preempts it to ``to_engine`` ("": back to the queue). From then on it places a group on
    engine "b" once the victim is queued again, so that the preempted sample and its
    unstarted siblings come in one Assign."""

    name = "move-once"
    whole_groups = False
    moves_running = True
    uses_predictions = False

    def __init__(self, to_engine: str = "b", victim: int = 0, first: tuple[int, ...] = ()):
        self.to_engine = to_engine
        self.victim = victim
        self.first = first
        self.preempted: Preempt | None = None
        self.snapshots: list[Snapshot] = []

    def plan(self, snapshot: Snapshot) -> Plan:
        self.snapshots.append(snapshot)
        assigns = []
        for group in snapshot.queue:
            if self.preempted is None:
                samples = tuple(i for i in group.pending if i in self.first)
                if samples or not self.first:
                    assigns.append(Assign(group.key, "a", samples))
            elif self.victim in group.pending:
                assigns.append(Assign(group.key, "b"))
        preempts: tuple[Preempt, ...] = ()
        if self.preempted is None:
            for sample in snapshot.running:
                if sample.engine_id == "a" and sample.index == self.victim and sample.progress:
                    self.preempted = Preempt(sample.group_key, sample.index, "a", self.to_engine)
                    preempts = (self.preempted,)
        return Plan(tuple(assigns), preempts)

    def queued(self, key: str) -> list[QueuedGroup]:
        """Every view of group ``key`` in the queue, oldest first."""
        return [g for s in self.snapshots for g in s.queue if g.key == key]


async def stream_length(redis_url: str, run_id: str) -> int:
    client = aioredis.Redis.from_url(redis_url)
    try:
        return int(await client.xlen(stream_key(run_id)))
    finally:
        await client.aclose()


async def deliver_once(redis_url: str, run_id: str) -> GroupResult:
    """The run's one stream entry, checked to stay the only one a while later."""
    [result] = await read_stream(redis_url, run_id, 1)
    await asyncio.sleep(0.2)
    assert await stream_length(redis_url, run_id) == 1
    return result


async def stop_all(runtime: SchedulerRuntime, *engines: FakeEngine) -> None:
    await runtime.stop()
    for engine in engines:
        await engine.stop()


async def test_a_preempted_sample_resumes_on_another_engine_with_its_tokens(
    redis_url: str,
) -> None:
    a = await FakeEngine("a", holds=(0,)).start()
    b = await FakeEngine("b", first_token=200).start()
    policy = MoveOnce(to_engine="b")
    runtime = await make_runtime(redis_url, [a, b], policy)
    run = new_run()
    try:
        group = spec("g0", n=2, max_tokens=MAX_TOKENS, run_id=run)
        seeded = dataclasses.replace(group, sampling=dataclasses.replace(group.sampling, seed=11))
        await runtime.submit(run, [seeded])
        result = await deliver_once(redis_url, run)
        status = runtime.status()
    finally:
        await stop_all(runtime, a, b)
    assert policy.preempted == Preempt(f"{run}/g0", 0, "a", "b")
    assert a.requests[0].sampling.seed == 11
    [abort] = a.aborts
    assert abort.request_id == a.requests[0].request_id and list(abort.sample_indices) == [0]
    [resume] = b.requests
    assert list(resume.prompt_token_ids) == PROMPT + KEPT
    assert resume.sampling.max_tokens == MAX_TOKENS - len(KEPT)
    assert list(resume.sample_indices) == [0]
    # Sample 0 resumes on a stream of its own: seed + n * resumptions (+ its index, there).
    assert resume.sampling.seed == 11 + 2 * 1
    assert result.status == GroupStatus.DELIVERED and result.attempts == 1
    moved, stayed = result.samples
    assert moved.token_ids == KEPT + RESUMED
    assert moved.logprobs == [-0.5] * len(moved.token_ids)
    assert (moved.preemptions, moved.resumed_tokens) == (1, len(KEPT))
    assert (moved.engine_id, moved.finish_reason) == ("b", FinishReason.LENGTH)
    assert stayed.token_ids == [100 + t for t in range(6)] and stayed.preemptions == 0
    assert status.samples_preempted == runtime.counters.samples_preempted == 1
    assert status.inflight_samples == 0 and status.queue_depth == 0


async def test_a_sample_preempted_to_the_queue_resumes_in_a_call_of_its_own(
    redis_url: str,
) -> None:
    a = await FakeEngine("a", holds=(0,)).start()
    b = await FakeEngine("b", first_token=200).start()
    # Samples 0 and 1 on "a"; sample 2 waits, and is placed with the preempted sample 0.
    policy = MoveOnce(to_engine="", first=(0, 1))
    runtime = await make_runtime(redis_url, [a, b], policy)
    run = new_run()
    try:
        await runtime.submit(run, [spec("g0", n=3, max_tokens=MAX_TOKENS, run_id=run)])
        result = await deliver_once(redis_url, run)
    finally:
        await stop_all(runtime, a, b)
    requeued = [g for g in policy.queued(f"{run}/g0") if g.progress]
    assert requeued and requeued[0].pending == (0, 2) and requeued[0].progress == (3, 0)
    # One Assign of samples 0 and 2: a fresh call of sample 2 and a call resuming sample 0
    # (started together: which of the two reaches the engine first is up to gRPC)
    assert sorted(b.asked()) == [[0], [2]]
    resume, fresh = sorted(b.requests, key=lambda r: list(r.sample_indices))
    assert list(fresh.prompt_token_ids) == PROMPT and fresh.sampling.max_tokens == MAX_TOKENS
    assert list(resume.prompt_token_ids) == PROMPT + KEPT
    assert resume.sampling.max_tokens == MAX_TOKENS - len(KEPT)
    moved, stayed, later = result.samples
    assert moved.token_ids == KEPT + RESUMED and len(moved.logprobs) == len(moved.token_ids)
    assert (moved.preemptions, moved.resumed_tokens, moved.engine_id) == (1, 3, "b")
    assert stayed.engine_id == "a" and later.engine_id == "b"
    assert later.token_ids == [200 + t for t in range(6)] and later.preemptions == 0


async def test_impossible_preempts_are_logged_and_skipped(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    a = await FakeEngine("a", holds=(0,)).start()
    full = await FakeEngine("full", holds=(0,), max_num_seqs=1).start()
    down = await FakeEngine("down").start()
    await down.stop()  # listed in the settings, never healthy
    run = new_run()
    g0 = f"{run}/g0"

    class Impossible:
        """Places g0 on "a" and h0 on "full" (room for one sample: h0's). Once g0's sample 0
        runs with tokens, preempts in every way that cannot be, and to the queue twice; then
        places nothing more."""

        name = "impossible"
        whole_groups = False
        moves_running = True
        uses_predictions = False
        preempts: tuple[Preempt, ...] = ()

        def plan(self, snapshot: Snapshot) -> Plan:
            if self.preempts:
                return Plan()
            if not any(s.group_key == g0 and s.progress for s in snapshot.running):
                return Plan(
                    tuple(Assign(g.key, "a" if g.key == g0 else "full") for g in snapshot.queue)
                )
            self.preempts = (
                Preempt(f"{run}/nope", 0, "a", "full"),  # no such group
                Preempt(g0, 0, "full", ""),  # not on that engine
                Preempt(g0, 1, "a", ""),  # finished
                Preempt(g0, 0, "a", "zzz"),  # unknown target
                Preempt(g0, 0, "a", "down"),  # unhealthy target
                Preempt(g0, 0, "a", "full"),  # target at capacity
                Preempt(g0, 0, "a", ""),  # possible
                Preempt(g0, 0, "a", ""),  # being preempted already
            )
            return Plan(preempts=self.preempts)

    runtime = await make_runtime(redis_url, [a, full, down], Impossible(), capacity_factor=1.0)
    try:
        with caplog.at_level(logging.ERROR, logger="rollserve.scheduler.runtime"):
            await runtime.submit(
                run,
                [
                    spec("g0", n=2, max_tokens=MAX_TOKENS, run_id=run),
                    spec("h0", n=1, max_tokens=MAX_TOKENS, run_id=run),
                ],
            )

            async def requeued() -> bool:
                return runtime.status().queue_depth == 1

            await eventually(requeued, "the one possible preempt to land")
        cancelled, _ = await runtime.cancel(run, ["g0", "h0"])
        status = runtime.status()
    finally:
        await stop_all(runtime, a, full)
    impossible = [r.getMessage() for r in caplog.records if "impossible Preempt" in r.message]
    assert [message.rsplit(": ", 1)[1] for message in impossible] == [
        "no sample 0 of that group runs on a",
        "no sample 0 of that group runs on full",
        "no sample 1 of that group runs on a",
        "engine zzz is unknown",
        "engine down is unhealthy",
        "engine full has no room",
        "that sample is being preempted already",
    ]
    [abort] = a.aborts
    assert list(abort.sample_indices) == [0] and full.aborts == []
    assert sorted(cancelled) == ["g0", "h0"]
    assert status.samples_preempted == 1 and status.inflight_samples == 0
    assert await stream_length(redis_url, run) == 0


async def test_a_sample_that_finishes_before_its_abort_lands_simply_finishes(
    redis_url: str,
) -> None:
    a = await FakeEngine("a", holds=(0,), on_abort=AbortOutcome.FINISHES).start()
    b = await FakeEngine("b", first_token=200).start()
    policy = MoveOnce(to_engine="b")
    runtime = await make_runtime(redis_url, [a, b], policy)
    run = new_run()
    try:
        await runtime.submit(run, [spec("g0", n=2, max_tokens=MAX_TOKENS, run_id=run)])
        result = await deliver_once(redis_url, run)
    finally:
        await stop_all(runtime, a, b)
    assert policy.preempted is not None and len(a.aborts) == 1
    assert b.requests == []  # nothing to resume
    assert [s.token_ids for s in result.samples] == [[100 + t for t in range(6)]] * 2
    assert [s.preemptions for s in result.samples] == [0, 0]
    assert {s.finish_reason for s in result.samples} == {FinishReason.STOP}
    assert runtime.counters.samples_preempted == 0


async def test_a_sample_aborted_after_its_abort_timed_out_resumes_from_the_queue(
    redis_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine carries out an Abort after the scheduler gave up waiting for its answer:
    the sample's aborted Complete is a preemption (it was delivered cut short, finish reason
    abort)."""
    monkeypatch.setattr(runtime_module, "_ABORT_TIMEOUT_S", 0.1)
    caplog.set_level(logging.WARNING, logger="rollserve")
    gate = asyncio.Event()
    a = await FakeEngine("a", holds=(0,), abort_gate=gate).start()
    b = await FakeEngine("b", first_token=200).start()
    policy = MoveOnce(to_engine="b")
    runtime = await make_runtime(redis_url, [a, b], policy)
    run = new_run()
    try:
        await runtime.submit(run, [spec("g0", n=2, max_tokens=MAX_TOKENS, run_id=run)])

        async def gave_up() -> bool:
            return any("it runs on" in r.getMessage() for r in caplog.records)

        await eventually(gave_up, "the scheduler to give up on the Abort's answer")
        gate.set()
        result = await deliver_once(redis_url, run)
        status = runtime.status()
    finally:
        gate.set()
        await stop_all(runtime, a, b)
    moved, stayed = result.samples
    assert moved.token_ids == KEPT + RESUMED and moved.finish_reason == FinishReason.LENGTH
    assert (moved.preemptions, moved.engine_id) == (1, "b")
    assert stayed.token_ids == [100 + t for t in range(6)]
    assert status.samples_preempted == 1


async def test_a_sample_stopped_with_all_its_tokens_finishes_without_a_call(
    redis_url: str,
) -> None:
    a = await FakeEngine("a", holds=(0,), on_abort=AbortOutcome.ENDS_FULL).start()
    b = await FakeEngine("b").start()
    runtime = await make_runtime(redis_url, [a, b], MoveOnce(to_engine="b"))
    run = new_run()
    try:
        # 6 tokens per sample: the aborted sample 0 arrives with all max_tokens of them.
        await runtime.submit(run, [spec("g0", n=2, max_tokens=6, run_id=run)])
        result = await deliver_once(redis_url, run)
    finally:
        await stop_all(runtime, a, b)
    assert len(a.aborts) == 1 and b.requests == []
    stopped = result.samples[0]
    assert stopped.token_ids == [100 + t for t in range(6)] and stopped.engine_id == "a"
    assert (stopped.finish_reason, stopped.preemptions) == (FinishReason.LENGTH, 0)
    assert runtime.counters.samples_preempted == 0


async def test_an_engine_failing_while_a_sample_is_preempted_requeues_it_from_scratch(
    redis_url: str,
) -> None:
    a = await FakeEngine("a", holds=(0,), on_abort=AbortOutcome.DIES, stays_down=True).start()
    b = await FakeEngine("b", first_token=200).start()
    policy = MoveOnce(to_engine="b")
    runtime = await make_runtime(redis_url, [a, b], policy)
    run = new_run()
    try:
        await runtime.submit(run, [spec("g0", n=2, max_tokens=MAX_TOKENS, run_id=run)])
        result = await deliver_once(redis_url, run)
        status = runtime.status()
    finally:
        await stop_all(runtime, a, b)
    # The Abort never landed: sample 0 ran again from its first token, alone, on "b".
    [rerun] = b.requests
    assert list(rerun.prompt_token_ids) == PROMPT and rerun.sampling.max_tokens == MAX_TOKENS
    assert result.status == GroupStatus.DELIVERED and result.attempts == 2
    rerun_sample, kept = result.samples
    assert rerun_sample.token_ids == [200 + t for t in range(6)]
    assert (rerun_sample.preemptions, rerun_sample.resumed_tokens) == (0, 0)
    assert kept.engine_id == "a" and kept.token_ids == [100 + t for t in range(6)]
    assert status.engine_failures == 1 and status.samples_preempted == 0


async def test_a_group_cancelled_while_its_sample_is_being_preempted_is_never_delivered(
    redis_url: str,
) -> None:
    a = await FakeEngine("a", holds=(0,), on_abort=AbortOutcome.IGNORED).start()
    b = await FakeEngine("b").start()
    runtime = await make_runtime(redis_url, [a, b], MoveOnce(to_engine="b"))
    run = new_run()
    try:
        await runtime.submit(run, [spec("g0", n=2, max_tokens=MAX_TOKENS, run_id=run)])

        async def abort_sent() -> bool:
            return len(a.aborts) == 1

        await eventually(abort_sent, "the Abort")
        cancelled, _ = await runtime.cancel(run, ["g0"])

        async def call_cancelled() -> bool:
            return a.cancelled == 1

        await eventually(call_cancelled, "the engine to see the call cancelled")
        await asyncio.sleep(0.2)
        status = runtime.status()
    finally:
        await stop_all(runtime, a, b)
    assert cancelled == ["g0"] and b.requests == []
    assert status.inflight_samples == 0 and status.queue_depth == 0
    assert status.groups_cancelled == 1 and status.samples_preempted == 0
    assert await stream_length(redis_url, run) == 0


async def test_a_sample_preempted_before_its_engine_counted_keeps_its_new_tokens_labels(
    redis_url: str,
) -> None:
    """A publish without weights while a sample is being preempted: its old engine answers
    how many tokens it made only after the sample resumed elsewhere and made more under the
    new version. Those count as the new version; the old engine's as the old (all of them
    were labelled old: the sample's length when the answer came). Faked: the engines' late
    answers (gates)."""
    aborts, counts = asyncio.Event(), asyncio.Event()
    a = await FakeEngine("a", holds=(0,), abort_gate=aborts, progress_gate=counts).start()
    b = await FakeEngine("b", first_token=200, holds=(0,)).start()
    policy = MoveOnce(to_engine="b")
    runtime = await make_runtime(redis_url, [a, b], policy, health_timeout_s=30.0)
    run = new_run()
    try:
        await runtime.submit(run, [spec("g0", n=2, max_tokens=MAX_TOKENS, run_id=run)])

        async def abort_sent() -> bool:
            return bool(a.aborts)

        await eventually(abort_sent, "the Abort of sample 0 on a")
        record = runtime._groups[f"{run}/g0"]
        sample = record.samples[0]
        await runtime.publish_version(run, 1)  # a's count waits for the test
        aborts.set()

        async def resumed() -> bool:
            return len(sample.token_ids) > len(KEPT)

        await eventually(resumed, "sample 0 to make tokens on b")
        counts.set()

        async def settled() -> bool:
            return all(m.end is not None for m in sample.made_before)

        await eventually(settled, "a's count of what the sample made there")
        labels = [(v.version, v.length) for v in sample.labels()]
        made_on_b = len(sample.token_ids) - len(KEPT)
        await runtime.cancel(run, ["g0"])
    finally:
        aborts.set()
        counts.set()
        await stop_all(runtime, a, b)
    assert labels == [(0, len(KEPT)), (1, made_on_b)]
