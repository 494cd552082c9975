"""``rollserve bench policies``' rows that move running samples: ``rl_moves`` by the predictor,
``rl_moves_told`` told each running sample's true tokens left (exactly or off by a set error).

Nothing is faked: the scheduler's rl policy over the simulator's engines, in virtual time.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console
from rollserve.bench.policies import PoliciesConfig, run_policies

SCENARIO = """
name = "tiny-tail"
description = "unit test: 12 groups x 4 on 3 engines, a long tail"
profile = "gpu-h100-llama8b"
engines = 3
groups_per_step = 12
n = 4
steps = 1
prompts = 12
prompt_len_median = 200
prompt_len_sigma = 0.3
shared_prefix_len = 0
prefix_pool = 1
response_median = 300
prompt_sigma = 0.9
within_sigma = 0.7
drift_sigma = 0.0
max_tokens = 8192
seed = 5
"""


def test_rows_that_move_report_their_moves_and_settings(tmp_path: Path) -> None:
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(SCENARIO)
    log = tmp_path / "log.txt"
    with log.open("w") as f:
        out = run_policies(
            PoliciesConfig(
                scenario=str(scenario),
                policies=("rl", "rl_moves_told"),
                move_gain=1e-4,
                told_noise=0.0,
                out_dir=tmp_path / "out",
            ),
            Console(file=f, width=190),
        )
    assert out["move_gain"] == 1e-4 and out["told_noise"] == 0.0
    rows = out["policies"]
    assert rows["rl"]["moves"] == 0
    told = rows["rl_moves_told"]
    assert told["moves"] > 0 and told["moved_tokens"] > 0
    # Told the truth, the moves do not lengthen the step (placement is the same as rl's).
    assert told["makespan_s"] <= rows["rl"]["makespan_s"]
    assert "moves" in log.read_text()  # the table's column, shown when a row moved


@pytest.mark.parametrize(
    ("move_gain", "told_noise", "match"),
    [
        (0.0, 0.0, "move_gain"),
        (1.0, 0.0, "move_gain"),
        (None, -0.5, "told_noise"),
        (None, float("inf"), "told_noise"),
    ],
)
def test_move_settings_are_checked(
    tmp_path: Path, move_gain: float | None, told_noise: float, match: str
) -> None:
    config = PoliciesConfig(
        policies=("rl_moves_told",), move_gain=move_gain, told_noise=told_noise, out_dir=tmp_path
    )
    with pytest.raises(ValueError, match=match):
        run_policies(config)


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--spec-history-outputs", "4"], "--spec-history-outputs says how"),
        (["--spec-accept-by-history", "1.5,2"], "--spec-accept-by-history refines"),
        (
            [
                *("--spec-accept", "2", "--spec-accept-by-history", "1.5,2"),
                *("--spec-history-outputs", "-1"),
            ],
            r"history_outputs \(-1\) must be >= 0",
        ),
    ],
)
def test_the_history_flags_are_checked_before_anything_runs(
    tmp_path: Path, flags: list[str], match: str
) -> None:
    from rollserve.cli.main import main

    with pytest.raises(SystemExit, match=match):
        main(["bench", "policies", "--out-dir", str(tmp_path), *flags])


def test_another_profile_runs_the_same_groups_on_other_engines(tmp_path: Path) -> None:
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(SCENARIO)
    runs = {}
    for profile in (None, "cpu-tiny-avx2"):
        with open(tmp_path / "log.txt", "w") as log:
            runs[profile] = run_policies(
                PoliciesConfig(
                    scenario=str(scenario),
                    profile=profile,
                    policies=("round_robin",),
                    out_dir=tmp_path / "out",
                ),
                Console(file=log, width=190),
            )
    gpu, cpu = runs[None], runs["cpu-tiny-avx2"]
    assert (gpu["profile"], cpu["profile"]) == ("gpu-h100-llama8b", "cpu-tiny-avx2")
    # The same samples (the scenario draws them), on engines of other step costs.
    assert cpu["length_max"] == gpu["length_max"]
    rows = gpu["policies"]["round_robin"], cpu["policies"]["round_robin"]
    assert rows[1]["output_tokens_per_s"] * rows[1]["makespan_s"] == pytest.approx(
        rows[0]["output_tokens_per_s"] * rows[0]["makespan_s"]
    )
    assert rows[1]["makespan_s"] != pytest.approx(rows[0]["makespan_s"], rel=0.01)
    with pytest.raises(ValueError, match="profile 'nope': no shipped profile of that name"):
        run_policies(PoliciesConfig(scenario=str(scenario), profile="nope", out_dir=tmp_path))


def test_over_sampled_rows_report_how_late_a_group_came_after_its_launch(tmp_path: Path) -> None:
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(SCENARIO.replace("steps = 1", "steps = 4"))
    with open(tmp_path / "log.txt", "w") as log:
        out = run_policies(
            PoliciesConfig(
                scenario=str(scenario),
                policies=("round_robin",),
                oversample=1.0,
                due="launch",
                steps=3,
                out_dir=tmp_path / "out",
            ),
            Console(file=log, width=190),
        )
    assert out["due"] == "launch"
    row = out["policies"]["round_robin"]
    assert row["max_launch_lag"] == 1 and row["max_staleness"] <= 1
    assert "due by launch" in (tmp_path / "log.txt").read_text()


def test_over_sampling_beyond_a_batch_is_refused_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"oversample \(2\) must be at most 1 when the tail"):
        run_policies(PoliciesConfig(scenario="S1", oversample=2.0, out_dir=tmp_path))
