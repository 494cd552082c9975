"""``rollserve bench push-cost`` as the user runs it: one real vLLM engine on CPU that
speculates with the rollout drafter (the tiny random Llama the benchmark makes), calls running
while outputs are pushed to it (AddOutputs), against calls with none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.cli_proc import run_rollserve

pytestmark = pytest.mark.integration


@pytest.mark.timeout(600)
def test_pushes_reach_a_running_engine_and_are_counted_by_rate(tmp_path: Path) -> None:
    report = tmp_path / "push-cost.json"
    args = ["--rates", "0,20", "--repeats", "1", "--calls", "2", "--n", "4", "--max-tokens", "64"]
    args += ["--json", str(report)]
    run_rollserve(["bench", "push-cost", *args])
    data = json.loads(report.read_text())
    none, pushed = data["summary"]["0.0"], data["summary"]["20.0"]
    assert none["pushes"] == 0 and none["vs_none"] == 1.0
    assert pushed["pushes"] >= 1 and pushed["push_ms"] > 0  # each answered by the engine
    # the tiny random model's samples run to max_tokens but for an end token drawn by chance
    assert 0 < none["tokens"] <= 2 * 4 * 64 and 0 < pushed["tokens"] <= 2 * 4 * 64
    assert [r["rate"] for r in data["runs"]] == [0.0, 20.0]
