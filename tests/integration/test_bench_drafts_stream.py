"""``rollserve bench drafts --stream RUN``: a run's delivered groups read from its stream on a
real redis-server, without consuming them. Entries are written as the scheduler writes them
(``encode_entry`` + XADD); no scheduler runs."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from rollserve.bench.drafts import read_stream
from rollserve.cli.main import main
from rollserve.client.wire import (
    FinishReason,
    GroupResult,
    GroupStatus,
    Sample,
    encode_entry,
    stream_key,
)

pytestmark = pytest.mark.integration


def _group(run: str, group_id: str, key: str, at: float, responses: list[list[int]]) -> GroupResult:
    return GroupResult(
        run_id=run,
        group_id=group_id,
        status=GroupStatus.DELIVERED,
        prompt_key=key,
        prompt_token_ids=[20, 21],
        samples=[
            Sample(
                sample_id=f"{group_id}/{i}",
                index=i,
                token_ids=tokens,
                logprobs=[-0.5] * len(tokens),
                finish_reason=FinishReason.STOP,
                engine_id="engine-0",
                spec_proposed_tokens=4,
                spec_accepted_tokens=1,
                spec_drafts=1,
            )
            for i, tokens in enumerate(responses)
        ],
        submitted_at=at,
        finished_at=at + 1,
    )


def _add(client: redis.Redis, result: GroupResult) -> None:
    fields: dict[Any, Any] = dict(encode_entry(result))  # as the scheduler writes it
    client.xadd(stream_key(result.run_id), fields)


def test_a_runs_stream_is_measured_without_consuming_it(
    redis_client: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    run = f"drafts-{uuid.uuid4().hex[:8]}"
    solution = list(range(100, 130))
    entries = [
        _group(run, "g-late", "p", 30.0, [solution]),  # written first, submitted last
        _group(run, "g-first", "p", 10.0, [solution, solution[:12]]),
        _group(run, "g-other", "q", 20.0, [list(range(200, 220))]),
        GroupResult(run_id=run, group_id="g-failed", status=GroupStatus.FAILED, error="boom"),
    ]
    for result in entries:
        _add(redis_client, result)
    # more than one page of XRANGE
    for i in range(600):
        _add(redis_client, _group(run, f"x{i}", f"k{i}", 40 + i, [[1, 2]]))

    rollouts = read_stream(redis_url, run)
    assert len(rollouts) == 603  # the failed group is left out
    first, other, late = rollouts[:3]  # by submission
    assert (first.prompt_key, first.epoch, late.prompt_key, late.epoch) == ("p", 0, "p", 1)
    assert (other.prompt_key, other.epoch) == ("q", 0)
    assert first.responses == (tuple(solution), tuple(solution[:12]))
    assert (first.prompt_token_ids, first.spec_proposed, first.spec_accepted) == ((20, 21), 8, 2)
    assert first.spec_drafts == 2

    report = tmp_path / "d.json"
    argv = ["bench", "drafts", "--stream", run, "--redis-url", redis_url, "--drafters", "history"]
    assert main([*argv, "--json", str(report)]) == 0
    history = json.loads(report.read_text())["drafters"]["history"]["all"]
    assert history["accepted_tokens"] > 0  # g-late repeats g-first's solution
    # Nothing was consumed: the stream still holds every entry, and no consumer group exists.
    assert redis_client.xlen(stream_key(run)) == 604
    assert redis_client.xinfo_groups(stream_key(run)) == []

    assert main(["bench", "drafts", "--stream", "no-such-run", "--redis-url", redis_url]) == 2
    assert main(["bench", "drafts", "--stream", run]) == 2  # no --redis-url


def test_bench_remaining_reads_a_runs_stream_too(
    redis_client: redis.Redis, redis_url: str, tmp_path: Path
) -> None:
    run = f"remaining-{uuid.uuid4().hex[:8]}"
    solution = list(range(100, 140))
    _add(redis_client, _group(run, "g0", "p", 10.0, [solution, solution[:20]]))
    _add(redis_client, _group(run, "g1", "p", 20.0, [solution, solution[:20]]))
    report = tmp_path / "rem.json"
    argv = ["bench", "remaining", "--stream", run, "--redis-url", redis_url, "--fractions", "0.5"]
    assert main([*argv, "--json", str(report)]) == 0
    rows = {(r["samples_of"], r["method"]): r for r in json.loads(report.read_text())["rows"]}
    # g1 (epoch 1) retraces g0: both its samples are aligned with g0's outputs; in g0 the long
    # sample at 20 tokens is aligned with its finished sibling, which ended there. Exact only
    # for g1's short sample: at 20 tokens the long one agrees with three outputs, two of
    # which ended there (the median of 0, 0 and 20 tokens left is 0: 1 is said)
    assert rows[("all", "aligned")]["samples"] == 4
    assert rows[("all", "aligned")]["aligned_share"] == 0.75
    assert rows[("all", "aligned")]["within_5pct"] == 0.25
    assert redis_client.xlen(stream_key(run)) == 2  # nothing consumed
    assert main(["bench", "remaining", "--stream", run]) == 2  # no --redis-url
    assert main([*argv, "--samples", str(report)]) == 2  # a file or a stream, not both
