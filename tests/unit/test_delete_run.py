"""DeleteRun: a run ended for good, its groups cancelled and its state gone from Redis.

Faked: the engine (``FakeEngine``). Real: Redis, the scheduler runtime and its store, and,
for the API's test, the scheduler as ``rollserve scheduler`` serves it (gRPC and HTTP) with
the SDK.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

import aiohttp
import pytest
import redis.asyncio as aioredis
import redis.exceptions
from rollserve.cli.stack import free_port
from rollserve.client import (
    AsyncRolloutClient,
    InvalidArgument,
    PromptGroup,
    RolloutClient,
    RunDeleted,
    SamplingParams,
)
from rollserve.client.wire import (
    DELETES_KEPT_S,
    RUNS_KEY,
    GroupResult,
    GroupStatus,
    deletes_key,
    ended_key,
    pending_key,
    samples_stream_key,
    stream_key,
    streamed_key,
    version_key,
)
from rollserve.scheduler.settings import EngineEndpoint, SchedulerSettings
from rollserve.scheduler.state import GroupSpec, SampleState
from rollserve.scheduler.store import Store

from tests.served import served_scheduler
from tests.unit.builders import spec
from tests.unit.fakes import AbortOutcome, Behaviour, FakeEngine
from tests.unit.test_runtime import (
    WAIT_S,
    eventually,
    make_runtime,
    new_run,
    read_stream,
    running,
    specs,
)
from tests.unit.test_runtime_weights import asked_to_load


async def run_keys(redis_url: str, run_id: str, *group_ids: str) -> list[str]:
    """The run's keys still in Redis, and whether it is in the runs set."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        keys = [
            pending_key(run_id),
            ended_key(run_id),
            version_key(run_id),
            stream_key(run_id),
            samples_stream_key(run_id),
            *(streamed_key(run_id, g) for g in group_ids),
        ]
        there = [key for key in keys if await client.exists(key)]
        if await client.sismember(RUNS_KEY, run_id):
            there.append(RUNS_KEY)
        return there
    finally:
        await client.aclose()


async def test_a_deleted_run_has_its_groups_cancelled_and_its_state_gone(
    redis_url: str,
) -> None:
    # g0 delivered; g1 runs with one sample streamed and one held on the engine; g2 queued
    # behind it (the engine takes one sample at a time... of g1's two: capacity 2).
    engine = await FakeEngine("e0", holds=(1,), on_abort=AbortOutcome.IGNORED).start()
    runtime = await make_runtime(redis_url, [engine])
    run, other = new_run(), new_run()
    try:
        await runtime.publish_version(run, 3)
        [g0] = specs(run, 1, n=1)
        await runtime.submit(run, [g0])
        await read_stream(redis_url, run, 1)
        g1 = dataclasses.replace(spec("g1", n=2, run_id=run), stream_samples=True)
        await runtime.submit(run, [g1, spec("g2", n=2, run_id=run)])
        await runtime.submit(other, specs(other, 1, n=1))
        await eventually(running(runtime, 2), "g1 and g2 running")

        async def streamed() -> bool:
            return runtime.counters.samples_streamed == 1

        await eventually(streamed, "g1's sample 0 streamed")
        assert await run_keys(redis_url, run, "g1") != []
        cancelled, existed = await runtime.delete_run(run)
        assert (cancelled, existed) == (2, True)
        assert await run_keys(redis_url, run, "g0", "g1", "g2") == []
        assert runtime.policy_version(run) == 0
        # The other run is untouched: its group runs (once the deleted run's leave it room:
        # it may have waited behind them, so nothing is said of it before).
        await read_stream(redis_url, other, 1)

        async def idle() -> bool:
            status = runtime.status()
            return status.queue_depth == 0 and status.inflight_groups == 0

        await eventually(idle, "nothing left queued or running")
        # The id is new again: the same group ids are taken and run.
        assert await runtime.delete_run(run) == (0, False)
        await runtime.submit(run, [g0])
        [again] = await read_stream(redis_url, run, 1)
    finally:
        await runtime.stop()
        await engine.stop()
    assert again.group_id == "g0" and again.status == GroupStatus.DELIVERED
    assert runtime.counters.groups_cancelled == 2


async def test_a_delivery_after_the_run_was_deleted_writes_nothing(redis_url: str) -> None:
    run = new_run()
    store = Store.from_url(redis_url)
    try:
        await store.add_pending(run, specs(run, 1))
        assert await store.delete_run(run) is True
        late = GroupResult(run_id=run, group_id="g0", status=GroupStatus.DELIVERED)
        assert await store.deliver(late) is None
        assert await store.delete_run(run) is False
    finally:
        await store.close()
    assert await run_keys(redis_url, run, "g0") == []


async def test_the_sdk_and_the_http_api_delete_a_run(other_redis_url: str) -> None:
    engine = await FakeEngine("e0", holds=(0,), on_abort=AbortOutcome.IGNORED).start()
    http_port = free_port()
    settings = SchedulerSettings.model_validate(
        {
            "redis_url": other_redis_url,
            "port": 0,
            "http_port": http_port,
            "engines": [EngineEndpoint(engine_id="e0", address=engine.address)],
            "health_interval_s": 0.1,
            "predictor_namespace": f"ns-{new_run()}",
        }
    )
    run = new_run()
    group = PromptGroup(
        group_id="held", prompt_token_ids=[5, 6], n=1, sampling=SamplingParams(max_tokens=8)
    )
    try:
        async with served_scheduler(settings, WAIT_S) as served:
            address = f"127.0.0.1:{served.port}"
            async with AsyncRolloutClient(address, other_redis_url, run) as client:
                assert await client.submit([group]) == 1

                async def held() -> bool:
                    return (await client.status()).inflight_groups == 1

                await eventually(held, "the group running")
                deleted = await client.delete_run()
                assert (deleted.cancelled, deleted.existed) == (1, True)

            def again() -> tuple[int, bool]:
                with RolloutClient(address, other_redis_url, run) as sync:
                    assert sync.submit([group]) == 1  # the id is free again
                    result = sync.delete_run()
                    return result.cancelled, result.existed

            assert await asyncio.to_thread(again) == (1, True)
            url = f"http://127.0.0.1:{http_port}/v1/runs"
            async with aiohttp.ClientSession() as http:
                async with http.delete(f"{url}/{run}") as reply:
                    assert reply.status == 200
                    assert await reply.json() == {"cancelled": 0, "existed": False}
                async with http.delete(f"{url}/bad%20id") as reply:
                    assert reply.status == 422
                    assert "run_id" in (await reply.json())["error"]["message"]
    finally:
        await engine.stop()
    assert await run_keys(other_redis_url, run, "held") == []
    with pytest.raises(InvalidArgument, match="run_id"):
        RolloutClient("127.0.0.1:1", other_redis_url, "bad id").delete_run()


async def test_a_run_deleted_while_a_submit_writes_its_groups_leaves_none_running(
    redis_url: str,
) -> None:
    # The Submit's groups are in Redis, not yet queued, when DeleteRun comes: it waits for
    # them to be queued, then cancels them with the rest (else they would run on, to a
    # delivery Redis refuses).
    engine = await FakeEngine("e0", holds=(0, 1), on_abort=AbortOutcome.IGNORED).start()
    runtime = await make_runtime(redis_url, [engine])
    run = new_run()
    written, go_on = asyncio.Event(), asyncio.Event()
    real_add = runtime._store.add_pending

    async def add_pending(run_id: str, groups: Sequence[GroupSpec]) -> None:
        await real_add(run_id, groups)
        written.set()
        await go_on.wait()

    runtime._store.add_pending = add_pending  # type: ignore[method-assign,assignment]
    try:
        submit = asyncio.create_task(runtime.submit(run, specs(run, 2)))
        await written.wait()
        delete = asyncio.create_task(runtime.delete_run(run))
        await asyncio.sleep(0.1)
        assert not delete.done()  # it waits for the Submit's groups to be queued
        go_on.set()
        await submit
        assert await delete == (2, True)
        status = runtime.status()
    finally:
        await runtime.stop()
        await engine.stop()
    assert (status.queue_depth, status.inflight_groups) == (0, 0)
    assert await run_keys(redis_url, run, "g0", "g1") == []


async def test_a_version_read_before_a_delete_is_not_kept_after_it(redis_url: str) -> None:
    """A Submit of a run this process has not seen reads the run's version (5) while a
    DeleteRun of it ends: the run used again starts at 0, as Redis has it, and its trainer
    publishes 1 (the 5 read before the delete, kept, refused every version below it).
    Faked: the engine, and the store's read of the version (held until the delete ends)."""
    engine = await FakeEngine("e0").start()
    runtime = await make_runtime(redis_url, [engine])
    run = new_run()
    store = runtime._store
    await store.publish_version(run, 5)  # (another scheduler's, before this one started)
    read = store.load_versions
    reading, deleted = asyncio.Event(), asyncio.Event()

    async def slow_first_read(run_ids: Sequence[str]) -> dict[str, int]:
        loaded = await read(run_ids)
        if not reading.is_set():
            reading.set()
            await deleted.wait()
        return loaded

    store.load_versions = slow_first_read  # type: ignore[method-assign]
    try:
        submit = asyncio.create_task(runtime.submit(run, specs(run, 1)))
        await asyncio.wait_for(reading.wait(), WAIT_S)
        await runtime.delete_run(run)
        deleted.set()
        await asyncio.wait_for(submit, WAIT_S)
        assert runtime.policy_version(run) == 0
        assert (await runtime.publish_version(run, 1)).version == 1
        await read_stream(redis_url, run, 1)
        await runtime.delete_run(run)  # (nothing left pending for the next test)
    finally:
        await runtime.stop()
        await engine.stop()


async def test_a_delivery_retried_across_the_delete_never_lands_in_the_run_used_again(
    redis_url: str,
) -> None:
    # g0's delivery meets a Redis error and is retried (50 ms later); DeleteRun and a Submit
    # of g0 again come in between. The old g0 must not be delivered for the new one (which
    # takes longer than the retry: 0.2 s between its two chunks).
    engine = await FakeEngine("e0", step_s=0.2).start()
    runtime = await make_runtime(redis_url, [engine])
    run = new_run()
    failed_once = asyncio.Event()
    real_deliver = runtime._store.deliver

    async def deliver(result: GroupResult) -> str | None:
        if result.run_id == run and not failed_once.is_set():
            failed_once.set()
            raise redis.exceptions.ConnectionError("Redis went away for a moment")
        return await real_deliver(result)

    runtime._store.deliver = deliver  # type: ignore[method-assign]
    first = dataclasses.replace(spec("g0", n=1, run_id=run), metadata=(("round", "1"),))
    second = dataclasses.replace(first, metadata=(("round", "2"),))
    try:
        await runtime.submit(run, [first])
        await failed_once.wait()
        assert await runtime.delete_run(run) == (0, True)
        await runtime.submit(run, [second])
        [delivered] = await read_stream(redis_url, run, 1)
        await asyncio.sleep(0.2)  # (anything more would have come by now)
        assert len(await read_stream(redis_url, run, 1)) == 1
    finally:
        await runtime.stop()
        await engine.stop()
    assert delivered.metadata == {"round": "2"}


async def test_a_delete_waits_for_the_endings_an_engine_failure_left_to_write(
    redis_url: str,
) -> None:
    # An engine fails under two runs' groups, each on its last attempt: both fail, and their
    # entries are written one after the other; run a's is slow (a Redis that refuses for a
    # while). A DeleteRun of run b waits for b's entry: written after it, and after a new
    # Submit of the same group id, it would end the new group with the old one's failure.
    engine = await FakeEngine("e0", behaviour=Behaviour.HANG).start()
    runtime = await make_runtime(redis_url, [engine], max_attempts=1)
    run_a, run_b = new_run(), new_run()
    gate = asyncio.Event()
    real_deliver = runtime._store.deliver

    async def deliver(result: GroupResult) -> str | None:
        if result.run_id == run_a:
            await gate.wait()
        return await real_deliver(result)

    runtime._store.deliver = deliver  # type: ignore[method-assign]

    async def hanging(count: int) -> bool:
        return engine.hanging >= count

    try:
        await runtime.submit(run_a, [spec("g0", run_id=run_a)])
        await eventually(lambda: hanging(1), "run a's group running")  # (its ending goes first)
        await runtime.submit(run_b, [spec("g0", run_id=run_b)])
        await eventually(lambda: hanging(2), "run b's group running")
        await runtime._engine_down(runtime._engines["e0"], "lost")
        delete = asyncio.create_task(runtime.delete_run(run_b))
        await asyncio.sleep(0.2)
        assert not delete.done()  # b's entry waits behind a's, and the delete waits for it
        gate.set()
        assert await delete == (0, True)
        await runtime.submit(run_b, [spec("g0", run_id=run_b)])  # the run used again
        [failed] = await read_stream(redis_url, run_a, 1)
        await asyncio.sleep(0.2)
        assert await run_keys(redis_url, run_b) == [pending_key(run_b), RUNS_KEY]  # no entry
        assert f"{run_b}/g0" in runtime._groups
        await runtime.delete_run(run_b)  # (nothing left pending for the next test)
    finally:
        await runtime.stop()
        await engine.stop()
    assert failed.status is GroupStatus.FAILED and "1 attempts failed" in failed.error


async def test_a_publish_whose_caller_went_still_holds_off_a_delete_of_its_run(
    other_redis_url: str,
) -> None:
    # The publish of weights goes on after its caller's deadline (carried through); the
    # delete waits for it, or the publish wrote the deleted run's version back to Redis.
    # (A database of its own: the fleet's weights stay in it.)
    gate = asyncio.Event()
    engine = await FakeEngine("e0", load_gate=gate).start()
    runtime = await make_runtime(other_redis_url, [engine])
    run = new_run()
    try:
        caller = asyncio.create_task(runtime.publish_version(run, 2, "/weights/v2"))
        await eventually(asked_to_load(engine), "the engine asked to load")
        caller.cancel()  # the trainer's deadline
        await asyncio.gather(caller, return_exceptions=True)
        delete = asyncio.create_task(runtime.delete_run(run))
        await asyncio.sleep(0.1)
        assert not delete.done()  # it waits for the publish
        gate.set()
        assert await delete == (0, True)
        assert await run_keys(other_redis_url, run) == []  # no version came back
        weights = await runtime._store.load_weights()
        assert weights is not None and (weights.path, weights.run_id) == ("/weights/v2", "")
        assert runtime.policy_version(run) == 0
    finally:
        await runtime.stop()
        await engine.stop()


async def test_a_delete_redis_refuses_leaves_the_run_running(redis_url: str) -> None:
    engine = await FakeEngine("e0", holds=(0,), on_abort=AbortOutcome.IGNORED).start()
    runtime = await make_runtime(redis_url, [engine])
    run = new_run()
    real_delete = runtime._store.delete_run
    refusals = [redis.exceptions.ConnectionError("Redis is down")]

    async def delete_run(run_id: str) -> bool:
        if refusals:
            raise refusals.pop()
        return await real_delete(run_id)

    runtime._store.delete_run = delete_run  # type: ignore[method-assign]
    try:
        await runtime.submit(run, specs(run, 1, n=1))
        await eventually(running(runtime, 1), "the group running")
        with pytest.raises(redis.exceptions.ConnectionError):
            await runtime.delete_run(run)
        assert runtime.status().inflight_groups == 1  # not forgotten: it runs on
        assert await runtime.delete_run(run) == (1, True)  # and a retry ends it
    finally:
        await runtime.stop()
        await engine.stop()


async def test_a_delete_whose_answer_was_lost_leaves_no_group_running_under_the_id_used_again(
    redis_url: str,
) -> None:
    # Redis deleted the run and the answer was lost: its group runs on here. A Submit of the
    # same id then (Redis takes it as new) ends the old one: two groups of one id ran, and
    # the old one's prompt stayed counted against the queue's limit.
    engine = await FakeEngine("e0", behaviour=Behaviour.HANG).start()
    runtime = await make_runtime(redis_url, [engine])
    run = new_run()
    real_delete = runtime._store.delete_run

    async def delete_run(run_id: str) -> bool:
        await real_delete(run_id)
        raise redis.exceptions.ConnectionError("Connection reset by peer")

    try:
        await runtime.submit(run, specs(run, 1, n=1))
        await eventually(running(runtime, 1), "the group running")
        runtime._store.delete_run = delete_run  # type: ignore[method-assign]
        with pytest.raises(redis.exceptions.ConnectionError):
            await runtime.delete_run(run)
        [old] = runtime._groups.values()
        await runtime.submit(run, specs(run, 1, n=1))
        [new] = runtime._groups.values()
        assert new is not old and old.samples[0].state is SampleState.CANCELLED
        assert runtime._held_prompt_tokens == len(new.spec.prompt_token_ids)
        await eventually(lambda: _cancelled(engine), "the old group's call cancelled")
        runtime._store.delete_run = real_delete  # type: ignore[method-assign]
        await runtime.delete_run(run)  # (nothing left pending for the next test)
    finally:
        await runtime.stop()
        await engine.stop()


async def _cancelled(engine: FakeEngine) -> bool:
    return engine.cancelled >= 1


async def test_a_publish_in_progress_ends_before_the_delete_and_the_weights_name_no_run(
    other_redis_url: str,
) -> None:
    # (A database of its own: the fleet's weights stay in it.)
    gate = asyncio.Event()
    engine = await FakeEngine("e0", load_gate=gate).start()
    runtime = await make_runtime(other_redis_url, [engine])
    run = new_run()
    try:
        publish = asyncio.create_task(runtime.publish_version(run, 5, "/weights/v5"))
        await eventually(asked_to_load(engine), "the engine asked to load")
        delete = asyncio.create_task(runtime.delete_run(run))
        await asyncio.sleep(0.1)
        assert not delete.done()  # it waits for the publish
        gate.set()
        assert (await publish).version == 5
        assert await delete == (0, True)
        store = runtime._store
        weights = await store.load_weights()
        # The engines still serve those weights; no run's tokens are labelled by them now.
        assert weights is not None and (weights.path, weights.run_id) == ("/weights/v5", "")
        assert runtime.policy_version(run) == 0 and not runtime._stamps(run)
        await runtime.submit(run, specs(run, 1, n=1))
        [result] = await read_stream(other_redis_url, run, 1)
    finally:
        await runtime.stop()
        await engine.stop()
    assert await run_keys(other_redis_url, run) != []  # (the run used again has its state)
    assert {seg.version for s in result.samples for seg in s.versions} == {0}


@pytest.mark.parametrize("sync", [False, True])
async def test_a_reader_of_a_run_deleted_under_it_is_told_so_and_makes_no_stream_again(
    redis_url: str, sync: bool
) -> None:
    engine = await FakeEngine("e0").start()
    runtime = await make_runtime(redis_url, [engine])
    run = new_run()
    # (the readers never call the scheduler: its address is not needed)
    reader = AsyncRolloutClient("127.0.0.1:1", redis_url, run, block_ms=100)
    redis_client = aioredis.Redis.from_url(redis_url)
    try:
        await runtime.submit(run, specs(run, 1, n=1))
        async for item in reader.groups(limit=1, timeout_s=WAIT_S):  # (its group made)
            await item.done()

        async def read_on() -> None:
            if sync:
                with RolloutClient("127.0.0.1:1", redis_url, run, block_ms=100) as client:
                    await asyncio.to_thread(lambda: list(client.groups(timeout_s=WAIT_S)))
            else:
                async for _ in reader.groups(timeout_s=WAIT_S):
                    pass

        reading = asyncio.create_task(read_on())
        await asyncio.sleep(0.5)  # (reading: blocked on the stream)
        assert not reading.done()
        await runtime.delete_run(run)
        with pytest.raises(RunDeleted, match=f"run '{run}' was deleted"):
            await asyncio.wait_for(reading, WAIT_S)
        assert await redis_client.exists(stream_key(run)) == 0  # not made again
        assert await redis_client.get(deletes_key(run)) == b"1"
        assert 0 < await redis_client.ttl(deletes_key(run)) <= DELETES_KEPT_S

        # The id used again: a reader made now reads the new run; one made before the delete
        # that reads only after the new Submit is still told (it would drop the new run's
        # groups whose ids it acknowledged in the old one: g0 here).
        stale = AsyncRolloutClient("127.0.0.1:1", redis_url, run, block_ms=100)
        await runtime.submit(run, specs(run, 1, n=1))
        try:
            async for item in stale.groups(limit=1, timeout_s=WAIT_S):
                await item.done()
            await runtime.delete_run(run)
            await runtime.submit(run, specs(run, 1, n=1))
            await read_stream(redis_url, run, 1)  # (the new g0 delivered)
            # Another worker of the trainer made the group anew: the stale reader meets no
            # NOGROUP, only an entry of a group id it acknowledged.
            await redis_client.xgroup_create(stream_key(run), "trainer", id="0")
            with pytest.raises(RunDeleted):
                async for _ in stale.groups(timeout_s=WAIT_S):
                    pass
            # The entry stays pending (read by the stale reader, not acknowledged): another
            # reader claims it once idle.
            async with AsyncRolloutClient(
                "127.0.0.1:1", redis_url, run, claim_idle_ms=300
            ) as again:
                async for item in again.groups(limit=1, timeout_s=WAIT_S):
                    assert item.result.group_id == "g0"
                    await item.done()
        finally:
            await stale.close()
        await runtime.delete_run(run)
    finally:
        await reader.close()
        await redis_client.aclose()
        await runtime.stop()
        await engine.stop()
