"""Prompt sets: seeded draws of tasks with long-tailed step counts, one JSON line a row.

A row holds the task (kind, values, target), the prompt text and a stable ``prompt_key``
(``{kind}-{hash of the task}``): the same task gets the same key in every prompt set and every
epoch, which is what the scheduler keys its length history by.

Step counts are log-normal per task kind and clipped (:data:`STEP_DISTRIBUTIONS`): most prompts
need a few steps and a few need many, and ``sort`` costs steps squared, so response lengths have
the long tail of RL rollouts of reasoning models.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
from rollserve.workload.tasks import LETTERS, TASK_KINDS, Problem, TaskKind

__all__ = [
    "STEP_DISTRIBUTIONS",
    "PromptRow",
    "StepDistribution",
    "iter_prompt_set",
    "make_prompt_set",
    "read_prompt_set",
    "sample_problem",
    "write_prompt_set",
]

ROW_SCHEMA = 1


@dataclass(frozen=True)
class StepDistribution:
    """Steps = clip(round(median * exp(sigma * N(0, 1))), low, high)."""

    median: float
    sigma: float
    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        steps = round(self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0)))
        return min(self.high, max(self.low, steps))


STEP_DISTRIBUTIONS: dict[TaskKind, StepDistribution] = {
    "sum": StepDistribution(median=5, sigma=0.75, low=2, high=48),
    "sort": StepDistribution(median=5, sigma=0.45, low=3, high=22),
    "count": StepDistribution(median=9, sigma=0.75, low=3, high=100),
}


class PromptRow(msgspec.Struct, frozen=True, kw_only=True):
    """One prompt of a set, as written to JSON lines."""

    prompt_key: str
    kind: TaskKind
    values: tuple[int, ...]
    target: int = 0
    prompt: str
    answer: str
    schema: int = ROW_SCHEMA

    @classmethod
    def of(cls, problem: Problem) -> PromptRow:
        return cls(
            prompt_key=_key(problem),
            kind=problem.kind,
            values=problem.values,
            target=problem.target,
            prompt=problem.prompt(),
            answer=problem.answer(),
        )

    @property
    def problem(self) -> Problem:
        return Problem(self.kind, self.values, self.target)


def _key(problem: Problem) -> str:
    text = f"{problem.kind}|{problem.target}|{','.join(map(str, problem.values))}"
    return f"{problem.kind}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def sample_problem(rng: random.Random) -> Problem:
    """One task: the kind uniformly, then its step count, then its values."""
    kind = TASK_KINDS[rng.randrange(len(TASK_KINDS))]
    steps = STEP_DISTRIBUTIONS[kind].draw(rng)
    if kind == "sum":
        return Problem(kind, tuple(rng.randint(1, 9) for _ in range(steps)))
    if kind == "sort":
        return Problem(kind, tuple(rng.randint(0, 9) for _ in range(steps)))
    letters = tuple(rng.randrange(len(LETTERS)) for _ in range(steps))
    return Problem(kind, letters, target=rng.randrange(len(LETTERS)))


def make_prompt_set(seed: int, size: int) -> list[PromptRow]:
    """``size`` rows drawn with ``seed``; the same arguments give the same rows."""
    if size < 1:
        raise ValueError(f"size ({size}) must be at least 1")
    rng = random.Random(seed)
    return [PromptRow.of(sample_problem(rng)) for _ in range(size)]


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(PromptRow)


def write_prompt_set(rows: Iterable[PromptRow], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        for row in rows:
            f.write(_encoder.encode(row) + b"\n")


def iter_prompt_set(path: Path) -> Iterator[PromptRow]:
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield _decoder.decode(line)
            except msgspec.ValidationError as exc:
                raise ValueError(f"{path}:{number}: not a prompt row: {exc}") from exc


def read_prompt_set(path: Path) -> list[PromptRow]:
    return list(iter_prompt_set(path))
