"""``rollserve bench share`` as the user runs it: two dev stacks (real vLLM on CPU speculating
with the rollout drafter, real Redis, the real scheduler), one handing engines the outputs
other engines made, one not. This is the end-to-end check of that path: the scheduler keeps
finished outputs, a Generate call carries those its engine lacks, and the engines take them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.cli_proc import run_rollserve

pytestmark = pytest.mark.integration


@pytest.mark.timeout(600)
def test_the_scheduler_hands_engines_the_outputs_other_engines_made(tmp_path: Path) -> None:
    report = tmp_path / "share.json"
    args = ["--groups", "4", "--n", "2", "--epochs", "2", "--rounds", "1", "--max-tokens", "48"]
    args += ["--policy", "round_robin", "--json", str(report)]
    run_rollserve(["bench", "share", *args])
    data = json.loads(report.read_text())
    shared, own = data["summary"]["shared"], data["summary"]["own"]
    # No prompt had outputs when epoch 0's calls started: what it handed over was pushed
    # (a sibling finished on the other engine while the group ran).
    assert shared["epoch 0"]["outputs_handed"] == shared["epoch 0"]["outputs_pushed"]
    # round robin split each group over both engines: each lacked the other's outputs
    assert shared["later"]["outputs_handed"] > 0
    assert own["all"]["outputs_handed"] == 0
    assert shared["all"]["groups"] == own["all"]["groups"] == 8
    # both made every sample (speculation may draw them otherwise: seeds fix the draws, and
    # how many a step consumes depends on the drafts)
    assert data["identical_samples"][1] == 16
    assert shared["later"]["tokens_per_drafted_pass"] > 1.0  # the engines speculated
