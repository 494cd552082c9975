"""``rollserve demo``: the dev stack plus a small trainer loop through the SDK.

Each step submits a batch of prompt groups, waits for all of them on the run's
Redis stream, acknowledges each (as a trainer does after using it) and moves on.
The summary is computed from what the trainer received, not from server counters.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rollserve.cli.models import default_model_dir, ensure_tiny_model
from rollserve.cli.stack import DevStack, StackConfig
from rollserve.client import GroupResult, PromptGroup, RolloutClient, SamplingParams

SYSTEM_PROMPT = (
    "You are a careful reasoner. Think step by step, write every intermediate "
    "result on its own line, and end with the final answer after 'Answer:'. "
)


@dataclass(frozen=True)
class DemoConfig:
    model: Path | None = None  # None: the tiny model in the cache, made if missing
    engines: int = 1
    steps: int = 4
    groups_per_step: int = 16
    n: int = 4
    max_tokens: int = 128
    temperature: float = 1.0
    seed: int = 0
    redis_url: str | None = None
    json_path: Path | None = None


@dataclass(frozen=True)
class DemoSummary:
    groups: int
    samples: int
    output_tokens: int
    wall_s: float
    output_tokens_per_s: float
    prefix_cache_hit_rate: float
    group_latency_p50_s: float
    group_latency_p99_s: float
    steps: int
    engines: int


def make_prompts(tokenizer_dir: Path, count: int, seed: int) -> list[list[int]]:
    """Arithmetic questions behind a shared instruction, tokenized with the model's tokenizer."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        terms = [rng.randint(2, 99) for _ in range(rng.randint(2, 6))]
        question = f"Question: what is {' + '.join(map(str, terms))}?\nSteps:\n"
        prompts.append(list(tokenizer.encode(SYSTEM_PROMPT + question).ids))
    return prompts


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(
    results: Sequence[GroupResult], wall_s: float, steps: int, engines: int
) -> DemoSummary:
    samples = [s for r in results for s in r.samples]
    output_tokens = sum(len(s.token_ids) for s in samples)
    prompt_tokens = sum(s.num_prompt_tokens for s in samples)
    cached = sum(s.cached_prompt_tokens for s in samples)
    latencies = [r.latency_s for r in results]
    return DemoSummary(
        groups=len(results),
        samples=len(samples),
        output_tokens=output_tokens,
        wall_s=wall_s,
        output_tokens_per_s=output_tokens / wall_s if wall_s > 0 else 0.0,
        prefix_cache_hit_rate=cached / prompt_tokens if prompt_tokens else 0.0,
        group_latency_p50_s=percentile(latencies, 50),
        group_latency_p99_s=percentile(latencies, 99),
        steps=steps,
        engines=engines,
    )


def run_trainer_loop(
    client: RolloutClient, cfg: DemoConfig, prompts: list[list[int]], console: Console
) -> tuple[list[GroupResult], float]:
    results: list[GroupResult] = []
    total = cfg.steps * cfg.groups_per_step
    with Progress(
        TextColumn("[bold]rollout"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("groups"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        bar = progress.add_task("rollout", total=total)
        start = time.perf_counter()
        for step in range(cfg.steps):
            groups = [
                PromptGroup(
                    group_id=f"step{step}-g{i}",
                    prompt_token_ids=prompts[i % len(prompts)],
                    n=cfg.n,
                    sampling=SamplingParams(
                        temperature=cfg.temperature,
                        max_tokens=cfg.max_tokens,
                        seed=cfg.seed + step * 1000 + i,
                    ),
                    prompt_key=f"prompt-{i % len(prompts)}",
                )
                for i in range(cfg.groups_per_step)
            ]
            client.submit(groups)
            for received in client.groups(limit=cfg.groups_per_step, timeout_s=600):
                results.append(received.result)
                received.done()  # the trainer has used the group: acknowledge it
                progress.advance(bar)
        wall_s = time.perf_counter() - start
    return results, wall_s


def print_summary(summary: DemoSummary, console: Console) -> None:
    table = Table(title="rollserve demo", show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("engines", str(summary.engines))
    table.add_row("steps", str(summary.steps))
    table.add_row("groups", str(summary.groups))
    table.add_row("samples", str(summary.samples))
    table.add_row("output tokens", str(summary.output_tokens))
    table.add_row("wall time", f"{summary.wall_s:.2f} s")
    table.add_row("output tokens/s", f"{summary.output_tokens_per_s:,.0f}")
    table.add_row("prefix-cache hit rate", f"{summary.prefix_cache_hit_rate:.1%}")
    table.add_row("group latency p50", f"{summary.group_latency_p50_s:.3f} s")
    table.add_row("group latency p99", f"{summary.group_latency_p99_s:.3f} s")
    console.print(table)


def run_demo(cfg: DemoConfig, console: Console | None = None) -> DemoSummary:
    console = console or Console()
    model = cfg.model or ensure_tiny_model(default_model_dir(), console)
    prompts = make_prompts(model, cfg.groups_per_step, cfg.seed)
    console.print(f"starting the dev stack: Redis, {cfg.engines} engine(s), scheduler …")
    with DevStack(StackConfig(model=model, engines=cfg.engines, redis_url=cfg.redis_url)) as stack:
        for name, where in stack.describe():
            console.print(f"  {name:<10} {where}")
        run_id = f"demo-{uuid.uuid4().hex[:8]}"
        with RolloutClient(stack.scheduler_address, stack.redis_url, run_id) as client:
            results, wall_s = run_trainer_loop(client, cfg, prompts, console)
    summary = summarize(results, wall_s, cfg.steps, cfg.engines)
    print_summary(summary, console)
    if cfg.json_path is not None:
        cfg.json_path.write_text(json.dumps(asdict(summary), indent=2) + "\n")
        console.print(f"wrote {cfg.json_path}")
    return summary
