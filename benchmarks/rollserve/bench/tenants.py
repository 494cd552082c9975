"""``rollserve bench tenants``: two runs on one fleet, with and without fair share.

Two trainers share a fleet of simulated engines behind the real scheduler. Run A queues a
backlog (``backlog_groups`` groups at once: a trainer that submits several steps ahead, or a
generation job). Run B is a synchronous GRPO trainer: it submits ``step_groups`` groups,
reads them all, and starts its next step, ``steps`` times. What B waits for each step is
what the scheduler's sharing decides.

Per policy, three rows, each a fresh scheduler and fleet on one embedded Redis:

- ``B alone``: B's steps on the idle fleet (the floor);
- ``arrival order``: A's backlog queued just before B's first step, the scheduler started
  with ``--no-fair-share`` (runs at one priority level go in arrival order: B's first step
  waits behind A's whole backlog);
- ``fair share``: the same with fair share on (the default: each run its share of the
  engines' slots while both have work queued).

Columns: B's mean and longest step in simulated seconds, B's mean step against ``B alone``,
and the groups of A delivered meanwhile, per simulated second (what sharing costs A).
Engine time is simulated (the profile's hardware); the scheduler, Redis and the SDK are real.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["TenantsConfig", "TenantsRow", "run_tenants"]

STEP_TIMEOUT_S = 1800.0
LAG_WARNING_S = 1.0  # real seconds the fleet may fall behind before the row says so
MODES = ("B alone", "arrival order", "fair share")
MODE_NAMES = dict(zip(("alone", "arrival", "fair"), MODES, strict=True))  # (on the command line)
_B_SEED_OFFSET = 1_000_003  # (B's prompts are not A's)


@dataclass(frozen=True)
class TenantsConfig:
    engines: int = 2
    backlog_groups: int = 1024  # 8,192 samples: 3.2 times the 2,560 slots of 2 such engines
    step_groups: int = 16
    steps: int = 4
    n: int = 8
    time_scale: float = 1.0
    policies: tuple[str, ...] = ("least_outstanding", "rl")
    modes: tuple[str, ...] = MODES  # the rows to run per policy, of MODES
    profile: str = "gpu-h100-llama8b"
    response_median: float = 150.0
    max_tokens: int = 1024
    seed: int = 0
    json_path: Path | None = None


@dataclass(frozen=True)
class TenantsRow:
    policy: str
    mode: str
    b_step_simulated_s: tuple[float, ...]  # each of B's steps
    b_mean_step_simulated_s: float
    a_groups_delivered: int  # of A's backlog, while B ran its steps
    # (over all of B's steps; when A's backlog ran out before they ended, the rate is
    # diluted by the time A had nothing left: the table says "drained")
    a_groups_per_simulated_s: float
    fleet_behind_s: float  # real seconds the most-behind engine fell behind its clock
    a_drained: bool = False  # A's backlog was all delivered before B's last step ended
    # Over the row, the engines' own figures: tokens decoded a step (the sequences in a
    # step's batch, on average) and samples they preempted (recomputed later).
    engine_batch: float = 0.0
    engine_preemptions: int = 0


def run_tenants(cfg: TenantsConfig, console: Console | None = None) -> dict[str, Any]:
    from rollserve.cli.redis_server import EmbeddedRedis
    from rollserve.scheduler.settings import SchedulerSettings
    from rollserve.sim.profile import load_profile

    console = console or Console(width=200)
    profile = load_profile(cfg.profile)
    factor = SchedulerSettings.model_fields["capacity_factor"].default
    slots = cfg.engines * math.ceil(profile.max_num_seqs * factor)
    if cfg.backlog_groups * cfg.n <= slots:
        console.print(
            f"[yellow]A's backlog ({cfg.backlog_groups * cfg.n} samples) fits in the fleet's "
            f"{slots} slots: nothing waits, so fair share has nothing to decide; raise "
            "--backlog[/yellow]"
        )
    console.print(
        f"[bold]SIMULATED engines[/bold]: {cfg.engines} x {profile.name} "
        f"({profile.simulated_hardware}); time_scale {cfg.time_scale:g}. Real: scheduler, "
        f"Redis, SDK.\n  A: {cfg.backlog_groups} groups queued at once; B: {cfg.steps} "
        f"synchronous steps of {cfg.step_groups} groups; n {cfg.n}, response median "
        f"{cfg.response_median:g} tokens"
    )
    rows: list[TenantsRow] = []
    with (
        tempfile.TemporaryDirectory(prefix="rollserve-bench-tenants-") as tmp,
        EmbeddedRedis() as redis_server,
    ):
        for policy in cfg.policies:
            for mode in cfg.modes:
                log_dir = Path(tmp) / f"{policy}-{mode.replace(' ', '-')}"
                row = _run_row(cfg, policy, mode, redis_server.url, log_dir)
                rows.append(row)
                console.print(
                    f"  {policy}, {mode}: B's step {row.b_mean_step_simulated_s:.1f} "
                    f"simulated s; A delivered {row.a_groups_delivered}"
                )
                if row.fleet_behind_s > LAG_WARNING_S:
                    console.print(
                        f"  [yellow]the fleet fell {row.fleet_behind_s:.1f} s behind real "
                        "time: its simulated times are overstated; raise --time-scale[/yellow]"
                    )
    console.print(_table(rows, profile.name))
    out: dict[str, Any] = {
        "simulated": True,
        "note": "engine time is simulated (the profile's hardware); scheduler, Redis, SDK real",
        "profile": profile.name,
        "config": {k: v for k, v in asdict(cfg).items() if k != "json_path"},
        "rows": [asdict(r) for r in rows],
    }
    if cfg.json_path is not None:
        cfg.json_path.parent.mkdir(parents=True, exist_ok=True)
        cfg.json_path.write_text(json.dumps(out, indent=2, default=str) + "\n")
        console.print(f"wrote {cfg.json_path}")
    return out


def _table(rows: list[TenantsRow], profile: str) -> Table:
    table = Table(title=f"two runs on one fleet ({profile}, SIMULATED engines, one run)")
    for column in (
        "policy",
        "mode",
        "B step sim s (mean)",
        "B step sim s (max)",
        "B vs alone",
        "A groups delivered",
        "A groups/sim s",
        "engine batch (seqs a step)",
        "engine preemptions",
    ):
        table.add_column(column, justify="right")
    alone = {r.policy: r for r in rows if r.mode == MODES[0]}

    for r in rows:
        table.add_row(
            r.policy,
            r.mode,
            f"{r.b_mean_step_simulated_s:.2f}",
            f"{max(r.b_step_simulated_s):.2f}",
            f"{r.b_mean_step_simulated_s / alone[r.policy].b_mean_step_simulated_s:.2f}x"
            if r.policy in alone
            else "-",
            "-" if r.mode == MODES[0] else str(r.a_groups_delivered),
            "-"
            if r.mode == MODES[0]
            else f"{r.a_groups_per_simulated_s:.2f}" + (" (drained)" if r.a_drained else ""),
            f"{r.engine_batch:.0f}",
            str(r.engine_preemptions),
        )
    return table


def _run_row(
    cfg: TenantsConfig, policy: str, mode: str, redis_url: str, log_dir: Path
) -> TenantsRow:
    import redis
    from rollserve.bench.fleet import (
        FleetConfig,
        prompt_groups,
        start_fleet,
        start_scheduler,
        wait_ready,
        wait_registered,
    )
    from rollserve.client import GroupStatus, RolloutClient
    from rollserve.client.wire import stream_key

    log_dir.mkdir(parents=True, exist_ok=True)
    fleet_cfg = FleetConfig(
        n=cfg.n,
        time_scale=cfg.time_scale,
        profile=cfg.profile,
        response_median=cfg.response_median,
        max_tokens=cfg.max_tokens,
        seed=cfg.seed,
    )
    extra: tuple[str, ...] = ("--max-n", str(max(64, cfg.n)))
    if mode == "arrival order":
        extra += ("--no-fair-share",)
    scheduler = start_scheduler(policy, redis_url, log_dir, extra)
    fleet = None
    tag = uuid.uuid4().hex[:8]
    stats = log_dir / "stats.json"  # (the fleet's totals, written as it stops)
    try:
        fleet = start_fleet(fleet_cfg, cfg.engines, scheduler.address, stats, log_dir)
        wait_ready(fleet)
        a_groups = prompt_groups(fleet_cfg, cfg.backlog_groups, prefix="a")
        b_cfg = dataclasses.replace(fleet_cfg, seed=cfg.seed + _B_SEED_OFFSET)
        b_groups = prompt_groups(b_cfg, cfg.steps * cfg.step_groups, prefix="b")
        with (
            RolloutClient(scheduler.address, redis_url, f"tenants-a-{tag}") as a,
            RolloutClient(scheduler.address, redis_url, f"tenants-b-{tag}") as b,
        ):
            wait_registered(b, cfg.engines, fleet)
            if mode != "B alone":
                a.submit(a_groups)
            started = time.monotonic()
            steps: list[float] = []
            for step in range(cfg.steps):
                begun = time.monotonic()
                batch = b_groups[step * cfg.step_groups : (step + 1) * cfg.step_groups]
                b.submit(batch)
                got = 0
                for item in b.groups(limit=len(batch), timeout_s=STEP_TIMEOUT_S):
                    if item.result.status != GroupStatus.DELIVERED:
                        raise RuntimeError(f"B's group {item.result.group_id}: {item.result.error}")
                    item.done()
                    got += 1
                if got != len(batch):
                    raise RuntimeError(f"B's step {step}: {got} of {len(batch)} groups arrived")
                steps.append((time.monotonic() - begun) / cfg.time_scale)
            simulated_s = (time.monotonic() - started) / cfg.time_scale
            counter = redis.Redis.from_url(redis_url)
            try:
                a_delivered = int(counter.xlen(stream_key(a.run_id)))
            finally:
                counter.close()
            for client in (a, b):  # (nothing left queued on the shared Redis)
                client.delete_run()
    finally:
        if fleet is not None:
            fleet.stop()
        scheduler.stop()
    totals = json.loads(stats.read_text())
    return TenantsRow(
        policy=policy,
        mode=mode,
        b_step_simulated_s=tuple(steps),
        b_mean_step_simulated_s=statistics.fmean(steps),
        a_groups_delivered=a_delivered,
        a_groups_per_simulated_s=a_delivered / simulated_s,
        fleet_behind_s=float(totals["behind_s_max"]),
        a_drained=mode != MODES[0] and a_delivered >= cfg.backlog_groups,
        engine_batch=totals["generated_tokens"] / max(1, totals["steps"]),
        engine_preemptions=int(totals["preemptions"]),
    )
