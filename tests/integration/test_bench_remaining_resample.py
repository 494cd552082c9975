"""``rollserve bench remaining --resample K``: continuing samples' states on the dev stack
(real vLLM on CPU, real Redis, real gRPC), as the user runs it: the ``rollserve`` command in
a child process, on a rollouts file written here with the shipped reasoner's prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rollserve.assets import reasoner_dir
from rollserve.bench.drafts import Rollout, write_rollouts
from rollserve.bench.workload import bench_groups

from tests.integration.cli_proc import run_rollserve

pytestmark = pytest.mark.integration


@pytest.mark.timeout(600)
def test_each_state_is_continued_k_times_within_what_the_sample_had_left(tmp_path: Path) -> None:
    max_tokens = 48
    groups = bench_groups(reasoner_dir(), 2, 1, max_tokens, 0)
    rollouts = [
        Rollout(g.prompt_key, 0, tuple(g.prompt_token_ids), (tuple(range(4, 24)),)) for g in groups
    ]
    samples, report = tmp_path / "r.jsonl", tmp_path / "rem.json"
    write_rollouts(samples, rollouts)
    args = ["--samples", str(samples), "--resample", "3", "--resample-samples", "2"]
    args += ["--engines", "1", "--max-tokens", str(max_tokens), "--fractions", "0.5"]
    run_rollserve(["bench", "remaining", *args, "--json", str(report)])
    data = json.loads(report.read_text())
    states = data["states"]
    assert sorted(s["prompt_key"] for s in states) == sorted(g.prompt_key for g in groups)
    for state in states:
        assert (state["progress"], state["left"]) == (10, 10)
        assert len(state["continuations"]) == 3
        assert all(1 <= made <= max_tokens - 10 for made in state["continuations"])
    rows = {(r["samples_of"], r["method"]): r for r in data["rows"]}
    assert rows[("all", "resampled")]["samples"] == 2
    assert rows[("all", "progress")]["samples"] == 2  # the other rows: the same states only
