"""Samples as they finish (``stream_samples``): the samples stream, its exactly-once write,
and a restarted scheduler that keeps what was written.

Faked: the engine (``FakeEngine``). Real: Redis, the scheduler runtime, its store and its
gRPC client code.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import cast

import pytest
import redis.asyncio as aioredis
import redis.exceptions
from rollserve.client import (
    AsyncReceivedSample,
    AsyncRolloutClient,
    InvalidArgument,
    PromptGroup,
    RolloutClient,
    SamplingParams,
)
from rollserve.client.wire import (
    FinishReason,
    GroupResult,
    GroupStatus,
    Sample,
    SampleResult,
    VersionSegment,
    decode_entry,
    decode_sample_entry,
    samples_stream_key,
    stream_key,
    streamed_key,
)
from rollserve.scheduler.settings import EngineEndpoint, SchedulerSettings
from rollserve.scheduler.state import GroupSpec
from rollserve.scheduler.store import Store

from tests.served import served_scheduler
from tests.unit.builders import spec
from tests.unit.fakes import AbortOutcome, FakeEngine
from tests.unit.test_runtime import (
    WAIT_S,
    eventually,
    make_runtime,
    new_run,
    read_stream,
    running,
)

Entries = list[tuple[bytes, dict[bytes, bytes]]]


def streaming(group_id: str, run_id: str, n: int = 3) -> GroupSpec:
    return dataclasses.replace(spec(group_id, n=n, run_id=run_id), stream_samples=True)


async def read_samples(redis_url: str, run_id: str) -> list[tuple[str, SampleResult]]:
    client = aioredis.Redis.from_url(redis_url)
    try:
        entries = cast(Entries, await client.xrange(samples_stream_key(run_id)))
    finally:
        await client.aclose()
    return [(entry_id.decode(), decode_sample_entry(fields)) for entry_id, fields in entries]


async def group_entry(redis_url: str, run_id: str) -> tuple[str, GroupResult]:
    await read_stream(redis_url, run_id, 1)
    client = aioredis.Redis.from_url(redis_url)
    try:
        [(entry_id, fields)] = cast(Entries, await client.xrange(stream_key(run_id)))
    finally:
        await client.aclose()
    return entry_id.decode(), decode_entry(fields)


def order(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


async def test_each_sample_is_streamed_once_before_its_group(redis_url: str) -> None:
    engine = await FakeEngine("e0", lengths=(2, 5, 7)).start()
    runtime = await make_runtime(redis_url, [engine])
    run = new_run()
    try:
        await runtime.submit(run, [streaming("g0", run), spec("plain", n=2, run_id=run)])
        await read_stream(redis_url, run, 2)
        group_id, group = await group_entry_named(redis_url, run, "g0")
        samples = await read_samples(redis_url, run)
        streamed = runtime.status().samples_streamed
    finally:
        await runtime.stop()
        await engine.stop()
    # Only the group that asked for it, each sample once, every one before the group's entry.
    assert sorted(r.sample_id for _, r in samples) == ["g0/0", "g0/1", "g0/2"]
    assert streamed == 3 and runtime.counters.samples_streamed == 3
    # (ids of two streams compare by their milliseconds only: each stream counts its own)
    assert all(order(entry_id)[0] <= order(group_id)[0] for entry_id, _ in samples)
    assert group.status == GroupStatus.DELIVERED
    by_index = {r.index: r for _, r in samples}
    for sample in group.samples:  # the group carries the very samples that were streamed
        assert by_index[sample.index].sample == sample
    first = by_index[0]
    assert (first.run_id, first.group_id, first.n, first.prompt_key) == (run, "g0", 3, "key-g0")
    assert [len(by_index[i].sample.token_ids) for i in range(3)] == [2, 5, 7]
    # The kept copies go with the group's entry.
    client = aioredis.Redis.from_url(redis_url)
    try:
        assert await client.exists(streamed_key(run, "g0")) == 0
    finally:
        await client.aclose()


async def group_entry_named(redis_url: str, run_id: str, group_id: str) -> tuple[str, GroupResult]:
    client = aioredis.Redis.from_url(redis_url)
    try:
        entries = cast(Entries, await client.xrange(stream_key(run_id)))
    finally:
        await client.aclose()
    for entry_id, fields in entries:
        result = decode_entry(fields)
        if result.group_id == group_id:
            return entry_id.decode(), result
    raise AssertionError(f"no entry for {group_id}")


async def test_a_restarted_scheduler_runs_only_the_samples_not_streamed(redis_url: str) -> None:
    # Sample 1 is held on the first engine (it never finishes there); sample 0 finishes and
    # is streamed; then the scheduler stops as if it died. The next one keeps sample 0 and
    # runs sample 1 alone.
    holding = await FakeEngine("first", holds=(1,), on_abort=AbortOutcome.IGNORED).start()
    first = await make_runtime(redis_url, [holding])
    run = new_run()
    await first.submit(run, [streaming("g0", run, n=2)])
    await eventually(running(first, 1), "the group running")

    async def sample_0_streamed() -> bool:
        return first.counters.samples_streamed == 1

    await eventually(sample_0_streamed, "sample 0 in the samples stream")
    await first.stop()
    await holding.stop()
    engine = await FakeEngine("second", first_token=500).start()
    second = await make_runtime(redis_url, [engine])
    try:
        _, group = await group_entry(redis_url, run)
        samples = await read_samples(redis_url, run)
    finally:
        await second.stop()
        await engine.stop()
    assert [list(r.sample_indices) for r in engine.requests] == [[1]]
    assert [r.sample_id for _, r in samples] == ["g0/0", "g0/1"]
    kept = samples[0][1].sample
    assert group.samples[0] == kept and kept.engine_id == "first"
    assert group.samples[1].engine_id == "second" and group.samples[1].token_ids[0] == 500
    assert group.samples[1] == samples[1][1].sample


async def test_a_group_whose_samples_were_all_streamed_is_delivered_at_start(
    redis_url: str,
) -> None:
    # A scheduler died between its last sample's write and the group's: the next one
    # delivers the group from what was written, running nothing.
    run = new_run()
    group = streaming("g0", run, n=2)
    store = Store.from_url(redis_url)
    sample_results = [
        SampleResult(
            run_id=run,
            group_id="g0",
            n=2,
            sample=_sample(f"g0/{i}", i),
        )
        for i in range(2)
    ]
    try:
        await store.add_pending(run, [group])
        for result in sample_results:
            assert await store.deliver_sample(result) is not None
    finally:
        await store.close()
    engine = await FakeEngine("e0").start()
    runtime = await make_runtime(redis_url, [engine])
    try:
        _, delivered = await group_entry(redis_url, run)
    finally:
        await runtime.stop()
        await engine.stop()
    assert engine.requests == []
    assert delivered.samples == [r.sample for r in sample_results]


async def test_a_sample_is_written_once_and_only_while_its_group_is_pending(
    redis_url: str,
) -> None:
    run = new_run()
    store = Store.from_url(redis_url)
    client = aioredis.Redis.from_url(redis_url)
    result = SampleResult(run_id=run, group_id="g0", n=2, sample=_sample("g0/0", 0))
    cancelled = SampleResult(run_id=run, group_id="g1", n=2, sample=_sample("g1/0", 0))
    try:
        assert await store.deliver_sample(result) is None  # never submitted
        await store.add_pending(run, [streaming("g0", run, n=2), streaming("g1", run, n=2)])
        assert await store.deliver_sample(result) is not None
        assert await store.deliver_sample(result) is None  # a retry writes nothing more
        kept = await store.load_streamed([(run, "g0")])
        assert [r.sample for r in kept[run, "g0"]] == [result.sample]
        assert await store.deliver_sample(cancelled) is not None
        assert await store.cancel(run, ["g1"]) == ["g1"]
        assert await client.exists(streamed_key(run, "g1")) == 0  # gone with the group
        assert await store.deliver_sample(cancelled) is None  # the group has ended
        ended = GroupResult(run_id=run, group_id="g0", status=GroupStatus.FAILED, error="x")
        assert await store.deliver(ended) is not None
        assert await store.load_streamed([(run, "g0")]) == {(run, "g0"): []}
        assert await store.deliver_sample(result) is None
        assert await client.xlen(samples_stream_key(run)) == 2
    finally:
        await store.close()
        await client.aclose()


def _sample(sample_id: str, index: int) -> Sample:
    return Sample(
        sample_id=sample_id,
        index=index,
        token_ids=[7, 8, 9],
        logprobs=[-0.25, -0.5, -0.75],
        finish_reason=FinishReason.STOP,
        engine_id="gone",
        versions=[VersionSegment(0, 3)],
        finished_at=1.5,
    )


async def test_the_sdk_reads_samples_as_they_finish_then_their_group(
    other_redis_url: str,
) -> None:
    # Over the wire: the SDK submits with stream_samples, a samples reader (async, then sync
    # in a thread) gets each sample once, and a groups reader gets the group with them.
    engine = await FakeEngine("e0", lengths=(3, 6)).start()
    settings = SchedulerSettings.model_validate(
        {
            "redis_url": other_redis_url,
            "port": 0,
            "engines": [EngineEndpoint(engine_id="e0", address=engine.address)],
            "health_interval_s": 0.1,
            "predictor_namespace": f"ns-{new_run()}",
        }
    )
    run = new_run()
    try:
        async with served_scheduler(settings, WAIT_S) as served:
            address = f"127.0.0.1:{served.port}"
            async with (
                AsyncRolloutClient(address, other_redis_url, run, reads="samples") as samples,
                AsyncRolloutClient(address, other_redis_url, run) as groups,
            ):
                groups_to_send = [
                    PromptGroup(
                        group_id=f"g{i}",
                        prompt_token_ids=[5, 6, 7],
                        n=2,
                        sampling=SamplingParams(max_tokens=8),
                        stream_samples=i < 2,
                    )
                    for i in range(3)
                ]
                assert await samples.submit(groups_to_send) == 3
                first = [r async for r in samples.samples(limit=2, timeout_s=WAIT_S)]
                for received in first:
                    assert await received.done()
                with pytest.raises(InvalidArgument, match="reads the run's samples stream"):
                    [r async for r in samples.groups(limit=1, timeout_s=0.1)]
                delivered = [r async for r in groups.groups(limit=3, timeout_s=WAIT_S)]
                for group in delivered:
                    await group.done()
                with pytest.raises(InvalidArgument, match="reads the run's groups stream"):
                    [r async for r in groups.samples(limit=1, timeout_s=0.1)]

            def read_the_rest() -> list[str]:
                with RolloutClient(address, other_redis_url, run, reads="samples") as reader:
                    rest = list(reader.samples(limit=2, timeout_s=WAIT_S))
                    assert reader.ack(*rest) == 2
                    assert list(reader.samples(timeout_s=0.2)) == []  # nothing more
                    return [r.sample_id for r in rest]

            rest = await asyncio.to_thread(read_the_rest)
    finally:
        await engine.stop()
    got = sorted([r.sample_id for r in first] + rest)
    assert got == ["g0/0", "g0/1", "g1/0", "g1/1"]  # g2 did not ask for its samples
    assert all(isinstance(r, AsyncReceivedSample) and not r.redelivered for r in first)
    by_id = {r.sample_id: r.result.sample for r in first}
    for group in delivered:
        for sample in group.result.samples:
            if sample.sample_id in by_id:
                assert by_id[sample.sample_id] == sample


async def test_samples_acknowledged_after_their_groups_are_trimmed(redis_url: str) -> None:
    # A scorer that acknowledges its samples after the trainer emptied the groups stream:
    # the run stays on the trim schedule while its samples stream holds entries.
    engine = await FakeEngine("e0", lengths=(2, 3)).start()
    runtime = await make_runtime(redis_url, [engine], trim_interval_s=0.05, acked_retention_s=0)
    run = new_run()
    client = aioredis.Redis.from_url(redis_url)
    groups, samples = stream_key(run), samples_stream_key(run)
    try:
        for key in (groups, samples):
            await client.xgroup_create(key, "t", id="0", mkstream=True)
        await runtime.submit(run, [streaming("g0", run, n=2)])
        await read_stream(redis_url, run, 1)
        reply = cast(list[tuple[bytes, Entries]], await client.xreadgroup("t", "s", {samples: ">"}))
        read = [entry_id for entry_id, _ in reply[0][1]]
        reply = cast(list[tuple[bytes, Entries]], await client.xreadgroup("t", "t", {groups: ">"}))
        await client.xack(groups, "t", *(entry_id for entry_id, _ in reply[0][1]))

        async def groups_trimmed() -> bool:
            return int(await client.xlen(groups)) == 0

        await eventually(groups_trimmed, "the groups stream trimmed")
        await asyncio.sleep(0.3)  # several trim rounds with nothing acknowledged there
        assert int(await client.xlen(samples)) == 2
        await client.xack(samples, "t", *read)

        async def samples_trimmed() -> bool:
            return int(await client.xlen(samples)) == 0

        await eventually(samples_trimmed, "the samples stream trimmed")
    finally:
        await client.aclose()
        await runtime.stop()
        await engine.stop()
    assert runtime.counters.stream_entries_trimmed == 3


async def test_a_refused_sample_write_leaves_nothing_taken_for_written(redis_url: str) -> None:
    run = new_run()
    store = Store.from_url(redis_url)
    client = aioredis.Redis.from_url(redis_url)
    result = SampleResult(run_id=run, group_id="g0", n=2, sample=_sample("g0/0", 0))
    try:
        await store.add_pending(run, [streaming("g0", run, n=2)])
        await client.set(samples_stream_key(run), "not a stream")
        with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
            await store.deliver_sample(result)
        assert await store.load_streamed([(run, "g0")]) == {(run, "g0"): []}
        await client.delete(samples_stream_key(run))
        assert await store.deliver_sample(result) is not None  # written once Redis takes it
        assert await store.cancel(run, ["g0"]) == ["g0"]
    finally:
        await store.close()
        await client.aclose()
