"""Weight updates through the scheduler (PublishVersion with a weights_path): every healthy
engine loads them, those that cannot are taken out of service, and engines that join later
load them before they get work. Edges faked: the engines (FakeEngine: UpdateWeights records
the request and serves the version it names); Redis is real, a database of each test's own."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import pytest
from rollserve.client.types import PublishResult, SchedulerStatus
from rollserve.client.wire import GroupResult
from rollserve.scheduler.runtime import SchedulerRuntime, VersionBehind, WeightsNotLoaded
from rollserve.scheduler.validation import ValidationError

from tests.unit.builders import spec
from tests.unit.fakes import FakeEngine
from tests.unit.test_runtime import WAIT_S, eventually, make_runtime, new_run, read_stream, specs


async def test_every_engine_loads_the_weights_before_the_version_is_published(
    other_redis_url: str,
) -> None:
    engines = [await FakeEngine(f"e{i}").start() for i in range(2)]
    runtime = await make_runtime(other_redis_url, engines)
    run = new_run()
    try:
        published = await runtime.publish_version(run, 3, "/ckpt/step-3")
        retried = await runtime.publish_version(run, 3, "/ckpt/step-3")  # loads nothing again
        await runtime.submit(run, specs(run, 2))
        results = await read_stream(other_redis_url, run, 2)
        status = SchedulerStatus.from_proto(runtime.status())  # as the SDK shows it
    finally:
        await runtime.stop()
        for e in engines:
            await e.stop()
    assert (published.version, published.engines_updated, published.engines_failed) == (3, 2, ())
    assert retried == published
    assert (status.fleet_weights_path, status.fleet_weights_version) == ("/ckpt/step-3", 3)
    assert {(e.weights_path, e.weights_version, e.loading_weights) for e in status.engines} == {
        ("/ckpt/step-3", 3, False)
    }
    for e in engines:
        assert [(u.weights_path, u.version) for u in e.weight_updates] == [("/ckpt/step-3", 3)]
    for sample in (s for r in results for s in r.samples):
        assert [(v.version, v.length) for v in sample.versions] == [(3, 6)]


async def test_one_version_is_one_checkpoint(other_redis_url: str) -> None:
    """The version already published with other weights: refused, nothing loaded (tokens of
    one version would come from two checkpoints)."""
    engine = await FakeEngine("e0").start()
    runtime = await make_runtime(other_redis_url, [engine])
    run = new_run()
    try:
        await runtime.publish_version(run, 6, "/ckpt/step-6")
        with pytest.raises(
            ValidationError,
            match=r"version 6 of run .* is the weights at '/ckpt/step-6'; weights_path "
            r"'/ckpt/other' needs a version of its own \(publish 7\)",
        ):
            await runtime.publish_version(run, 6, "/ckpt/other")
        await runtime.publish_version(run, 7, "/ckpt/other")
    finally:
        await runtime.stop()
        await engine.stop()
    assert [(u.weights_path, u.version) for u in engine.weight_updates] == [
        ("/ckpt/step-6", 6),
        ("/ckpt/other", 7),
    ]


async def test_an_engine_that_cannot_load_the_weights_gets_no_work(
    other_redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="rollserve")
    good = await FakeEngine("good").start()
    bad = await FakeEngine("bad", refuse_weights=True).start()
    runtime = await make_runtime(other_redis_url, [good, bad], health_interval_s=0.05)
    run = new_run()
    try:
        published = await runtime.publish_version(run, 1, "/ckpt/step-1")
        await runtime.submit(run, specs(run, 6))
        results = await read_stream(other_redis_url, run, 6)

        async def asked_again() -> bool:
            return len(bad.weight_updates) >= 4

        await eventually(asked_again, "a probe to ask the engine to load the weights again")
        status = {e.engine_id: e for e in runtime.status().engines}
    finally:
        await runtime.stop()
        await good.stop()
        await bad.stop()
    assert published.engines_updated == 1
    assert published.engines_failed == ("bad: INVALID_ARGUMENT: fake engine cannot load it",)
    assert not status["bad"].healthy and "weights not loaded" in status["bad"].last_error
    # Said once in the log as it stays out, with what the operator can do (not each probe).
    [stays] = [r.getMessage() for r in caplog.records if "stays out of service" in r.getMessage()]
    assert "/ckpt/step-1" in stays and "--forget-fleet-weights" in stays
    assert bad.requests == []  # out of service: no work
    assert {s.engine_id for r in results for s in r.samples} == {"good"}


async def test_weights_no_engine_can_load_change_nothing(other_redis_url: str) -> None:
    bad = await FakeEngine("bad", refuse_weights=True).start()
    runtime = await make_runtime(other_redis_url, [bad])
    run = new_run()
    try:
        await runtime.publish_version(run, 1)
        with pytest.raises(WeightsNotLoaded, match="bad: INVALID_ARGUMENT"):
            await runtime.publish_version(run, 2, "/ckpt/missing")
        version = runtime.policy_version(run)
        healthy = runtime.status().engines[0].healthy
    finally:
        await runtime.stop()
        await bad.stop()
    assert version == 1 and healthy


async def test_an_engine_that_joins_or_restarts_loads_the_fleet_s_weights_first(
    other_redis_url: str,
) -> None:
    first = await FakeEngine("first").start()
    runtime = await make_runtime(other_redis_url, [first])
    late = await FakeEngine("late").start()
    try:
        await runtime.publish_version(new_run(), 5, "/ckpt/step-5")

        async def late_serves() -> bool:
            return {e.engine_id: e.healthy for e in runtime.status().engines}["late"]

        # (the reply to a registration does not wait for the load)
        await runtime.register_engine("late", late.address)
        await eventually(late_serves, "the late engine to load the weights and serve")
        late_loaded = [(u.weights_path, u.version) for u in late.weight_updates]
        # It restarts (with its launch weights) and registers again, as engines do.
        late.weights = (0, "")
        await runtime.register_engine("late", late.address)

        async def reloaded_and_serves() -> bool:
            return late.weights == (5, "/ckpt/step-5") and await late_serves()

        await eventually(reloaded_and_serves, "the restarted engine to load them again")
        reloaded = late.weights
        failures = runtime.status().engine_failures
    finally:
        await runtime.stop()
    # A scheduler started later (the weights are in Redis) finds "first" restarted with the
    # weights it was launched with, and has it load the fleet's before it serves.
    first.weights = (0, "")
    second = await make_runtime(other_redis_url, [first])
    try:

        async def serving() -> bool:
            return second.status().engines[0].healthy

        await eventually(serving, "the restarted engine to serve")
    finally:
        await second.stop()
        await first.stop()
        await late.stop()
    assert late_loaded == [("/ckpt/step-5", 5)]
    assert reloaded == (5, "/ckpt/step-5")
    assert failures == 1  # taken out of service while it loaded
    assert [(u.weights_path, u.version) for u in first.weight_updates][-1] == ("/ckpt/step-5", 5)
    assert first.weights == (5, "/ckpt/step-5")


async def publish_between_halves(
    runtime: SchedulerRuntime,
    run: str,
    version: int,
    path: str,
    *,
    fast: FakeEngine,
    second_halves: asyncio.Event,
) -> tuple[list[GroupResult], asyncio.Task[PublishResult]]:
    """Submits a group of two samples, one on each engine (each sends half its tokens, and
    the rest once ``second_halves`` is set); once the first halves are in, publishes
    ``version`` with the weights at ``path``, and once ``fast`` has loaded them lets the
    second halves be made. The group's entry, and the publish (which may still wait for
    the other engine's load)."""

    async def first_halves() -> bool:
        record = next(iter(runtime._groups.values()), None)
        return record is not None and [len(s.token_ids) for s in record.samples] == [3, 3]

    async def fast_loaded() -> bool:
        return fast.weights == (version, path)

    await runtime.submit(run, specs(run, 1, n=2))
    await eventually(first_halves, "each engine's first half of a sample")
    publishing = asyncio.create_task(runtime.publish_version(run, version, path))
    await eventually(fast_loaded, "fast to load the new weights")
    second_halves.set()
    return await read_stream(runtime.settings.redis_url, run, 1), publishing


@pytest.mark.parametrize("before", ["launch", "another run's"])
async def test_tokens_count_as_the_weights_that_made_them_while_the_fleet_loads(
    other_redis_url: str, caplog: pytest.LogCaptureFixture, before: str
) -> None:
    # Each engine sends half of a sample's tokens, and the rest once the test lets it; a
    # publish comes between. "fast" has loaded the new weights by its second half, "slow"
    # loads them only after its second half is in: the run's version changes once both have.
    # The engines serve their launch weights before, or another run's version 4.
    second_halves = asyncio.Event()
    slow_loads = asyncio.Event()
    fast = await FakeEngine("fast", second_half_gate=second_halves).start()
    slow = await FakeEngine("slow", second_half_gate=second_halves, load_gate=slow_loads).start()
    runtime = await make_runtime(other_redis_url, [fast, slow], policy="round_robin")
    run, other = new_run(), new_run()
    publishing: asyncio.Task[PublishResult] | None = None
    try:
        if before == "launch":
            await runtime.publish_version(run, 1)  # no weights: the engines serve their own
            version, path = 2, "/ckpt/step-2"
        else:
            slow_loads.set()
            await runtime.publish_version(other, 4, "/ckpt/w-4")
            slow_loads.clear()
            version, path = 1, "/ckpt/m-1"
        results, publishing = await publish_between_halves(
            runtime, run, version, path, fast=fast, second_halves=second_halves
        )
        assert not publishing.done()  # slow is still loading
        slow_loads.set()
        published = await asyncio.wait_for(publishing, WAIT_S)
    finally:
        if publishing is not None:
            publishing.cancel()
            await asyncio.wait({publishing})
        await runtime.stop()
        await fast.stop()
        await slow.stop()
    assert published.engines_updated == 2
    samples = results[0].samples
    versions = {s.engine_id: [(v.version, v.length) for v in s.versions] for s in samples}
    if before == "launch":
        # The first halves were made with the engines' launch weights, before the run
        # published any: they count as the run's version then.
        assert versions == {"fast": [(1, 3), (2, 3)], "slow": [(1, 6)]}
    else:
        # Made with the other run's weights, they count as the run's version 0, not as the
        # other's 4 (a version the run never had: the labels went down from 4 to 1).
        assert versions == {"fast": [(0, 3), (1, 3)], "slow": [(0, 6)]}
        assert f"in place of run {other}'s (/ckpt/w-4, version 4)" in caplog.text


async def test_tokens_keep_the_weights_version_when_the_run_moves_on_without_weights(
    other_redis_url: str,
) -> None:
    engine = await FakeEngine("e0").start()
    runtime = await make_runtime(other_redis_url, [engine])
    run = new_run()
    try:
        await runtime.publish_version(run, 3, "/ckpt/step-3")
        await runtime.publish_version(run, 4)  # the engines still serve step 3's weights
        await runtime.submit(run, specs(run, 1))
        before = await read_stream(other_redis_url, run, 1)
    finally:
        await runtime.stop()
    second = await make_runtime(other_redis_url, [engine])  # reads the fleet's from Redis
    try:
        await second.submit(run, [spec("after", n=2, max_tokens=8, run_id=run)])
        after = await read_stream(other_redis_url, run, 2)
    finally:
        await second.stop()
        await engine.stop()
    for sample in (s for r in before + after for s in r.samples):
        assert [(v.version, v.length) for v in sample.versions] == [(3, 6)]


async def test_a_scheduler_told_to_forget_the_fleet_s_weights_leaves_engines_their_own(
    other_redis_url: str,
) -> None:
    engine = await FakeEngine("e0").start()
    first = await make_runtime(other_redis_url, [engine])
    try:
        await first.publish_version(new_run(), 2, "/ckpt/step-2")
    finally:
        await first.stop()
    engine.weights = (0, "")  # restarted with its launch weights, for a new experiment
    fresh = await make_runtime(other_redis_url, [engine], forget_fleet_weights=True)
    try:
        await eventually(serving_of(fresh), "the engine to serve")
        run = new_run()
        await fresh.submit(run, specs(run, 1))
        results = await read_stream(other_redis_url, run, 1)
    finally:
        await fresh.stop()
    again = await make_runtime(other_redis_url, [engine])  # nothing left in Redis to load
    try:
        await eventually(serving_of(again), "the engine to serve")
    finally:
        await again.stop()
        await engine.stop()
    assert len(engine.weight_updates) == 1  # the first publish only
    assert engine.weights == (0, "")
    assert all(v.version == 0 for s in results[0].samples for v in s.versions)


def asked_to_load(engine: FakeEngine) -> Callable[[], Awaitable[bool]]:
    """Whether the engine was asked to load weights (its load may wait for a gate)."""

    async def asked() -> bool:
        return len(engine.weight_updates) == 1

    return asked


def serving_of(runtime: SchedulerRuntime) -> Callable[[], Awaitable[bool]]:
    async def serving() -> bool:
        return runtime.status().engines[0].healthy

    return serving


async def test_an_engine_that_registers_is_answered_before_it_has_loaded_the_weights(
    other_redis_url: str,
) -> None:
    """RegisterEngine waits a probe deadline at most: the load of the fleet's weights goes on
    after the reply (an engine's RegisterEngine deadline cut the load short, part way)."""
    first = await FakeEngine("first").start()
    runtime = await make_runtime(other_redis_url, [first], health_timeout_s=0.5)
    gate = asyncio.Event()
    late = await FakeEngine("late", load_gate=gate).start()
    try:
        await runtime.publish_version(new_run(), 5, "/ckpt/step-5")
        await asyncio.wait_for(runtime.register_engine("late", late.address), 10)
        loading = {e.engine_id: e for e in runtime.status().engines}["late"]
        gate.set()

        async def serving() -> bool:
            return {e.engine_id: e.healthy for e in runtime.status().engines}["late"]

        await eventually(serving, "the late engine to serve once loaded")
    finally:
        await runtime.stop()
        await first.stop()
        await late.stop()
    assert not loading.healthy and loading.loading_weights
    assert late.weights == (5, "/ckpt/step-5")


async def test_a_publish_that_waited_for_a_newer_one_loads_nothing(other_redis_url: str) -> None:
    """Two publishes of a run with weights at once, the newer first: the older one, which
    waited for it, is refused before it loads anything (loaded after, it left the fleet on
    the older weights while the run's version was the newer)."""
    gate = asyncio.Event()
    engine = await FakeEngine("e0", load_gate=gate).start()
    runtime = await make_runtime(other_redis_url, [engine])
    run = new_run()
    try:
        newer = asyncio.create_task(runtime.publish_version(run, 6, "/ckpt/step-6"))

        await eventually(asked_to_load(engine), "the engine to load step 6")
        older = asyncio.create_task(runtime.publish_version(run, 5, "/ckpt/step-5"))
        await asyncio.sleep(0)  # it waits for the newer one now
        gate.set()
        published = await asyncio.wait_for(newer, WAIT_S)
        with pytest.raises(VersionBehind, match=r"below the policy version of run .* \(6\)"):
            await asyncio.wait_for(older, WAIT_S)
        status = runtime.status()
    finally:
        await runtime.stop()
        await engine.stop()
    assert published.version == 6
    assert [(u.weights_path, u.version) for u in engine.weight_updates] == [("/ckpt/step-6", 6)]
    assert (status.fleet_weights_path, status.fleet_weights_version) == ("/ckpt/step-6", 6)
    assert runtime.policy_version(run) == 6


async def test_a_publish_whose_caller_goes_is_carried_through(other_redis_url: str) -> None:
    """The trainer's deadline passes while the engines load: the publish still makes the
    weights the fleet's and the version the run's (cut off, the engines served weights the
    fleet did not name, and a retry found them loaded but the version not stored)."""
    gate = asyncio.Event()
    engine = await FakeEngine("e0", load_gate=gate).start()
    runtime = await make_runtime(other_redis_url, [engine])
    run = new_run()
    try:
        publishing = asyncio.create_task(runtime.publish_version(run, 2, "/ckpt/step-2"))

        await eventually(asked_to_load(engine), "the engine to load step 2")
        publishing.cancel()
        await asyncio.wait({publishing})
        gate.set()

        async def published() -> bool:
            return runtime.policy_version(run) == 2

        await eventually(published, "the publish to finish")
        status = runtime.status()
        stored = await runtime._store.load_versions([run])
    finally:
        await runtime.stop()
        await engine.stop()
    assert publishing.cancelled()
    assert (status.fleet_weights_path, status.fleet_weights_version) == ("/ckpt/step-2", 2)
    assert stored == {run: 2}
    assert status.engines[0].healthy and not status.engines[0].loading_weights


async def test_an_engine_probed_while_the_fleet_loads_keeps_the_new_weights(
    other_redis_url: str,
) -> None:
    """An engine that registers again while a publish loads the fleet (it had loaded the new
    weights, another engine still loads them): its probe leaves it to the publish. (It
    compared the engine with the fleet's old weights, took it out and loaded those back: the
    fleet then served two versions.)"""
    gate = asyncio.Event()
    fast = await FakeEngine("fast").start()
    slow = await FakeEngine("slow", load_gate=gate).start()
    gate.set()
    runtime = await make_runtime(other_redis_url, [fast, slow], health_interval_s=0.05)
    run = new_run()
    try:
        await runtime.publish_version(run, 1, "/ckpt/step-1")
        gate.clear()
        publishing = asyncio.create_task(runtime.publish_version(run, 2, "/ckpt/step-2"))

        async def fast_loaded() -> bool:
            return fast.weights == (2, "/ckpt/step-2")

        await eventually(fast_loaded, "fast to load step 2")
        await runtime.register_engine("fast", fast.address)  # as after a reconnect
        gate.set()
        published = await asyncio.wait_for(publishing, WAIT_S)

        async def looked_again() -> bool:
            return not runtime._engines["fast"].may_have_restarted

        await eventually(looked_again, "a probe to look at fast once the fleet has loaded")
        status = {e.engine_id: e for e in runtime.status().engines}
    finally:
        await runtime.stop()
        await fast.stop()
        await slow.stop()
    assert published.engines_updated == 2
    assert fast.weights == slow.weights == (2, "/ckpt/step-2")
    assert [u.version for u in fast.weight_updates] == [1, 2]
    assert status["fast"].healthy and runtime.status().engine_failures == 0


async def test_a_scheduler_starts_and_probes_on_while_an_engine_loads_the_weights(
    other_redis_url: str,
) -> None:
    """A scheduler that starts with the fleet's weights in Redis and an engine that must load
    them: it starts serving without waiting for the load, and its health rounds go on (the
    first round, then every round, waited for the load: up to weights_timeout_s)."""
    engine = await FakeEngine("e0").start()
    first = await make_runtime(other_redis_url, [engine])
    try:
        await first.publish_version(new_run(), 3, "/ckpt/step-3")
    finally:
        await first.stop()
    engine.weights = (0, "")  # restarted with its launch weights
    gate = asyncio.Event()
    engine.load_gate = gate
    other = await FakeEngine("other").start()
    runtime = await asyncio.wait_for(
        make_runtime(other_redis_url, [engine, other], health_timeout_s=0.5), WAIT_S
    )
    try:
        rounds = runtime._probe_round

        async def rounds_go_on() -> bool:
            return runtime._probe_round >= rounds + 3

        await eventually(rounds_go_on, "three more health rounds while e0 loads")
        status = {e.engine_id: e for e in runtime.status().engines}
        gate.set()

        async def e0_serves() -> bool:
            return {e.engine_id: e.healthy for e in runtime.status().engines}["e0"]

        await eventually(e0_serves, "e0 to serve once loaded")
    finally:
        gate.set()
        await runtime.stop()
        await engine.stop()
        await other.stop()
    assert status["e0"].loading_weights and not status["e0"].healthy
    assert status["other"].healthy
    assert engine.weights == (3, "/ckpt/step-3")


async def test_a_publish_while_a_probe_looks_at_every_engine_leaves_the_load_to_it(
    other_redis_url: str,
) -> None:
    """A publish when the only healthy engine is being looked at by a probe (it registered
    again): the weights become the fleet's, none counted as loaded, and the probe loads them.
    (Counted as failed, the publish was refused with no engine at fault.) Faked: the probe's
    look (the engine marked as loading, as while the probe's Stats is out)."""
    engine = await FakeEngine("e0").start()
    runtime = await make_runtime(other_redis_url, [engine])
    run = new_run()
    try:
        handle = runtime._engines["e0"]
        handle.loading_weights = True
        published = await runtime.publish_version(run, 2, "/ckpt/step-2")
        handle.loading_weights = False
        handle.may_have_restarted = True  # what the faked probe leaves for the next one

        async def serves_them() -> bool:
            return engine.weights == (2, "/ckpt/step-2") and runtime.status().engines[0].healthy

        await eventually(serves_them, "a probe to load the weights into the engine")
        status = runtime.status()
    finally:
        await runtime.stop()
        await engine.stop()
    assert (published.version, published.engines_updated, published.engines_failed) == (2, 0, ())
    assert (status.fleet_weights_path, status.fleet_weights_version) == ("/ckpt/step-2", 2)
    assert engine.weights == (2, "/ckpt/step-2") and status.engines[0].healthy


async def test_an_engine_that_registers_elsewhere_during_a_publish_fails_alone(
    other_redis_url: str,
) -> None:
    """Engine "a" registers at a new address while it loads a publish's weights (closing its
    old channel breaks off that load): the publish goes through on the others, names "a" as
    failed, and the new "a" loads the weights before it serves. (The publish was cut off as
    cancelled, leaving the engines that had loaded serving weights never made the fleet's.)"""
    gate = asyncio.Event()
    a = await FakeEngine("a", load_gate=gate).start()
    b = await FakeEngine("b").start()
    a_again = await FakeEngine("a").start()  # the same engine, restarted at another port
    runtime = await make_runtime(other_redis_url, [a, b])
    run = new_run()
    try:
        publishing = asyncio.create_task(runtime.publish_version(run, 3, "/ckpt/step-3"))

        async def loading() -> bool:
            return bool(a.weight_updates) and b.weights == (3, "/ckpt/step-3")

        await eventually(loading, "a to load step 3 and b to have loaded it")
        await runtime.register_engine("a", a_again.address)
        published = await asyncio.wait_for(publishing, WAIT_S)

        async def a_serves() -> bool:
            return a_again.weights == (3, "/ckpt/step-3") and runtime._engines["a"].healthy

        await eventually(a_serves, "the new a to load step 3 and serve")
        status = runtime.status()
    finally:
        gate.set()
        await runtime.stop()
        for engine in (a, b, a_again):
            await engine.stop()
    assert (published.version, published.engines_updated) == (3, 1)
    [failed] = published.engines_failed
    assert failed.startswith("a: its load broke off")
    assert (status.fleet_weights_path, status.fleet_weights_version) == ("/ckpt/step-3", 3)
    assert runtime.policy_version(run) == 3
