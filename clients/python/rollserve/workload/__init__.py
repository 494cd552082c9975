"""Verifiable reasoning tasks with long-tailed response lengths, and their verifier.

``from rollserve.workload import score`` is the reward function a trainer uses; prompt sets
are made with ``rollserve workload make`` or :func:`make_prompt_set`.
"""

from rollserve.workload.dataset import (
    PromptRow,
    iter_prompt_set,
    make_prompt_set,
    read_prompt_set,
    write_prompt_set,
)
from rollserve.workload.tasks import Problem, Reasoner, solve
from rollserve.workload.verify import extract_answer, score

__all__ = [
    "Problem",
    "PromptRow",
    "Reasoner",
    "extract_answer",
    "iter_prompt_set",
    "make_prompt_set",
    "read_prompt_set",
    "score",
    "solve",
    "write_prompt_set",
]
