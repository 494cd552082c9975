"""``rollserve bench peer-pool A.json B.json ...``: the rounds of several ``bench peer`` runs of
one setting, pooled.

Two runs of one ``bench peer`` command on this machine have differed by 0.1x in their pooled
ratio, more than either run's bootstrap interval allows for: the rounds of one run share the
machine's state of the moment. Pooling the rounds of several runs gives the figure to quote.
Each row's ratio to the router is its groups over its time in all rounds of all runs, over the
router's (``pooled_ratios``); the interval resamples the rounds of all runs together
(``pooled_interval``). Runs pool only if they measured the same thing: every setting but where
they wrote and how many rounds they ran must be equal, else the first difference is named.
A row pools where every run has it (the ``--variant-*`` row may be in some runs only). Where
"rollserve B" pools, its ratio to the plain "rollserve" row of the same rounds is pooled the
same way: the A/B figure of a ``--variant-*`` run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollserve.bench.peer import PEER, ROLLSERVE, ROLLSERVE_B, pooled_interval, pooled_ratios

# Settings of a run that say where it wrote or how long it ran, not what it measured.
_RUN_ONLY = frozenset(
    {"json_path", "out_dir", "trace_path", "run_dir", "repeats", "variant", "router_policies"}
)
# Settings added to `bench peer` after some runs were kept: a file without one ran with this.
_ADDED_LATER: dict[str, Any] = {"router_engine_args": []}


@dataclass(frozen=True, slots=True)
class Round:
    """One row's round: the groups it delivered in its measured steps and their wall time."""

    groups: int
    wall_s: float


@dataclass(frozen=True, slots=True)
class PeerRun:
    path: Path
    settings: dict[str, Any]  # what it measured (``_RUN_ONLY`` left out), the router's policy
    rows: dict[str, list[Round]]  # row name -> its rounds, in order
    variant: Any = None  # what its row "rollserve B" ran, if it has one


@dataclass(frozen=True, slots=True)
class PooledRuns:
    runs: tuple[PeerRun, ...]
    rows: tuple[str, ...]  # pooled rows other than the router's, in the first run's order
    per_run: tuple[dict[str, float], ...]  # each run's pooled ratios
    pooled: dict[str, float]  # over every round of every run
    interval: dict[str, tuple[float, float]]  # 90% bootstrap of ``pooled``
    rounds: int
    # "rollserve B" over "rollserve" where both pool: each run's, all rounds', its interval.
    variant_per_run: tuple[float, ...] = ()
    variant_pooled: float | None = None
    variant_interval: tuple[float, float] | None = None


def load_run(path: Path) -> PeerRun:
    """A ``bench peer`` JSON; ValueError naming the file and what it lacks."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc})") from None
    try:
        given = {**_ADDED_LATER, **data["settings"]}
        settings = {k: v for k, v in given.items() if k not in _RUN_ONLY}
        settings["measured router policy"] = data["router_policy"]
        rows = {
            name: [Round(r["summary"]["groups"], r["summary"]["wall_s"]) for r in runs]
            for name, runs in data["runs"].items()
        }
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not the JSON of `rollserve bench peer` (no {exc})") from None
    if PEER not in rows:
        raise ValueError(f"{path}: has no {PEER} row to compare with")
    return PeerRun(path, settings, rows, data["settings"].get("variant"))


def _difference(a: Mapping[str, Any], b: Mapping[str, Any]) -> str | None:
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            return f"{key}: {a.get(key)!r} against {b.get(key)!r}"
    return None


def pool_runs(runs: Sequence[PeerRun]) -> PooledRuns:
    """Pools the runs' rounds; ValueError if there are fewer than two runs or their settings
    differ (naming the setting and the files). A row pools only if every run has it, and
    "rollserve B" only if every run's B ran the same variant."""
    if len(runs) < 2:
        raise ValueError(f"give at least two runs to pool (got {len(runs)})")
    first = runs[0]
    for run in runs[1:]:
        why = _difference(first.settings, run.settings)
        if why is not None:
            raise ValueError(f"{first.path} and {run.path} measured different things: {why}")
    same_variant = all(run.variant == first.variant for run in runs)
    rows = tuple(
        name
        for name in first.rows
        if name != PEER
        and all(name in r.rows for r in runs)
        and (name != ROLLSERVE_B or same_variant)
    )
    together = {name: [x for run in runs for x in run.rows[name]] for name in (PEER, *rows)}
    per_run = tuple(pooled_ratios({name: run.rows[name] for name in (PEER, *rows)}) for run in runs)
    variant_per_run: tuple[float, ...] = ()
    variant_pooled: float | None = None
    variant_interval: tuple[float, float] | None = None
    if ROLLSERVE in rows and ROLLSERVE_B in rows:
        pair = (ROLLSERVE, ROLLSERVE_B)
        variant_per_run = tuple(
            pooled_ratios({n: run.rows[n] for n in pair}, ROLLSERVE)[ROLLSERVE_B] for run in runs
        )
        both = {n: together[n] for n in pair}
        variant_pooled = pooled_ratios(both, ROLLSERVE)[ROLLSERVE_B]
        variant_interval = pooled_interval(both, ROLLSERVE).get(ROLLSERVE_B)
    return PooledRuns(
        runs=tuple(runs),
        rows=rows,
        per_run=per_run,
        pooled=pooled_ratios(together),
        interval=pooled_interval(together),
        rounds=len(together[PEER]),
        variant_per_run=variant_per_run,
        variant_pooled=variant_pooled,
        variant_interval=variant_interval,
    )


def to_json(pooled: PooledRuns) -> dict[str, Any]:
    return {
        "files": [str(run.path) for run in pooled.runs],
        "rounds": pooled.rounds,
        "settings": pooled.runs[0].settings,
        "rows": {
            name: {
                "vs_router_per_run": [ratios[name] for ratios in pooled.per_run],
                "vs_router_pooled": pooled.pooled[name],
                "vs_router_pooled_interval_90": list(pooled.interval.get(name, ())),
            }
            for name in pooled.rows
        },
        **(
            {
                "variant_over_rollserve": {
                    "per_run": list(pooled.variant_per_run),
                    "pooled": pooled.variant_pooled,
                    "pooled_interval_90": list(pooled.variant_interval or ()),
                }
            }
            if pooled.variant_pooled is not None
            else {}
        ),
    }


def print_pooled(pooled: PooledRuns) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"bench peer runs pooled: {len(pooled.runs)} runs, {pooled.rounds} rounds; "
        "each row's groups over its time, over vllm-router's"
    )
    table.add_column("row", justify="left")
    for i, run in enumerate(pooled.runs, 1):
        table.add_column(f"run {i} ({len(run.rows[PEER])} rounds)", justify="right")
    table.add_column("all rounds [90%]", justify="right")
    for name in pooled.rows:
        low_high = pooled.interval.get(name)
        span = f" [{low_high[0]:.2f}-{low_high[1]:.2f}]" if low_high else ""
        table.add_row(
            name,
            *(f"{ratios[name]:.2f}x" for ratios in pooled.per_run),
            f"{pooled.pooled[name]:.2f}x{span}",
        )
    console = Console()
    console.print(table)
    if pooled.variant_pooled is not None:
        low_high = pooled.variant_interval
        span = f" [{low_high[0]:.2f}-{low_high[1]:.2f}]" if low_high else ""
        console.print(
            f"  {ROLLSERVE_B} / {ROLLSERVE} (same rounds): "
            + ", ".join(f"run {i} {r:.2f}x" for i, r in enumerate(pooled.variant_per_run, 1))
            + f"; all rounds {pooled.variant_pooled:.2f}x{span}"
        )
    for i, run in enumerate(pooled.runs, 1):
        console.print(f"  run {i}: {run.path}")
