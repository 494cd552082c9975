"""The direct side of ``rollserve bench overhead``: the batch straight through AsyncLLM.

Run as a child process by ``overhead.py`` (vLLM wants a fresh process and a
``__main__`` guard). Reads the groups as JSON from a file, builds the engine,
prints ``ready``, then runs the batch once for every ``run`` line on stdin and
prints a JSON line ``{"wall_s": …, "output_tokens": …}`` for each; ``quit`` (or
end of input) shuts the engine down. The parent alternates these runs with
rollserve's, so slow drift of a shared machine hits both sides alike.

The engine is built from the same ``EngineSettings`` defaults and the same
``build_engine_args`` as the engine service, and each sample is requested the
same way (n=1, seed + i, one logprob per token, delta outputs), so the only
difference from the rollserve side is everything rollserve adds around it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from rollserve.bench.workload import BenchGroup


def sample_params(max_tokens: int, seed: int) -> Any:
    """vLLM's SamplingParams for one sample as the engine service asks for it: n=1,
    temperature 1, its own seed, the sampled token's logprob, token ids only, delta outputs."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=1,
        max_tokens=max_tokens,
        temperature=1.0,
        seed=seed,
        logprobs=0,
        flat_logprobs=True,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )


async def _one_sample(llm: Any, params: Any, prompt: Any, request_id: str) -> int:
    tokens: list[int] = []
    logprobs: list[float] = []
    async for out in llm.generate(prompt, params, request_id):
        completion = out.outputs[0]
        tokens.extend(completion.token_ids)
        lp = completion.logprobs
        if lp is not None:
            logprobs.extend(
                lp.logprobs[: len(completion.token_ids)] if hasattr(lp, "logprobs") else []
            )
    return len(tokens)


async def _serve(model: Path, groups: list[BenchGroup], frontend_nice: int) -> None:
    from rollserve.engine.cpu_priority import renice_threads
    from rollserve.engine.service import build_engine_args
    from rollserve.engine.settings import EngineSettings, apply_environment, resolve_device

    settings = EngineSettings(model=model)
    device = resolve_device(settings)
    apply_environment(settings, device)

    from vllm.inputs import tokens_input
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(build_engine_args(settings, device))
    if frontend_nice:
        # As the engine service does (EngineSettings.frontend_nice): both sides alike.
        renice_threads(frontend_nice)
    loop = asyncio.get_running_loop()
    print("ready", flush=True)
    try:
        rep = 0
        while (line := await loop.run_in_executor(None, sys.stdin.readline)).strip() == "run":
            rep += 1
            start = time.perf_counter()
            jobs = []
            for g in groups:
                prompt = tokens_input(list(g.prompt_token_ids))
                for i in range(g.n):
                    params = sample_params(g.max_tokens, g.seed + i)
                    jobs.append(_one_sample(llm, params, prompt, f"r{rep}-{g.index}/{i}"))
            counts = await asyncio.gather(*jobs)
            wall = time.perf_counter() - start
            print(json.dumps({"wall_s": wall, "output_tokens": sum(counts)}), flush=True)
        if line.strip() not in ("", "quit"):
            raise SystemExit(f"unknown command {line.strip()!r}")
    finally:
        llm.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m rollserve.bench.direct")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--groups", type=Path, required=True, help="JSON file of the groups")
    parser.add_argument("--frontend-nice", type=int, default=0, help="niceness of this process")
    args = parser.parse_args()
    groups = [BenchGroup(**g) for g in json.loads(args.groups.read_text())]
    asyncio.run(_serve(args.model, groups, args.frontend_nice))
    return 0


if __name__ == "__main__":
    sys.exit(main())
