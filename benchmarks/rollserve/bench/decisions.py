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
a deeper queue costs each plan. Each policy is timed twice: its next plan (it planned on
the same queue before, as a busy scheduler's policy has) and its first. Above them, the
runtime's own pass over the queue that gathers the policy's view of it (``snapshot``, an
``rl`` runtime built and not started: no engine, no Redis call), after a plan with nothing
changed since, and after one delivered group of a new prompt was learnt from (what each
finished group brings), with a length prior learnt from ``PRIOR_GROUPS`` groups before; the
queue of one run, then of two (every other group: fair share's turns in the pass).
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
PRIOR_GROUPS = 2_000  # groups the runtime's length prior learnt from before the depth table


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


def _plan_s(name: str, snapshot: Any, repeats: int, planned_before: bool = False) -> float:
    """The median wall time of ``repeats`` plans, each by a fresh policy object; with
    ``planned_before``, its second plan of ``snapshot`` (what it kept from the first kept)."""
    from rollserve.scheduler.core.policy import create_policy

    times = []
    for _ in range(repeats):
        policy = create_policy(name)
        if planned_before:
            policy.plan(snapshot)
        t0 = time.perf_counter()
        policy.plan(snapshot)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _finished_record(group_id: str, prompt_len: int, length: int) -> Any:
    """A delivered group of two samples of ``length`` tokens, as the runtime learns from."""
    from rollserve.client.wire import FinishReason
    from rollserve.scheduler.state import GroupRecord, GroupSpec, SamplingSpec

    spec = GroupSpec(
        run_id="bench",
        group_id=group_id,
        prompt_token_ids=(1,) * prompt_len,
        n=2,
        sampling=SamplingSpec(max_tokens=32768),
        prompt_key=group_id,
    )
    record = GroupRecord.new(spec, seq=0)
    record.start((0, 1), "e0", now=0.0)
    for index in (0, 1):
        record.add_tokens(index, [1] * length, [0.0] * length)
        record.finish_sample(index, FinishReason.STOP, prompt_len, 0, now=0.0)
    return record


def _snapshot_s(queue: list[Any], repeats: int, seed: int, runs: int = 1) -> tuple[float, float]:
    """The runtime's snapshot of ``queue`` (its groups submitted, by ``runs`` runs in turn):
    median seconds with nothing changed since the one before, and after a delivered group
    was learnt from."""
    from rollserve.scheduler.core.policy import create_policy
    from rollserve.scheduler.runtime import SchedulerRuntime
    from rollserve.scheduler.settings import SchedulerSettings
    from rollserve.scheduler.state import GroupSpec, SamplingSpec
    from rollserve.scheduler.store import Store

    settings = SchedulerSettings.model_validate(
        {"redis_url": "redis://127.0.0.1:1", "policy": "rl"}  # never called
    )
    store = Store.from_url(settings.redis_url, predictor_namespace="bench-decisions")
    runtime = SchedulerRuntime(settings, store, create_policy("rl"))
    rng = random.Random(seed)
    for i in range(PRIOR_GROUPS):
        length = round(1000 * math.exp(0.95 * rng.gauss(0, 1)))
        runtime._learn(_finished_record(f"prior{i}", 400, length))
    prompts: dict[int, tuple[int, ...]] = {}  # one prompt a length: the runtime reads lengths
    for i, q in enumerate(queue):
        tokens = prompts.setdefault(q.prompt_len, (1,) * q.prompt_len)
        spec = GroupSpec(
            run_id=f"bench{i % runs}",
            group_id=q.key,
            prompt_token_ids=tokens,
            n=q.n,
            sampling=SamplingSpec(max_tokens=q.max_tokens),
            prompt_key=q.prompt_key,
        )
        runtime._enqueue(spec)
    runtime.snapshot()  # the first: every view built
    unchanged, learnt = [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        runtime.snapshot()
        unchanged.append(time.perf_counter() - t0)
        length = round(1000 * math.exp(0.95 * rng.gauss(0, 1)))
        runtime._learn(_finished_record(f"new{i}", 400, length))
        t0 = time.perf_counter()
        runtime.snapshot()
        learnt.append(time.perf_counter() - t0)
    return statistics.median(unchanged), statistics.median(learnt)


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
    rows: dict[str, dict[int, float]] = {}
    for runs, label in ((1, ""), (2, ", two runs")):
        snapshot_s = {
            d: _snapshot_s(list(snapshots[d].queue), cfg.repeats, cfg.seed, runs)
            for d in cfg.depths
        }
        rows[f"runtime snapshot{label}, nothing changed"] = {
            d: snapshot_s[d][0] for d in cfg.depths
        }
        rows[f"runtime snapshot{label}, a group learnt"] = {d: snapshot_s[d][1] for d in cfg.depths}
    for name in cfg.policies:
        rows[name] = {d: _plan_s(name, snapshots[d], cfg.repeats, True) for d in cfg.depths}
        rows[f"{name}, first plan"] = {
            d: _plan_s(name, snapshots[d], cfg.repeats) for d in cfg.depths
        }
    out: dict[str, Any] = {}
    for name, costs in rows.items():
        out[name] = {
            str(d): {
                "us": 1e6 * costs[d],
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
        out["depths"] = {"engines": cfg.depth_engines, "rows": _run_depths(cfg, console)}
    if cfg.json_path is not None:
        cfg.json_path.parent.mkdir(parents=True, exist_ok=True)
        cfg.json_path.write_text(json.dumps(out, indent=2) + "\n")
        console.print(f"wrote {cfg.json_path}")
    return out
