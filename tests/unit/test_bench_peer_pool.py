"""``rollserve bench peer-pool`` on hand-made ``bench peer`` JSON files (nothing is run)."""

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rollserve.bench.peer_pool import load_run, pool_runs, to_json


def write_run(path: Path, rows: dict[str, list[tuple[int, float]]], **settings: Any) -> Path:
    """A file as ``bench peer --json`` writes it, with each row's rounds as (groups, wall s)."""
    data = {
        "settings": {"steps": 10, "oversample": 1.0, "json_path": str(path), "repeats": 3}
        | settings,
        "router_policy": "round_robin",
        "runs": {
            name: [{"summary": {"groups": g, "wall_s": w}, "steps": []} for g, w in rounds]
            for name, rounds in rows.items()
        },
    }
    path.write_text(json.dumps(data))
    return path


def test_rounds_of_runs_pool_by_groups_over_time(tmp_path: Path) -> None:
    a = write_run(
        tmp_path / "a.json",
        {
            "vllm-router": [(160, 16.0), (160, 20.0), (160, 16.0)],
            "rollserve": [(160, 10.0), (160, 12.0), (160, 10.0)],
            "rollserve B": [(160, 11.0), (160, 11.0), (160, 11.0)],
        },
    )
    b = write_run(
        tmp_path / "b.json",
        {
            "vllm-router": [(160, 18.0), (160, 18.0), (160, 18.0), (160, 18.0)],
            "rollserve": [(160, 15.0), (160, 15.0), (160, 15.0), (160, 15.0)],
        },
        json_path="elsewhere.json",
        repeats=4,
    )
    pooled = pool_runs([load_run(a), load_run(b)])
    assert pooled.rows == ("rollserve",)  # B is not in every run
    assert pooled.rounds == 7
    assert pooled.per_run[0]["rollserve"] == pytest.approx((480 / 32) / (480 / 52))
    assert pooled.per_run[1]["rollserve"] == pytest.approx(18 / 15)
    assert pooled.pooled["rollserve"] == pytest.approx((1120 / 92) / (1120 / 124))
    low, high = pooled.interval["rollserve"]
    assert low <= pooled.pooled["rollserve"] <= high
    assert to_json(pooled)["rows"]["rollserve"]["vs_router_pooled"] == pooled.pooled["rollserve"]


def test_row_b_pools_only_where_every_run_ran_the_same_variant(tmp_path: Path) -> None:
    rows = {
        "vllm-router": [(160, 16.0)],
        "rollserve": [(160, 10.0)],
        "rollserve B": [(160, 8.0)],
    }
    spec = {"engine_args": ["--spec-method=rollout"]}
    a = load_run(write_run(tmp_path / "a.json", rows, variant=spec))
    b = load_run(write_run(tmp_path / "b.json", rows, variant=spec))
    other = load_run(write_run(tmp_path / "c.json", rows, variant={"policy": "rl"}))
    both = pool_runs([a, b])
    assert both.rows == ("rollserve", "rollserve B")
    # B over the plain row of the same rounds: 10 s against 8 s a round in each run
    assert both.variant_per_run == pytest.approx((1.25, 1.25))
    assert both.variant_pooled == pytest.approx(1.25)
    assert to_json(both)["variant_over_rollserve"]["pooled"] == pytest.approx(1.25)
    assert pool_runs([a, other]).rows == ("rollserve",)
    assert pool_runs([a, other]).variant_pooled is None
    assert "variant_over_rollserve" not in to_json(pool_runs([a, other]))
    # a setting added to `bench peer` later: a file without it ran with its default
    old = load_run(write_run(tmp_path / "d.json", rows, variant=spec))
    new = load_run(write_run(tmp_path / "e.json", rows, variant=spec, router_engine_args=[]))
    assert pool_runs([old, new]).rounds == 2
    spec_router = write_run(
        tmp_path / "f.json", rows, variant=spec, router_engine_args=["--spec-method=ngram"]
    )
    with pytest.raises(ValueError, match="router_engine_args"):
        pool_runs([old, load_run(spec_router)])


def test_runs_of_different_settings_or_files_of_another_kind_do_not_pool(tmp_path: Path) -> None:
    rows = {"vllm-router": [(160, 16.0)], "rollserve": [(160, 10.0)]}
    a = load_run(write_run(tmp_path / "a.json", rows))
    b = load_run(write_run(tmp_path / "b.json", rows, oversample=0.5))
    with pytest.raises(ValueError, match=r"different things: oversample: 1\.0 against 0\.5"):
        pool_runs([a, b])
    with pytest.raises(ValueError, match="at least two runs"):
        pool_runs([a])
    other = tmp_path / "fleet.json"
    other.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match=r"fleet\.json: not the JSON of `rollserve bench peer`"):
        load_run(other)
    with pytest.raises(ValueError, match=r"missing\.json: not a readable JSON file"):
        load_run(tmp_path / "missing.json")
    no_router = write_run(tmp_path / "c.json", {"rollserve": [(160, 10.0)]})
    with pytest.raises(ValueError, match="no vllm-router row"):
        load_run(no_router)


def test_the_command_prints_the_pooled_table_and_refuses_with_a_reason(tmp_path: Path) -> None:
    rows = {"vllm-router": [(160, 16.0)] * 3, "rollserve": [(160, 10.0)] * 3}
    a = write_run(tmp_path / "a.json", rows)
    b = write_run(tmp_path / "b.json", rows)
    out = tmp_path / "pooled.json"

    def command(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "rollserve.cli.main", "bench", "peer-pool", *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    done = command(str(a), str(b), "--json", str(out))
    assert done.returncode == 0, done.stderr
    assert "1.60x" in done.stdout  # 16 s against 10 s for the same groups, every round
    assert json.loads(out.read_text())["rows"]["rollserve"]["vs_router_pooled"] == 1.6
    refused = command(str(a), str(write_run(tmp_path / "c.json", rows, steps=12)))
    assert refused.returncode != 0
    assert "measured different things: steps: 10 against 12" in refused.stderr
