"""The reasoning tasks, the prompt sets and the verifier (pure Python, nothing faked)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from rollserve.assets import DEFAULT_PROMPTS_SEED, DEFAULT_PROMPTS_SIZE, default_prompts
from rollserve.workload import (
    Problem,
    PromptRow,
    Reasoner,
    extract_answer,
    make_prompt_set,
    read_prompt_set,
    score,
    solve,
    write_prompt_set,
)
from rollserve.workload.dataset import STEP_DISTRIBUTIONS, sample_problem


def test_traces_of_each_task() -> None:
    assert solve(Problem("sum", (34, 17, 9))) == "3 4 + 1 7 = 5 1 ; 5 1 + 9 = 6 0 ; answer 6 0"
    assert solve(Problem("sort", (5, 3, 1))) == (
        "pass 3 1 5 ; pass 1 3 5 ; pass 1 3 5 ; answer 1 3 5"
    )
    assert solve(Problem("count", (1, 0, 0), target=0)) == "b 0 ; a 1 ; a 2 ; answer 2"
    assert Problem("count", (1, 0, 0), target=0).prompt() == "count a in b a a ?"
    assert Problem("sum", (34, 17)).prompt() == "sum 3 4 + 1 7 ?"


def test_exact_solver_is_always_right() -> None:
    rng = random.Random(7)
    for _ in range(300):
        row = PromptRow.of(sample_problem(rng))
        assert score(row, solve(row.problem)) == 1.0, row.prompt


def test_noisy_reasoner_errs_more_on_longer_tasks_and_checks_make_length_vary() -> None:
    rng = random.Random(3)
    reasoner = Reasoner(slip_rate=0.05, check_rate=0.3)
    short = PromptRow.of(Problem("sum", (12, 34)))
    long = PromptRow.of(Problem("sum", tuple(range(10, 50))))
    short_acc = sum(score(short, reasoner.respond(short.problem, rng)) for _ in range(400))
    long_acc = sum(score(long, reasoner.respond(long.problem, rng)) for _ in range(400))
    assert long_acc < short_acc
    lengths = {len(reasoner.respond(short.problem, rng).split()) for _ in range(200)}
    assert len(lengths) >= 3  # one, two, three attempts at least


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("1 + 2 = 3 ; answer 3", "3"),
        ("answer 4 check 1 + 2 = 3 ; answer 3", "3"),  # the last answer counts
        ("answer 3 check 1 + 2 = 4 ;", "3"),  # a check cut off keeps the earlier answer
        ("1 + 2 = 3 ;", None),  # no answer
        ("answer", None),  # an empty answer
        ("answer check", None),
        ("  answer   1  2 ", "1 2"),  # any whitespace
    ],
)
def test_extract_answer(response: str, answer: str | None) -> None:
    assert extract_answer(response) == answer


def test_score_needs_the_exact_answer() -> None:
    row = PromptRow.of(Problem("sum", (34, 17, 9)))
    assert row.answer == "6 0"
    assert score(row, "answer 6 0") == 1.0
    assert score(row, "answer 6 0 0") == 0.0
    assert score(row, "answer 0 6 0") == 0.0  # no leading zero
    assert score(row, "answer 6") == 0.0
    assert score(row, "answer 60") == 0.0  # digits are separate tokens
    assert score(row, "") == 0.0
    sort_row = PromptRow.of(Problem("sort", (3, 1, 2)))
    assert score(sort_row, "pass 1 2 3 ; answer 1 2 3") == 1.0
    assert score(sort_row, "answer 1 3 2") == 0.0


def test_prompt_sets_are_seeded_and_keys_are_stable(tmp_path: Path) -> None:
    first = make_prompt_set(11, 200)
    assert first == make_prompt_set(11, 200)
    assert first != make_prompt_set(12, 200)
    # The key names the task, not the row: the same task has the same key in any set.
    again = PromptRow.of(first[5].problem)
    assert again.prompt_key == first[5].prompt_key
    assert len({r.prompt_key for r in first}) >= 190  # short tasks may repeat, most do not
    path = tmp_path / "set.jsonl"
    write_prompt_set(first, path)
    assert read_prompt_set(path) == first
    assert {r.kind for r in first} == {"sum", "sort", "count"}
    for row in first:
        dist = STEP_DISTRIBUTIONS[row.kind]
        assert dist.low <= len(row.values) <= dist.high


def test_read_prompt_set_names_the_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    write_prompt_set(make_prompt_set(1, 2), path)
    with path.open("a") as f:
        f.write('{"prompt_key": 3}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3"):
        read_prompt_set(path)


def test_make_prompt_set_rejects_empty() -> None:
    with pytest.raises(ValueError, match="size"):
        make_prompt_set(0, 0)


def test_shipped_prompt_set_is_what_the_generator_makes() -> None:
    shipped = read_prompt_set(default_prompts())
    assert shipped == make_prompt_set(DEFAULT_PROMPTS_SEED, DEFAULT_PROMPTS_SIZE)
