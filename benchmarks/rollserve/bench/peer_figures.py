"""The PNGs of ``rollserve bench peer``: what the table says, round by round and step by step.

- ``rounds.png``: each row's groups/s in every round, and each rollserve row's ratio to the
  router in the same round, with the goal and the pooled ratio (the rounds' spread is the
  benchmark's noise; the pooled ratio is the figure to read).
- ``steps.png``: the measured steps' wall times of each row, all rounds together.
- ``engines.png``: how each row's engines spent their time over all rounds: computing, waiting
  for a CPU, idle (``bubble_ratio``).
- ``lengths.png``: the response lengths each row delivered (log scale: the tail).
- ``inflight.png``: the samples in flight over the measured steps of each row's median round
  (by groups/s), step ends marked: the synchronous steps' tails, where the engines run a few
  long samples, against the over-sampled pipeline. Delivered samples only (the groups a round
  cancels at its end are not drawn), from each sample's start and end as the side recorded
  them.

Every figure is drawn from the runs' records alone (no timing of its own).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rollserve.bench.peer_stats import SideRun, engine_time_shares, idle_share, median_index

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_COLOURS = ("#555555", "#3a6ea5", "#8fb4dc", "#d08c2c")  # router, then rollserve rows


def write_figures(
    runs: Mapping[str, Sequence[SideRun]],
    ratios: Mapping[str, Sequence[float]],
    pooled: Mapping[str, float],
    *,
    goal: float,
    out_dir: Path,
    base: str,
) -> list[Path]:
    """Writes the four PNGs into ``out_dir`` (made if missing); returns their paths.
    ``ratios``: each row's groups/s over ``base``'s, per round; ``pooled``: over all rounds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    names = list(runs)
    colour = {name: _COLOURS[i % len(_COLOURS)] for i, name in enumerate(names)}
    paths: list[Path] = []

    def save(fig: Figure, name: str) -> None:
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    rounds = max(len(r) for r in runs.values())
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    for name in names:
        xs = range(1, len(runs[name]) + 1)
        top.plot(xs, [r.groups_per_s for r in runs[name]], "o-", label=name, color=colour[name])
        if name != base:
            bottom.plot(xs, ratios[name], "o-", label=name, color=colour[name])
            bottom.axhline(pooled[name], color=colour[name], linestyle=":", linewidth=1)
    bottom.axhline(goal, color="#b03030", linestyle="--", linewidth=1, label=f"goal {goal:g}x")
    bottom.axhline(1.0, color=colour[base], linewidth=0.8)
    top.set_ylabel("groups/s")
    top.set_title("Each round: groups/s, and the ratio to the router (dotted: pooled)")
    top.legend(fontsize=8)
    bottom.set_ylabel(f"vs {base}")
    bottom.set_xlabel("round")
    bottom.set_xticks(range(1, rounds + 1))
    bottom.legend(fontsize=8)
    save(fig, "rounds.png")

    fig, ax = plt.subplots(figsize=(8, 4))
    walls = [[s.wall_s for r in runs[name] for s in r.steps] for name in names]
    ax.boxplot(walls, showfliers=True)
    ax.set_xticks(range(1, len(names) + 1), names)
    ax.set_ylabel("step wall time (s)")
    ax.set_title("Measured steps, all rounds")
    save(fig, "steps.png")

    fig, ax = plt.subplots(figsize=(8, 1.8 + 0.6 * len(names)))
    for row, name in enumerate(names):
        computing, waiting = engine_time_shares(runs[name])
        idle = idle_share(computing, waiting)
        left = 0.0
        for share, part, shade in (
            (computing, "computing", "#3a6ea5"),
            (waiting, "waiting for a CPU", "#d08c2c"),
            (idle, "idle (bubble)", "#dddddd"),
        ):
            ax.barh(row, share, left=left, color=shade, label=part if row == 0 else None)
            if share >= 0.06:
                ax.text(left + share / 2, row, f"{share:.0%}", ha="center", va="center")
            left += share
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of the engines' time, all rounds (engine cores' main threads)")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3)
    save(fig, "engines.png")

    fig, ax = plt.subplots(figsize=(8, 4))
    lengths = {
        name: [len(s.token_ids) for r in runs[name] for g in r.groups for s in g.samples]
        for name in names
    }
    longest = max((max(v) for v in lengths.values() if v), default=1)
    bins = [longest * i / 50 for i in range(51)]  # the same bins for every row
    for name in names:
        if lengths[name]:
            ax.hist(
                lengths[name], bins=bins, histtype="step", log=True, label=name, color=colour[name]
            )
    ax.set_xlabel("response length (tokens)")
    ax.set_ylabel("delivered samples")
    ax.set_title("Response lengths delivered, all rounds (rows with the same draws overlap)")
    ax.legend(fontsize=8)
    save(fig, "lengths.png")

    fig, axes = plt.subplots(len(names), 1, figsize=(9, 1.4 + 1.6 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        run = runs[name][median_index(runs[name])]
        times, counts = in_flight(run)
        ax.step(times, counts, where="post", color=colour[name])
        ax.fill_between(times, counts, step="post", color=colour[name], alpha=0.3)
        end = 0.0
        for step in run.steps:
            end += step.wall_s
            ax.axvline(end, color="#999999", linewidth=0.6)
        ax.set_xlim(0, max(run.wall_s, 1e-9))
        ax.set_ylabel(name, rotation=0, ha="right", va="center")
    axes[-1, 0].set_xlabel("seconds into the measured steps (grey: a step ends)")
    fig.suptitle("Samples in flight, each row's median round")
    save(fig, "inflight.png")
    return paths


def in_flight(run: SideRun) -> tuple[list[float], list[int]]:
    """Samples in flight over the run's measured window (seconds from its start), as a step
    function: the count from ``times[i]`` on is ``counts[i]``. A sample started before the
    window (carried over) counts from its start."""
    events: list[tuple[float, int]] = []
    for group in run.groups:
        for sample in group.samples:
            if sample.finished_at <= 0:
                continue
            start = max(0.0, sample.started_at - run.start_at)
            end = min(run.wall_s, sample.finished_at - run.start_at)
            if end > start:
                events += [(start, 1), (end, -1)]
    events.sort()
    times, counts, count = [0.0], [0], 0
    for at, change in events:
        count += change
        if at == times[-1]:
            counts[-1] = count
        else:
            times.append(at)
            counts.append(count)
    return times, counts
