"""``rollserve bench bound``: the step cost model over draws, its incremental moves, the
placements it compares and a whole small run (numbers and tmp files only; nothing faked: the
rl policy and the scenario loader are the real ones)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console
from rollserve.bench.bound import (
    CLAIRVOYANT,
    BoundConfig,
    Makespans,
    StepModel,
    dealt,
    run_bound,
    search,
)
from rollserve.scheduler.core.policies.rl import RLSettings

from tests.unit.test_des import group

COSTS = RLSettings(base_s=1.0, per_seq_s=0.1, per_kv_token_s=0.01, per_prefill_token_s=0.0)


def test_makespan_is_the_slowest_engine_of_rl_cost_model() -> None:
    model = StepModel.of([group("a", (4, 2), prompt_len=10), group("b", (6, 1), prompt_len=10)])
    lens = model.true_lens[None, :]  # samples: a0=4, a1=2, b0=6, b1=1
    engine_of = np.array([0, 1, 0, 1])

    def work(length: float) -> float:
        return 0.1 * length + 0.01 * length * (10 + length / 2)

    engine0 = 1.0 * 6 + work(4) + work(6)
    engine1 = 1.0 * 2 + work(2) + work(1)
    assert Makespans(lens, model, COSTS, engine_of, 2).mean() == pytest.approx(
        max(engine0, engine1)
    )


def test_a_move_scores_as_the_placement_it_makes() -> None:
    model = StepModel.of([group("a", (40, 3, 9)), group("b", (5, 70, 2)), group("c", (8, 8, 1))])
    lens = model.draw(np.random.default_rng(3), 25)
    makespans = Makespans(lens, model, COSTS, dealt(model, 3), 3)
    for sample, target in ((0, 2), (4, 0), (0, 1), (8, 2)):
        predicted = makespans.moved(sample, target)
        makespans.move(sample, target)
        fresh = Makespans(lens, model, COSTS, makespans.engine_of, 3)
        assert predicted == pytest.approx(makespans.mean())
        assert makespans.mean() == pytest.approx(fresh.mean())


def test_dealt_spreads_every_group_or_keeps_the_risky_ones_apart() -> None:
    groups = [group(f"g{i}", (10 * (i + 1),) * 4) for i in range(6)]
    model = StepModel.of(groups)
    spread = dealt(model, 4)
    for i in range(6):
        assert sorted(spread[model.group_of == i].tolist()) == [0, 1, 2, 3]
    # The two groups of highest log-mean (g5, g4) on engines 0 and 1, the others on 2 and 3.
    apart = dealt(model, 4, risky=2, own=2)
    risky = np.isin(model.group_of, [4, 5])
    assert set(apart[risky].tolist()) == {0, 1}
    assert set(apart[~risky].tolist()) == {2, 3}


def test_search_never_worsens_and_undoes_a_bad_placement() -> None:
    model = StepModel.of([group(f"g{i}", (30, 5, 12, 2)) for i in range(4)])
    lens = model.draw(np.random.default_rng(0), 20)
    piled = Makespans(lens, model, COSTS, np.zeros(model.samples, dtype=int), 4)
    spread = Makespans(lens, model, COSTS, dealt(model, 4), 4).mean()
    assert piled.mean() > spread * 1.3  # sixteen samples on one engine of four
    search(piled, 4, max_passes=20)
    assert piled.mean() <= spread  # it finds a placement at least as good as dealing
    assert len(set(piled.engine_of.tolist())) == 4
    settled = piled.mean()
    assert search(piled, 4, max_passes=20) == 1 and piled.mean() == settled


def test_a_small_run_compares_blind_placements_with_the_clairvoyant(tmp_path: Path) -> None:
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(
        'name = "tiny"\ndescription = "a tiny long-tailed step"\nprofile = "gpu-h100-llama8b"\n'
        "engines = 2\ngroups_per_step = 6\nn = 4\nsteps = 1\nprompts = 12\n"
        "prompt_len_median = 200\nprompt_len_sigma = 0.3\nresponse_median = 300\n"
        "prompt_sigma = 0.9\nwithin_sigma = 0.6\nmax_tokens = 8192\nseed = 5\n"
        "drift_sigma = 0.0\nprefix_pool = 1\nshared_prefix_len = 0\n"
    )
    out_json = tmp_path / "bound.json"
    out = run_bound(
        BoundConfig(scenario=str(scenario), draws=12, max_passes=2, json_path=out_json),
        Console(width=200, file=None, record=True, quiet=True),
    )
    assert json.loads(out_json.read_text()) == json.loads(json.dumps(out))
    rows = out["placements"]
    assert next(iter(rows)) == "spread" and CLAIRVOYANT in rows
    assert rows["spread"]["vs_spread"] == 1.0
    # Told every length, rl places at least as well as dealing the samples blindly.
    assert rows[CLAIRVOYANT]["expected_makespan_s"] <= rows["spread"]["expected_makespan_s"]
    assert out["scenario_draw"]["clairvoyant"] <= out["scenario_draw"]["spread"]
    assert out["modelled"] is True and out["draws"] == 12


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (BoundConfig(draws=1), r"draws \(1\) must be at least 2"),
        (BoundConfig(warm_steps=-1), r"warm_steps \(-1\) must be at least 0"),
        (BoundConfig(engines=1), r"engines \(1\) must be at least 2"),
    ],
)
def test_bad_settings_are_errors_that_name_the_field(cfg: BoundConfig, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        run_bound(cfg, Console(quiet=True))
