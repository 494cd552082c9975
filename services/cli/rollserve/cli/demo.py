"""``rollserve demo``: the dev stack plus a small trainer loop through the SDK.

The trainer loop is that of GRPO-style RL on the workload's reasoning tasks: each step
takes the next batch of prompts of the default prompt set, submits them as groups of ``n``
samples, waits for all of them on the run's Redis stream, scores every sample with the
workload's verifier (the reward), acknowledges each group (as a trainer does after using
it) and moves on. The model is the shipped trained reasoner unless ``--model`` says
otherwise. The summary is computed from what the trainer received, not from server counters.

With ``--train`` the loop also learns: after each step a GRPO update
(:mod:`rollserve.training.grpo`) on the step's groups, the new weights written as a checkpoint
and published as the next policy version (``publish_version(step + 1, weights_path=...)``):
the engines load them before the next step's groups, whose tokens carry that version.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rollserve.cli.stack import DevStack, StackConfig
from rollserve.client import (
    GroupResult,
    PromptGroup,
    RolloutClient,
    SamplingParams,
    SchedulerStatus,
)
from rollserve.workload import PromptRow, read_prompt_set, score


@dataclass(frozen=True)
class DemoConfig:
    model: Path | None = None  # None: the shipped trained reasoner
    prompts: Path | None = None  # None: the shipped default prompt set
    engines: int = 1
    steps: int = 4
    groups_per_step: int = 16
    n: int = 4
    max_tokens: int = 1024
    temperature: float = 1.0
    seed: int = 0
    redis_url: str | None = None
    json_path: Path | None = None
    train: bool = False  # a GRPO update after each step, published to the engines
    lr: float = 2e-5
    checkpoints: Path | None = None  # where --train writes them (default: a temp folder)


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
    mean_reward: float
    mixed_group_share: float  # groups with both right and wrong samples: GRPO's signal
    steps: int
    engines: int
    engine_dtypes: tuple[str, ...] = ()  # what the engines said they compute in (Status)
    # The scheduler's length predictor over the run's delivered samples (Status).
    predictor_scored_samples: int = 0
    predictor_mae_tokens: float | None = None
    predictor_tail_auc: float | None = None
    # --train: the policy version each step's tokens were made under, and the last published
    versions_per_step: tuple[tuple[int, ...], ...] = ()
    policy_version: int = 0
    train_s: float = 0.0  # learning and publishing (left out of wall_s)


class Rewarder:
    """Turns a sample's token ids into text with the model's tokenizer and scores it."""

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def encode_prompt(self, row: PromptRow) -> list[int]:
        return list(self._tokenizer.encode(row.prompt).ids)

    def rewards(self, row: PromptRow, result: GroupResult) -> list[float]:
        return [
            score(row, self._tokenizer.decode(list(s.token_ids), skip_special_tokens=True))
            for s in result.samples
        ]


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(
    results: Sequence[GroupResult],
    rewards: Sequence[Sequence[float]],
    wall_s: float,
    steps: int,
    engines: int,
    *,
    status: SchedulerStatus | None = None,
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
        mean_reward=statistics.fmean(r for g in rewards for r in g) if rewards else 0.0,
        mixed_group_share=(
            sum(1 for g in rewards if 0 < sum(g) < len(g)) / len(rewards) if rewards else 0.0
        ),
        steps=steps,
        engines=engines,
        engine_dtypes=status.engine_dtypes if status else (),
        predictor_scored_samples=status.predictor_scored_samples if status else 0,
        predictor_mae_tokens=status.predictor_mae_tokens if status else None,
        predictor_tail_auc=status.predictor_tail_auc if status else None,
    )


class Learner:
    """``--train``: a GRPO update after each step, written as a checkpoint and published to
    the engines as the next policy version."""

    def __init__(self, client: RolloutClient, model: Path, cfg: DemoConfig, folder: Path) -> None:
        from rollserve.training.grpo import GrpoConfig, GrpoTrainer

        self._client = client
        self._trainer = GrpoTrainer(model, GrpoConfig(lr=cfg.lr))
        self._folder = folder
        self.version = 0
        self.seconds = 0.0  # spent learning and publishing, not rolling out

    def after_step(
        self, step: int, results: Sequence[GroupResult], rewards: Sequence[Sequence[float]]
    ) -> str:
        start = time.perf_counter()
        update = self._trainer.step(results, rewards)
        path = self._trainer.save(self._folder / f"step-{step + 1}")
        published = self._client.publish_version(step + 1, weights_path=str(path))
        self.version = published.version
        self.seconds += time.perf_counter() - start
        failed = (
            f", failed: {'; '.join(published.engines_failed)}" if published.engines_failed else ""
        )
        return (
            f"  update: loss {update.loss:+.4f} over {update.tokens} tokens of "
            f"{update.groups_used} groups with a reward spread, {update.clipped_share:.1%} "
            f"clipped, logprobs within {update.max_logprob_gap:.1e} of the engine's; version "
            f"{published.version} loaded by {published.engines_updated} engine(s){failed}"
        )


def step_versions(results: Sequence[GroupResult]) -> tuple[int, ...]:
    """The policy versions the tokens of these groups were made under."""
    return tuple(sorted({seg.version for r in results for s in r.samples for seg in s.versions}))


def run_trainer_loop(
    client: RolloutClient,
    cfg: DemoConfig,
    rows: Sequence[PromptRow],
    rewarder: Rewarder,
    console: Console,
    *,
    learner: Learner | None = None,
) -> tuple[list[GroupResult], list[list[float]], float]:
    """Runs the steps; returns every group, its rewards, and the seconds spent rolling out
    (the learner's time left out)."""
    results: list[GroupResult] = []
    rewards: list[list[float]] = []
    by_key = {row.prompt_key: row for row in rows}
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
            batch = [
                rows[(step * cfg.groups_per_step + i) % len(rows)]
                for i in range(cfg.groups_per_step)
            ]
            groups = [
                PromptGroup(
                    group_id=f"step{step}-g{i}",
                    prompt_token_ids=rewarder.encode_prompt(row),
                    n=cfg.n,
                    sampling=SamplingParams(
                        temperature=cfg.temperature,
                        max_tokens=cfg.max_tokens,
                        seed=cfg.seed + step * 1000 + i,
                    ),
                    prompt_key=row.prompt_key,
                )
                for i, row in enumerate(batch)
            ]
            client.submit(groups)
            first = len(results)
            for received in client.groups(limit=cfg.groups_per_step, timeout_s=600):
                result = received.result
                results.append(result)
                rewards.append(rewarder.rewards(by_key[result.prompt_key], result))
                received.done()  # the trainer has used the group: acknowledge it
                progress.advance(bar)
            mean = statistics.fmean(r for g in rewards[first:] for r in g)
            progress.console.print(f"step {step + 1}/{cfg.steps}: mean reward {mean:.3f}")
            if learner is not None:
                progress.console.print(learner.after_step(step, results[first:], rewards[first:]))
        wall_s = time.perf_counter() - start - (learner.seconds if learner else 0.0)
    return results, rewards, wall_s


def print_summary(summary: DemoSummary, console: Console) -> None:
    table = Table(title="rollserve demo", show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    dtypes = f" ({', '.join(summary.engine_dtypes)})" if summary.engine_dtypes else ""
    table.add_row("engines", f"{summary.engines}{dtypes}")
    table.add_row("steps", str(summary.steps))
    table.add_row("groups", str(summary.groups))
    table.add_row("samples", str(summary.samples))
    table.add_row("output tokens", str(summary.output_tokens))
    table.add_row("wall time", f"{summary.wall_s:.2f} s")
    table.add_row("output tokens/s", f"{summary.output_tokens_per_s:,.0f}")
    table.add_row("prefix-cache hit rate", f"{summary.prefix_cache_hit_rate:.1%}")
    table.add_row("group latency p50", f"{summary.group_latency_p50_s:.3f} s")
    table.add_row("group latency p99", f"{summary.group_latency_p99_s:.3f} s")
    table.add_row("mean reward", f"{summary.mean_reward:.3f}")
    table.add_row("groups with mixed rewards", f"{summary.mixed_group_share:.1%}")
    if summary.versions_per_step:
        table.add_row(
            "policy versions by step",
            " ".join("/".join(map(str, v)) for v in summary.versions_per_step),
        )
        table.add_row("learning + publishing", f"{summary.train_s:.2f} s (not in wall time)")
    if summary.predictor_mae_tokens is not None:
        auc = summary.predictor_tail_auc
        table.add_row(
            "length predictor",
            f"MAE {summary.predictor_mae_tokens:.0f} tokens, tail AUC "
            f"{'-' if auc is None else f'{auc:.3f}'} ({summary.predictor_scored_samples} samples)",
        )
    console.print(table)


def run_demo(cfg: DemoConfig, console: Console | None = None) -> DemoSummary:
    console = console or Console()
    from rollserve.assets import default_prompts, reasoner_dir

    model = cfg.model or reasoner_dir()
    rows = read_prompt_set(cfg.prompts or default_prompts())
    rewarder = Rewarder(model)
    console.print(f"model {model}, {len(rows)} prompts")
    console.print(f"starting the dev stack: Redis, {cfg.engines} engine(s), scheduler …")
    with DevStack(StackConfig(model=model, engines=cfg.engines, redis_url=cfg.redis_url)) as stack:
        for name, where in stack.describe():
            console.print(f"  {name:<10} {where}")
        run_id = f"demo-{uuid.uuid4().hex[:8]}"
        with (
            RolloutClient(stack.scheduler_address, stack.redis_url, run_id) as client,
            tempfile.TemporaryDirectory(prefix="rollserve-ckpt-") as scratch,
        ):
            learner = None
            if cfg.train:
                folder = cfg.checkpoints or Path(scratch)
                console.print(f"training: GRPO, lr {cfg.lr}, checkpoints in {folder}")
                learner = Learner(client, model, cfg, folder)
            results, rewards, wall_s = run_trainer_loop(
                client, cfg, rows, rewarder, console, learner=learner
            )
            status = client.status()
    summary = summarize(results, rewards, wall_s, cfg.steps, cfg.engines, status=status)
    if learner is not None:
        per_step = [
            step_versions(results[i : i + cfg.groups_per_step])
            for i in range(0, len(results), cfg.groups_per_step)
        ]
        summary = replace(
            summary,
            versions_per_step=tuple(per_step),
            policy_version=learner.version,
            train_s=learner.seconds,
        )
    print_summary(summary, console)
    if cfg.json_path is not None:
        cfg.json_path.write_text(json.dumps(asdict(summary), indent=2) + "\n")
        console.print(f"wrote {cfg.json_path}")
    return summary
