"""``rollserve bench decisions`` on a tiny fleet and queue: every row is measured, the
runtime's snapshot included (in process: nothing is started)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console
from rollserve.bench.decisions import DecisionsConfig, run_decisions


def test_the_depth_table_times_the_runtime_s_snapshot_and_each_policy_s_plans(
    tmp_path: Path,
) -> None:
    cfg = DecisionsConfig(
        engines=(2, 4),
        policies=("round_robin", "rl"),
        groups=6,
        n=2,
        repeats=2,
        depths=(10, 40),
        depth_engines=4,
        json_path=tmp_path / "out.json",
    )
    run_decisions(cfg, Console(width=200, file=io.StringIO()))
    out = json.loads((tmp_path / "out.json").read_text())
    assert set(out["policies"]) == {"round_robin", "rl"}
    rows = out["depths"]["rows"]
    assert set(rows) == {
        "runtime snapshot, nothing changed",
        "runtime snapshot, a group learnt",
        "runtime snapshot, two runs, nothing changed",
        "runtime snapshot, two runs, a group learnt",
        "round_robin",
        "round_robin, first plan",
        "rl",
        "rl, first plan",
    }
    for costs in rows.values():
        assert set(costs) == {"10", "40"}
        assert all(cost["us"] > 0 and cost["queue_growth"] in (1, 4) for cost in costs.values())
