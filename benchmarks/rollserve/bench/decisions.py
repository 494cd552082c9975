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

A second table (``depths``) times the plan a busy scheduler makes most: a fleet of
``depth_engines`` engines with room for one group left, and a queue ``depth`` groups deep
(a trainer that queued an epoch ahead, say). Such a plan places one group, whatever the
depth; its cost against the shallowest queue's, next to the queue's own growth, shows what
a deeper queue costs each plan. The runtime's own pass over the queue (gathering the
policy's view of it) is not in these figures.
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
DEFAULT_DEPTHS = (1_000, 10_000, 100_000)


@dataclass(frozen=True)
class DecisionsConfig:
    engines: tuple[int, ...] = DEFAULT_ENGINES
    policies: tuple[str, ...] = DEFAULT_POLICIES
    groups: int = 128
    n: int = 8
    repeats: int = 5
    seed: int = 0
    depths: tuple[int, ...] = ()
    depth_engines: int = 64
    json_path: Path | None = None


def _queue(groups: int, cfg: DecisionsConfig, rng: random.Random) -> list[Any]:
    from rollserve.scheduler.core.snapshot import QueuedGroup

    queue = []
    for g in range(groups):
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
    return queue


def _snapshot(engines: int, cfg: DecisionsConfig) -> Any:
    from rollserve.scheduler.core.snapshot import EngineView, Snapshot

    rng = random.Random(cfg.seed)
    queue = _queue(cfg.groups, cfg, rng)
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


def _deep_snapshot(depth: int, cfg: DecisionsConfig) -> Any:
    """``depth`` groups queued; every engine full but the first, which has room for one."""
    from rollserve.scheduler.core.snapshot import EngineView, Snapshot

    rng = random.Random(cfg.seed)
    queue = _queue(depth, cfg, rng)
    capacity = 256
    views = [
        EngineView(
            engine_id=f"e{e:04d}",
            healthy=True,
            capacity_samples=capacity,
            inflight_samples=capacity - (cfg.n if e == 0 else 0),
            outstanding_tokens=capacity * 32768,
            predicted_outstanding=capacity * 1000.0,
            predicted_longest=8000.0,
            kv_capacity_tokens=4 * capacity * 1400,
            kv_used_tokens=capacity * 1400,
        )
        for e in range(cfg.depth_engines)
    ]
    return Snapshot(tuple(queue), tuple(views))


def _plan_s(name: str, snapshot: Any, repeats: int) -> float:
    """The median wall time of ``repeats`` plans, each by a fresh policy object."""
    from rollserve.scheduler.core.policy import create_policy

    times = []
    for _ in range(repeats):
        policy = create_policy(name)
        t0 = time.perf_counter()
        policy.plan(snapshot)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _run_depths(cfg: DecisionsConfig, console: Console) -> dict[str, Any]:
    snapshots = {d: _deep_snapshot(d, cfg) for d in cfg.depths}
    shallowest = min(cfg.depths)
    table = Table(
        title=f"a busy fleet's plan ({cfg.depth_engines} engines, room for one group of "
        f"{cfg.n}) against the queue's depth (real time)"
    )
    table.add_column("policy")
    for d in cfg.depths:
        table.add_column(f"{d:,} queued µs", justify="right")
    for d in cfg.depths:
        if d != shallowest:
            table.add_column(f"growth (queue {d // shallowest}x)", justify="right")
    out: dict[str, Any] = {}
    for name in cfg.policies:
        costs = {d: _plan_s(name, snapshots[d], cfg.repeats) for d in cfg.depths}
        out[name] = {
            str(d): {
                "plan_us": 1e6 * costs[d],
                "growth": costs[d] / costs[shallowest],
                "queue_growth": d / shallowest,
            }
            for d in cfg.depths
        }
        table.add_row(
            name,
            *(f"{1e6 * costs[d]:,.0f}" for d in cfg.depths),
            *(f"{costs[d] / costs[shallowest]:.1f}x" for d in cfg.depths if d != shallowest),
        )
    console.print(table)
    return out


def run_decisions(cfg: DecisionsConfig, console: Console | None = None) -> dict[str, Any]:
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
        costs = {e: _plan_s(name, snapshots[e], cfg.repeats) for e in cfg.engines}
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
    if cfg.depths:
        out["depths"] = {"engines": cfg.depth_engines, "policies": _run_depths(cfg, console)}
    if cfg.json_path is not None:
        cfg.json_path.parent.mkdir(parents=True, exist_ok=True)
        cfg.json_path.write_text(json.dumps(out, indent=2) + "\n")
        console.print(f"wrote {cfg.json_path}")
    return out
