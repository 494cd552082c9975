"""``rollserve bench decisions``: what one scheduling decision costs as the fleet grows.

Each policy plans the same queue (``groups`` groups of ``n`` samples, prompt lengths and
predicted lengths drawn from scenario S1's distributions) over 8, 64 and 512 engines that are
already running work (each engine's in-flight samples, outstanding, predicted and KV tokens
drawn the same way). The cost of one ``plan`` call is the median wall time over ``repeats``
calls, each on a fresh policy object (no state carried between calls), measured in this
process. The table gives microseconds per call and per sample placed, and the growth against
the smallest fleet next to the growth of the fleet itself: a policy whose cost grows no faster
than the engine count scales at most linearly. Real time of the real policy code; nothing here
is simulated except the snapshot's contents.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

DEFAULT_ENGINES = (8, 64, 512)
DEFAULT_POLICIES = ("round_robin", "least_loaded", "cache_aware", "rl")


@dataclass(frozen=True)
class DecisionsConfig:
    engines: tuple[int, ...] = DEFAULT_ENGINES
    policies: tuple[str, ...] = DEFAULT_POLICIES
    groups: int = 128
    n: int = 8
    repeats: int = 5
    seed: int = 0
    json_path: Path | None = None


def _snapshot(engines: int, cfg: DecisionsConfig) -> Any:
    from rollserve.scheduler.core.snapshot import EngineView, QueuedGroup, Snapshot

    rng = random.Random(cfg.seed)
    queue = []
    for g in range(cfg.groups):
        prompt_len = max(1, round(400 * math.exp(0.5 * rng.gauss(0, 1))))
        predicted = 1000 * math.exp(0.95 * rng.gauss(0, 1))
        tokens = tuple(rng.randrange(32000) for _ in range(math.ceil(prompt_len / 16)))
        queue.append(
            QueuedGroup(
                key=f"g{g}",
                n=cfg.n,
                prompt_len=prompt_len,
                max_tokens=32768,
                seq=g,
                prompt_key=f"p{g}",
                prompt_token_ids=tokens,
                predicted_len=predicted,
            )
        )
    views = []
    for e in range(engines):
        inflight = rng.randrange(0, 64)
        predicted = sum(1000 * math.exp(0.95 * rng.gauss(0, 1)) for _ in range(inflight))
        views.append(
            EngineView(
                engine_id=f"e{e:04d}",
                healthy=True,
                capacity_samples=1280,
                inflight_samples=inflight,
                outstanding_tokens=inflight * 32768,
                predicted_outstanding=predicted,
                predicted_longest=predicted / max(1, inflight) * 3,
                kv_capacity_tokens=409600,
                kv_used_tokens=inflight * 1400,
            )
        )
    return Snapshot(tuple(queue), tuple(views))


def run_decisions(cfg: DecisionsConfig, console: Console | None = None) -> dict[str, Any]:
    from rollserve.scheduler.core.policy import create_policy

    console = console or Console(width=150)
    snapshots = {e: _snapshot(e, cfg) for e in cfg.engines}
    samples = cfg.groups * cfg.n
    out: dict[str, Any] = {
        "groups": cfg.groups,
        "n": cfg.n,
        "repeats": cfg.repeats,
        "engines": list(cfg.engines),
        "policies": {},
    }
    table = Table(title=f"decision cost: one plan of {cfg.groups} groups x {cfg.n} (real time)")
    table.add_column("policy")
    for e in cfg.engines:
        table.add_column(f"{e} engines µs", justify="right")
    smallest = min(cfg.engines)
    for e in cfg.engines:
        if e != smallest:
            table.add_column(f"growth {e}/{smallest} (fleet {e // smallest}x)", justify="right")
    for name in cfg.policies:
        costs: dict[int, float] = {}
        for e in cfg.engines:
            times = []
            for _ in range(cfg.repeats):
                policy = create_policy(name)
                t0 = time.perf_counter()
                policy.plan(snapshots[e])
                times.append(time.perf_counter() - t0)
            costs[e] = statistics.median(times)
        growth = {e: costs[e] / costs[smallest] for e in cfg.engines}
        out["policies"][name] = {
            str(e): {
                "plan_us": 1e6 * costs[e],
                "per_sample_us": 1e6 * costs[e] / samples,
                "growth": growth[e],
                "fleet_growth": e / smallest,
            }
            for e in cfg.engines
        }
        table.add_row(
            name,
            *(f"{1e6 * costs[e]:,.0f}" for e in cfg.engines),
            *(f"{growth[e]:.2f}x" for e in cfg.engines if e != smallest),
        )
    console.print(table)
    if cfg.json_path is not None:
        cfg.json_path.parent.mkdir(parents=True, exist_ok=True)
        cfg.json_path.write_text(json.dumps(out, indent=2) + "\n")
        console.print(f"wrote {cfg.json_path}")
    return out
