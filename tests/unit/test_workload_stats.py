"""The shape figures of ``rollserve workload stats``, on hand-made passes (no engine)."""

from __future__ import annotations

import pytest
from rollserve.training.stats import PassResult, shape_of, top_overlap, variance_share
from rollserve.workload import Problem, PromptRow


def test_variance_share_is_between_over_total() -> None:
    assert variance_share([[10, 10], [20, 20]]) == pytest.approx(1.0)
    assert variance_share([[10, 20], [10, 20]]) == pytest.approx(0.0)
    # means 15 and 25 around 20: between 4*25 = 100; total 100 + 4*25 = 200
    assert variance_share([[10, 20], [20, 30]]) == pytest.approx(0.5)
    assert variance_share([[5, 5], [5, 5]]) == 0.0


def test_top_overlap_counts_the_shared_top_tenth() -> None:
    first = [float(i) for i in range(20)]  # top 2: 19, 18
    assert top_overlap(first, first) == 1.0
    assert top_overlap(first, list(reversed(first))) == 0.0
    second = first.copy()
    second[19] = -1.0  # prompt 19 falls out; prompt 17 comes in
    assert top_overlap(first, second) == 0.5


def test_shape_of_two_passes() -> None:
    rows = [
        PromptRow.of(Problem("sum", (1, 2))),
        PromptRow.of(Problem("sort", (3, 1, 2))),
        PromptRow.of(Problem("count", (0, 1, 0), target=0)),
        PromptRow.of(Problem("sum", (5, 6, 7))),
    ]
    pass1 = PassResult(
        lengths=[[10, 10], [10, 12], [10, 10], [100, 400]],
        scores=[[1.0, 1.0], [1.0, 0.0], [0.0, 0.0], [0.0, 1.0]],
        truncated=1,
        wall_s=2.0,
    )
    pass2 = PassResult(
        lengths=[[9, 11], [10, 10], [12, 10], [300, 200]],
        scores=[[1.0, 1.0]] * 4,
        truncated=0,
        wall_s=2.0,
    )
    shape = shape_of(rows, pass1, pass2)
    assert shape.median == 10.0
    assert shape.max == 400
    assert shape.max_over_median == 40.0
    assert shape.accuracy == pytest.approx(4 / 8)
    assert shape.mixed_group_share == 0.5
    assert shape.top10_overlap == 1.0
    assert shape.truncated_share == pytest.approx(1 / 8)
    assert shape.output_tokens_per_s == pytest.approx((562 + 562) / 4.0)
    assert 0.0 < shape.prompt_variance_share < 1.0
    assert set(shape.per_kind) == {"sum", "sort", "count"}
    met = {key: ok for key, _, _, _, ok in shape.checks()}
    assert met["max_over_median"]
    assert met["accuracy"]
    p99 = shape.p99_over_median
    assert met["p99_over_median"] == (p99 >= 8.0)
