"""Synthetic reasoning tasks whose number of steps is set by the prompt.

Three task families, each a prompt, a step-by-step reference trace and a checkable answer:

- ``sum``: add ``k`` numbers, writing every running sum
  (``sum 3 4 + 7 + 9 ?`` -> ``3 4 + 7 = 4 1 ; 4 1 + 9 = 5 0 ; answer 5 0``); the prompt sets
  draw one-digit terms;
- ``sort``: bubble-sort ``k`` digits, writing the list after every pass until a pass
  swaps nothing (``sort 5 3 1 ?`` -> ``pass 3 1 5 ; pass 1 3 5 ; pass 1 3 5 ; answer 1 3 5``);
  the number of passes depends on the list, not only on ``k``;
- ``count``: count one letter in ``k`` letters, writing the count after every letter
  (``count a in b a a ?`` -> ``b 0 ; a 1 ; a 2 ; answer 2``).

Every token is separated by a space and numbers are written digit by digit, so a response of
``s`` steps costs a number of tokens proportional to ``s`` and to the size of its numbers.

The traces a model is trained on come from :class:`Reasoner`, a *noisy* reference solver that
behaves like a reasoning model under sampling: each step slips with a small probability (a
wrong digit, a skipped swap, a missed count) and the error carries on; after each answer it
re-checks its work with some probability by solving the task again from the start
(``... answer 5 1 check 3 4 + 7 = 4 1 ; ... answer 5 0``), and the last answer counts. So
accuracy falls with the number of steps, and a prompt's response length is set mostly by its
task and ``k`` and partly by chance (the checks): lengths are predictable but not fixed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "LETTERS",
    "TASK_KINDS",
    "Problem",
    "Reasoner",
    "TaskKind",
    "digits",
    "solve",
]

TaskKind = Literal["sum", "sort", "count"]
TASK_KINDS: tuple[TaskKind, ...] = ("sum", "sort", "count")
LETTERS = "abcde"


def digits(value: int) -> str:
    """``125`` -> ``"1 2 5"``: numbers are written one digit a token."""
    return " ".join(str(value))


@dataclass(frozen=True)
class Problem:
    """One task instance: what the prompt says and the answer it has."""

    kind: TaskKind
    values: tuple[int, ...]  # sum: the terms; sort: the digits; count: letter indices
    target: int = 0  # count: index in LETTERS of the letter to count

    @property
    def steps(self) -> int:
        return len(self.values)

    def prompt(self) -> str:
        if self.kind == "sum":
            return "sum " + " + ".join(digits(v) for v in self.values) + " ?"
        if self.kind == "sort":
            return "sort " + " ".join(str(v) for v in self.values) + " ?"
        letters = " ".join(LETTERS[v] for v in self.values)
        return f"count {LETTERS[self.target]} in {letters} ?"

    def answer(self) -> str:
        """The correct answer as it is written after ``answer``."""
        if self.kind == "sum":
            return digits(sum(self.values))
        if self.kind == "sort":
            return " ".join(str(v) for v in sorted(self.values))
        return digits(sum(1 for v in self.values if v == self.target))


def solve(problem: Problem) -> str:
    """The exact step-by-step trace, without slips or checks."""
    return Reasoner(slip_rate=0.0, check_rate=0.0).respond(problem, random.Random(0))


@dataclass(frozen=True)
class Reasoner:
    """The noisy reference solver whose traces the model imitates (see the module docstring).

    ``slip_rate`` is the chance that one step goes wrong; ``check_rate`` the chance of solving
    again after an answer, up to ``max_checks`` times.
    """

    slip_rate: float = 0.02
    check_rate: float = 0.25
    max_checks: int = 6

    def respond(self, problem: Problem, rng: random.Random) -> str:
        parts = [self._attempt(problem, rng)]
        for _ in range(self.max_checks):
            if rng.random() >= self.check_rate:
                break
            parts.append("check " + self._attempt(problem, rng))
        return " ".join(parts)

    def _slip(self, rng: random.Random) -> bool:
        return self.slip_rate > 0 and rng.random() < self.slip_rate

    def _attempt(self, problem: Problem, rng: random.Random) -> str:
        if problem.kind == "sum":
            return self._sum(problem.values, rng)
        if problem.kind == "sort":
            return self._sort(problem.values, rng)
        return self._count(problem.values, problem.target, rng)

    def _sum(self, terms: tuple[int, ...], rng: random.Random) -> str:
        total = terms[0]
        steps = []
        for term in terms[1:]:
            new = total + term
            if self._slip(rng):
                new = max(0, new + rng.choice((-10, -1, 1, 10)))
            steps.append(f"{digits(total)} + {digits(term)} = {digits(new)} ;")
            total = new
        return " ".join(steps) + f" answer {digits(total)}"

    def _sort(self, values: tuple[int, ...], rng: random.Random) -> str:
        items = list(values)
        passes = []
        while True:
            swapped = False
            for i in range(len(items) - 1):
                if items[i] > items[i + 1] and not self._slip(rng):
                    items[i], items[i + 1] = items[i + 1], items[i]
                    swapped = True
            if self._slip(rng):  # a digit miscopied
                i = rng.randrange(len(items))
                items[i] = min(9, max(0, items[i] + rng.choice((-1, 1))))
            passes.append("pass " + " ".join(map(str, items)) + " ;")
            if not swapped:
                break
        return " ".join(passes) + " answer " + " ".join(map(str, items))

    def _count(self, letters: tuple[int, ...], target: int, rng: random.Random) -> str:
        count = 0
        steps = []
        for letter in letters:
            if letter == target and not self._slip(rng):
                count += 1
            steps.append(f"{LETTERS[letter]} {digits(count)} ;")
        return " ".join(steps) + f" answer {digits(count)}"
