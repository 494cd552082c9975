"""``rollserve bench push-cost`` as the user runs it: one real vLLM engine on CPU that
speculates with the rollout drafter (the tiny random Llama the benchmark makes), calls running
while outputs are pushed to it (AddOutputs), against calls with none."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.timeout(600)
def test_pushes_reach_a_running_engine_and_are_counted_by_rate(tmp_path: Path) -> None:
    report = tmp_path / "push-cost.json"
    args = ["--rates", "0,20", "--repeats", "1", "--calls", "2", "--n", "4", "--max-tokens", "64"]
    args += ["--json", str(report)]
    done = subprocess.run(
        [sys.executable, "-m", "rollserve.cli.main", "bench", "push-cost", *args],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(report.read_text())
    none, pushed = data["summary"]["0.0"], data["summary"]["20.0"]
    assert none["pushes"] == 0 and none["vs_none"] == 1.0
    assert pushed["pushes"] >= 1 and pushed["push_ms"] > 0  # each answered by the engine
    # the tiny random model's samples run to max_tokens but for an end token drawn by chance
    assert 0 < none["tokens"] <= 2 * 4 * 64 and 0 < pushed["tokens"] <= 2 * 4 * 64
    assert [r["rate"] for r in data["runs"]] == [0.0, 20.0]
