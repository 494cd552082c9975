"""The trained reasoner on real vLLM: the stats command and the demo's trainer loop.

Both run as the user runs them, as the ``rollserve`` command in a child process (each starts
its own engine: real vLLM on CPU, real Redis, real gRPC). The figures themselves are not
asserted against the workload's targets here: a dozen prompts cannot show a tail; the full
measurement is ``rollserve workload stats`` (see docs/workload.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.cli_proc import run_rollserve

pytestmark = pytest.mark.integration


@pytest.mark.timeout(600)
def test_workload_stats_writes_the_figures_and_the_json(tmp_path: Path) -> None:
    out = tmp_path / "stats"
    run_rollserve(
        [
            "workload",
            "stats",
            "--prompts",
            "24",
            "--samples",
            "2",
            "--out-dir",
            str(out),
            "--json",
            str(out / "stats.json"),
        ],
        cwd=tmp_path,
        timeout=540,
    )
    figures = json.loads((out / "stats.json").read_text())
    for key in (
        "p99_over_median",
        "max_over_median",
        "prompt_variance_share",
        "top10_overlap",
        "accuracy",
        "mixed_group_share",
    ):
        assert isinstance(figures[key], float), key
    assert figures["prompts"] == 24
    assert figures["samples_per_prompt"] == 2
    # The trained model solves some tasks and not all: its reward has a signal.
    assert 0.0 < figures["accuracy"] < 1.0
    for name in ("lengths_hist.png", "pass1_vs_pass2.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG"), name


@pytest.mark.timeout(600)
def test_demo_runs_the_trained_model_and_reports_reward(tmp_path: Path) -> None:
    summary_path = tmp_path / "demo.json"
    run_rollserve(
        ["demo", "--steps", "2", "--groups", "6", "--n", "4", "--json", str(summary_path)],
        cwd=tmp_path,
        timeout=540,
    )
    summary = json.loads(summary_path.read_text())
    assert summary["groups"] == 12
    assert summary["samples"] == 48
    assert summary["output_tokens_per_s"] > 0
    assert 0.0 < summary["mean_reward"] < 1.0
    assert 0.0 <= summary["prefix_cache_hit_rate"] <= 1.0
    assert summary["engine_dtypes"] in (["float32"], ["bfloat16"])  # as the engine said


@pytest.mark.timeout(600)
def test_demo_that_trains_publishes_each_update_and_the_next_step_runs_it(tmp_path: Path) -> None:
    from rollserve.assets import reasoner_dir
    from safetensors.numpy import load_file

    summary_path = tmp_path / "demo.json"
    checkpoints = tmp_path / "ckpt"
    run_rollserve(
        [
            "demo", "--steps", "2", "--groups", "6", "--n", "4", "--train", "--lr", "1e-4",
            "--checkpoints", str(checkpoints), "--json", str(summary_path),
        ],
        cwd=tmp_path,
        timeout=540,
    )  # fmt: skip
    summary = json.loads(summary_path.read_text())
    # Step 1 ran the shipped weights (version 0), step 2 the first update (version 1).
    assert summary["versions_per_step"] == [[0], [1]]
    assert summary["policy_version"] == 2
    assert summary["samples"] == 48 and summary["train_s"] > 0
    for step in (1, 2):
        assert (checkpoints / f"step-{step}" / "tokenizer.json").is_file()
    shipped = load_file(reasoner_dir() / "model.safetensors")
    trained = load_file(checkpoints / "step-2" / "model.safetensors")
    assert set(trained) == set(shipped)
    assert any((trained[name] != shipped[name]).any() for name in shipped)
