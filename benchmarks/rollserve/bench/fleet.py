"""``rollserve bench fleet``: the real scheduler against fleets of simulated engines.

One row per engine count E and scheduler policy, side by side in one run. Each row starts
the real scheduler process (``python -m rollserve.scheduler``, no engines at start, a length
history of its own in Redis, empty: the first epoch of a run, whatever ran before it) and one
sim fleet process
(``python -m rollserve.sim fleet --engines E``) whose engines register with it, over one
embedded Redis. Once the scheduler sees E healthy engines the bench measures the scheduler's
idle CPU for a moment (it probes every engine's health each second), then submits
``groups_per_engine x E`` groups of n samples with the client SDK and reads every one from the
stream, acknowledging it. The load grows with the fleet, so ideal scaling is groups/s growing
as E and the scheduler's CPU per group staying flat.

Per row: the makespan (submit to last group read) in wall seconds and, divided by
``time_scale``, in simulated seconds; delivered groups and output tokens per simulated second;
the scheduler process's CPU seconds (user + system, psutil) per delivered group and its idle
CPU share; the fleet process's CPU per group; the Chunk and Complete messages the engines sent
per group; the engines' busy share (simulated busy seconds over E x simulated makespan); the
fleet's start time and peak memory; and how far the fleet fell behind real time (a fleet that
cannot keep up runs slower than the hardware it simulates, so its simulated rates are too low:
the row says so). Ratios are against the first row of the same policy (the smallest fleet)
and, with several policies, against the first policy's row of the same fleet size.

With ``--publish-weights``, once half of the groups are read the bench publishes policy version
1 with a weights folder (``publish_version(1, weights_path=...)``): every engine pauses for its
profile's ``weights_load_s`` and recomputes its running samples, and the call returns once all
have loaded. The row gives that call's wall time, its share beyond the load itself (the
scheduler's fan-out of Stats and UpdateWeights, and the engines' step in flight), and the
delivered tokens labelled version 1 (made after the load). With ``--publish-version`` the
publish has no weights (the trainer updated the engines its own way): the scheduler asks every
engine running the run's samples how many tokens each has made (Stats with progress), so that
those count as version 0 whenever they arrive; the row gives that call's wall time.

A policy named ``NAME+stream`` runs ``NAME`` with the groups submitted with ``stream_samples``:
the row counts the samples stream's entries (one per sample, or it fails) and gives how long
before its group's entry a sample finished, on average (``sample lead``, simulated seconds);
beside the plain row, what streaming costs the scheduler.

Engine time and everything the engines compute is simulated (the profile's hardware) and
labelled so; the scheduler, Redis, the SDK and every message between them are real.
"""

from __future__ import annotations

import json
import math
import random
import re
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = [
    "FleetConfig",
    "FleetRow",
    "prompt_groups",
    "run_fleet",
    "start_fleet",
    "start_scheduler",
    "wait_ready",
    "wait_registered",
]

FLEET_START_TIMEOUT_S = 300.0
REGISTER_TIMEOUT_S = 120.0
SCHEDULER_START_TIMEOUT_S = 60.0
CONSUME_TIMEOUT_S = 3600.0
IDLE_PROBE_S = 2.0
"""Seconds of an idle scheduler (engines registered, nothing queued) whose CPU is measured."""
SUBMIT_BATCH = 1000
PROMPT_LEN_MEDIAN = 400
PROMPT_LEN_SIGMA = 0.5
PROMPT_LEN_MAX = 4096
PROMPT_VOCAB = 32000
LAG_WARNING_SHARE = 0.01
"""Warn when the fleet fell behind real time by more than this share of the makespan."""
STREAM = "+stream"
"""Suffix of a policy's name: its row submits the groups with ``stream_samples`` (each sample
also written to the samples stream as it finishes); side by side with the plain name, the
rows show what that costs the scheduler and how long before its group a sample is there."""
_READY = re.compile(r"rollserve-sim ready .*start_s=(?P<start>[\d.]+) rss_mb=(?P<rss>[\d.]+)")


@dataclass(frozen=True)
class FleetConfig:
    engines: tuple[int, ...] = (8, 64, 512)
    groups_per_engine: int = 2
    n: int = 4
    time_scale: float = 4.0
    policies: tuple[str, ...] = ("least_outstanding",)
    profile: str = "gpu-h100-llama8b"
    response_median: float = 150.0
    max_tokens: int = 1024
    seed: int = 0
    publish_weights: bool = False  # publish a new version with weights half way (see above)
    publish_version: bool = False  # publish a new version without weights half way
    json_path: Path | None = None
    run_dir: Path | None = None


@dataclass(frozen=True)
class FleetRow:
    policy: str
    engines: int
    groups: int
    samples: int
    output_tokens: int
    makespan_wall_s: float
    makespan_simulated_s: float
    groups_per_simulated_s: float
    tokens_per_simulated_s: float
    scheduler_cpu_s: float
    scheduler_cpu_ms_per_group: float
    scheduler_cpu_ms_per_group_net: float  # less its idle rate over the makespan
    scheduler_cpu_share: float  # of one core, during the makespan
    scheduler_idle_cpu_share: float
    fleet_cpu_ms_per_group: float
    chunks_per_group: float
    engine_busy_share: float
    prefix_hit_rate: float
    preemptions: int
    fleet_start_s: float
    fleet_rss_mb: float
    fleet_behind_s: float  # real seconds the most-behind engine gave up
    fleet_max_lag_ms: float
    fleet_kept_up: bool
    # With publish_weights or publish_version: the publish call's wall seconds, how many
    # engines loaded weights, and the delivered tokens labelled with the new version.
    publish_wall_s: float | None = None
    publish_engines_updated: int = 0
    new_version_tokens: int = 0
    # A +stream row: the samples in the run's samples stream, and how long before its group's
    # entry a sample finished, on average (simulated seconds): what a reader of the samples
    # stream gains over one of the groups stream.
    samples_streamed: int = 0
    sample_lead_simulated_s: float | None = None


def run_fleet(cfg: FleetConfig, console: Console | None = None) -> dict[str, Any]:
    from rollserve.cli.redis_server import EmbeddedRedis
    from rollserve.sim.profile import load_profile

    if cfg.publish_weights and cfg.publish_version:
        raise ValueError("publish_weights and publish_version: give one (a row publishes once)")
    console = console or Console(width=200)
    profile = load_profile(cfg.profile)
    console.print(
        f"[bold]SIMULATED engines[/bold]: {profile.name} ({profile.simulated_hardware}); "
        f"time_scale {cfg.time_scale:g} (real s per simulated s). Real: scheduler "
        f"({', '.join(cfg.policies)}), Redis, SDK.\n  {cfg.groups_per_engine} groups x {cfg.n} "
        "per engine, "
        f"response median {cfg.response_median:g} tokens, max_tokens {cfg.max_tokens}"
    )
    rows: list[FleetRow] = []
    with tempfile.TemporaryDirectory(prefix="rollserve-bench-fleet-") as tmp:
        run_dir = cfg.run_dir or Path(tmp)
        run_dir.mkdir(parents=True, exist_ok=True)
        with EmbeddedRedis() as redis_server:
            for engines in cfg.engines:
                for policy in cfg.policies:
                    log_dir = run_dir / f"e{engines}-{policy}"
                    row = _run_row(cfg, policy, engines, redis_server.url, log_dir)
                    rows.append(row)
                    console.print(
                        f"  {engines} engines, {policy}: {row.groups} groups in "
                        f"{row.makespan_wall_s:.1f} s wall = {row.makespan_simulated_s:.1f} s "
                        "simulated"
                    )
                if not row.fleet_kept_up:
                    console.print(
                        f"  [yellow]the fleet fell {row.fleet_behind_s:.1f} s behind real time: "
                        "its simulated rates are understated; raise --time-scale[/yellow]"
                    )
    load_wall_s = profile.weights_load_s * cfg.time_scale if cfg.publish_weights else 0.0
    console.print(_table(rows, profile.name, load_wall_s))
    out: dict[str, Any] = {
        "simulated": True,
        "note": "engine time is simulated (the profile's hardware); scheduler, Redis, SDK real",
        "profile": profile.name,
        "simulated_hardware": profile.simulated_hardware,
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("json_path", "run_dir")},
        "rows": [asdict(r) for r in rows],
    }
    if cfg.json_path is not None:
        cfg.json_path.parent.mkdir(parents=True, exist_ok=True)
        cfg.json_path.write_text(json.dumps(out, indent=2) + "\n")
        console.print(f"wrote {cfg.json_path}")
    return out


def _table(rows: list[FleetRow], profile: str, load_wall_s: float = 0.0) -> Table:
    table = Table(title=f"real scheduler on sim fleets ({profile}, SIMULATED engines, one run)")
    smallest: dict[str, FleetRow] = {}  # policy -> its first row
    first_policy: dict[int, FleetRow] = {}  # engines -> the first policy's row
    for r in rows:
        smallest.setdefault(r.policy, r)
        first_policy.setdefault(r.engines, r)
    several = len(smallest) > 1
    versus = f"vs {rows[0].engines if rows else '-'}"
    columns = (
        "engines",
        "policy",
        "groups",
        "makespan sim s",
        "groups/sim s",
        versus,
        f"vs {rows[0].policy}" if several else "",
        "tokens/sim s",
        "sched CPU ms/group (net of idle)",
        versus,
        "sched CPU busy / idle",
        "fleet CPU ms/group",
        "chunks/group",
        "engine busy",
        "fleet start s / MB",
        "fleet behind real s",
        "publish wall s (beyond load)" if any(r.publish_wall_s is not None for r in rows) else "",
        "sample lead sim s" if any(r.sample_lead_simulated_s is not None for r in rows) else "",
    )
    for column in columns:
        if column:
            table.add_column(column, justify="right")
    for r in rows:
        base = smallest[r.policy]
        versus_policy = r.groups_per_simulated_s / first_policy[r.engines].groups_per_simulated_s
        table.add_row(
            str(r.engines),
            r.policy,
            str(r.groups),
            f"{r.makespan_simulated_s:.1f}",
            f"{r.groups_per_simulated_s:.2f}",
            f"{r.groups_per_simulated_s / base.groups_per_simulated_s:.2f}x",
            *([f"{versus_policy:.2f}x"] if several else []),
            f"{r.tokens_per_simulated_s:,.0f}",
            f"{r.scheduler_cpu_ms_per_group:.2f} ({r.scheduler_cpu_ms_per_group_net:.2f})",
            f"{r.scheduler_cpu_ms_per_group / base.scheduler_cpu_ms_per_group:.2f}x",
            f"{r.scheduler_cpu_share:.0%} / {r.scheduler_idle_cpu_share:.0%}",
            f"{r.fleet_cpu_ms_per_group:.2f}",
            f"{r.chunks_per_group:.1f}",
            f"{r.engine_busy_share:.1%}",
            f"{r.fleet_start_s:.2f} / {r.fleet_rss_mb:.0f}",
            f"{r.fleet_behind_s:.2f}" + ("" if r.fleet_kept_up else " (!)"),
            *([_publish_cell(r, load_wall_s)] if columns[-2] else []),
            *([_lead_cell(r)] if columns[-1] else []),
        )
    return table


def _lead_cell(row: FleetRow) -> str:
    if row.sample_lead_simulated_s is None:
        return "-"
    return f"{row.sample_lead_simulated_s:.2f}"


def _publish_cell(row: FleetRow, load_wall_s: float) -> str:
    if row.publish_wall_s is None:
        return "-"
    return f"{row.publish_wall_s:.2f} ({row.publish_wall_s - load_wall_s:+.2f})"


def prompt_groups(
    cfg: FleetConfig, count: int, stream_samples: bool = False, prefix: str = "g"
) -> list[Any]:
    """``count`` groups of ``cfg.n`` samples, random prompts of log-normal lengths (ids
    ``<prefix><i>``)."""
    from rollserve.client import PromptGroup, SamplingParams

    rng = random.Random(cfg.seed)
    groups = []
    for g in range(count):
        length = round(PROMPT_LEN_MEDIAN * math.exp(PROMPT_LEN_SIGMA * rng.gauss(0, 1)))
        length = min(PROMPT_LEN_MAX, max(16, length))
        groups.append(
            PromptGroup(
                group_id=f"{prefix}{g}",
                prompt_token_ids=[rng.randrange(PROMPT_VOCAB) for _ in range(length)],
                n=cfg.n,
                sampling=SamplingParams(max_tokens=cfg.max_tokens, seed=g * cfg.n),
                prompt_key=f"{prefix}p{g}",
                stream_samples=stream_samples,
            )
        )
    return groups


def _run_row(
    cfg: FleetConfig, policy: str, engines: int, redis_url: str, log_dir: Path
) -> FleetRow:
    import psutil
    from rollserve.cli.stack import ManagedProcess
    from rollserve.client import GroupStatus, RolloutClient

    log_dir.mkdir(parents=True, exist_ok=True)
    scheduler = start_scheduler(
        policy.removesuffix(STREAM), redis_url, log_dir, ("--max-n", str(max(64, cfg.n)))
    )
    fleet: ManagedProcess | None = None
    stats_path = log_dir / "fleet-stats.json"
    try:
        fleet = start_fleet(cfg, engines, scheduler.address, stats_path, log_dir)
        start_s, rss_mb = wait_ready(fleet)
        count = cfg.groups_per_engine * engines
        streaming = policy.endswith(STREAM)
        groups = prompt_groups(cfg, count, streaming)
        leads: list[float] = []
        sched_proc = psutil.Process(scheduler.popen.pid)
        fleet_proc = psutil.Process(fleet.popen.pid)
        with RolloutClient(scheduler.address, redis_url, f"fleet-{uuid.uuid4().hex[:8]}") as client:
            wait_registered(client, engines, fleet)
            idle_before = _cpu_s(sched_proc)
            time.sleep(IDLE_PROBE_S)
            idle_share = (_cpu_s(sched_proc) - idle_before) / IDLE_PROBE_S
            sched_before, fleet_before = _cpu_s(sched_proc), _cpu_s(fleet_proc)
            started = time.monotonic()
            for i in range(0, count, SUBMIT_BATCH):
                client.submit(groups[i : i + SUBMIT_BATCH])
            seen: set[str] = set()
            samples = tokens = new_tokens = 0
            publish: tuple[float, int] | None = None
            for item in client.groups(limit=count, timeout_s=CONSUME_TIMEOUT_S):
                result = item.result
                if result.group_id in seen:
                    raise RuntimeError(f"group {result.group_id} delivered twice")
                if result.status != GroupStatus.DELIVERED or len(result.samples) != cfg.n:
                    raise RuntimeError(
                        f"group {result.group_id}: {result.status} with "
                        f"{len(result.samples)} samples: {result.error}"
                    )
                seen.add(result.group_id)
                if streaming:
                    leads += (result.finished_at - s.finished_at for s in result.samples)
                samples += len(result.samples)
                tokens += sum(len(s.token_ids) for s in result.samples)
                new_tokens += sum(v.length for s in result.samples for v in s.versions if v.version)
                item.done()
                publishing = cfg.publish_weights or cfg.publish_version
                if publishing and publish is None and len(seen) * 2 >= count:
                    publish = _publish(client, engines, log_dir, weights=cfg.publish_weights)
            wall_s = time.monotonic() - started
            sched_cpu = _cpu_s(sched_proc) - sched_before
            fleet_cpu = _cpu_s(fleet_proc) - fleet_before
            streamed = _samples_streamed(redis_url, client.run_id) if streaming else 0
        if streaming and streamed != samples:
            raise RuntimeError(f"{streamed} samples in the samples stream, {samples} delivered")
        if len(seen) != count:
            raise RuntimeError(
                f"{engines} engines: {len(seen)} of {count} groups arrived within "
                f"{CONSUME_TIMEOUT_S:.0f} s; logs in {log_dir}"
            )
    finally:
        if fleet is not None:
            fleet.stop()
        scheduler.stop()
    totals = json.loads(stats_path.read_text())
    simulated_s = wall_s / cfg.time_scale
    behind_s = float(totals["behind_s_max"])
    return FleetRow(
        policy=policy,
        engines=engines,
        groups=count,
        samples=samples,
        output_tokens=tokens,
        makespan_wall_s=wall_s,
        makespan_simulated_s=simulated_s,
        groups_per_simulated_s=count / simulated_s,
        tokens_per_simulated_s=tokens / simulated_s,
        scheduler_cpu_s=sched_cpu,
        scheduler_cpu_ms_per_group=sched_cpu / count * 1000,
        scheduler_cpu_ms_per_group_net=max(0.0, sched_cpu - idle_share * wall_s) / count * 1000,
        scheduler_cpu_share=sched_cpu / wall_s,
        scheduler_idle_cpu_share=idle_share,
        fleet_cpu_ms_per_group=fleet_cpu / count * 1000,
        chunks_per_group=totals["chunks"] / count,
        engine_busy_share=totals["busy_simulated_s"] / (engines * simulated_s),
        prefix_hit_rate=totals["cached_prompt_tokens"] / max(1, totals["prompt_tokens"]),
        preemptions=totals["preemptions"],
        fleet_start_s=start_s,
        fleet_rss_mb=rss_mb,
        fleet_behind_s=behind_s,
        fleet_max_lag_ms=float(totals["max_lag_s"]) * 1000,
        fleet_kept_up=behind_s <= LAG_WARNING_SHARE * wall_s,
        publish_wall_s=None if publish is None else publish[0],
        publish_engines_updated=0 if publish is None else publish[1],
        new_version_tokens=new_tokens,
        samples_streamed=streamed,
        sample_lead_simulated_s=(
            statistics.fmean(leads) / cfg.time_scale if streaming and leads else None
        ),
    )


def start_scheduler(policy: str, redis_url: str, log_dir: Path, extra: tuple[str, ...] = ()) -> Any:
    """The real scheduler (``python -m rollserve.scheduler``) on ``redis_url`` with no engines
    at start and a length history of its own, serving; its ``address`` set."""
    from rollserve.cli.stack import ManagedProcess, free_port, wait_serving

    port = free_port()
    scheduler = ManagedProcess.start(
        "scheduler",
        [
            sys.executable,
            "-m",
            "rollserve.scheduler",
            "--port",
            str(port),
            "--redis-url",
            redis_url,
            "--policy",
            policy,
            "--predictor-namespace",
            f"bench-fleet-{uuid.uuid4().hex[:8]}",
            # Rows share one Redis: a row's engines must not load an earlier row's weights.
            "--forget-fleet-weights",
            *extra,
        ],
        log_dir,
    )
    scheduler.address = f"127.0.0.1:{port}"
    try:
        wait_serving(scheduler.address, SCHEDULER_START_TIMEOUT_S, scheduler)
    except BaseException:
        scheduler.stop()
        raise
    return scheduler


def start_fleet(
    cfg: FleetConfig, engines: int, scheduler_address: str, stats_path: Path, log_dir: Path
) -> Any:
    """A sim fleet process of ``engines`` engines (``cfg``'s profile, time scale, response
    lengths and seed) that register with the scheduler; its totals go to ``stats_path``."""
    from rollserve.cli.stack import ManagedProcess

    return ManagedProcess.start(
        "fleet",
        [
            sys.executable,
            "-m",
            "rollserve.sim",
            "fleet",
            "--engines",
            str(engines),
            "--profile",
            cfg.profile,
            "--time-scale",
            str(cfg.time_scale),
            "--response-median",
            str(cfg.response_median),
            "--seed",
            str(cfg.seed),
            "--scheduler-address",
            scheduler_address,
            "--stats-path",
            str(stats_path),
        ],
        log_dir,
    )


def _samples_streamed(redis_url: str, run_id: str) -> int:
    import redis
    from rollserve.client.wire import samples_stream_key

    client = redis.Redis.from_url(redis_url)
    try:
        return int(client.xlen(samples_stream_key(run_id)))
    finally:
        client.close()


def _publish(client: Any, engines: int, log_dir: Path, *, weights: bool) -> tuple[float, int]:
    """Publishes version 1, with a weights folder the sim engines accept (they read nothing
    in it) or without; returns the call's wall seconds and how many engines loaded weights."""
    path = ""
    if weights:
        folder = log_dir / "weights-v1"
        folder.mkdir(exist_ok=True)
        (folder / "model.safetensors").write_bytes(b"")
        path = str(folder)
    start = time.monotonic()
    result = client.publish_version(1, weights_path=path)
    wall_s = time.monotonic() - start
    if result.engines_failed or result.engines_updated != (engines if weights else 0):
        raise RuntimeError(
            f"{engines} engines: {result.engines_updated} loaded the weights; failed: "
            f"{result.engines_failed}"
        )
    return wall_s, result.engines_updated


def _cpu_s(process: Any) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def wait_ready(fleet: Any) -> tuple[float, float]:
    """Waits for the fleet's ready line; returns its start seconds and peak memory (MB)."""
    from rollserve.cli.stack import StackError

    deadline = time.monotonic() + FLEET_START_TIMEOUT_S
    while True:
        match = _READY.search(fleet.log_tail(1 << 20))
        if match:
            return float(match["start"]), float(match["rss"])
        if fleet.popen.poll() is not None or time.monotonic() > deadline:
            raise StackError(
                f"the sim fleet did not start; log {fleet.log_path}:\n{fleet.log_tail()}"
            )
        time.sleep(0.1)


def wait_registered(client: Any, engines: int, fleet: Any) -> None:
    """Waits until the scheduler sees every engine of the fleet healthy."""
    from rollserve.cli.stack import StackError

    deadline = time.monotonic() + REGISTER_TIMEOUT_S
    while (healthy := client.status().healthy_engines) < engines:
        if fleet.popen.poll() is not None or time.monotonic() > deadline:
            raise StackError(
                f"{healthy} of {engines} sim engines healthy at the scheduler; "
                f"fleet log {fleet.log_path}:\n{fleet.log_tail()}"
            )
        time.sleep(0.2)
