"""What the scheduler keeps of finished outputs for engines that draft from them, and which of
them each engine holds (``rollserve.scheduler.outputs``). Pure: nothing is faked."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from rollserve.scheduler.outputs import EarlierOutputs

P = (5, 6, 7)
Q = (5, 6, 8)


def lists(outputs: Sequence[Sequence[int]]) -> list[list[int]]:
    return [list(o) for o in outputs]


def test_an_engine_gets_each_output_it_did_not_make_once() -> None:
    kept = EarlierOutputs(per_prompt=8, max_tokens=1000)
    kept.finished(P, [1, 2], "a")
    kept.finished(P, [3], "b")
    kept.finished(P, [4, 4], None)  # resumed: made whole nowhere
    kept.finished(Q, [9], "b")
    assert lists(kept.missing(P, "a", 1000)) == [[3], [4, 4]]
    assert kept.missing(P, "a", 1000) == []  # the call carried them
    assert lists(kept.missing(P, "b", 1000)) == [[1, 2], [4, 4]]
    assert lists(kept.missing(P, "c", 1000)) == [[1, 2], [3], [4, 4]]
    assert lists(kept.missing(Q, "a", 1000)) == [[9]]  # another prompt's, by its tokens
    assert kept.missing((1,), "a", 1000) == []
    kept.finished(P, [5], "b")
    assert lists(kept.missing(P, "a", 1000)) == [[5]]
    kept.finished(P, [], "b")  # nothing to draft from: not kept
    assert kept.missing(P, "a", 1000) == []


def test_a_forgotten_engine_gets_every_output_again() -> None:
    kept = EarlierOutputs(per_prompt=8, max_tokens=1000)
    kept.finished(P, [1], "a")
    kept.finished(P, [2], "b")
    assert lists(kept.missing(P, "a", 1000)) == [[2]]
    kept.forget_engine("a")  # it restarted
    assert lists(kept.missing(P, "a", 1000)) == [[1], [2]]
    assert lists(kept.missing(P, "b", 1000)) == [[1]]


def test_the_newest_outputs_are_kept_and_sent_within_the_token_budget() -> None:
    kept = EarlierOutputs(per_prompt=3, max_tokens=1000)
    for i in range(5):
        kept.finished(P, [i] * (i + 1), "a")
    assert lists(kept.missing(P, "b", 1000)) == [[2] * 3, [3] * 4, [4] * 5]
    assert kept.tokens == 12
    # a call's budget takes the newest that fit, oldest first
    assert lists(kept.missing(P, "c", 8)) == [[2] * 3, [4] * 5]  # [3] * 4 did not fit
    assert lists(kept.missing(P, "c", 8)) == [[3] * 4]


def test_the_prompt_used_least_recently_goes_when_the_tokens_run_over() -> None:
    kept = EarlierOutputs(per_prompt=8, max_tokens=10)
    kept.finished(P, [1] * 4, "a")
    kept.finished(Q, [2] * 4, "a")
    assert kept.missing(P, "a", 100) == []  # P used now: Q is the older
    kept.finished((9,), [3] * 4, "a")
    assert len(kept) == 2 and kept.tokens == 8
    assert lists(kept.missing(Q, "b", 100)) == []
    assert lists(kept.missing(P, "b", 100)) == [[1] * 4]


def test_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="per_prompt"):
        EarlierOutputs(per_prompt=0, max_tokens=10)
    with pytest.raises(ValueError, match="max_tokens"):
        EarlierOutputs(per_prompt=1, max_tokens=0)


def test_at_most_max_outputs_are_chosen_the_newest_and_the_rest_later() -> None:
    kept = EarlierOutputs(per_prompt=8, max_tokens=1000)
    for token in range(5):
        kept.finished(P, [token], "b")
    assert lists(kept.missing(P, "a", 1000, max_outputs=2)) == [[3], [4]]
    assert lists(kept.missing(P, "a", 1000, max_outputs=0)) == []
    assert lists(kept.missing(P, "a", 1000)) == [[0], [1], [2]]


def test_outputs_that_did_not_reach_an_engine_are_not_held_by_it() -> None:
    kept = EarlierOutputs(per_prompt=8, max_tokens=1000)
    kept.finished(P, [1], "b")
    kept.finished(P, [2], "b")
    first = kept.missing(P, "a", 1000)
    kept.finished(P, [3], "b")
    second = kept.missing(P, "a", 1000)
    kept.release(P, "a", first)  # the call that carried them was refused
    kept.release(Q, "a", first)  # another prompt's: nothing
    kept.release(P, "c", first)  # an engine that holds nothing: nothing
    assert lists(second) == [[3]]
    assert lists(kept.missing(P, "a", 1000)) == [[1], [2]]  # [3] still held
