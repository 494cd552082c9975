"""The scheduler runtime against fake engines (see fakes.py for what is faked) and the
session's real Redis."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, cast

import grpc
import pytest
import redis.asyncio as aioredis
import redis.exceptions
from rollserve.client.types import SchedulerStatus
from rollserve.client.wire import GroupResult, GroupStatus, decode_entry, stream_key, version_key
from rollserve.scheduler.core.policy import Policy, create_policy
from rollserve.scheduler.core.snapshot import Plan, QueuedGroup, Snapshot
from rollserve.scheduler.engines import EngineHandle
from rollserve.scheduler.lease import LEASE_KEY
from rollserve.scheduler.runtime import (
    MAX_PLAN_PACE_S,
    FleetFull,
    QueueFull,
    SchedulerRuntime,
    VersionBehind,
    plan_pace,
)
from rollserve.scheduler.settings import EngineEndpoint, SchedulerSettings
from rollserve.scheduler.state import GroupSpec
from rollserve.scheduler.store import DuplicateGroup, Store
from rollserve.scheduler.validation import ValidationError
from rollserve.v1 import rollserve_pb2 as pb
from rollserve.v1 import rollserve_pb2_grpc as pb_grpc

from tests.unit.builders import spec
from tests.unit.fakes import AbortOutcome, Behaviour, FakeEngine

WAIT_S = 30.0
POLL_S = 0.01


def new_run() -> str:
    return f"u-{uuid.uuid4().hex[:10]}"


async def make_runtime(
    redis_url: str,
    engines: Sequence[FakeEngine],
    instance: Policy | None = None,
    **overrides: object,
) -> SchedulerRuntime:
    """A started runtime on ``engines``, with the policy ``instance`` or the one the settings
    name; its length history has a namespace of its own unless ``predictor_namespace`` is
    given."""
    settings = SchedulerSettings.model_validate(
        {
            "redis_url": redis_url,
            "engines": [EngineEndpoint(engine_id=e.engine_id, address=e.address) for e in engines],
            "health_interval_s": 0.1,
            "health_timeout_s": 1.0,
            "predictor_namespace": f"ns-{uuid.uuid4().hex[:10]}",
            **overrides,
        }
    )
    store = Store.from_url(redis_url, predictor_namespace=settings.predictor_namespace)
    runtime = SchedulerRuntime(settings, store, instance or create_policy(settings.policy))
    await runtime.start()
    return runtime


async def eventually(predicate: Callable[[], Awaitable[bool]], what: str) -> None:
    """Polls until ``predicate`` holds; fails the test after WAIT_S."""
    for _ in range(int(WAIT_S / POLL_S)):
        if await predicate():
            return
        await asyncio.sleep(POLL_S)
    pytest.fail(f"timed out waiting for {what}")


async def read_stream(redis_url: str, run_id: str, count: int) -> list[GroupResult]:
    client = aioredis.Redis.from_url(redis_url)
    try:

        async def arrived() -> bool:
            return int(await client.xlen(stream_key(run_id))) >= count

        await eventually(arrived, f"{count} stream entries")
        entries = cast(
            list[tuple[bytes, dict[bytes, bytes]]], await client.xrange(stream_key(run_id))
        )
        return [decode_entry(fields) for _, fields in entries]
    finally:
        await client.aclose()


def running(runtime: SchedulerRuntime, count: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return runtime.status().inflight_groups >= count

    return check


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    fake = await FakeEngine("e0").start()
    yield fake
    await fake.stop()


def specs(run_id: str, count: int, n: int = 2, max_tokens: int = 8) -> list[GroupSpec]:
    return [spec(f"g{i}", n=n, max_tokens=max_tokens, run_id=run_id) for i in range(count)]


async def test_groups_are_delivered_whole_and_once(redis_url: str, engine: FakeEngine) -> None:
    runtime = await make_runtime(redis_url, [engine])
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 5, n=3))
        results = await read_stream(redis_url, run, 5)
        await asyncio.sleep(0.2)
        assert len(await read_stream(redis_url, run, 5)) == 5
    finally:
        await runtime.stop()
    assert sorted(r.group_id for r in results) == [f"g{i}" for i in range(5)]
    for r in results:
        assert r.status == GroupStatus.DELIVERED and len(r.samples) == 3
        assert all(s.token_ids == [100 + t for t in range(6)] for s in r.samples)
        assert all(len(s.logprobs) == 6 for s in r.samples)
    assert runtime.counters.groups_delivered == 5
    assert runtime.counters.samples_delivered == 15
    assert runtime._outputs is not None and len(runtime._outputs) == 0  # no engine drafts
    # the metrics endpoint's distributions: a latency per group, a length per sample
    latency, lengths, staleness, plans = runtime.histograms
    assert latency.count == 5
    assert latency.sum == pytest.approx(sum(r.latency_s for r in results))
    assert (lengths.count, lengths.sum) == (15, 15 * 6)
    assert dict(lengths.cumulative())["16.0"] == 15  # 6 tokens each: the first bucket
    assert (staleness.count, staleness.sum) == (15 * 6, 0)  # no publish: all on-policy
    assert plans.name == "plan_seconds" and plans.count >= 1  # (5 groups took a plan or more)


def test_a_slow_plan_is_followed_by_a_wait_as_long_up_to_a_quarter_second() -> None:
    settings = SchedulerSettings(redis_url="redis://x:1")
    assert settings.plan_pace_from_s == 0.02
    assert plan_pace(0.02, settings) == 0.0  # (shallow queues: no wait)
    assert plan_pace(0.08, settings) == 0.08
    assert plan_pace(3.0, settings) == MAX_PLAN_PACE_S == 0.25
    assert plan_pace(0.001, settings.model_copy(update={"plan_pace_from_s": 0.0})) == 0.001


class _SlowPlans:
    """A policy that takes ``least_outstanding``'s plans, each after a busy wait (a deep
    queue's plan, in time) and counts them."""

    def __init__(self) -> None:
        self._inner = create_policy("least_outstanding")
        self.name = "slow"
        self.whole_groups = True
        self.moves_running = False
        self.uses_predictions = False
        self.plans = 0

    def plan(self, snapshot: Snapshot) -> Plan:
        self.plans += 1
        began = time.perf_counter()
        while time.perf_counter() - began < 0.03:
            pass
        return self._inner.plan(snapshot)


async def test_groups_come_in_while_paced_plans_wait_are_all_placed(redis_url: str) -> None:
    """Every plan is followed by a wait (``plan_pace_from_s`` 0): groups submitted and samples
    finished during the waits are placed by the plans after them, none left queued."""
    engine = await FakeEngine("e0", max_num_seqs=2, step_s=0.01).start()
    policy = _SlowPlans()
    runtime = await make_runtime(redis_url, [engine], policy, plan_pace_from_s=0.0)
    run = new_run()
    try:
        for i in range(4):
            await runtime.submit(run, [spec(f"g{i}", n=2, run_id=run)])
        results = await read_stream(redis_url, run, 4)
        assert sorted(r.group_id for r in results) == [f"g{i}" for i in range(4)]
        assert all(r.status == GroupStatus.DELIVERED for r in results)
        assert policy.plans >= 2  # (the engine takes one group at a time, near enough)
    finally:
        await runtime.stop()
        await engine.stop()


async def test_a_probe_answered_before_a_failure_does_not_put_the_engine_back(
    redis_url: str, engine: FakeEngine
) -> None:
    """A health probe in flight when a call to the engine breaks answers SERVING from before
    the failure: the engine stays out until a later probe. Faked: the probe's answer (held
    until the failure is in)."""
    runtime = await make_runtime(redis_url, [engine], health_interval_s=60)
    try:
        handle = runtime._engines["e0"]
        assert handle.healthy
        asked, answer = asyncio.Event(), asyncio.Event()

        async def late_probe(timeout_s: float, look: bool = False) -> bool:
            asked.set()
            await answer.wait()
            return False

        handle.probe = late_probe  # type: ignore[method-assign]
        probe = asyncio.create_task(runtime._probe(handle))
        await asyncio.wait_for(asked.wait(), WAIT_S)
        await runtime._engine_down(handle, "UNAVAILABLE: a call broke")
        answer.set()
        await asyncio.wait_for(probe, WAIT_S)
        assert not handle.healthy
    finally:
        await runtime.stop()


async def test_a_probe_that_fails_after_a_later_one_answered_leaves_the_engine_in(
    redis_url: str, engine: FakeEngine
) -> None:
    """Two probes out at once (a health round, a registration): the earlier one fails after
    the later one found the engine serving, as when it went to a process that has exited
    since. The engine stays in service (with one failure to count, it was taken out and its
    work requeued). Faked: the earlier probe's answer (held, then a failure)."""
    runtime = await make_runtime(redis_url, [engine], health_interval_s=60, health_failures=1)
    try:
        handle = runtime._engines["e0"]
        real_probe = handle.probe
        asked, answer = asyncio.Event(), asyncio.Event()

        async def probe(timeout_s: float, look: bool = False) -> bool:
            task = asyncio.current_task()
            if task is not None and task.get_name() == "earlier":
                asked.set()
                await answer.wait()
                raise RuntimeError("UNAVAILABLE: that process is gone")
            return await real_probe(timeout_s, look)

        handle.probe = probe  # type: ignore[method-assign]
        earlier = asyncio.create_task(runtime._probe(handle), name="earlier")
        await asyncio.wait_for(asked.wait(), WAIT_S)
        await runtime._probe(handle)
        answer.set()
        await asyncio.wait_for(earlier, WAIT_S)
        healthy, failures = handle.healthy, runtime.counters.engine_failures
    finally:
        await runtime.stop()
    assert healthy and failures == 0


async def test_engine_dying_midstream_requeues_to_another_engine(redis_url: str) -> None:
    # Down for good once it dies (else a probe could find it serving again and hand it the
    # group a second time before "healthy" joins: attempts 3).
    dying = await FakeEngine("dying", behaviour=Behaviour.DIE_MID_STREAM, stays_down=True).start()
    healthy = await FakeEngine("healthy", step_s=0.01).start()
    # Only the dying engine at first, so the group surely lands there.
    runtime = await make_runtime(redis_url, [dying])
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 1))

        async def engine_failed() -> bool:
            return runtime.counters.engine_failures > 0

        await eventually(engine_failed, "the engine failure")
        await runtime.register_engine("healthy", healthy.address)
        [result] = await read_stream(redis_url, run, 1)
    finally:
        await runtime.stop()
        await dying.stop()
        await healthy.stop()
    assert result.status == GroupStatus.DELIVERED
    assert result.attempts == 2
    assert {s.engine_id for s in result.samples} == {"healthy"}
    # Partial tokens from the dead engine were dropped, not glued to the new run.
    assert all(s.token_ids == [100 + t for t in range(6)] for s in result.samples)


async def test_registered_engines_down_and_silent_leave_the_fleet_which_has_a_limit(
    redis_url: str,
) -> None:
    """A registered engine that is down and sends no heartbeat leaves after
    ``forget_engine_after_s`` (at least five heartbeat periods, here 0.5 s); one that is up,
    or one of the settings, stays. A full fleet refuses a new engine, not one it knows."""
    static = await FakeEngine("static").start()
    up = await FakeEngine("up").start()
    gone = await FakeEngine("gone").start()
    runtime = await make_runtime(
        redis_url,
        [static],
        max_engines=3,
        forget_engine_after_s=0.2,
        heartbeat_interval_ms=100,
        health_failures=1,
    )
    try:
        await runtime.register_engine("up", up.address)
        await runtime.register_engine("gone", gone.address)
        with pytest.raises(
            FleetFull, match=r"the fleet has 3 engines of at most 3 \(max_engines\)"
        ):
            await runtime.register_engine("more", "127.0.0.1:1")
        await runtime.register_engine("up", up.address)  # known: no room needed
        await static.stop()
        await gone.stop()

        def engine_ids() -> set[str]:
            return {e.engine_id for e in runtime.status().engines}

        async def left() -> bool:
            return "gone" not in engine_ids()

        await eventually(left, "the silent engine to leave")
        assert engine_ids() == {"static", "up"}
        assert not runtime.failed.is_set()
        await runtime.register_engine("more", up.address)  # room again
    finally:
        await runtime.stop()
        await up.stop()


async def test_an_engine_whose_stats_make_no_sense_stays_out_and_limits_nothing(
    redis_url: str, engine: FakeEngine
) -> None:
    """An engine that says its context is 0 tokens would refuse every Submit of every run
    (the limits are the engines' minimum): it stays out of service, its error naming the
    field, and the others' limits hold."""
    odd = await FakeEngine("odd", max_model_len=0).start()
    runtime = await make_runtime(redis_url, [engine], health_failures=1)
    try:
        await runtime.register_engine("odd", odd.address)

        def odd_view() -> pb.EngineStatus:
            (view,) = (e for e in runtime.status().engines if e.engine_id == "odd")
            return view

        async def probed() -> bool:
            return "max_model_len (0) must be >= 2" in odd_view().last_error

        await eventually(probed, "the odd engine's probe")
        assert not odd_view().healthy
        assert runtime.limits().max_model_len == engine.max_model_len
        run = new_run()
        await runtime.submit(run, specs(run, 1))
        assert len(await read_stream(redis_url, run, 1)) == 1
    finally:
        await runtime.stop()
        await odd.stop()


@pytest.mark.parametrize(
    ("defect", "words"),
    [
        ({"first_token": 995}, "token id 1000 for sample"),
        ({"ignores_max_tokens": True, "tokens_per_sample": 12}, "past its max_tokens (8)"),
        ({"logprobs_short_by": 1}, "tokens with 2 logprobs for sample"),
        ({"says_prompt_tokens": -5}, "says its prompt had -5 tokens, 0 of them cached"),
    ],
)
async def test_an_engine_that_breaks_the_contract_goes_out_and_its_groups_run_elsewhere(
    redis_url: str, engine: FakeEngine, defect: dict[str, Any], words: str
) -> None:
    """Output the Engine API does not allow (ids past the engine's vocabulary, tokens past
    max_tokens, logprobs that do not match the tokens) never reaches the stream: the engine
    goes out of service, naming what it sent, and its groups are delivered by the other."""
    bad = await FakeEngine("bad", **defect).start()
    runtime = await make_runtime(redis_url, [bad, engine], health_failures=100)
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 6, n=2, max_tokens=8))
        results = await read_stream(redis_url, run, 6)
        (bad_view,) = (e for e in runtime.status().engines if e.engine_id == "bad")
    finally:
        await runtime.stop()
        await bad.stop()
    assert bad.requests, "the bad engine was given no work"
    assert not bad_view.healthy and words in bad_view.last_error, bad_view.last_error
    for result in results:
        assert result.status == GroupStatus.DELIVERED, result.error
        for sample in result.samples:
            assert sample.token_ids == [100 + t for t in range(6)]
            assert len(sample.logprobs) == 6


async def test_group_fails_with_reason_after_max_attempts(redis_url: str) -> None:
    dying = await FakeEngine("dying", behaviour=Behaviour.DIE_MID_STREAM).start()
    runtime = await make_runtime(redis_url, [dying], max_attempts=2, health_failures=100)
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 1))
        # It comes back healthy at the next probe, fails again, and then the group fails.
        [result] = await read_stream(redis_url, run, 1)
    finally:
        await runtime.stop()
        await dying.stop()
    assert result.status == GroupStatus.FAILED
    assert "2 attempts failed" in result.error and "fake engine died" in result.error
    assert result.samples == []
    assert runtime.counters.groups_failed == 1


@pytest.mark.parametrize(
    ("behaviour", "message"),
    [
        (Behaviour.REJECT, "fake engine rejects it"),  # the call refused: INVALID_ARGUMENT
        (Behaviour.FATAL_ERROR, "fake engine cannot do it"),  # an Error message, not retryable
    ],
)
async def test_a_non_retryable_engine_failure_fails_the_group_without_retry(
    redis_url: str, behaviour: Behaviour, message: str
) -> None:
    engine = FakeEngine("e", behaviour=behaviour)
    result, runtime = await one_group(redis_url, engine)
    assert result.status == GroupStatus.FAILED and message in result.error
    assert len(engine.requests) == 1 and runtime.counters.engine_failures == 0


async def test_a_call_the_engine_fails_alone_is_retried_and_the_engine_serves_on(
    redis_url: str,
) -> None:
    """One call failed with a retryable error (one request vLLM could not finish): its
    group runs again, and the engine's other call goes on (taken out of service, the
    engine lost every running sample's tokens with it)."""
    engine = await FakeEngine("e", failing_calls=1, step_s=0.2).start()
    runtime = await make_runtime(redis_url, [engine])
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 2))
        results = await read_stream(redis_url, run, 2)
    finally:
        await runtime.stop()
        await engine.stop()
    attempts = sorted(r.attempts for r in results)
    assert all(r.status is GroupStatus.DELIVERED for r in results) and attempts == [1, 2]
    assert len(engine.requests) == 3 and runtime.counters.engine_failures == 0


async def test_an_engine_whose_calls_keep_failing_is_taken_out_of_service(
    redis_url: str,
) -> None:
    engine = FakeEngine("e", failing_calls=3)
    result, runtime = await one_group(redis_url, engine)
    assert result.status is GroupStatus.FAILED and "3 attempts failed" in result.error
    assert "3 calls failed so within 60 s" in result.error
    assert runtime.counters.engine_failures == 1  # (at the third)


async def one_group(redis_url: str, engine: FakeEngine) -> tuple[GroupResult, SchedulerRuntime]:
    """One group of one run through a runtime on ``engine`` alone: what reached the stream,
    and the runtime (stopped) for its counters."""
    await engine.start()
    runtime = await make_runtime(redis_url, [engine])
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 1))
        [result] = await read_stream(redis_url, run, 1)
    finally:
        await runtime.stop()
        await engine.stop()
    return result, runtime


async def test_each_delivered_sample_carries_its_speculation_counts(redis_url: str) -> None:
    result, _ = await one_group(redis_url, FakeEngine("e", spec=(8, 3, 2)))
    assert result.status == GroupStatus.DELIVERED
    assert [
        (s.spec_proposed_tokens, s.spec_accepted_tokens, s.spec_drafts) for s in result.samples
    ] == [(8, 3, 2)] * len(result.samples)


@pytest.mark.parametrize("logprob", [float("nan"), float("-inf")])
async def test_a_logprob_that_is_not_finite_fails_the_group_with_the_reason(
    redis_url: str, logprob: float
) -> None:
    """NaN cannot be written to the stream's JSON (it would read as null and the SDK could not
    decode the group), and it would poison a trainer's update: the group fails instead, and
    the engine is not blamed as down."""
    result, runtime = await one_group(redis_url, FakeEngine("e", logprob=logprob))
    assert result.status == GroupStatus.FAILED
    assert f"engine e sent unusable output: a logprob of {logprob} for token 0" in result.error
    assert runtime.counters.engine_failures == 0


async def test_cancel_running_group_aborts_engine_call_and_never_delivers(
    redis_url: str,
) -> None:
    hanging = await FakeEngine("slow", behaviour=Behaviour.HANG).start()
    runtime = await make_runtime(redis_url, [hanging])
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 2))
        await eventually(running(runtime, 2), "2 running groups")

        async def hanging_there() -> bool:  # a cancel before a call reached it goes unseen
            return hanging.hanging >= 2

        await eventually(hanging_there, "both calls hanging on the engine")
        cancelled, unknown = await runtime.cancel(run, ["g0", "g1", "nope"])
        assert sorted(cancelled) == ["g0", "g1"] and unknown == ["nope"]

        async def aborted() -> bool:
            return hanging.cancelled >= 2

        await eventually(aborted, "the engine to see both calls cancelled")
        status = runtime.status()
    finally:
        await runtime.stop()
        await hanging.stop()
    assert status.inflight_groups == 0 and status.groups_cancelled == 2
    client = aioredis.Redis.from_url(redis_url)
    assert await client.xlen(stream_key(run)) == 0
    await client.aclose()


async def test_restart_recovers_pending_groups_and_never_duplicates(
    redis_url: str, engine: FakeEngine
) -> None:
    hanging = await FakeEngine("slow", behaviour=Behaviour.HANG).start()
    first = await make_runtime(redis_url, [hanging])
    run = new_run()
    await first.submit(run, specs(run, 3))
    await eventually(running(first, 3), "3 running groups")
    await first.stop()  # as if the process died: nothing was delivered
    await hanging.stop()
    second = await make_runtime(redis_url, [engine])
    try:
        results = await read_stream(redis_url, run, 3)
        with pytest.raises(DuplicateGroup):
            await second.submit(run, specs(run, 1))
    finally:
        await second.stop()
    assert sorted(r.group_id for r in results) == ["g0", "g1", "g2"]


@pytest.mark.parametrize("retried", [True, False])
async def test_a_submit_whose_answer_was_lost_is_queued(
    redis_url: str, engine: FakeEngine, retried: bool
) -> None:
    """Redis took the Submit's groups and the answer was lost (a connection reset): the
    caller saw UNAVAILABLE, and its retry is refused as a duplicate. The groups are queued
    as Redis holds them, retried or not: they waited for a restart of the scheduler."""
    runtime = await make_runtime(redis_url, [engine])
    real = runtime._store.add_pending
    answers = [redis.exceptions.ConnectionError("Connection reset by peer")]

    async def add_pending(run_id: str, groups: Sequence[GroupSpec]) -> None:
        await real(run_id, groups)
        if answers:
            raise answers.pop()

    runtime._store.add_pending = add_pending  # type: ignore[assignment]
    run = new_run()
    try:
        with pytest.raises(redis.exceptions.ConnectionError):
            await runtime.submit(run, specs(run, 2))
        if retried:
            with pytest.raises(DuplicateGroup):
                await runtime.submit(run, specs(run, 2))  # the retry: both were taken
        results = await read_stream(redis_url, run, 2)
        with pytest.raises(DuplicateGroup):  # once delivered, nothing more runs
            await runtime.submit(run, specs(run, 2))
        await asyncio.sleep(0.2)
        assert runtime.status().inflight_groups == 0
    finally:
        await runtime.stop()
    assert sorted(r.group_id for r in results) == ["g0", "g1"]
    assert all(r.status is GroupStatus.DELIVERED for r in results)


async def test_a_duplicate_of_a_group_being_delivered_does_not_run_it_again(
    redis_url: str, engine: FakeEngine
) -> None:
    """A group out of memory whose entry is being written is still pending in Redis: a
    duplicate Submit then is not taken for one whose answer was lost."""
    runtime = await make_runtime(redis_url, [engine])
    writing, gate = asyncio.Event(), asyncio.Event()
    real = runtime._store.deliver

    async def deliver(result: GroupResult) -> str | None:
        writing.set()
        await gate.wait()
        return await real(result)

    runtime._store.deliver = deliver  # type: ignore[method-assign]
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 1))
        await asyncio.wait_for(writing.wait(), WAIT_S)
        with pytest.raises(DuplicateGroup):
            await runtime.submit(run, specs(run, 1))
        assert runtime.status().queue_depth == 0 and not runtime._groups
        gate.set()
        [result] = await read_stream(redis_url, run, 1)
    finally:
        await runtime.stop()
    assert result.status is GroupStatus.DELIVERED


async def test_store_delivery_is_idempotent(redis_url: str) -> None:
    store = Store.from_url(redis_url)
    run = new_run()
    [group] = specs(run, 1)
    await store.add_pending(run, [group])
    result = GroupResult(run_id=run, group_id="g0", status=GroupStatus.DELIVERED)
    try:
        first = await store.deliver(result)
        again = await store.deliver(result)
        assert first is not None and again is None
        assert all(s.run_id != run for s in await store.load_pending())
        with pytest.raises(DuplicateGroup):
            await store.add_pending(run, [group])
    finally:
        await store.close()
    client = aioredis.Redis.from_url(redis_url)
    assert await client.xlen(stream_key(run)) == 1
    await client.aclose()


async def test_queue_full_refuses_whole_batch(redis_url: str) -> None:
    runtime = await make_runtime(redis_url, [], max_queued_groups=3)
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 2))
        with pytest.raises(QueueFull, match="room for 1"):
            await runtime.submit(run, [spec(f"x{i}", run_id=run) for i in range(2)])
        assert runtime.status().queue_depth == 2
        await runtime.cancel(run, ["g0", "g1"])  # leave nothing pending in Redis
    finally:
        await runtime.stop()


def gate_store_call(runtime: SchedulerRuntime, name: str) -> asyncio.Event:
    """Holds the answer of the runtime store's ``name`` (done in Redis) until the event is
    set: a caller that goes meanwhile goes after Redis made the change."""
    gate = asyncio.Event()
    real = getattr(runtime._store, name)

    async def gated(*args: Any) -> Any:
        answer = await real(*args)
        await gate.wait()
        return answer

    setattr(runtime._store, name, gated)
    return gate


async def test_a_cancel_whose_caller_goes_still_stops_the_groups(redis_url: str) -> None:
    """The caller goes once Redis has ended the group: the scheduler still takes it out and
    the engine aborts it (it ran on, to a delivery Redis refused)."""
    gate = asyncio.Event()
    engine = await FakeEngine("e0", second_half_gate=gate).start()
    runtime = await make_runtime(redis_url, [engine])
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 1))
        await eventually(running(runtime, 1), "the group to run")
        answer = gate_store_call(runtime, "cancel")
        cancelling = asyncio.create_task(runtime.cancel(run, ["g0"]))
        await asyncio.sleep(0.05)
        cancelling.cancel()
        answer.set()

        async def aborted() -> bool:
            return engine.cancelled >= 1 and runtime.status().inflight_groups == 0

        await eventually(aborted, "the engine to abort the cancelled group")
        status = runtime.status()
    finally:
        gate.set()
        await runtime.stop()
        await engine.stop()
    assert cancelling.cancelled()
    assert status.groups_cancelled == 1 and status.groups_delivered == 0


async def test_a_publish_whose_caller_goes_still_counts_the_version(redis_url: str) -> None:
    """The caller goes once Redis has stored the version: the scheduler still takes it as
    the run's (it kept labelling tokens with the old one while Redis had the new)."""
    runtime = await make_runtime(redis_url, [])
    run = new_run()
    try:
        await runtime.publish_version(run, 1)
        answer = gate_store_call(runtime, "publish_version")
        publishing = asyncio.create_task(runtime.publish_version(run, 2))
        await asyncio.sleep(0.05)
        publishing.cancel()
        answer.set()

        async def counted() -> bool:
            return runtime.policy_version(run) == 2

        await eventually(counted, "the scheduler to count version 2")
    finally:
        await runtime.stop()
    assert publishing.cancelled()


async def test_a_delivery_redis_refuses_for_a_while_is_retried(redis_url: str) -> None:
    """Redis answers the first delivery with an error (a replica turned read-only, out of
    memory under noeviction): the write is retried and the group delivered once (given up,
    it stayed pending in Redis, out of memory, never delivered). Faked: the first answer."""
    engine = await FakeEngine("e0").start()
    runtime = await make_runtime(redis_url, [engine])
    real_deliver = runtime._store.deliver
    refusals: list[str] = []

    async def deliver(result: GroupResult) -> str | None:
        if not refusals:
            refusals.append(result.group_id)
            raise redis.exceptions.ReadOnlyError("You can't write against a read only replica.")
        return await real_deliver(result)

    runtime._store.deliver = deliver  # type: ignore[method-assign]
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 1))
        [result] = await read_stream(redis_url, run, 1)
        failed = runtime.failed.is_set()
    finally:
        await runtime.stop()
        await engine.stop()
    assert refusals == ["g0"] and result.group_id == "g0" and not failed


def refuse_for_good(runtime: SchedulerRuntime, refuses: Callable[[str], bool]) -> None:
    """Redis answers WRONGTYPE (an answer no retry changes) to the deliveries of the groups
    ``refuses`` says so of, by group id, and takes the others."""
    real_deliver = runtime._store.deliver

    async def deliver(result: GroupResult) -> str | None:
        if refuses(result.group_id):
            raise redis.exceptions.ResponseError(
                "WRONGTYPE Operation against a key holding the wrong kind of value"
            )
        return await real_deliver(result)

    runtime._store.deliver = deliver  # type: ignore[method-assign]


async def test_a_delivery_no_retry_can_pass_is_tried_once_and_said(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis answers a delivery with an error no retry changes (the stream's key holds a
    string): the write is not retried (it was, every 2 s for good, as for an outage), the
    error is logged with the group, and the scheduler goes on. Faked: the answer."""
    caplog.set_level(logging.WARNING, logger="rollserve")
    engine = await FakeEngine("e0").start()
    runtime = await make_runtime(redis_url, [engine])
    tries: list[str] = []

    def refuses(group_id: str) -> bool:
        tries.append(group_id)
        return group_id == "bad"

    refuse_for_good(runtime, refuses)
    run = new_run()
    try:
        await runtime.submit(run, [spec("bad", run_id=run)])

        async def said() -> bool:
            return any("not retried" in r.getMessage() for r in caplog.records)

        await eventually(said, "the refusal to be logged")
        await runtime.submit(run, [spec("good", run_id=run)])
        [result] = await read_stream(redis_url, run, 1)
        failed = runtime.failed.is_set()
        pending = await runtime._store.load_pending()
        await runtime._store.cancel(run, ["bad"])  # (else the next test's scheduler runs it)
    finally:
        await runtime.stop()
        await engine.stop()
    assert [s.group_id for s in pending if s.run_id == run] == ["bad"]  # for a restart
    assert tries == ["bad", "good"] and result.group_id == "good" and not failed


async def test_length_history_redis_refuses_is_kept_and_the_scheduler_stops_cleanly(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis refuses every save of the length history (out of memory): groups are still
    delivered, what was learnt is kept for a later save, and the scheduler still stops
    cleanly, releasing its lease (the save at stop raised, which left the engines' channels
    open and the lease to expire). Faked: the refusals, and the engine."""
    caplog.set_level(logging.WARNING, logger="rollserve")
    engine = await FakeEngine("e0").start()
    runtime = await make_runtime(redis_url, [engine])
    saved: list[list[str]] = []

    async def save_history(records: Mapping[str, bytes], globals_: bytes, max_keys: int) -> int:
        saved.append(sorted(records))
        raise redis.exceptions.OutOfMemoryError("command not allowed when used memory > maxmemory")

    runtime._store.save_history = save_history  # type: ignore[method-assign]
    run = new_run()
    client = aioredis.Redis.from_url(redis_url)
    try:
        await runtime.submit(run, [spec("first", run_id=run)])
        await read_stream(redis_url, run, 1)
        await runtime.submit(run, [spec("second", run_id=run)])
        await read_stream(redis_url, run, 2)
        await runtime.stop()  # saves what is left: refused too
        lease = await client.get(LEASE_KEY)
    finally:
        await runtime.stop()
        await engine.stop()
        await client.aclose()
    assert saved[-1] == ["key-first", "key-second"] and lease is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_groups_ended_by_a_registration_are_written_without_holding_it(
    redis_url: str,
) -> None:
    """An engine registers at a new address while a group that has no attempt left runs on
    its old one: the group fails, the registration answers at once although Redis is slow,
    and the ending is written once Redis answers (awaited, the write held the registration
    past its deadline, and cut off with it, the group was out of memory and pending in Redis).
    Faked: Redis's slowness (the delivery waits for the test)."""
    old = await FakeEngine("a", behaviour=Behaviour.HANG).start()
    new = await FakeEngine("a").start()
    runtime = await make_runtime(redis_url, [old], max_attempts=1)
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 1))

        async def hanging() -> bool:
            return old.hanging > 0

        await eventually(hanging, "the group to run on the old engine")
        answer = gate_store_call(runtime, "deliver")
        await asyncio.wait_for(runtime.register_engine("a", new.address), 5.0)
        answer.set()
        [result] = await read_stream(redis_url, run, 1)
    finally:
        await runtime.stop()
        await old.stop()
        await new.stop()
    assert result.status == GroupStatus.FAILED and "re-registered" in result.error


async def test_one_ending_redis_refuses_for_good_leaves_the_others_written(
    redis_url: str,
) -> None:
    """An engine re-registers while two groups with no attempt left run on it: Redis refuses
    the first ending for good (WRONGTYPE); the second is still written (the first refusal
    ended the loop, and the rest stayed pending in Redis). Faked: that refusal."""
    old = await FakeEngine("a", behaviour=Behaviour.HANG).start()
    new = await FakeEngine("a").start()
    runtime = await make_runtime(redis_url, [old], max_attempts=1)
    refused: list[str] = []

    def refuses(group_id: str) -> bool:  # the first ending only
        if refused:
            return False
        refused.append(group_id)
        return True

    refuse_for_good(runtime, refuses)
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 2))

        async def hanging() -> bool:
            return old.hanging >= 2

        await eventually(hanging, "both groups to run on the old engine")
        await runtime.register_engine("a", new.address)
        [result] = await read_stream(redis_url, run, 1)
        await runtime._store.cancel(run, refused)  # (else the next test's scheduler runs it)
    finally:
        await runtime.stop()
        await old.stop()
        await new.stop()
    assert result.group_id != refused[0] and result.status == GroupStatus.FAILED


async def test_publishes_at_once_each_cap_the_tokens_made_before_them(redis_url: str) -> None:
    """Two publishes without weights at once (v1, v2): the tokens made before v2 count as v1,
    not v0 (each read the version before them, 0, before Redis answered)."""
    engine = await FakeEngine("e0", holds=(0,), made_ahead=2).start()
    runtime = await make_runtime(redis_url, [engine])
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 1, n=1))
        await eventually(running(runtime, 1), "the sample to run")
        [record] = runtime._groups.values()

        async def counted() -> bool:
            return all(m.end is not None for m in record.samples[0].made_before)

        # v1 is stored and its answer held while v2 is published
        answers = gate_store_call(runtime, "publish_version")
        client = aioredis.Redis.from_url(redis_url)
        first = asyncio.create_task(runtime.publish_version(run, 1))

        async def stored() -> bool:
            return await client.get(version_key(run)) == b"1"

        await eventually(stored, "version 1 in Redis")
        await client.aclose()
        second = asyncio.create_task(runtime.publish_version(run, 2))
        await asyncio.sleep(0.05)
        answers.set()
        await asyncio.wait_for(asyncio.gather(first, second), WAIT_S)
        await eventually(counted, "the engine to count what the sample made")
        made = [m.version for m in record.samples[0].made_before]
        await runtime.cancel(run, ["g0"])
    finally:
        await runtime.stop()
        await engine.stop()
    assert made == [0, 1]


async def test_submits_at_once_do_not_overfill_the_queue(redis_url: str) -> None:
    """Two Submits that each fit alone, at once: the second counts the first's groups while
    Redis writes them (both were accepted: the queue held 4 of at most 3)."""
    runtime = await make_runtime(redis_url, [], max_queued_groups=3, max_held_prompt_tokens=17)
    run = new_run()
    try:
        outcomes = await asyncio.gather(
            runtime.submit(run, specs(run, 2)),
            runtime.submit(run, [spec(f"x{i}", run_id=run) for i in range(2)]),
            return_exceptions=True,
        )
        depth = runtime.status().queue_depth
        accepted = ["g0", "g1"] if outcomes[0] is None else ["x0", "x1"]
        await runtime.cancel(run, accepted)  # leave nothing pending in Redis
    finally:
        await runtime.stop()
    assert depth == 2
    assert sorted(type(o).__name__ for o in outcomes) == ["NoneType", "QueueFull"]


async def test_prompt_tokens_held_past_the_limit_refuse_the_whole_batch(redis_url: str) -> None:
    """Groups are held in memory until delivered: their prompt tokens are bounded, and a
    group that ends (here: cancelled) frees its share."""
    runtime = await make_runtime(redis_url, [], max_held_prompt_tokens=17)  # 3 groups of 5
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 2))
        with pytest.raises(QueueFull, match=r"hold 10 prompt tokens of at most 17.* 10 do not"):
            await runtime.submit(run, [spec(f"x{i}", run_id=run) for i in range(2)])
        assert runtime.status().queue_depth == 2
        await runtime.cancel(run, ["g0"])
        await runtime.submit(run, [spec(f"x{i}", run_id=run) for i in range(2)])
        assert runtime.status().queue_depth == 3
        await runtime.cancel(run, ["g1", "x0", "x1"])
    finally:
        await runtime.stop()


async def test_a_batch_no_queue_takes_is_refused_as_invalid_not_full(redis_url: str) -> None:
    """More groups, or prompt tokens, than the queue holds when empty: a retry would never
    pass, so it is no RESOURCE_EXHAUSTED (retry later) but INVALID_ARGUMENT, naming the
    setting."""
    runtime = await make_runtime(redis_url, [], max_queued_groups=3, max_held_prompt_tokens=9)
    run = new_run()
    try:
        with pytest.raises(
            ValidationError, match=r"groups has 4 groups; the queue holds at most 3 \(max_queued"
        ):
            await runtime.submit(run, specs(run, 4))
        with pytest.raises(
            ValidationError,
            match=r"these 2 groups hold 10 prompt tokens; .* at most 9 \(max_held_prompt_tokens\)",
        ):
            await runtime.submit(run, specs(run, 2))
        assert runtime.status().queue_depth == 0
    finally:
        await runtime.stop()


async def test_many_small_groups_through_a_narrow_engine_all_arrive(redis_url: str) -> None:
    # Two groups fit at a time, so every completion is followed by a dispatch: the dispatch
    # loop keeps running while groups end, and must survive every interleaving of the two.
    narrow = await FakeEngine("narrow", max_num_seqs=4, tokens_per_sample=2).start()
    runtime = await make_runtime(redis_url, [narrow], capacity_factor=1.0)
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 150, n=2, max_tokens=4))
        results = await read_stream(redis_url, run, 150)
        status = runtime.status()
    finally:
        await runtime.stop()
        await narrow.stop()
    assert len({r.group_id for r in results}) == 150
    assert status.queue_depth == 0 and status.inflight_groups == 0


async def test_a_plan_that_starts_many_calls_gives_the_loop_turns_between(
    redis_url: str,
) -> None:
    """A plan starts its calls a slice a turn of the event loop (each builds and sends its
    request in the turn after it was started): a task that runs every turn sees the count of
    started calls grow in steps, not jump from 0 to all of them (as it did: thousands at once
    held the loop for seconds, the lease's renewal waiting)."""
    wide = await FakeEngine("wide", max_num_seqs=512, step_s=0.05).start()
    runtime = await make_runtime(redis_url, [wide], capacity_factor=1.0)
    run = new_run()
    seen: list[int] = []
    watching = True

    async def watch() -> None:
        while watching:
            seen.append(runtime._calls_started)
            await asyncio.sleep(0)

    watcher = asyncio.create_task(watch())
    try:
        await runtime.submit(run, specs(run, 200, n=1, max_tokens=4))
        results = await read_stream(redis_url, run, 200)
    finally:
        watching = False
        await watcher
        await runtime.stop()
        await wide.stop()
    assert len({r.group_id for r in results}) == 200
    assert any(0 < count < 200 for count in seen), sorted(set(seen))


class Recording:
    """A real policy that also keeps every snapshot it was shown; with ``uses_predictions``,
    shown predictions even when the inner policy would not read them."""

    def __init__(self, inner: Policy, uses_predictions: bool | None = None) -> None:
        self.name = inner.name
        self.whole_groups = inner.whole_groups
        self.moves_running = inner.moves_running
        self.uses_predictions = (
            inner.uses_predictions if uses_predictions is None else uses_predictions
        )
        self._inner = inner
        self.snapshots: list[Snapshot] = []

    def plan(self, snapshot: Snapshot) -> Plan:
        self.snapshots.append(snapshot)
        return self._inner.plan(snapshot)

    def queued(self, key: str) -> list[QueuedGroup]:
        """Every view of group ``key`` in the queue, oldest first."""
        return [g for s in self.snapshots for g in s.queue if g.key == key]


@pytest.mark.parametrize("policy", ["cache_aware", "rl"])
async def test_sample_level_policies_deliver_each_group_once(redis_url: str, policy: str) -> None:
    a = await FakeEngine("a", lengths=(3, 9), step_s=0.005).start()
    b = await FakeEngine("b", lengths=(3, 9), step_s=0.005).start()
    runtime = await make_runtime(redis_url, [a, b], policy=policy, capacity_factor=0.1)
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 12, n=4, max_tokens=16))
        results = await read_stream(redis_url, run, 12)
        await asyncio.sleep(0.2)
        assert len(await read_stream(redis_url, run, 12)) == 12
        status = runtime.status()
    finally:
        await runtime.stop()
        await a.stop()
        await b.stop()
    assert sorted(r.group_id for r in results) == sorted(f"g{i}" for i in range(12))
    for r in results:
        assert r.status == GroupStatus.DELIVERED and r.attempts == 1
        assert [len(s.token_ids) for s in r.samples] == [3, 9, 3, 9]
    assert sum(len(indices) for indices in a.asked() + b.asked()) == 48  # each sample once
    assert a.requests and b.requests
    assert status.queue_depth == status.inflight_samples == 0


async def test_round_robin_spreads_groups_over_engines_and_delivers_each_once(
    redis_url: str,
) -> None:
    a = await FakeEngine("a", lengths=(3, 4, 5, 6)).start()
    b = await FakeEngine("b", lengths=(3, 4, 5, 6)).start()
    runtime = await make_runtime(redis_url, [a, b], policy="round_robin")
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 6, n=4))
        results = await read_stream(redis_url, run, 6)
        await asyncio.sleep(0.2)
        assert len(await read_stream(redis_url, run, 6)) == 6
    finally:
        await runtime.stop()
        await a.stop()
        await b.stop()
    assert sorted(r.group_id for r in results) == [f"g{i}" for i in range(6)]
    for r in results:
        assert r.status == GroupStatus.DELIVERED and r.attempts == 1
        assert [s.index for s in r.samples] == [0, 1, 2, 3]
        assert [len(s.token_ids) for s in r.samples] == [3, 4, 5, 6]
        assert {s.engine_id for s in r.samples} == {"a", "b"}  # one group, two engines
    # Every call named its samples; together they asked for each sample exactly once.
    asked = a.asked() + b.asked()
    assert all(0 < len(indices) < 4 for indices in asked)
    assert sum(len(indices) for indices in asked) == 24
    assert runtime.counters.samples_delivered == 24


@pytest.mark.parametrize("per_prompt", [16, 0])
async def test_calls_carry_the_outputs_of_their_prompt_that_the_engine_did_not_make(
    redis_url: str, per_prompt: int
) -> None:
    """Engine ``a`` drafts from earlier outputs, ``b`` does not: a call on ``a`` carries the
    outputs of its prompt that ``b`` made (``a`` made the others, and each is sent once);
    calls on ``b`` carry none, nor does a prompt with no outputs yet. None with
    ``earlier_outputs_per_prompt`` 0."""
    a = await FakeEngine("a", tokens_per_sample=4, takes_earlier_outputs=True).start()
    b = await FakeEngine("b", tokens_per_sample=4, first_token=500).start()
    runtime = await make_runtime(
        redis_url,
        [a, b],
        policy="round_robin",
        earlier_outputs_per_prompt=per_prompt,
        earlier_outputs_push=False,  # the outputs go with calls only (pushes: below)
    )
    run = new_run()
    other = dataclasses.replace(spec("other", n=4, run_id=run), prompt_token_ids=(1, 2, 3))
    try:
        for round_ in range(3):
            groups = [spec(f"g{round_}", n=4, run_id=run)] + ([other] if round_ == 1 else [])
            await runtime.submit(run, groups)
            await read_stream(redis_url, run, round_ + 1 + (round_ >= 1))
        sent = runtime.status().earlier_outputs_sent
    finally:
        await runtime.stop()
        await a.stop()
        await b.stop()
    assert all(not r.earlier_outputs for r in b.requests)
    carried = {r.request_id: [list(o.token_ids) for o in r.earlier_outputs] for r in a.requests}

    def group_of(request: pb.GenerateRequest) -> str:
        return request.request_id.split("/")[1].split("#")[0]

    made_on_b: dict[str, int] = {}
    for request, indices in zip(b.requests, b.asked(), strict=True):
        made_on_b[group_of(request)] = made_on_b.get(group_of(request), 0) + len(indices)
    assert {"g0", "g1"} <= set(made_on_b)  # round robin put samples of both on b
    expected = 0
    calls_per_group: dict[str, int] = {}
    for request in a.requests:
        outputs = carried[request.request_id]
        group = group_of(request)
        calls_per_group[group] = calls_per_group.get(group, 0) + 1
        if per_prompt == 0 or group in {"other", "g0"}:
            assert outputs == [], (request.request_id, outputs)
            continue
        # a's first call of a round carries the outputs b made in the round before
        want = made_on_b[f"g{int(group[1:]) - 1}"] if calls_per_group[group] == 1 else 0
        assert outputs == [[500, 501, 502, 503]] * want, (request.request_id, outputs)
        expected += want
    assert sent == expected and (per_prompt == 0 or expected > 0)


@pytest.mark.parametrize("case", ["push", "no-push", "takes-none", "refused"])
async def test_outputs_finished_on_one_engine_are_pushed_to_the_group_running_on_another(
    redis_url: str, case: str
) -> None:
    """``b`` finishes its share of the group at once, ``a`` runs its share for a second: the
    scheduler sends ``b``'s outputs to ``a`` while its samples run (AddOutputs), counted in
    the status; none to ``b``, whose call has ended. Nothing is pushed with the push turned
    off, nor to an engine that does not draft from outputs; a push the engine refuses loses
    nothing of the group."""
    # Edges faked: both engines (FakeEngine over real gRPC, with the standard health service).
    a = await FakeEngine(
        "a",
        tokens_per_sample=4,
        step_s=1.0,
        takes_earlier_outputs=case != "takes-none",
        refuse_pushes=case == "refused",
    ).start()
    b = await FakeEngine(
        "b", tokens_per_sample=4, first_token=500, takes_earlier_outputs=True
    ).start()
    runtime = await make_runtime(
        redis_url,
        [a, b],
        policy="round_robin",
        earlier_outputs_push=case != "no-push",
        earlier_outputs_push_interval_s=0.01,
    )
    run = new_run()
    group = spec("g0", n=4, run_id=run)
    try:
        await runtime.submit(run, [group])
        [result] = await read_stream(redis_url, run, 1)
        pushed = runtime.status().earlier_outputs_pushed
    finally:
        await runtime.stop()
        await a.stop()
        await b.stop()
    assert result.status == GroupStatus.DELIVERED
    assert [len(s.token_ids) for s in result.samples] == [4, 4, 4, 4]
    on_b = sum(len(indices) for indices in b.asked())
    assert 0 < on_b < 4 and not b.pushes
    if case in ("no-push", "takes-none"):
        assert not a.pushes and pushed == 0
        return
    prompts = [p for push in a.pushes for p in push.prompts]
    assert all(list(p.prompt_token_ids) == list(group.prompt_token_ids) for p in prompts)
    outputs = [list(o.token_ids) for p in prompts for o in p.outputs]
    assert outputs == [[500, 501, 502, 503]] * len(outputs) and pushed == len(outputs)
    # Each once, as they finished; what a refused is not counted as held by it.
    assert len(outputs) == on_b if case == "push" else len(outputs) >= 1
    assert runtime._outputs is not None
    lacks = runtime._outputs.missing(group.prompt_token_ids, "a", 1 << 20)
    assert [list(o) for o in lacks] == ([] if case == "push" else [[500, 501, 502, 503]] * on_b)


async def test_outputs_a_refused_call_carried_are_sent_with_the_next(redis_url: str) -> None:
    """``a`` refuses g1's call (INVALID_ARGUMENT, before it takes anything): the outputs of
    g0 that ``b`` made, which the call carried, are not counted as held by ``a``."""
    # Edges faked: both engines (FakeEngine over real gRPC, with the standard health service).
    a = await FakeEngine("a", tokens_per_sample=4, takes_earlier_outputs=True).start()
    b = await FakeEngine("b", tokens_per_sample=4, first_token=500).start()
    runtime = await make_runtime(
        redis_url, [a, b], policy="round_robin", earlier_outputs_push=False
    )
    run = new_run()
    # (g1 of one sample: round robin puts it on a; a sample of it on b would add to the
    # prompt's outputs, which a lacks, whenever it ended before a's refusal)
    g0, g1 = spec("g0", n=2, run_id=run), spec("g1", n=1, run_id=run)

    async def both_healthy() -> bool:  # (a first probe answered late leaves one out a while)
        return all(runtime._engines[e].healthy for e in ("a", "b"))

    try:
        await eventually(both_healthy, "both engines healthy")
        await runtime.submit(run, [g0])
        [made] = await read_stream(redis_url, run, 1)
        assert sorted(s.engine_id for s in made.samples) == ["a", "b"]  # (one each)
        a.behaviour = Behaviour.REJECT
        await runtime.submit(run, [g1])
        [_, refused] = await read_stream(redis_url, run, 2)
    finally:
        await runtime.stop()
        await a.stop()
        await b.stop()
    assert refused.status == GroupStatus.FAILED
    assert len(a.requests) == 2 and len(b.requests) == 1  # (g1 went to a alone)
    carried = [list(o.token_ids) for o in a.requests[-1].earlier_outputs]
    assert carried == [[500, 501, 502, 503]]
    assert runtime._outputs is not None
    lacks = runtime._outputs.missing(g1.prompt_token_ids, "a", 1 << 20)
    assert [list(o) for o in lacks] == carried


@pytest.mark.parametrize("interval_s", [0.01, 3600.0])
async def test_an_engine_gets_pushed_outputs_at_most_once_an_interval(
    redis_url: str, interval_s: float
) -> None:
    """``a`` runs its share of groups g0 and g1 (another prompt) for seconds, ``b`` finishes
    its share of each at once. g0's outputs reach ``a`` at once (its first push); g1's,
    submitted after, go in a second push an interval after the first: soon with a short
    interval, never while ``a`` runs them with an hour's."""
    # Edges faked: both engines (FakeEngine over real gRPC, with the standard health service).
    a = await FakeEngine("a", tokens_per_sample=4, step_s=1.5, takes_earlier_outputs=True).start()
    b = await FakeEngine(
        "b", tokens_per_sample=4, first_token=500, takes_earlier_outputs=True
    ).start()
    runtime = await make_runtime(
        redis_url, [a, b], policy="round_robin", earlier_outputs_push_interval_s=interval_s
    )
    run = new_run()
    g0 = spec("g0", n=2, run_id=run)
    g1 = dataclasses.replace(spec("g1", n=2, run_id=run), prompt_token_ids=(1, 2, 3))
    try:
        await runtime.submit(run, [g0])

        async def pushed() -> bool:
            return bool(a.pushes)

        await eventually(pushed, "g0's output pushed to a")
        await runtime.submit(run, [g1])
        await read_stream(redis_url, run, 2)
        status = runtime.status()
    finally:
        await runtime.stop()
        await a.stop()
        await b.stop()
    prompts = [[tuple(p.prompt_token_ids) for p in push.prompts] for push in a.pushes]
    if interval_s < 1:
        assert prompts == [[g0.prompt_token_ids], [g1.prompt_token_ids]]
    else:
        assert prompts == [[g0.prompt_token_ids]]
    assert status.earlier_outputs_pushed == len(prompts)  # one output of b's a group


async def test_an_engine_removed_takes_its_pusher_with_it(redis_url: str) -> None:
    """A pusher waiting out its interval for an engine that leaves (it registered again at
    another address) ends with it: left, it took the pushes due to the new engine of the id
    and dropped them as not its own. Faked: the engine."""
    a = await FakeEngine("a", takes_earlier_outputs=True).start()
    runtime = await make_runtime(redis_url, [a], earlier_outputs_push_interval_s=3600)
    try:
        handle = runtime._engines["a"]
        runtime._pushed_at["a"] = time.monotonic()
        runtime._push_due["a"] = {"run/g0"}
        pusher = asyncio.create_task(runtime._pusher(handle))
        runtime._pushers["a"] = pusher
        await asyncio.sleep(0.05)  # (waiting out its interval)
        await runtime._remove_engine(handle, "registered at another address")
        await asyncio.wait({pusher}, timeout=WAIT_S)
        assert pusher.cancelled() and "a" not in runtime._pushers
    finally:
        await runtime.stop()
        await a.stop()


async def test_an_engine_that_restarted_gets_every_output_of_its_prompt_again(
    redis_url: str,
) -> None:
    """What the scheduler believed ``a`` held goes when ``a`` goes down: the engine that
    comes back at its address gets the outputs the old one made too."""
    a = await FakeEngine("a", tokens_per_sample=4, takes_earlier_outputs=True).start()
    b = await FakeEngine("b", tokens_per_sample=4, first_token=500).start()
    runtime = await make_runtime(redis_url, [a, b], policy="round_robin")
    run = new_run()
    back = FakeEngine("a", tokens_per_sample=4, takes_earlier_outputs=True, port=a.port)
    try:
        await runtime.submit(run, [spec("g0", n=4, run_id=run)])
        await read_stream(redis_url, run, 1)
        on_a = sum(len(indices) for indices in a.asked())
        assert 0 < on_a < 4
        await a.stop()

        async def a_is(healthy: bool) -> bool:
            return any(
                e.engine_id == "a" and e.healthy == healthy for e in runtime.status().engines
            )

        await eventually(lambda: a_is(False), "a marked unhealthy")
        await back.start()
        await eventually(lambda: a_is(True), "a back")
        await runtime.submit(run, [spec("g1", n=4, run_id=run)])
        await read_stream(redis_url, run, 2)
    finally:
        await runtime.stop()
        await back.stop()
        await b.stop()
    carried = sorted(tuple(o.token_ids) for r in back.requests for o in r.earlier_outputs)
    made = [(100, 101, 102, 103)] * on_a + [(500, 501, 502, 503)] * (4 - on_a)
    assert carried == sorted(made)


@pytest.mark.parametrize("anew", [True, False], ids=["restarted", "same-process"])
async def test_an_engine_back_before_a_probe_failed_is_known_by_its_boot_id(
    other_redis_url: str, anew: bool
) -> None:
    """``a`` goes and comes back at its address at once, long before enough probes fail to
    mark it down (50), on a database of its own (the fleet's weights it publishes stay
    there). A new process (another boot id in its Stats) is counted a restart,
    loads the fleet's weights and gets every output of its prompt again; the same process
    behind a broken connection (same boot id) keeps what it was handed."""
    # Edges faked: both engines (FakeEngine over real gRPC, with the standard health
    # service); "back" stands for what answers at a's address after the watch broke.
    a = await FakeEngine("a", tokens_per_sample=4, takes_earlier_outputs=True).start()
    b = await FakeEngine("b", tokens_per_sample=4, first_token=500).start()
    runtime = await make_runtime(
        other_redis_url,
        [a, b],
        policy="round_robin",
        health_failures=50,
        earlier_outputs_push=False,  # what a holds comes with calls only: all of it in g1's
    )
    run = new_run()
    back = FakeEngine(
        "a",
        tokens_per_sample=4,
        takes_earlier_outputs=True,
        port=a.port,
        boot_id=uuid.uuid4().hex if anew else a.boot_id,
        weights=(0, "") if anew else (5, "/ckpt/step-5"),
    )
    try:
        await runtime.publish_version(run, 5, "/ckpt/step-5")
        await runtime.submit(run, [spec("g0", n=4, run_id=run)])
        await read_stream(other_redis_url, run, 1)
        on_a = sum(len(indices) for indices in a.asked())
        assert 0 < on_a < 4
        await a.stop()

        async def a_probe_failed() -> bool:
            return runtime._engines["a"].failed_probes > 0

        await eventually(a_probe_failed, "a probe of a to fail")
        await back.start()

        async def probed_back() -> bool:
            # (A new process is healthy again only once it has loaded the fleet's weights.)
            handle = runtime._engines["a"]
            loaded = bool(back.weight_updates) or not anew
            looked = bool(back.stats_calls) and not handle.may_have_restarted
            return looked and loaded and handle.healthy and not handle.loading_weights

        await eventually(probed_back, "the scheduler to read the Stats of what is at a's address")
        await runtime.submit(run, [spec("g1", n=4, run_id=run)])
        await read_stream(other_redis_url, run, 2)
        status = runtime.status()
    finally:
        await runtime.stop()
        await back.stop()
        await b.stop()
    on_b = [(500, 501, 502, 503)] * (4 - on_a)
    made = [(100, 101, 102, 103)] * on_a + on_b if anew else on_b
    carried = sorted(tuple(o.token_ids) for r in back.requests for o in r.earlier_outputs)
    assert carried == sorted(made)
    assert back.weights == (5, "/ckpt/step-5")
    assert [u.version for u in back.weight_updates] == ([5] if anew else [])
    restarts = {e.engine_id: e.restarts for e in status.engines}
    assert restarts == {"a": 1 if anew else 0, "b": 0}
    # Never marked down for failed probes (50 would have to fail); a new process is taken
    # out of service while it loads the fleet's weights.
    assert status.engine_failures == (1 if anew else 0)


async def test_an_engine_that_drains_gets_no_new_work_and_finishes_what_it_runs(
    redis_url: str,
) -> None:
    # Edges faked: both engines (FakeEngine over real gRPC, with the standard health
    # service). "a" says NOT_SERVING while its call runs, as an engine does when it drains
    # on SIGTERM: its health watch stops new work at once, and the call it runs finishes
    # there. Probes alone (every 0.1 s here) would have taken it for failed after two and
    # requeued the call (2 attempts), long before its second chunk comes (1 s).
    a = await FakeEngine("a", step_s=1.0).start()
    b = await FakeEngine("b").start()
    runtime = await make_runtime(redis_url, [a, b])
    run = new_run()
    try:
        await runtime.submit(run, [spec("first", n=2, max_tokens=8, run_id=run)])

        async def running_on_a() -> bool:
            return len(a.requests) == 1

        await eventually(running_on_a, "the first group running on a")
        await a.set_serving(False)

        async def a_unhealthy() -> bool:
            return not {e.engine_id: e.healthy for e in runtime.status().engines}["a"]

        await eventually(a_unhealthy, "the scheduler to see a NOT_SERVING")
        await runtime.submit(run, [spec("second", n=2, max_tokens=8, run_id=run)])
        results = {r.group_id: r for r in await read_stream(redis_url, run, 2)}
        status = runtime.status()
    finally:
        await runtime.stop()
        await a.stop()
        await b.stop()
    first, second = results["first"], results["second"]
    assert first.status == GroupStatus.DELIVERED and first.attempts == 1
    assert {s.engine_id for s in first.samples} == {"a"}
    assert [len(s.token_ids) for s in first.samples] == [6, 6]
    assert second.status == GroupStatus.DELIVERED
    assert {s.engine_id for s in second.samples} == {"b"}
    assert len(a.requests) == 1 and status.engine_failures == 0


async def test_watched_healthy_engines_are_probed_in_turn_every_few_rounds(
    redis_url: str,
) -> None:
    # Edges faked: four engines (FakeEngine). With the health watches stopped, their
    # handles' states are set by hand and the probes of six rounds recorded: the engine
    # with no open watch and the unhealthy one every round, the two watched healthy ones
    # once in three rounds, in different rounds.
    names = ("w0", "w1", "unwatched", "unhealthy")
    engines = [await FakeEngine(name).start() for name in names]
    runtime = await make_runtime(redis_url, engines, health_interval_s=30.0, health_watched_every=3)
    probed: list[list[str]] = []

    async def record(engine: EngineHandle) -> None:
        probed[-1].append(engine.engine_id)

    try:
        # The watches stopped first: they would set what this test sets by hand.
        watches = list(runtime._watches.values())
        for task in watches:
            task.cancel()
        await asyncio.gather(*watches, return_exceptions=True)
        handles = runtime._engines
        for handle in handles.values():
            handle.watching = True
        handles["unwatched"].watching = False
        handles["unhealthy"].healthy = False
        runtime._probe = record  # type: ignore[method-assign]
        for _ in range(6):
            probed.append([])
            await runtime._probe_all()
    finally:
        await runtime.stop()
        for e in engines:
            await e.stop()
    assert all({"unwatched", "unhealthy"} <= set(r) for r in probed)
    rounds = {name: [k for k, r in enumerate(probed) if name in r] for name in ("w0", "w1")}
    assert len(rounds["w0"]) == len(rounds["w1"]) == 2
    assert rounds["w0"][1] - rounds["w0"][0] == 3 and rounds["w0"] != rounds["w1"]


async def test_a_failed_call_requeues_only_its_unfinished_samples(redis_url: str) -> None:
    # Both engines idle: least_outstanding breaks the tie by id, so the group goes to
    # "a-flaky", which finishes sample 0 and dies; its health then says NOT_SERVING.
    flaky = FakeEngine("a-flaky", behaviour=Behaviour.DIE_AFTER_FIRST, stays_down=True)
    await flaky.start()
    healthy = await FakeEngine("b-healthy").start()
    runtime = await make_runtime(redis_url, [flaky, healthy])
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 1, n=3))
        [result] = await read_stream(redis_url, run, 1)
        status = runtime.status()
    finally:
        await runtime.stop()
        await flaky.stop()
        await healthy.stop()
    assert result.status == GroupStatus.DELIVERED and result.attempts == 2
    assert [s.engine_id for s in result.samples] == ["a-flaky", "b-healthy", "b-healthy"]
    assert flaky.asked() == [[0, 1, 2]]
    assert healthy.asked() == [[1, 2]]  # sample 0 was kept, not run again
    assert all(s.token_ids == [100 + t for t in range(6)] for s in result.samples)
    assert status.engine_failures == 1


async def test_cancel_cancels_every_call_of_a_split_group(redis_url: str) -> None:
    a = await FakeEngine("a", behaviour=Behaviour.HANG).start()
    b = await FakeEngine("b", behaviour=Behaviour.HANG).start()
    runtime = await make_runtime(redis_url, [a, b], policy="round_robin")
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 1, n=4))

        async def both_running() -> bool:
            loads = {e.engine_id: e.inflight_samples for e in runtime.status().engines}
            # Both calls reached the engines: a cancel before that never reaches them.
            return loads == {"a": 2, "b": 2} and a.hanging == 1 and b.hanging == 1

        await eventually(both_running, "the group's samples running on both engines")
        assert runtime.status().inflight_groups == 1
        cancelled, _ = await runtime.cancel(run, ["g0"])
        assert cancelled == ["g0"]

        async def aborted() -> bool:
            return a.cancelled == 1 and b.cancelled == 1

        await eventually(aborted, "both engines to see their call cancelled")
        status = runtime.status()
    finally:
        await runtime.stop()
        await a.stop()
        await b.stop()
    assert status.inflight_groups == 0 and status.inflight_samples == 0
    assert status.groups_cancelled == 1
    client = aioredis.Redis.from_url(redis_url)
    assert await client.xlen(stream_key(run)) == 0
    await client.aclose()


async def test_partly_placed_groups_show_their_pending_samples_and_engines_count_samples(
    redis_url: str,
) -> None:
    # Room for two samples: round_robin places two of the group's four and queues the rest.
    narrow = await FakeEngine("narrow", behaviour=Behaviour.HANG, max_num_seqs=2).start()
    policy = Recording(create_policy("round_robin"), uses_predictions=True)
    runtime = await make_runtime(redis_url, [narrow], policy, capacity_factor=1.0)
    run = new_run()
    try:
        assert runtime.snapshot().engines[0].urgent_priority is None  # nothing runs
        first_spec = dataclasses.replace(spec("g0", n=4, max_tokens=8, run_id=run), priority=3)
        await runtime.submit(run, [first_spec])

        async def first_tokens() -> bool:  # the first chunk: 3 of 6 tokens per sample
            [view] = runtime.status().engines
            return view.outstanding_tokens == 2 * (8 - 3)

        await eventually(first_tokens, "the first chunk")
        await runtime.submit(run, [spec("later", n=1, run_id=run)])
        # The engine is full, so no plan runs: what one would be shown now.
        snapshot = runtime.snapshot()
        status = runtime.status()
        await runtime.cancel(run, ["g0", "later"])  # leave nothing pending in Redis
    finally:
        await runtime.stop()
        await narrow.stop()
    [first] = policy.queued(f"{run}/g0")
    assert first.samples == () and first.pending == (0, 1, 2, 3)
    [last] = [g for g in snapshot.queue if g.key == f"{run}/g0"]
    assert last.samples == (2, 3)
    [view] = status.engines
    assert view.inflight_samples == 2 and view.inflight_groups == 1
    assert status.inflight_groups == 1 and status.queue_depth == 2
    # Nothing learnt yet: the prior, conditioned on the running siblings' progress (3).
    predictor = runtime.predictor
    conditioned = predictor.predict("key-g0", 5, (), (3,)).mean
    assert last.predicted_len == pytest.approx(min(conditioned, 8.0))
    left = min(conditioned, 8.0) - 3
    assert view.predicted_outstanding_tokens == pytest.approx(2 * left)
    [engine_view] = snapshot.engines
    assert engine_view.kv_used_tokens == 2 * (5 + 3)
    assert engine_view.urgent_priority == 3  # what rl keeps new work away from
    assert engine_view.predicted_longest == pytest.approx(left)


async def test_a_policy_is_not_asked_to_plan_while_no_engine_has_a_free_slot(
    redis_url: str,
) -> None:
    # A full engine: the groups submitted meanwhile wait without a plan (it could start
    # nothing); the slot a cancelled group frees gets them planned.
    narrow = await FakeEngine("narrow", behaviour=Behaviour.HANG, max_num_seqs=2).start()
    policy = Recording(create_policy("least_outstanding"))
    runtime = await make_runtime(redis_url, [narrow], policy, capacity_factor=1.0)
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 1, n=2, max_tokens=8))

        async def running() -> bool:
            return runtime.status().engines[0].inflight_samples == 2

        await eventually(running, "the first group running")
        asked = len(policy.snapshots)
        for i in range(3):  # each submission wakes the dispatcher
            await runtime.submit(run, [spec(f"later{i}", n=2, run_id=run)])
            await asyncio.sleep(0.05)  # time for a plan, had one been asked for
        waited = len(policy.snapshots)
        await runtime.cancel(run, ["g0"])

        async def placed() -> bool:
            return runtime.status().queue_depth == 2

        await eventually(placed, "a later group placed in the freed slots")
        await runtime.cancel(run, ["later0", "later1", "later2"])
    finally:
        await runtime.stop()
        await narrow.stop()
    assert waited == asked
    assert len(policy.snapshots) > asked
    assert all(any(e.free_samples for e in s.engines) for s in policy.snapshots)


async def test_a_policy_that_reads_no_predictions_is_shown_none(redis_url: str) -> None:
    # least_outstanding reads no prediction: its snapshots leave them unknown (they cost a
    # predictor call per queued group and running sample at every plan), while Status still
    # reports the predicted tokens to operators.
    narrow = await FakeEngine("narrow", behaviour=Behaviour.HANG, max_num_seqs=2).start()
    policy = Recording(create_policy("least_outstanding"))
    assert policy.uses_predictions is False
    runtime = await make_runtime(redis_url, [narrow], policy, capacity_factor=1.0)
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 1, n=2, max_tokens=8))

        async def first_tokens() -> bool:
            [view] = runtime.status().engines
            return view.outstanding_tokens == 2 * (8 - 3)

        await eventually(first_tokens, "the first chunk")
        await runtime.submit(run, [spec("later", n=2, run_id=run)])  # queued while g0 runs
        snapshots = [*policy.snapshots, runtime.snapshot()]
        status = runtime.status()
        await runtime.cancel(run, ["g0", "later"])
    finally:
        await runtime.stop()
        await narrow.stop()
    assert [g.key for g in snapshots[-1].queue] == [f"{run}/later"]
    assert all(g.predicted_len is None for s in snapshots for g in s.queue)
    assert all(
        e.predicted_outstanding == 0 and e.predicted_longest == 0
        for s in snapshots
        for e in s.engines
    )
    [engine_view] = snapshots[-1].engines
    assert engine_view.inflight_samples == 2  # the load itself is still counted
    [view] = status.engines
    assert view.predicted_outstanding_tokens > 0


async def test_lengths_are_learnt_by_prompt_key_and_epoch(redis_url: str) -> None:
    engine = await FakeEngine("e", lengths=(10, 20, 30, 40)).start()
    policy = Recording(create_policy("least_outstanding"), uses_predictions=True)
    runtime = await make_runtime(redis_url, [engine], policy)
    run = new_run()
    predictor = runtime.predictor

    def group(group_id: str, epoch: int | None = None, prompt_key: str = "row") -> GroupSpec:
        return dataclasses.replace(
            spec(group_id, n=4, max_tokens=64, run_id=run), prompt_key=prompt_key, epoch=epoch
        )

    def learnt(epoch: int) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            return predictor.last_epoch("row") == epoch

        return check

    try:
        assert runtime.status().predictor_scored_samples == 0
        assert not runtime.status().HasField("predictor_mae_tokens")
        prior = min(predictor.predict("row", 5).mean, 64.0)  # nothing learnt yet
        await runtime.submit(run, [group("first")])
        await eventually(learnt(0), "the first group's lengths")
        expected = predictor.predict("row", 5).mean
        await runtime.submit(run, [group("second")])  # no epoch: the next one of "row"
        await eventually(learnt(1), "the second group's lengths")
        before_third = predictor.predict("row", 5).mean
        await runtime.submit(run, [group("blank", prompt_key=""), group("third", epoch=5)])
        await eventually(learnt(5), "the third group's lengths")
        results = await read_stream(redis_url, run, 4)
        status = runtime.status()
    finally:
        await runtime.stop()
        await engine.stop()
    assert {r.status for r in results} == {GroupStatus.DELIVERED}
    [seen, *_] = policy.queued(f"{run}/second")
    assert seen.predicted_len == pytest.approx(expected)
    assert 10 < expected < 40
    assert predictor.epoch == 5 and status.predictor_epoch == 5
    assert "" not in predictor  # a group without prompt_key teaches nothing
    assert status.predictor_keys == len(predictor) >= 1
    # Each delivered group with a prompt_key is scored before it is learnt: the first from
    # the prior, the second and third from the history before them; "blank" is not.
    lengths = (10, 20, 30, 40)
    pairs = [(guess, length) for guess in (prior, expected, before_third) for length in lengths]
    assert status.predictor_scored_samples == 12
    assert status.predictor_mae_tokens == pytest.approx(
        sum(abs(g - n) for g, n in pairs) / len(pairs)
    )
    assert status.HasField("predictor_tail_auc") and 0 <= status.predictor_tail_auc <= 1
    typed = SchedulerStatus.from_proto(status)
    assert (typed.predictor_keys, typed.predictor_epoch) == (status.predictor_keys, 5)
    assert typed.predictor_scored_samples == 12
    assert typed.predictor_mae_tokens == pytest.approx(status.predictor_mae_tokens)
    assert typed.predictor_tail_auc == pytest.approx(status.predictor_tail_auc)
    assert SchedulerStatus.from_proto(type(status)()).predictor_mae_tokens is None


@pytest.mark.parametrize(
    ("made_ahead", "fails", "on_arrival", "labels"),
    [
        (2, False, False, [(6, 5), (7, 1)]),
        (None, False, False, [(6, 3), (7, 3)]),
        (2, True, False, [(6, 3), (7, 3)]),
        (2, False, True, [(6, 3), (7, 3)]),
    ],
)
async def test_tokens_made_before_a_publish_keep_the_old_version_whenever_they_come(
    redis_url: str,
    made_ahead: int | None,
    fails: bool,
    on_arrival: bool,
    labels: list[tuple[int, int]],
) -> None:
    """Sample 0 sends 3 of its 6 tokens and is held, having made 2 more that its engine has
    not sent; version 7 comes out; then the rest arrives. With the engine's count the 2 are
    version 6; an engine that gives no count, or cannot be asked, leaves them labelled as
    they arrive (and the publish goes through), as does a scheduler told to label on
    arrival. Sample 1, done before the publish, is all version 6."""
    held = await FakeEngine(
        "held",
        holds=(0,),
        on_abort=AbortOutcome.ENDS_FULL,
        made_ahead=made_ahead,
        progress_fails=fails,
    ).start()
    runtime = await make_runtime(redis_url, [held], label_on_arrival=on_arrival)
    run = new_run()
    try:
        await runtime.publish_version(run, 6)
        await runtime.submit(run, specs(run, 1, n=2))

        async def sample_1_done() -> bool:
            record = next(iter(runtime._groups.values()), None)
            return record is not None and record.samples[1].finish_reason is not None

        await eventually(sample_1_done, "the free sample to finish")
        assert (await runtime.publish_version(run, 7)).version == 7
        assert (await runtime.publish_version(run, 7)).version == 7  # a retry is no change
        with pytest.raises(VersionBehind, match=r"version \(5\) is below .* \(7\)"):
            await runtime.publish_version(run, 5)
        await eventually(counted(runtime), "the engine's count")
        async with grpc.aio.insecure_channel(held.address) as channel:
            await pb_grpc.EngineStub(channel).Abort(
                pb.AbortRequest(request_id=held.requests[0].request_id)
            )
        [result] = await read_stream(redis_url, run, 1)
    finally:
        await runtime.stop()
        await held.stop()
    first, second = result.samples
    assert [(v.version, v.length) for v in first.versions] == labels
    assert [(v.version, v.length) for v in second.versions] == [(6, 6)]


def counted(runtime: SchedulerRuntime) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return runtime.status().publishes_awaiting_counts == 0

    return check


async def test_a_publish_does_not_wait_for_the_engines_counts(redis_url: str) -> None:
    """Both samples of a group are held after 3 of their 6 tokens, each having made 2 more;
    the engine counts at once but answers late. Versions 7 and 8 come out without waiting
    for it, and its counts settle the labels in the order of the publishes: sample 0,
    which ends before the engine counts for version 8, has its first 5 tokens as version 6
    and the 6th as version 7 (it ended before 8's count); sample 1, which goes on after
    both counts, has 5 as version 6 and its last as version 8 (when it came)."""
    gate = asyncio.Event()
    held = await FakeEngine(
        "held",
        holds=(0, 1),
        on_abort=AbortOutcome.ENDS_FULL,
        made_ahead=2,
        progress_gate=gate,
    ).start()
    runtime = await make_runtime(redis_url, [held])
    run = new_run()

    async def abort(index: int) -> None:
        async with grpc.aio.insecure_channel(held.address) as channel:
            await pb_grpc.EngineStub(channel).Abort(
                pb.AbortRequest(request_id=held.requests[0].request_id, sample_indices=[index])
            )

    try:
        await runtime.publish_version(run, 6)
        await runtime.submit(run, specs(run, 1, n=2))

        async def first_halves() -> bool:
            record = next(iter(runtime._groups.values()), None)
            return record is not None and [len(s.token_ids) for s in record.samples] == [3, 3]

        await eventually(first_halves, "both samples' first 3 tokens")
        await asyncio.wait_for(runtime.publish_version(run, 7), WAIT_S)
        await asyncio.wait_for(runtime.publish_version(run, 8), WAIT_S)
        assert SchedulerStatus.from_proto(runtime.status()).publishes_awaiting_counts == 2

        async def asked_for_7() -> bool:  # (8's question goes once 7's is answered)
            return held.progress_questions == 1

        # The question reaches the engine in the background: had sample 0 ended before it,
        # the engine would count none of its tokens and all 6 would be labelled version 6
        await eventually(asked_for_7, "the engine asked what was made under version 6")
        await abort(0)

        async def sample_0_done() -> bool:
            record = next(iter(runtime._groups.values()))
            return record.samples[0].finish_reason is not None

        await eventually(sample_0_done, "sample 0 to end")
        gate.set()
        await eventually(counted(runtime), "the engine's counts")
        await abort(1)
        [result] = await read_stream(redis_url, run, 1)
    finally:
        await runtime.stop()
        await held.stop()
    first, second = result.samples
    assert [(v.version, v.length) for v in first.versions] == [(6, 5), (7, 1)]
    assert [(v.version, v.length) for v in second.versions] == [(6, 5), (8, 1)]
    # delivered at version 8: 10 tokens 2 versions old, one 1 old, one on-policy
    staleness = runtime.histograms[2]
    assert staleness.cumulative()[:3] == [("0.0", 1), ("1.0", 2), ("2.0", 12)]
    assert (staleness.count, staleness.sum) == (12, 21)


async def test_a_trainer_that_publishes_faster_than_engines_count_is_held_back(
    redis_url: str,
) -> None:
    """Four publishes may await counts at once; the fifth waits for the first answer."""
    gate = asyncio.Event()
    held = await FakeEngine("held", holds=(0,), made_ahead=2, progress_gate=gate).start()
    runtime = await make_runtime(redis_url, [held])
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 1, n=1))
        await eventually(running(runtime, 1), "the group running")
        for version in range(1, 5):
            await asyncio.wait_for(runtime.publish_version(run, version), WAIT_S)
        fifth = asyncio.create_task(runtime.publish_version(run, 5))
        done, _ = await asyncio.wait({fifth}, timeout=0.5)  # a Redis write takes ms
        assert not done
        assert runtime.status().publishes_awaiting_counts == 4
        assert (await runtime.publish_version(run, 4)).version == 4  # no new version: no wait
        gate.set()
        assert (await asyncio.wait_for(fifth, WAIT_S)).version == 5
        await eventually(counted(runtime), "every count")
        await runtime.cancel(run, ["g0"])  # nothing left for the next test's scheduler
    finally:
        await runtime.stop()
        await held.stop()


async def test_a_sample_started_over_while_its_count_is_due_takes_its_new_tokens_labels(
    redis_url: str,
) -> None:
    """Version 7 comes out while the sample runs; its engine dies before it answers, so the
    sample starts over from nothing: every token it delivers came after the publish."""
    gate = asyncio.Event()
    held = await FakeEngine(
        "held", holds=(0,), made_ahead=2, progress_gate=gate, on_abort=AbortOutcome.DIES
    ).start()
    runtime = await make_runtime(redis_url, [held])
    run = new_run()

    async def abort() -> None:
        async with grpc.aio.insecure_channel(held.address) as channel:
            await pb_grpc.EngineStub(channel).Abort(
                pb.AbortRequest(request_id=held.requests[-1].request_id)
            )

    try:
        await runtime.publish_version(run, 6)
        await runtime.submit(run, specs(run, 1, n=1))

        async def held_at(calls: int) -> bool:
            record = next(iter(runtime._groups.values()))
            return len(held.requests) == calls and len(record.samples[0].token_ids) == 3

        await eventually(lambda: held_at(1), "the sample's first 3 tokens")
        await runtime.publish_version(run, 7)
        await abort()  # the call dies: the sample goes back to the queue with nothing
        await eventually(lambda: held_at(2), "the sample started over")
        gate.set()
        await eventually(counted(runtime), "the dead call's count")
        held.on_abort = AbortOutcome.ENDS_FULL
        await abort()
        [result] = await read_stream(redis_url, run, 1)
    finally:
        await runtime.stop()
        await held.stop()
    assert [(v.version, v.length) for v in result.samples[0].versions] == [(7, 6)]


async def test_a_scheduler_stops_while_an_engine_owes_it_a_count(redis_url: str) -> None:
    """The question a publish left running is the runtime's task: stop cancels it."""
    held = await FakeEngine("held", holds=(0,), made_ahead=2, progress_gate=asyncio.Event()).start()
    runtime = await make_runtime(redis_url, [held])
    run = new_run()
    try:
        await runtime.submit(run, specs(run, 1, n=1))
        await eventually(running(runtime, 1), "the group running")

        async def first_half() -> bool:
            record = next(iter(runtime._groups.values()))
            return len(record.samples[0].token_ids) == 3

        await eventually(first_half, "the sample's first 3 tokens")
        await runtime.publish_version(run, 1)
        await runtime.cancel(run, ["g0"])  # nothing left for the next test's scheduler
        assert runtime.status().publishes_awaiting_counts == 1
        await asyncio.wait_for(runtime.stop(), WAIT_S)
        assert runtime.status().publishes_awaiting_counts == 0
    finally:
        await held.stop()


async def test_a_restarted_scheduler_keeps_each_run_s_policy_version(
    redis_url: str, engine: FakeEngine
) -> None:
    hanging = await FakeEngine("slow", behaviour=Behaviour.HANG).start()
    first = await make_runtime(redis_url, [hanging])
    recovered, later = new_run(), new_run()
    await first.publish_version(recovered, 4)
    await first.publish_version(later, 9)
    await first.submit(recovered, specs(recovered, 1))
    await eventually(running(first, 1), "a running group")
    await first.stop()  # as if the process died
    await hanging.stop()
    second = await make_runtime(redis_url, [engine])
    try:
        [result] = await read_stream(redis_url, recovered, 1)
        await second.submit(later, specs(later, 1))
        [other] = await read_stream(redis_url, later, 1)
        with pytest.raises(VersionBehind):
            await second.publish_version(later, 8)
    finally:
        await second.stop()
    assert all([(v.version, v.length) for v in s.versions] == [(4, 6)] for s in result.samples)
    assert all([(v.version, v.length) for v in s.versions] == [(9, 6)] for s in other.samples)


async def test_an_engine_removed_while_its_probe_is_out_leaves_the_health_loop_running(
    redis_url: str,
) -> None:
    """An engine that registers again at another address while a probe of it is out: closing
    the old channel cancels the probe's calls, which must not end the health loop (it ended
    without a word, and no engine was probed again). Faked: the engines, and the old
    handle's probe (held until the new address is in, then cancelled as its channel is)."""
    first, second = await FakeEngine("e0").start(), await FakeEngine("e0").start()
    runtime = await make_runtime(redis_url, [], health_interval_s=0.05, health_watched_every=1)
    try:
        await runtime.register_engine("e0", first.address)
        old = runtime._engines["e0"]
        asked, answer = asyncio.Event(), asyncio.Event()

        async def cut_probe(timeout_s: float, look: bool = False) -> bool:
            asked.set()
            await answer.wait()
            raise asyncio.CancelledError  # what a call on a channel closed under it raises

        old.probe = cut_probe  # type: ignore[method-assign]
        await asyncio.wait_for(asked.wait(), WAIT_S)
        await runtime.register_engine("e0", second.address)
        answer.set()
        new = runtime._engines["e0"]
        assert new is not old and new.address == second.address
        rounds = runtime._probe_round

        async def probed_again() -> bool:
            return runtime._probe_round > rounds + 2

        await eventually(probed_again, "more health rounds")
        assert not runtime.failed.is_set()
        assert new.healthy
    finally:
        await runtime.stop()
        await first.stop()
        await second.stop()


async def test_a_background_loop_cancelled_by_anything_but_stop_is_a_failure(
    redis_url: str, engine: FakeEngine
) -> None:
    runtime = await make_runtime(redis_url, [engine])
    try:
        [health] = [t for t in runtime._background if t.get_name() == "health"]
        health.cancel()
        await asyncio.wait_for(runtime.failed.wait(), WAIT_S)
    finally:
        await runtime.stop()


async def test_a_version_published_while_a_submit_reads_it_is_kept(
    redis_url: str, engine: FakeEngine
) -> None:
    """A Submit and a PublishVersion of a run this process has not seen, at once: the
    version the Submit read (before the publish) does not replace the published one. Faked:
    the engine, and the store's read of the version (held until the publish is done)."""
    runtime = await make_runtime(redis_url, [engine])
    run = new_run()
    store = runtime._store
    read = store.load_versions
    reading, publish_done = asyncio.Event(), asyncio.Event()

    async def slow_first_read(run_ids: Sequence[str]) -> dict[str, int]:
        loaded = await read(run_ids)  # 0: nothing published yet
        if not reading.is_set():
            reading.set()
            await publish_done.wait()
        return loaded

    store.load_versions = slow_first_read  # type: ignore[method-assign]
    try:
        submit = asyncio.create_task(runtime.submit(run, specs(run, 1)))
        await asyncio.wait_for(reading.wait(), WAIT_S)
        await runtime.publish_version(run, 4)
        publish_done.set()
        await asyncio.wait_for(submit, WAIT_S)
        assert runtime.policy_version(run) == 4
    finally:
        await runtime.stop()


async def test_a_submit_whose_caller_goes_while_redis_writes_still_queues_the_groups(
    redis_url: str, engine: FakeEngine
) -> None:
    """The caller's deadline passes while the groups are being written: once written they
    are queued and delivered (written and not queued, they waited for a restart, and a retry
    was refused as a duplicate). Faked: the engine, and the store's write (held until the
    caller has gone)."""
    runtime = await make_runtime(redis_url, [engine])
    run = new_run()
    store = runtime._store
    write = store.add_pending
    writing, caller_gone = asyncio.Event(), asyncio.Event()

    async def slow_write(run_id: str, specs: Sequence[GroupSpec]) -> None:
        writing.set()
        await caller_gone.wait()
        await write(run_id, specs)

    store.add_pending = slow_write  # type: ignore[method-assign]
    try:
        submit = asyncio.create_task(runtime.submit(run, specs(run, 2)))
        await asyncio.wait_for(writing.wait(), WAIT_S)
        submit.cancel()  # as gRPC cancels a handler whose caller went
        with pytest.raises(asyncio.CancelledError):
            await submit
        caller_gone.set()
        results = await read_stream(redis_url, run, 2)
    finally:
        await runtime.stop()
    assert sorted(r.group_id for r in results) == ["g0", "g1"]
    assert all(r.status == GroupStatus.DELIVERED for r in results)


async def test_a_call_that_fails_in_the_scheduler_fails_its_group_instead_of_hanging(
    redis_url: str, engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """(A bug of the scheduler's, stood for by a request that cannot be built.)"""
    runtime = await make_runtime(redis_url, [engine])
    run = new_run()
    handle = runtime._engines[engine.engine_id]

    def generate(*args: object, **kwargs: object) -> Any:
        raise ValueError("Value out of range: 4294967294")

    handle.generate = generate  # type: ignore[method-assign]
    try:
        await runtime.submit(run, specs(run, 1))
        [result] = await read_stream(redis_url, run, 1)
        status = runtime.status()
    finally:
        await runtime.stop()
    assert result.status == GroupStatus.FAILED and "Value out of range" in result.error
    assert (status.inflight_groups, status.queue_depth) == (0, 0)
    assert "failed in the scheduler" in caplog.text
