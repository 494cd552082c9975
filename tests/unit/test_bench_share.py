"""``rollserve bench share``'s settings and arithmetic (pooling by stack and part, the ratio,
samples set side by side). No stack runs here: the integration test runs one."""

from __future__ import annotations

import pytest
from rich.console import Console
from rollserve.bench.share import Epoch, ShareConfig, Summary, identical_samples, table


def epoch(arm: str, rnd: int, ep: int, seconds: float, tokens: int, **more: object) -> Epoch:
    fields: dict[str, object] = {
        "groups": 2,
        "passes": 0,
        "accepted": 0,
        "proposed": 0,
        "handed": 0,
        "samples": {},
    } | more
    return Epoch(arm, rnd, ep, seconds, tokens=tokens, **fields)  # type: ignore[arg-type]


def test_figures_are_pooled_by_stack_and_part_and_set_against_own() -> None:
    epochs = [
        epoch("shared", 0, 0, 2.0, 100, passes=10, accepted=5, proposed=20),
        epoch("shared", 0, 1, 1.0, 100, passes=10, accepted=15, proposed=20, handed=4),
        epoch("own", 0, 0, 2.0, 100, passes=10, accepted=5, proposed=20),
        epoch("own", 0, 1, 2.0, 100, passes=10, accepted=10, proposed=20),
        epoch("shared", 1, 1, 1.0, 50, handed=2),
        epoch("own", 1, 1, 1.0, 50),
    ]
    s = Summary.of(epochs)
    shared, own = s.figures["shared"], s.figures["own"]
    assert shared["all"]["seconds"] == 4.0 and shared["all"]["tokens"] == 250
    assert shared["later"]["tokens_per_s"] == 75.0 and own["later"]["tokens_per_s"] == 50.0
    assert shared["later"]["outputs_handed"] == 6 and own["all"]["outputs_handed"] == 0
    assert shared["later"]["tokens_per_drafted_pass"] == 1 + 15 / 10
    assert shared["epoch 0"]["acceptance"] == 0.25
    assert s.ratio("later") == 1.5 and s.ratio("epoch 0") == 1.0
    assert s.ratio("all") == pytest.approx((250 / 4) / (250 / 5))
    assert s.figures["own"]["later"]["accepted_share"] == 10 / 150
    console = Console(width=200, record=True)
    console.print(table(s, ShareConfig(rounds=2, own_args=("--no-earlier-outputs-push",))))
    text = console.export_text()
    assert "1.500x" in text and "bench share: 2 rounds x 4 epochs" in text
    assert "own: --no-earlier-outputs-push" in text


def test_samples_are_set_side_by_side_by_group_and_index() -> None:
    epochs = [
        epoch("shared", 0, 0, 1.0, 3, samples={"g/0": (1, 2), "g/1": (3,), "h/0": (4,)}),
        epoch("own", 0, 0, 1.0, 3, samples={"g/0": (1, 2), "g/1": (5,)}),
    ]
    assert identical_samples(epochs) == (1, 2)  # h/0 ran on one stack only
    assert Summary.of([]).ratio("all") == 0.0


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        ({"epochs": 1}, "epochs (1) must be >= 2"),
        ({"engines": 1}, "engines (1) must be >= 2"),
        ({"groups": 0}, "groups (0) must be >= 1"),
        ({"groups": 300, "rounds": 4}, "groups x rounds (300 x 4) exceeds the 1000 prompts"),
        ({"policy": "fastest"}, "policy ('fastest') unknown"),
        ({"engine_args": ("--spec-method=ngram",)}, "must speculate with the rollout drafter"),
    ],
)
def test_settings_out_of_range_are_refused_with_the_field(
    values: dict[str, object], problem: str
) -> None:
    with pytest.raises(ValueError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        ShareConfig(**values)  # type: ignore[arg-type]


def test_the_rollout_drafter_may_be_named_in_two_words() -> None:
    ShareConfig(engine_args=("--spec-method", "rollout", "--spec-max-batch=8"))
