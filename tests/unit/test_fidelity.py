"""``bench fidelity``'s pure parts: a real run's records become the simulator's groups, busy
time is a union of intervals, and the replay runs the scheduler's policy over them.

The real step (dev stack, vLLM) is not run here; its records are built by hand.
"""

from __future__ import annotations

import io
import json
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from rollserve.assets import reasoner_dir
from rollserve.bench.fidelity import (
    FidelityConfig,
    SampleRecord,
    StepComparison,
    busy_union_s,
    executed_steps,
    frontend_ran_waited,
    largest_burst,
    per_step,
    real_engine_load,
    run_fidelity,
    run_pairs,
    run_pooled,
    sim_groups,
    simulate,
)
from rollserve.bench.workload import BenchGroup
from rollserve.cli.main import main


def bench_group(index: int, n: int = 2, prompt_len: int = 12) -> BenchGroup:
    return BenchGroup(
        index=index,
        prompt_key=f"sum-{index}",
        prompt_token_ids=list(range(3, 3 + prompt_len)),
        n=n,
        max_tokens=64,
        seed=1000 * index,
    )


def record(
    group: int,
    index: int,
    length: int,
    engine: str = "engine-0",
    span: tuple[float, float] = (0, 1),
) -> SampleRecord:
    return SampleRecord(
        group=group,
        index=index,
        prompt_len=12,
        response_len=length,
        finish_reason="length" if length >= 64 else "stop",
        engine_id=engine,
        started_at=span[0],
        finished_at=span[1],
    )


def test_busy_union_merges_overlaps_and_keeps_gaps() -> None:
    assert busy_union_s([]) == 0.0
    assert busy_union_s([(0, 1), (0.5, 2), (3, 4), (3.2, 3.5)]) == pytest.approx(3.0)
    assert busy_union_s([(5, 6), (0, 10)]) == pytest.approx(10.0)


def test_real_engine_load_per_engine_in_id_order() -> None:
    samples = [
        record(0, 0, 10, "engine-1", (0, 2)),
        record(0, 1, 30, "engine-1", (1, 3)),
        record(1, 0, 5, "engine-0", (0, 1)),
    ]
    load = real_engine_load(samples)
    assert list(load) == ["engine-0", "engine-1"]
    assert load["engine-1"].busy_s == pytest.approx(3.0)
    assert load["engine-1"].output_tokens == 40
    assert load["engine-1"].samples == 2
    assert (load["engine-0"].report_burst, load["engine-1"].report_burst) == (1, 1)  # 2 s apart


def test_the_largest_burst_counts_ends_within_the_window() -> None:
    assert largest_burst([]) == 0
    assert largest_burst([5.0]) == 1
    # 2.00, 2.05 and 2.09 lie within 0.1 s; 1.0 and 3.0 stand alone.
    assert largest_burst([3.0, 2.05, 1.0, 2.09, 2.0]) == 3
    assert largest_burst([0.0, 0.2, 0.4, 0.6]) == 1
    assert largest_burst([0.0, 0.2, 0.4, 0.6], window_s=0.25) == 2


def test_sim_groups_keep_order_lengths_and_prompts() -> None:
    groups = [bench_group(0), bench_group(1, prompt_len=20)]
    samples = [record(1, 1, 7), record(0, 0, 64), record(1, 0, 3), record(0, 1, 9)]
    out = sim_groups(groups, samples)
    assert [g.key for g in out] == ["g0", "g1"]
    assert out[0].output_lens == (64, 9)
    assert out[1].output_lens == (3, 7)
    assert out[1].prompt_len == 20
    assert out[0].max_tokens == 64
    assert out[0].prompt_key == "sum-0"
    with pytest.raises(ValueError, match="group 1"):
        sim_groups(groups, samples[1:])


def test_simulate_replays_every_step_with_the_policy() -> None:
    steps = [
        sim_groups(
            [bench_group(i) for i in range(4)],
            [record(i, k, 10 + 5 * i + k) for i in range(4) for k in range(2)],
        )
        for _ in range(2)
    ]
    cfg = FidelityConfig(engines=2, policy="least_outstanding")
    out = simulate(steps, cfg)
    assert len(out) == 2
    for makespan, engines in out:
        assert makespan > 0
        assert list(engines) == ["e000", "e001"]
        assert all(0 < e.busy_s <= makespan + 1e-12 for e in engines.values())
        assert all(e.engine_steps > 0 for e in engines.values())
    assert simulate(steps, cfg) == out  # deterministic


def test_rounds_repeat_the_timed_steps_after_one_warm_up() -> None:
    assert executed_steps(3, 1) == [(0, 0), (1, 1), (1, 2), (1, 3)]
    assert executed_steps(2, 3) == [(0, 0), (1, 1), (1, 2), (2, 1), (2, 2), (3, 1), (3, 2)]


def comparison(step: int, round_no: int, real: float, sim: float) -> StepComparison:
    return StepComparison(
        step=step,
        real_makespan_s=real,
        sim_makespan_s=sim,
        output_tokens=1,
        response_len_median=1.0,
        response_len_max=1,
        cut_at_max_tokens=0,
        real_engines={},
        sim_engines={},
        load_average=[],
        samples=[],
        round=round_no,
    )


def test_each_timed_step_is_the_median_of_its_rounds() -> None:
    rows = [
        comparison(0, 0, 9.0, 1.0),  # the warm-up: left out
        comparison(1, 1, 4.0, 3.0),
        comparison(2, 1, 2.0, 2.0),
        comparison(1, 2, 3.0, 3.0),
        comparison(2, 2, 2.5, 2.0),
        comparison(1, 3, 5.0, 3.0),
        comparison(2, 3, 1.5, 2.0),
    ]
    first, second = per_step(rows)
    assert (first.step, first.rounds, first.real_median_s) == (1, 3, 4.0)
    assert (first.real_min_s, first.real_max_s, first.sim_median_s) == (3.0, 5.0, 3.0)
    assert first.error == pytest.approx(-0.25)
    assert (second.real_median_s, second.real_min_s, second.real_max_s) == (2.0, 1.5, 2.5)
    assert second.error == pytest.approx(0.0)


def recorded_run(path: Path, rounds: int, steps: int, slower_s: float = 0.0) -> Path:
    """A --json of a run of 2 groups x 2 samples, 1 timed step, ``steps`` steps recorded,
    each ``slower_s`` slower than in the base run."""
    settings = {
        "model": str(reasoner_dir()),
        "groups": 2,
        "n": 2,
        "max_tokens": 64,
        "engines": 2,
        "policy": "least_outstanding",
        "capacity_factor": 1.25,
        "repeats": 1,
        "seed": 0,
        "rounds": rounds,
    }
    rows = [
        {
            "real_makespan_s": 1.0 + number + slower_s,
            "load_average": [],
            "samples": [asdict(record(g, k, 20 + g + k)) for g in range(2) for k in range(2)],
        }
        for number in range(steps)
    ]
    path.write_text(json.dumps({"settings": settings, "steps": rows}))
    return path


def test_a_replay_takes_the_medians_over_the_recorded_rounds(tmp_path: Path) -> None:
    path = recorded_run(tmp_path / "run.json", rounds=2, steps=3)  # warm-up + 2 rounds of 1
    out = io.StringIO()
    report = run_fidelity(FidelityConfig(replay=path), Console(file=out, width=140))
    assert report["settings"]["rounds"] == 2
    (step,) = report["per_step"]
    assert (step["step"], step["rounds"]) == (1, 2)
    assert (step["real_min_s"], step["real_max_s"], step["real_median_s"]) == (2.0, 3.0, 2.5)
    assert report["real_makespan_median_s"] == 2.5
    assert [(r["step"], r["round"]) for r in report["steps"]] == [(0, 0), (1, 1), (1, 2)]
    assert "1 (round 2)" in out.getvalue() and "(2.00-3.00)" in out.getvalue()


def test_a_replay_whose_steps_do_not_match_its_rounds_is_refused(tmp_path: Path) -> None:
    path = recorded_run(tmp_path / "run.json", rounds=2, steps=2)
    with pytest.raises(ValueError, match=r"has 2 steps; its settings \(repeats 1, rounds 2\)"):
        run_fidelity(FidelityConfig(replay=path), Console(file=io.StringIO()))


def test_the_front_ends_cpu_is_read_from_the_engine_trees_without_their_cores() -> None:
    cpu = {
        "engine-1": {"cpu_s": 0.4, "wait_s": 0.7},
        "engine-0 core": {"cpu_s": 3.0, "wait_s": 0.2},
        "engine-0": {"cpu_s": 0.1, "wait_s": 1.7},
        "scheduler": {"cpu_s": 0.1, "wait_s": 0.1},
        "engine-1 core": {"cpu_s": 2.9, "wait_s": 0.3},
    }
    assert frontend_ran_waited(cpu) == [(0.1, 1.7), (0.4, 0.7)]
    assert frontend_ran_waited({}) == []


def profile_lines(step_base_s: float = 0.002) -> list[str]:
    return [
        'name = "cpu-tiny"',
        'source = "test"',
        'simulated_hardware = "test"',
        f"step_base_s = {step_base_s}",
        "per_decode_seq_s = 4e-05",
        "per_prefill_token_s = 2e-05",
        "per_kv_token_s = 3e-07",
        "kv_capacity_tokens = 838848",
        "block_size = 32",
        "max_num_seqs = 64",
        "max_num_batched_tokens = 2048",
    ]


def test_a_check_on_more_engines_than_the_profile_was_calibrated_with_says_so(
    tmp_path: Path,
) -> None:
    """The recorded run had 2 engines; a profile fitted on 1 is used with a note, and the
    report keeps the profile's engine count."""
    lines = profile_lines()
    profile = tmp_path / "one.toml"
    profile.write_text("\n".join([*lines, "calibrated_engines = 1", ""]))
    path = recorded_run(tmp_path / "run.json", rounds=1, steps=2)
    out = io.StringIO()
    report = run_fidelity(
        FidelityConfig(replay=path, profile=str(profile)), Console(file=out, width=200)
    )
    assert report["settings"]["profile_calibrated_engines"] == 1
    assert "calibrated with 1 engine(s) side by side and this check runs 2" in out.getvalue()

    profile.write_text("\n".join([*lines, "calibrated_engines = 2", ""]))
    out = io.StringIO()
    run_fidelity(FidelityConfig(replay=path, profile=str(profile)), Console(file=out, width=200))
    assert "side by side and this check runs" not in out.getvalue()


def test_pooling_takes_every_round_of_every_run_and_every_profile(tmp_path: Path) -> None:
    fast = recorded_run(tmp_path / "fast.json", rounds=2, steps=3)  # timed: 2.0, 3.0 s
    slow = recorded_run(tmp_path / "slow.json", rounds=2, steps=3, slower_s=2.0)  # 4.0, 5.0 s
    profiles = []
    for name, base in (("a", 0.002), ("b", 0.02)):
        path = tmp_path / f"{name}.toml"
        path.write_text("\n".join(profile_lines(base)) + "\n")
        profiles.append(str(path))
    out = io.StringIO()
    report = run_pooled([fast, slow], profiles, Console(file=out, width=200))
    (step,) = report["per_step"]
    assert (step["step"], step["real_rounds"], step["real_median_s"]) == (1, 4, 3.5)
    assert (step["real_min_s"], step["real_max_s"]) == (2.0, 5.0)
    sims = [
        run_fidelity(FidelityConfig(replay=run, profile=p), Console(file=io.StringIO()))[
            "per_step"
        ][0]["sim_median_s"]
        for run in (fast, slow)
        for p in profiles
    ]
    assert step["sim_median_s"] == pytest.approx(statistics.median(sims))
    assert step["sim_min_s"] < step["sim_max_s"]  # the slower profile simulates slower
    assert report["error"] == pytest.approx(step["sim_median_s"] / 3.5 - 1)
    assert len(report["pairs"]) == 4
    assert report["pairs_within_goal"] == sum(abs(p["error"]) <= 0.15 for p in report["pairs"])
    assert "pooled: 2 run(s) x 2 profile(s)" in out.getvalue()


def test_only_runs_of_the_same_work_pool(tmp_path: Path) -> None:
    first = recorded_run(tmp_path / "first.json", rounds=1, steps=2)
    other = recorded_run(tmp_path / "other.json", rounds=1, steps=2)
    data = json.loads(other.read_text())
    data["settings"]["seed"] = 7
    other.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"other\.json: seed is 7 where .*first\.json has 0"):
        run_pooled([first, other], ["cpu-tiny"], Console(file=io.StringIO()))


def test_several_profiles_without_a_replay_are_refused() -> None:
    with pytest.raises(SystemExit, match="several --profile need --replay"):
        main(["bench", "fidelity", "--profile", "cpu-tiny", "gpu-h100-llama8b"])


def test_pairs_calibrate_then_check_each_time_and_pool_them_all(tmp_path: Path) -> None:
    """Faked: the calibration (writes a profile, each slower than the one before) and the
    check (writes a recorded run, each slower than the one before); the pooling is real."""
    order: list[str] = []

    def calibrate(profile: Path, json_path: Path) -> None:
        order.append(f"calibrate {profile.name}")
        k = int(profile.stem.split("-")[1])
        profile.write_text("\n".join(profile_lines(0.002 * k)) + "\n")

    def check(cfg: FidelityConfig) -> dict[str, Any]:
        assert cfg.json_path is not None
        order.append(f"check {Path(cfg.profile).name}")
        k = int(cfg.json_path.stem.split("-")[1])
        recorded_run(cfg.json_path, rounds=1, steps=2, slower_s=float(k))
        return {"error": -0.1 * k}

    out = io.StringIO()
    report = run_pairs(
        FidelityConfig(json_path=tmp_path / "pooled.json"),
        3,
        tmp_path / "pairs",
        Console(file=out, width=200),
        calibrate=calibrate,
        check=check,
    )
    assert order == [
        f"{what} profile-{k}.toml" for k in (1, 2, 3) for what in ("calibrate", "check")
    ]
    assert report["own_pairs"] == pytest.approx([-0.1, -0.2, -0.3])
    assert len(report["pairs"]) == 9
    (step,) = report["per_step"]
    assert step["real_rounds"] == 3 and step["real_median_s"] == 4.0  # 3.0, 4.0, 5.0
    assert json.loads((tmp_path / "pooled.json").read_text())["own_pairs"] == report["own_pairs"]
    assert "pooled: 3 run(s) x 3 profile(s)" in out.getvalue()


def test_pairs_need_two_and_no_replay(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--pairs \(1\) must be at least 2"):
        run_pairs(FidelityConfig(), 1, tmp_path, Console(file=io.StringIO()))
    with pytest.raises(ValueError, match="cannot take --replay"):
        run_pairs(FidelityConfig(replay=tmp_path / "x.json"), 2, tmp_path)
    with pytest.raises(SystemExit, match="takes neither --replay nor --profile"):
        main(["bench", "fidelity", "--pairs", "2", "--profile", "gpu-h100-llama8b"])
