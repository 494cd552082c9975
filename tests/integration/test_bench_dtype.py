"""``rollserve bench dtype`` as the user runs it: the shipped reasoner on real vLLM engines in
float32 and in bfloat16, built as the engine service builds them, timed and scored against
the trainer's float32 forward pass (transformers). Nothing is asserted on time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.cli_proc import run_rollserve

pytestmark = pytest.mark.integration


@pytest.mark.timeout(600)
def test_each_dtype_runs_as_asked_and_float32_logprobs_are_the_trainers(tmp_path: Path) -> None:
    report = tmp_path / "dtype.json"
    args = ["--batches", "1,4", "--tokens", "24", "--repeats", "1", "--json", str(report)]
    run_rollserve(["bench", "dtype", *args])
    data = json.loads(report.read_text())
    fp32, bf16 = data["dtypes"]["float32"], data["dtypes"]["bfloat16"]
    assert (fp32["resolved"], bf16["resolved"]) == ("float32", "bfloat16")
    for run in (fp32, bf16):
        assert set(run["walls_s"]) == {"1", "4"}
        assert all(len(w) == 1 and w[0] > 0 for w in run["walls_s"].values())
        assert run["logprob_vs_trainer"]["tokens"] == 4 * 24  # the largest batch's samples
    assert data["vs_float32"]["float32"] == {"1": 1.0, "4": 1.0}
    # float32 in the engine is the trainer's float32, to rounding; bfloat16 is not
    assert fp32["logprob_vs_trainer"]["max"] < 1e-3
    assert bf16["logprob_vs_trainer"]["max"] > fp32["logprob_vs_trainer"]["max"]
    assert data["auto"] in ("float32", "auto") and data["auto_why"]
