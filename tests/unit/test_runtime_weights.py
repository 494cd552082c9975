"""Weight updates through the scheduler (PublishVersion with a weights_path): every healthy
engine loads them, those that cannot are taken out of service, and engines that join later
load them before they get work. Edges faked: the engines (FakeEngine: UpdateWeights records
the request and serves the version it names); Redis is real, a database of each test's own."""

from __future__ import annotations

import pytest
from rollserve.scheduler.runtime import WeightsNotLoaded

from tests.unit.fakes import FakeEngine
from tests.unit.test_runtime import eventually, make_runtime, new_run, read_stream, specs


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
    finally:
        await runtime.stop()
        for e in engines:
            await e.stop()
    assert (published.version, published.engines_updated, published.engines_failed) == (3, 2, ())
    assert retried == published
    for e in engines:
        assert [(u.weights_path, u.version) for u in e.weight_updates] == [("/ckpt/step-3", 3)]
    for sample in (s for r in results for s in r.samples):
        assert [(v.version, v.length) for v in sample.versions] == [(3, 6)]


async def test_an_engine_that_cannot_load_the_weights_gets_no_work(other_redis_url: str) -> None:
    good = await FakeEngine("good").start()
    bad = await FakeEngine("bad", refuse_weights=True).start()
    runtime = await make_runtime(other_redis_url, [good, bad], health_interval_s=0.05)
    run = new_run()
    try:
        published = await runtime.publish_version(run, 1, "/ckpt/step-1")
        await runtime.submit(run, specs(run, 6))
        results = await read_stream(other_redis_url, run, 6)

        async def asked_again() -> bool:
            return len(bad.weight_updates) >= 2

        await eventually(asked_again, "a probe to ask the engine to load the weights again")
        status = {e.engine_id: e for e in runtime.status().engines}
    finally:
        await runtime.stop()
        await good.stop()
        await bad.stop()
    assert published.engines_updated == 1
    assert published.engines_failed == ("bad: INVALID_ARGUMENT: fake engine cannot load it",)
    assert not status["bad"].healthy and "weights not loaded" in status["bad"].last_error
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
        await runtime.register_engine("late", late.address)
        late_loaded = [(u.weights_path, u.version) for u in late.weight_updates]
        late_healthy = {e.engine_id: e.healthy for e in runtime.status().engines}["late"]
        # It restarts (with its launch weights) and registers again, as engines do.
        late.weights = (0, "")
        await runtime.register_engine("late", late.address)
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
    assert late_loaded == [("/ckpt/step-5", 5)] and late_healthy
    assert reloaded == (5, "/ckpt/step-5")
    assert failures == 1  # taken out of service while it loaded
    assert [(u.weights_path, u.version) for u in first.weight_updates][-1] == ("/ckpt/step-5", 5)
    assert first.weights == (5, "/ckpt/step-5")
