"""``rollserve bench push-cost``'s settings and arithmetic (pooling by rate, the ratio to no
pushes, the order the runs go in). No engine runs here: the integration test runs one."""

from __future__ import annotations

import pytest
from rich.console import Console
from rollserve.bench.push_cost import PushCostConfig, Run, Summary, schedule, table


def test_figures_are_pooled_by_rate_and_set_against_no_pushes() -> None:
    runs = [
        Run(0.0, 0, 2.0, 200),
        Run(0.0, 1, 2.0, 200),
        Run(5.0, 0, 2.0, 180, [0.01, 0.03]),
        Run(5.0, 1, 3.0, 270, [0.02]),
    ]
    s = Summary.of(runs)
    none, five = s.figures[0.0], s.figures[5.0]
    assert none["tokens_per_s"] == 100.0 and none["vs_none"] == 1.0 and none["pushes"] == 0
    assert five["tokens_per_s"] == 90.0 and five["vs_none"] == pytest.approx(0.9)
    assert five["pushes_per_s"] == pytest.approx(3 / 5) and five["push_ms"] == pytest.approx(20)
    console = Console(width=200, record=True)
    console.print(table(s, PushCostConfig(repeats=2)))
    text = console.export_text()
    assert "0.900x" in text and "bench push-cost: 2 repeats" in text


def test_rates_run_in_turn_reversed_every_other_repeat() -> None:
    cfg = PushCostConfig(rates=(0.0, 1.0, 20.0), repeats=3)
    assert schedule(cfg) == [
        (0, 0.0), (0, 1.0), (0, 20.0),
        (1, 20.0), (1, 1.0), (1, 0.0),
        (2, 0.0), (2, 1.0), (2, 20.0),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        ({"rates": (1.0, 5.0)}, "must include 0"),
        ({"rates": (0.0, -1.0)}, "must each be in [0, 1000]"),
        ({"rates": (0.0, 5.0, 5.0)}, "name a rate twice"),
        ({"repeats": 0}, "repeats (0) must be >= 1"),
        ({"output_tokens": 0}, "output_tokens (0) must be >= 1"),
    ],
)
def test_bad_settings_are_refused_by_name(values: dict[str, object], problem: str) -> None:
    with pytest.raises(ValueError) as info:
        PushCostConfig(**values)  # type: ignore[arg-type]
    assert problem in str(info.value)
