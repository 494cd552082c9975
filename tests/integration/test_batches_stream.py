"""The step batcher over the SDK's real stream reader and a real redis-server.

Faked: the scheduler's gRPC side. ``ScriptedRun`` is a ``RolloutClient`` whose ``submit``
and ``cancel`` do not call a scheduler: a submitted group "finishes" by an XADD of its entry,
as the scheduler writes it, at once for fast groups and at the next ``submit`` for slow ones
(every third group), so slow groups are carried over into the next step. Real: Redis, the
client's consumer-group reads, re-reads of its pending list after the batcher stops reading
mid-batch, and its acks.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence

import pytest
import redis
from rollserve.client import (
    CancelResult,
    GroupResult,
    GroupStatus,
    PromptGroup,
    RolloutClient,
    StepBatcher,
)
from rollserve.client.wire import encode_entry, stream_key

GROUP = "trainer"
WAIT_S = 10.0  # bound on any wait for entries that are there; never a measured time


class ScriptedRun(RolloutClient):
    def __init__(self, redis_url: str, run_id: str, r: redis.Redis) -> None:
        super().__init__("127.0.0.1:1", redis_url, run_id, consumer_group=GROUP, block_ms=50)
        self._r = r
        self._slow: list[str] = []
        self.submitted: list[PromptGroup] = []

    def submit(self, groups: Sequence[PromptGroup]) -> int:
        held, self._slow = self._slow, []
        for group_id in held:
            self._finish(group_id)
        for group in groups:
            self.submitted.append(group)
            if int(group.group_id.removeprefix("g")) % 3 == 0:
                self._slow.append(group.group_id)
            else:
                self._finish(group.group_id)
        return len(groups)

    def cancel(self, group_ids: Sequence[str]) -> CancelResult:
        cancelled = tuple(g for g in group_ids if g in self._slow)
        self._slow = [g for g in self._slow if g not in cancelled]
        return CancelResult(cancelled, tuple(g for g in group_ids if g not in cancelled))

    def _finish(self, group_id: str) -> None:
        result = GroupResult(run_id=self.run_id, group_id=group_id, status=GroupStatus.DELIVERED)
        self._r.xadd(stream_key(self.run_id), encode_entry(result))  # type: ignore[arg-type]


def prompt_groups() -> Iterator[PromptGroup]:
    index = 0
    while True:
        yield PromptGroup(group_id=f"g{index}", prompt_token_ids=[5, 6, 7], n=1)
        index += 1


@pytest.fixture
def r(redis_client: redis.Redis) -> redis.Redis:
    return redis_client


def test_batches_over_the_real_stream(r: redis.Redis, redis_url: str) -> None:
    run_id = f"test-{uuid.uuid4().hex[:12]}"
    client = ScriptedRun(redis_url, run_id, r)
    with client:
        batcher = StepBatcher(
            client,
            prompt_groups(),
            batch_size=4,
            oversample=0.5,
            max_staleness=1,
            batch_timeout_s=WAIT_S,
        )
        batches = []
        for _, batch in zip(range(5), batcher, strict=False):
            assert len(batch) == 4
            batcher.ack(batch)
            batches.append(batch)
        delivered = [g.group_id for b in batches for g in b.groups]
        assert len(delivered) == len(set(delivered)) == 20
        # Slow groups come one step late, due, at the head of the next batch.
        assert all(g.staleness == (1 if g.due else 0) for b in batches for g in b.groups)
        assert [g.group_id for g in batches[1].groups if g.due] == ["g0", "g3"]
        assert all(
            g.launch_step == p.priority
            for b in batches
            for g in b.groups
            for p in client.submitted
            if p.group_id == g.group_id
        )
        dropped = batcher.cancel_outstanding(drain_timeout_s=WAIT_S)
        assert not dropped.unread
        assert sorted(delivered + list(dropped.group_ids)) == sorted(
            g.group_id for g in client.submitted
        )
        pending = r.xpending(stream_key(run_id), GROUP)["pending"]
        assert pending == 0  # every entry read was acknowledged, used or not
        assert client.in_hand == 0


def test_dynamic_sampling_over_the_real_stream(r: redis.Redis, redis_url: str) -> None:
    # keep turns away every group whose index is 1 mod 4: the batcher acknowledges each such
    # entry as the real reader hands it over and submits another in its place, mid-read.
    run_id = f"test-{uuid.uuid4().hex[:12]}"
    client = ScriptedRun(redis_url, run_id, r)
    with client:
        batcher = StepBatcher(
            client,
            prompt_groups(),
            batch_size=4,
            oversample=0.5,
            max_staleness=1,
            batch_timeout_s=WAIT_S,
            keep=lambda result: int(result.group_id.removeprefix("g")) % 4 != 1,
        )
        batches = []
        for _, batch in zip(range(5), batcher, strict=False):
            batcher.ack(batch)
            batches.append(batch)
        delivered = [g.group_id for b in batches for g in b.groups]
        assert [len(b) for b in batches] == [4] * 5
        assert len(set(delivered)) == 20
        assert all(int(g.removeprefix("g")) % 4 != 1 for g in delivered)
        assert sum(b.filtered for b in batches) == batcher.state.filtered > 0
        batcher.cancel_outstanding(drain_timeout_s=WAIT_S)
        assert r.xpending(stream_key(run_id), GROUP)["pending"] == 0
        assert client.in_hand == 0
