"""CLI glue of ``rollserve workload make|stats`` and ``rollserve model train-reasoner``."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table


def make(seed: int, size: int, out: Path, console: Console) -> None:
    from collections import Counter

    from rollserve.workload import make_prompt_set, write_prompt_set

    rows = make_prompt_set(seed, size)
    write_prompt_set(rows, out)
    kinds = Counter(r.kind for r in rows)
    summary = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
    console.print(f"wrote {len(rows)} prompts ({summary}) to {out}")


def train(out_dir: Path, seed: int, steps: int | None, console: Console) -> None:
    from rollserve.training.reasoner import ReasonerConfig, train_reasoner

    cfg = ReasonerConfig(seed=seed)
    if steps is not None:
        cfg = replace(cfg, steps=steps, warmup_steps=min(cfg.warmup_steps, max(1, steps // 10)))
    console.print(
        f"training a {cfg.layers}-layer Llama (hidden {cfg.hidden_size}) for {cfg.steps} steps "
        f"of {cfg.batch_tokens} tokens, seed {cfg.seed}, {cfg.threads} threads …"
    )

    def progress(step: int, loss: float, elapsed: float) -> None:
        console.print(f"  step {step:>5}/{cfg.steps}  loss {loss:.4f}  {elapsed:7.1f} s")

    result = train_reasoner(out_dir, cfg, progress)
    size_mb = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file()) / 1e6
    console.print(
        f"wrote {out_dir}: {result.parameters / 1e6:.2f}M parameters, {size_mb:.1f} MB, "
        f"final loss {result.final_loss:.4f}, {result.wall_s / 60:.1f} min"
    )


def stats(
    *,
    model: Path | None,
    data: Path | None,
    samples: int,
    prompts: int | None,
    out_dir: Path,
    json_path: Path | None,
    console: Console,
) -> bool:
    """Measures and prints the shape; True when every target is met."""
    from rollserve.assets import default_prompts, reasoner_dir
    from rollserve.training.stats import StatsConfig, measure, to_json, write_figures
    from rollserve.workload import read_prompt_set

    model = model or reasoner_dir()
    data = data or default_prompts()
    rows = read_prompt_set(data)
    if prompts is not None:
        rows = rows[:prompts]
    threads = max(1, (os.cpu_count() or 2) - 1)
    cfg = StatsConfig(model=model, data=data, samples=samples, omp_threads=threads)
    console.print(
        f"{len(rows)} prompts x {samples} samples x 2 passes at temperature "
        f"{cfg.temperature} on vLLM, model {model}"
    )

    def progress(what: str, done: int, total: int) -> None:
        if done % 2000 == 0 or done == total:
            console.print(f"  {what}: {done}/{total} samples")

    shape, pass1, pass2 = measure(cfg, rows, progress)
    figures = write_figures(pass1, pass2, out_dir, f"{len(rows)} prompts x {samples}")

    table = Table(title="Workload shape (pass 1; overlap across passes)")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    table.add_column("met", justify="center")
    for key, value, low, high, met in shape.checks():
        target = f">= {low:g}" if math.isinf(high) else f"{low:g} – {high:g}"
        table.add_row(key, f"{value:.3f}", target, "yes" if met else "[red]no[/red]")
    table.add_row(
        "median / p99 / max length", f"{shape.median:.0f} / {shape.p99:.0f} / {shape.max}"
    )
    table.add_row("truncated (max_tokens)", f"{shape.truncated_share:.2%}")
    table.add_row("output tokens/s", f"{shape.output_tokens_per_s:,.0f}")
    for kind, figs in shape.per_kind.items():
        table.add_row(
            f"  {kind}",
            f"{figs['prompts']:.0f} prompts, median {figs['median_length']:.0f}, "
            f"acc {figs['accuracy']:.2f}",
        )
    console.print(table)
    for path in figures:
        console.print(f"wrote {path}")
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        out = to_json(shape) | {
            "model": str(model),
            "data": str(data),
            "figures": [str(p) for p in figures],
        }
        json_path.write_text(json.dumps(out, indent=2) + "\n")
        console.print(f"wrote {json_path}")
    return all(met for *_, met in shape.checks())
