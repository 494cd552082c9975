"""``rollserve bench policies``: scheduling policies side by side, in the discrete-event mode.

Every policy runs the same scenario (the same groups with the same true lengths, the same
simulated engines) through :func:`rollserve.sim.des.run_des`, which calls the policy code the
scheduler runs. The table and the JSON give, per policy: mean step makespan, groups and output
tokens per second, bubble ratio (1 - busy engine-time / (engines x time)), tail time (while only
the last 10% of a step's samples run), prefix-cache hit rate, preemptions and recomputed tokens,
the off-policy token fraction, the decision cost, and ``vs_round_robin`` (groups/s over
round_robin's). PNGs: an engine timeline per policy and the length distribution. Everything
here is simulated and labelled so.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

BASELINE = "round_robin"
DEFAULT_POLICIES = ("round_robin", "least_loaded", "cache_aware")


@dataclass(frozen=True)
class PoliciesConfig:
    scenario: str = "S1"
    steps: int | None = None
    engines: int | None = None
    policies: tuple[str, ...] = DEFAULT_POLICIES
    json_path: Path | None = None
    out_dir: Path = Path("bench-policies")


def run_policies(cfg: PoliciesConfig, console: Console | None = None) -> dict[str, Any]:
    from rollserve.scheduler.core.policy import create_policy
    from rollserve.sim.des import run_des
    from rollserve.sim.profile import load_profile
    from rollserve.sim.scenarios import load_scenario

    # Wide enough for the table's twelve columns even when stdout is not a terminal.
    console = console or Console(width=170)
    scenario = load_scenario(cfg.scenario)
    if cfg.steps is not None:
        scenario = replace(scenario, steps=cfg.steps)
    if cfg.engines is not None:
        scenario = replace(scenario, engines=cfg.engines)
    profile = load_profile(scenario.profile)
    steps = scenario.steps_of_groups()
    lengths = [n for groups in steps for g in groups for n in g.output_lens]
    median = statistics.median(lengths)
    console.print(
        f"[bold]SIMULATED[/bold] {scenario.name}: {scenario.description}\n"
        f"  {scenario.engines} engines of {profile.name} ({profile.simulated_hardware}), "
        f"{len(steps)} step(s) of {scenario.groups_per_step} groups x {scenario.n}; "
        f"response length median {median:.0f}, max {max(lengths)} "
        f"(max/median {max(lengths) / median:.1f})"
    )
    results = {}
    for name in cfg.policies:
        results[name] = run_des(steps, create_policy(name), profile, scenario.engines)
        console.print(f"  ran {name}")
    base = results.get(BASELINE)
    table = Table(title=f"policies on {scenario.name} (simulated, one run)")
    for column in (
        "policy",
        "makespan s",
        "groups/s",
        "tokens/s",
        "bubble",
        "tail s",
        "prefix hit",
        "preempt",
        "recomputed",
        "off-policy",
        "decision µs",
        "vs round_robin",
    ):
        table.add_column(column, justify="left" if column == "policy" else "right")
    out: dict[str, Any] = {
        "simulated": True,
        "scenario": scenario.name,
        "profile": profile.name,
        "engines": scenario.engines,
        "steps": len(steps),
        "length_median": median,
        "length_max": max(lengths),
        "policies": {},
    }
    for name, r in results.items():
        ratio = r.groups_per_s / base.groups_per_s if base else float("nan")
        table.add_row(
            name,
            f"{r.makespan_s:.1f}",
            f"{r.groups_per_s:.3f}",
            f"{r.output_tokens_per_s:,.0f}",
            f"{r.bubble_ratio:.1%}",
            f"{r.tail_s:.1f}",
            f"{r.prefix_hit_rate:.1%}",
            str(r.preemptions),
            f"{r.recomputed_tokens:,}",
            "0.0%",
            f"{r.decision_us:,.0f}",
            f"{ratio:.2f}x",
        )
        out["policies"][name] = {
            "makespan_s": r.makespan_s,
            "groups_per_s": r.groups_per_s,
            "output_tokens_per_s": r.output_tokens_per_s,
            "bubble_ratio": r.bubble_ratio,
            "tail_s": r.tail_s,
            "prefix_hit_rate": r.prefix_hit_rate,
            "preemptions": r.preemptions,
            "recomputed_tokens": r.recomputed_tokens,
            "offpolicy_token_fraction": 0.0,
            "decision_us": r.decision_us,
            "vs_round_robin": ratio,
        }
    console.print(table)
    figures = _figures(results, lengths, cfg.out_dir, scenario.name)
    out["figures"] = [str(p) for p in figures]
    for path in figures:
        console.print(f"wrote {path}")
    if cfg.json_path is not None:
        cfg.json_path.parent.mkdir(parents=True, exist_ok=True)
        cfg.json_path.write_text(json.dumps(out, indent=2) + "\n")
        console.print(f"wrote {cfg.json_path}")
    return out


def _figures(results: dict[str, Any], lengths: list[int], out_dir: Path, label: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, axes = plt.subplots(len(results), 1, figsize=(9, 1.6 + 1.4 * len(results)), squeeze=False)
    horizon = max(r.total_s for r in results.values())
    for ax, (name, r) in zip(axes[:, 0], results.items(), strict=True):
        image = ax.imshow(
            _batch_grid(r.timeline, r.engines, horizon),
            aspect="auto",
            interpolation="nearest",
            extent=(0, horizon, r.engines - 0.5, -0.5),
            cmap="Blues",
            vmin=0,
        )
        ax.set_ylabel(name, rotation=0, ha="right", va="center")
        ax.set_yticks([])
        fig.colorbar(image, ax=ax, pad=0.01, label="batch")
    axes[-1, 0].set_xlabel("simulated time (s); colour: mean decode batch (white: idle)")
    fig.suptitle(f"Engine timelines, {label} (simulated)")
    fig.tight_layout()
    timeline = out_dir / "timelines.png"
    fig.savefig(timeline, dpi=110)
    plt.close(fig)
    paths.append(timeline)

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(lengths, bins=60, color="#3a6ea5", log=True)
    ax.set_xlabel("response length (tokens)")
    ax.set_ylabel("samples")
    ax.set_title(f"Response lengths, {label} (scenario draw)")
    fig.tight_layout()
    hist = out_dir / "lengths.png"
    fig.savefig(hist, dpi=110)
    plt.close(fig)
    paths.append(hist)
    return paths


def _batch_grid(
    timeline: list[tuple[int, float, float, int]], engines: int, horizon: float, bins: int = 600
) -> Any:
    """Engines x time bins: the time-weighted mean decode batch of each engine in each bin."""
    import numpy as np

    grid = np.zeros((engines, bins))
    width = horizon / bins
    for engine, start, end, batch in timeline:
        first, last = int(start / width), min(bins - 1, int(end / width))
        for b in range(first, last + 1):
            overlap = min(end, (b + 1) * width) - max(start, b * width)
            if overlap > 0:
                grid[engine, b] += batch * overlap / width
    return grid
