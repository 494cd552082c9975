"""The batch of groups the benchmarks send, identical for every side of a comparison."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BenchGroup:
    index: int
    prompt_key: str
    prompt_token_ids: list[int]
    n: int
    max_tokens: int
    seed: int  # sample i uses seed + i, on every side


def bench_groups(model: Path, groups: int, n: int, max_tokens: int, seed: int) -> list[BenchGroup]:
    """``groups`` prompts drawn with ``seed`` from the default prompt set, tokenized with the
    model's tokenizer."""
    from rollserve.assets import default_prompts
    from rollserve.workload import read_prompt_set
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    rows = read_prompt_set(default_prompts())
    picked = random.Random(seed).sample(rows, min(groups, len(rows)))
    picked += [rows[i % len(rows)] for i in range(groups - len(picked))]
    return [
        BenchGroup(
            index=i,
            prompt_key=row.prompt_key,
            prompt_token_ids=list(tokenizer.encode(row.prompt).ids),
            n=n,
            max_tokens=max_tokens,
            seed=seed + 1000 * i,
        )
        for i, row in enumerate(picked)
    ]
