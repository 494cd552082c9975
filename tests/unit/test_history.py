"""The length predictor's history in Redis: the store's records, and a restarted runtime that
predicts as before. Real Redis (the session's); engines are fakes (see fakes.py)."""

from __future__ import annotations

import dataclasses
import uuid

import pytest
import redis.asyncio as aioredis
from rollserve.scheduler.core.predictor import LengthPredictor
from rollserve.scheduler.store import Store, history_keys

from tests.unit.builders import spec
from tests.unit.fakes import FakeEngine
from tests.unit.test_runtime import eventually, make_runtime, new_run, read_stream


def namespace() -> str:
    return f"ns-{uuid.uuid4().hex[:10]}"


async def test_store_keeps_the_most_recently_written_keys_in_use_order(redis_url: str) -> None:
    ns = namespace()
    store = Store.from_url(redis_url, predictor_namespace=ns)
    try:
        assert (await store.load_history()).records == []
        assert await store.save_history({"a": b"1", "b": b"2"}, b"g1", max_keys=2) == 0
        assert await store.save_history({"c": b"3"}, b"g2", max_keys=2) == 1
        history = await store.load_history()
        assert history.globals == b"g2"
        assert history.records[-1] == ("c", b"3") and len(history.records) == 2
        await store.drop_history_keys(["c"])
        assert [k for k, _ in (await store.load_history()).records] == ["b"]
    finally:
        await store.close()
    client = aioredis.Redis.from_url(redis_url)
    records_key, used_key, _, _ = history_keys(ns)
    assert await client.hlen(records_key) == await client.zcard(used_key) == 1
    await client.aclose()


async def test_a_restarted_runtime_predicts_as_before(redis_url: str) -> None:
    ns = namespace()
    engine = await FakeEngine("e", lengths=(10, 20, 30, 40)).start()
    first = await make_runtime(redis_url, [engine], predictor_namespace=ns)
    store = Store.from_url(redis_url, predictor_namespace=ns)
    run = new_run()
    groups = [
        dataclasses.replace(
            spec(f"g{i}", n=4, max_tokens=max_tokens, run_id=run), prompt_key=key, epoch=epoch
        )
        for i, (key, max_tokens, epoch) in enumerate(
            [("k0", 15, 0), ("k1", 64, 1), ("k0", 64, 3), ("k2", 25, 3)]
        )
    ]
    try:
        await first.submit(run, groups)
        await read_stream(redis_url, run, 4)
        before = first.predictor

        # Saved after each group, not only at shutdown.
        async def saved() -> bool:
            history = await store.load_history()
            return len(history.records) == 3 and history.globals == before.dump_globals()

        await eventually(saved, "the history of 3 prompt keys in Redis")
    finally:
        await first.stop()
        await engine.stop()
        await store.close()
    second = await make_runtime(redis_url, [], predictor_namespace=ns)
    try:
        after = second.predictor
    finally:
        await second.stop()
    other = await make_runtime(redis_url, [])  # another namespace: nothing learnt
    try:
        assert len(other.predictor) == 0
    finally:
        await other.stop()
    assert list(after) == list(before) and sorted(after) == ["k0", "k1", "k2"]
    assert after.dump_globals() == before.dump_globals() and after.epoch == 3
    assert all(after.dump_key(key) == before.dump_key(key) for key in before)
    for key in ("k0", "k1", "k2", "never-seen"):
        for siblings, progress in (((), ()), ((12,), ()), ((), (30,))):
            assert after.predict(key, 5, siblings, progress) == before.predict(
                key, 5, siblings, progress
            )
    assert after.predict("k1", 5).mean != LengthPredictor().predict("k1", 5).mean


@pytest.mark.parametrize("broken", [b"", b"\x09" * 57])
async def test_a_broken_saved_record_is_dropped_not_fatal(redis_url: str, broken: bytes) -> None:
    ns = namespace()
    store = Store.from_url(redis_url, predictor_namespace=ns)
    good = LengthPredictor()
    good.observe("fine", 100)
    await store.save_history({"fine": good.dump_key("fine"), "bad": broken}, b"junk", 10)
    await store.close()
    runtime = await make_runtime(redis_url, [], predictor_namespace=ns)
    try:
        assert list(runtime.predictor) == ["fine"] and runtime.predictor.epoch == 0
    finally:
        await runtime.stop()
    check = Store.from_url(redis_url, predictor_namespace=ns)
    assert [k for k, _ in (await check.load_history()).records] == ["fine"]
    await check.close()
