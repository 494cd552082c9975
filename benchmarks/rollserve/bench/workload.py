"""The batch of groups the benchmarks send, identical for every side of a comparison."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BenchGroup:
    index: int
    prompt_token_ids: list[int]
    n: int
    max_tokens: int
    seed: int  # sample i uses seed + i, on every side


def bench_groups(model: Path, groups: int, n: int, max_tokens: int, seed: int) -> list[BenchGroup]:
    from rollserve.cli.demo import make_prompts

    prompts = make_prompts(model, groups, seed)
    return [
        BenchGroup(index=i, prompt_token_ids=p, n=n, max_tokens=max_tokens, seed=seed + 1000 * i)
        for i, p in enumerate(prompts)
    ]
