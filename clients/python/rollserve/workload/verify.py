"""The verifier: scores a response to a task, 1.0 correct and 0.0 wrong; use it as the reward.

Parsing rules, the same for every task:

1. The response is split on whitespace into tokens (the model's tokens are space-separated
   words, digits and signs; a response decoded from token ids with the model's tokenizer has
   that form).
2. The answer is what follows the *last* ``answer`` token, up to the next ``check`` token or
   the end: a model may answer, re-check its work and answer again, and the last answer counts.
3. That answer is compared, token for token, with the task's answer: the digits of the number
   (``sum``, ``count``) or the sorted digits (``sort``). Nothing else is accepted: no extra or
   missing token, no leading zero.
4. A response without an ``answer`` token, or with an empty one, scores 0.0, and so does a
   response cut off by ``max_tokens`` before its last answer was complete (it is read as it is).
"""

from __future__ import annotations

from rollserve.workload.dataset import PromptRow

__all__ = ["extract_answer", "score"]

ANSWER = "answer"
CHECK = "check"


def extract_answer(response: str) -> str | None:
    """The last answer in ``response`` as space-joined tokens, or None when there is none."""
    tokens = response.split()
    starts = [i for i, token in enumerate(tokens) if token == ANSWER]
    if not starts:
        return None
    answer: list[str] = []
    for token in tokens[starts[-1] + 1 :]:
        if token == CHECK:
            break
        answer.append(token)
    return " ".join(answer) or None


def score(row: PromptRow, response: str) -> float:
    """1.0 when the last answer in ``response`` is the row's answer, else 0.0."""
    return 1.0 if extract_answer(response) == row.answer else 0.0
