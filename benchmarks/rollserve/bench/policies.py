"""``rollserve bench policies``: scheduling policies side by side, in the discrete-event mode.

Every policy runs the same scenario (the same groups with the same true lengths, the same
simulated engines) through :mod:`rollserve.sim.des`, which calls the policy code the scheduler
runs. ``oracle`` is the ``rl`` policy given every sample's true length: the bound of what
placement can do; ``oracle_group`` is ``rl`` given each group's true mean length, the bound of
what any length predictor can give it (a prompt's samples still vary). ``rl_moves`` also moves
running samples apart, by the predictor's remaining lengths; ``rl_moves_told`` does the same
told each running sample's true tokens left, off by a log-error of ``told_noise`` (what the
moves would give with a per-sample predictor of that quality; ``move_gain`` sets both rows'
threshold). ``rl`` gets the length predictor, which has seen ``warm_steps`` earlier steps of
the scenario (a run in progress; 0 starts it cold); the baselines use no prediction, as the
systems they stand for. ``rl`` and the oracles use the simulated profile's step costs as their
cost model.

A policy's name with ``+spec`` (``rl+spec``, ``round_robin+spec``) runs it on engines that
speculate (``PoliciesConfig.spec``: a model-free drafter, in the tail of a step; see
:mod:`rollserve.sim.profile`); the plain names run without, as the systems they stand for do, so
one table shows what the placement gives and what speculation adds, and ``vs_round_robin`` is
always over plain ``round_robin``.

Synchronous by default (every group of a step delivered); with ``oversample`` the trainer's
batch is over-sampled and the tail carried over within ``max_staleness`` policy versions
(:func:`rollserve.sim.des.run_des_async`), and a synchronous ``round_robin`` run of the same
steps is the reference of ``vs_sync_round_robin``.

The table and the JSON give, per policy: mean step makespan, groups and output tokens per
second, bubble ratio (1 - busy engine-time / (engines x time)), tail time (while only the last
10% of a step's samples run), prefix-cache hit rate, preemptions and recomputed tokens, the
off-policy token fraction and the largest staleness delivered, the predictor's mean absolute
error and tail-ranking AUC (of the predictions samples were placed with), the decision cost,
and ``vs_round_robin`` (groups/s over round_robin's in the same mode). PNGs: an engine timeline
per policy and the length distribution. Everything here is simulated and labelled so.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from rollserve.scheduler.core.policy import Policy
    from rollserve.sim.des import Due, Oracle, RunResult, Tail
    from rollserve.sim.profile import CostProfile, SpecDecoding
    from rollserve.sim.scenarios import SimGroup

BASELINE = "round_robin"
ORACLE = "oracle"  # rl with every sample's true length instead of predictions
GROUP_ORACLE = "oracle_group"  # rl with each group's true mean length: a perfect predictor
RL_MOVES = "rl_moves"  # rl that also moves running samples apart (Plan.preempts); off in rl
# rl_moves told each running sample's true tokens left (off by PoliciesConfig.told_noise): what
# the moves could do with a per-sample remaining-length predictor of that quality.
RL_MOVES_TOLD = "rl_moves_told"
SPEC = "+spec"  # suffix of a policy's name: its row runs on engines that speculate
DEFAULT_POLICIES = ("round_robin", "least_loaded", "cache_aware", "rl", GROUP_ORACLE, ORACLE)
_ORACLES: dict[str, Oracle] = {ORACLE: "sample", GROUP_ORACLE: "group"}
# Policies that are given predictions (the others ignore them, as the systems they stand for).
_PREDICTED = {"rl", RL_MOVES, RL_MOVES_TOLD}
_MOVING = {RL_MOVES, RL_MOVES_TOLD}


@dataclass(frozen=True)
class PoliciesConfig:
    scenario: str = "S1"
    steps: int | None = None
    engines: int | None = None
    profile: str | None = None  # a shipped profile's name or a TOML file; None: the scenario's
    policies: tuple[str, ...] = DEFAULT_POLICIES
    warm_steps: int = 1
    predictor_default_len: int | None = None  # the predictor's prior mean; None: its default
    oversample: float | None = None  # None: synchronous steps
    max_staleness: int = 1
    tail: Tail = "carry"  # over-sampled runs: carry the rest over, or defer it to long rounds
    due: Due = "tokens"  # carried groups are due by their oldest tokens, or by launch (the SDK)
    weight_updates: bool = False  # engines load each new version's weights (DesConfig)
    spec: SpecDecoding | None = None  # the speculative decoding of the "+spec" rows
    move_gain: float | None = None  # the moving rows' RLSettings.move_gain (None: its default)
    told_noise: float = 0.0  # rl_moves_told: log-error sd of the remaining lengths it is told
    told_seed: int = 0  # rl_moves_told: the draw of those errors
    shared_history: bool = False  # the drafters' history: every engine's outputs (DesConfig)
    json_path: Path | None = None
    out_dir: Path = Path("bench-policies")


def rl_policy_for(
    profile: CostProfile, *, moves: bool = False, move_gain: float | None = None
) -> Policy:
    """The rl policy with the simulated engines' step costs as its cost model; with
    ``moves``, moving running samples too (each move saving ``move_gain`` of the busiest
    engine's time, when given)."""
    from rollserve.scheduler.core.policies.rl import RLPolicy
    from rollserve.sim.profile import rl_settings

    settings = replace(rl_settings(profile), move_running=moves)
    if move_gain is not None:
        settings = replace(settings, move_gain=move_gain)
    return RLPolicy(settings)


def run_policies(cfg: PoliciesConfig, console: Console | None = None) -> dict[str, Any]:
    from rollserve.scheduler.core.policy import create_policy
    from rollserve.scheduler.core.predictor import LengthPredictor, PredictorSettings
    from rollserve.sim.des import DesConfig, run_des, run_des_async
    from rollserve.sim.profile import load_profile
    from rollserve.sim.scenarios import load_scenario

    # Wide enough for the table's columns even when stdout is not a terminal.
    console = console or Console(width=190)
    from rollserve.scheduler.core.policy import policy_names

    known = (*policy_names(), RL_MOVES, RL_MOVES_TOLD, *_ORACLES)
    unknown = [name for name in cfg.policies if name.removesuffix(SPEC) not in known]
    if unknown:
        raise ValueError(
            f"policies {unknown} unknown; known: {', '.join(known)}, each also as NAME{SPEC} "
            "(on speculating engines)"
        )
    if cfg.predictor_default_len is not None and cfg.predictor_default_len < 1:
        raise ValueError(f"predictor_default_len ({cfg.predictor_default_len}) must be >= 1 token")
    if cfg.move_gain is not None and not 0 < cfg.move_gain < 1:
        raise ValueError(f"move_gain ({cfg.move_gain}) must be in (0, 1)")
    if not (math.isfinite(cfg.told_noise) and cfg.told_noise >= 0):
        raise ValueError(f"told_noise ({cfg.told_noise}) must be a finite log-error sd >= 0")
    if cfg.oversample is not None and cfg.oversample > 1 and cfg.tail == "carry":
        raise ValueError(
            f"oversample ({cfg.oversample:g}) must be at most 1 when the tail is carried (a "
            "step would have to deliver more than its batch); use --tail batch for more"
        )
    speculating = [name for name in cfg.policies if name.endswith(SPEC)]
    if speculating and cfg.spec is None:
        raise ValueError(
            f"{', '.join(speculating)} run on engines that speculate: give the speculative "
            "decoding (--spec-accept, the mean tokens a verification pass advances a sequence; "
            "--spec-tokens, --spec-max-batch)"
        )
    scenario = load_scenario(cfg.scenario)
    if cfg.engines is not None:
        scenario = replace(scenario, engines=cfg.engines)
    if cfg.profile is not None:
        scenario = replace(scenario, profile=cfg.profile)
    measured = cfg.steps or scenario.steps
    over = cfg.oversample
    # Over-sampled runs draw more groups than they deliver: enough scenario steps to feed them.
    drawn = measured if over is None else math.ceil(measured * (1 + over)) + 2
    scenario = replace(scenario, steps=cfg.warm_steps + drawn)
    profile = load_profile(scenario.profile)
    all_steps = scenario.steps_of_groups()
    history, steps = all_steps[: cfg.warm_steps], all_steps[cfg.warm_steps :]
    sync_steps = steps[:measured]
    lengths = [n for groups in sync_steps for g in groups for n in g.output_lens]
    median = statistics.median(lengths)
    mode = (
        "synchronous: every group of a step delivered"
        if over is None
        else f"over-sampled by {over:g}, the rest carried over within {cfg.max_staleness} "
        f"version(s), due by {'launch' if cfg.due == 'launch' else 'their oldest tokens'}"
        if cfg.tail == "carry"
        else f"over-sampled by {over:g}, the rest stopped and batched into long rounds"
    )
    if cfg.weight_updates:
        mode += (
            f"; each new version's weights loaded by every engine ({profile.weights_load_s:g} s "
            "pause, running samples recomputed, prefix cache emptied)"
        )
    console.print(
        f"[bold]SIMULATED[/bold] {scenario.name}: {scenario.description}\n"
        f"  {scenario.engines} engines of {profile.name} ({profile.simulated_hardware}); "
        f"{measured} step(s) of {scenario.groups_per_step} groups x {scenario.n}, {mode}; "
        f"the predictor saw {cfg.warm_steps} earlier step(s) of history\n"
        f"  response length median {median:.0f}, max {max(lengths)} "
        f"(max/median {max(lengths) / median:.1f})"
    )
    spec_profile = profile.with_spec(cfg.spec)
    if speculating and cfg.spec is not None:
        console.print(
            f"  {', '.join(speculating)}: engines speculate ({cfg.spec.describe()}; "
            f"drafting {cfg.spec.draft_s * 1e6:g} µs a sequence a pass, "
            f"{cfg.spec.pass_s * 1e3:g} ms a pass for the speculative path, "
            + (
                "a draft token as a decoded sequence"
                if cfg.spec.token_s is None
                else f"{cfg.spec.token_s * 1e6:g} µs a draft token"
            )
            + ")"
        )

    def predictor() -> LengthPredictor:
        p = LengthPredictor(
            PredictorSettings()
            if cfg.predictor_default_len is None
            else PredictorSettings(default_len=cfg.predictor_default_len)
        )
        for groups in history:
            for g in groups:
                for length in g.output_lens:
                    p.observe(g.prompt_key, length, g.epoch, g.prompt_len)
        return p

    stream = [g for groups in steps for g in groups]
    des_cfg = DesConfig(weight_updates=cfg.weight_updates, shared_history=cfg.shared_history)
    told_cfg = replace(des_cfg, told_remaining=cfg.told_noise, told_seed=cfg.told_seed)
    results: dict[str, RunResult] = {}
    for name in cfg.policies:
        plain = name.removesuffix(SPEC)
        engine = spec_profile if name.endswith(SPEC) else profile
        policy = (
            rl_policy_for(profile, moves=plain in _MOVING, move_gain=cfg.move_gain)
            if plain in _PREDICTED or plain in _ORACLES
            else create_policy(plain)
        )
        kwargs: dict[str, Any] = {
            "predictor": predictor() if plain in _PREDICTED else None,
            "oracle": _ORACLES.get(plain),
            "cfg": told_cfg if plain == RL_MOVES_TOLD else des_cfg,
        }
        if over is None:
            results[name] = run_des(sync_steps, policy, engine, scenario.engines, **kwargs)
        else:
            results[name] = run_des_async(
                stream,
                policy,
                engine,
                scenario.engines,
                batch=scenario.groups_per_step,
                steps=measured,
                oversample=over,
                max_staleness=cfg.max_staleness,
                tail=cfg.tail,
                due=cfg.due,
                **kwargs,
            )
        console.print(f"  ran {name}")
    sync_base = None
    if over is not None:
        sync_base = run_des(
            sync_steps,
            create_policy(BASELINE),
            profile,
            scenario.engines,
            cfg=des_cfg,
            keep_timeline=False,
        )
        console.print(f"  ran synchronous {BASELINE} (the reference of vs_sync_round_robin)")
    base = results.get(BASELINE)
    out = _report(
        cfg,
        scenario.name,
        profile=profile.name,
        engines=scenario.engines,
        results=results,
        base=base,
        sync_base=sync_base,
    )
    out.update(length_median=median, length_max=max(lengths), steps=measured)
    # What no placement can beat: the longest sample of a step, alone on an engine, takes its
    # solo time; a group may span at most max_staleness + 1 steps.
    spans = 1 if over is None or cfg.tail == "batch" else cfg.max_staleness + 1
    floor = statistics.fmean(_solo_s(groups, profile) for groups in sync_steps) / spans
    reference = sync_base or base
    out["step_floor_s"] = floor
    out["max_vs_sync_round_robin"] = reference.makespan_s / floor if reference else None
    console.print(_table(scenario.name, results, base, sync_base))
    console.print(
        f"floor: the longest sample of a step alone on an engine takes {floor * spans:.1f} s"
        + (f", over {spans} steps {floor:.1f} s a step" if spans > 1 else "")
        + f"; no policy beats {_times(out['max_vs_sync_round_robin'])} synchronous {BASELINE}"
    )
    if speculating and cfg.spec is not None:
        # The floor: each sample at the best acceptance any sample gets.
        best = replace(cfg.spec, accept_len=max((cfg.spec.accept_len, *cfg.spec.accept_by_history)))
        floor_profile = profile.with_spec(replace(best, accept_by_history=()))
        spec_floor = (
            statistics.fmean(_solo_s(groups, floor_profile) for groups in sync_steps) / spans
        )
        out["spec"] = {
            "draft_tokens": cfg.spec.draft_tokens,
            "accept_len": cfg.spec.accept_len,
            "max_batch": cfg.spec.max_batch,
            "draft_s": cfg.spec.draft_s,
            "pass_s": cfg.spec.pass_s,
            "token_s": cfg.spec.token_s,
            "drafted": cfg.spec.drafted,
            "accept_by_history": list(cfg.spec.accept_by_history),
            "history_outputs": cfg.spec.history_outputs,
            "rows": speculating,
        }
        out["step_floor_spec_s"] = spec_floor
        out["max_spec_vs_sync_round_robin"] = (
            reference.makespan_s / spec_floor if reference else None
        )
        pays = profile.with_spec(replace(cfg.spec, accept_by_history=())).spec_pays_up_to()
        out["spec"]["pays_up_to"] = pays
        console.print(
            f"floor with speculation: {spec_floor * spans:.1f} s; no speculating policy beats "
            f"{_times(out['max_spec_vs_sync_round_robin'])} synchronous {BASELINE}\n"
            f"speculation at {cfg.spec.accept_len:g} tokens a pass costs less a token than "
            + (
                f"plain decoding in steps of up to {pays} sequences (--spec-max-batch {pays})"
                if pays
                else "plain decoding in no step on these costs"
            )
        )
    figures = _figures(results, lengths, cfg.out_dir, scenario.name)
    out["figures"] = [str(p) for p in figures]
    for path in figures:
        console.print(f"wrote {path}")
    if cfg.json_path is not None:
        cfg.json_path.parent.mkdir(parents=True, exist_ok=True)
        cfg.json_path.write_text(json.dumps(out, indent=2) + "\n")
        console.print(f"wrote {cfg.json_path}")
    return out


def _solo_s(groups: list[SimGroup], profile: CostProfile) -> float:
    """Simulated time of the step's longest sample alone on one engine."""
    from rollserve.sim.engine_model import SimEngine, SimRequest

    longest = max(groups, key=lambda g: min(max(g.output_lens), g.max_tokens))
    engine = SimEngine("solo", profile)
    engine.add(SimRequest("solo", longest.prompt_len, max(longest.output_lens), longest.max_tokens))
    total = 0.0
    while engine.has_work():
        total += engine.step().duration_s
    return total


def _ratio(r: RunResult, ref: RunResult | None) -> float | None:
    """groups/s over the reference's; None (null in the JSON, "-" in the table) when the
    reference did not run."""
    return r.groups_per_s / ref.groups_per_s if ref is not None else None


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _report(
    cfg: PoliciesConfig,
    scenario: str,
    *,
    profile: str,
    engines: int,
    results: dict[str, RunResult],
    base: RunResult | None,
    sync_base: RunResult | None,
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "simulated": True,
        "scenario": scenario,
        "profile": profile,
        "engines": engines,
        "warm_steps": cfg.warm_steps,
        "predictor_default_len": cfg.predictor_default_len,
        "oversample": cfg.oversample,
        "max_staleness": cfg.max_staleness if cfg.oversample is not None else 0,
        "tail": cfg.tail if cfg.oversample is not None else None,
        "due": cfg.due if cfg.oversample is not None else None,
        "weight_updates": cfg.weight_updates,
        "move_gain": cfg.move_gain,
        "told_noise": cfg.told_noise,
        "told_seed": cfg.told_seed,
        "shared_history": cfg.shared_history,
        "policies": {},
    }
    if sync_base is not None:
        out["sync_round_robin_groups_per_s"] = sync_base.groups_per_s
    for name, r in results.items():
        entry = {
            "makespan_s": r.makespan_s,
            "groups_per_s": r.groups_per_s,
            "output_tokens_per_s": r.output_tokens_per_s,
            "bubble_ratio": r.bubble_ratio,
            "tail_s": r.tail_s,
            "prefix_hit_rate": r.prefix_hit_rate,
            "preemptions": r.preemptions,
            "recomputed_tokens": r.recomputed_tokens,
            "moves": r.moves,
            "moved_tokens": r.moved_tokens,
            "history_hit_rate": r.history_hit_rate,
            "offpolicy_token_fraction": r.offpolicy_token_fraction,
            "max_staleness": r.max_staleness,
            "max_launch_lag": r.max_launch_lag,
            "discarded_token_fraction": r.discarded_token_fraction,
            "decision_us": r.decision_us,
            "predictor_mae": r.predictor_mae,
            "predictor_tail_auc": r.predictor_tail_auc,
            "speculating": name.endswith(SPEC),
            "spec_steps": r.spec_steps,
            "vs_round_robin": _ratio(r, base),
        }
        if sync_base is not None:
            entry["vs_sync_round_robin"] = _ratio(r, sync_base)
        out["policies"][name] = entry
    return out


def _table(
    scenario: str,
    results: dict[str, RunResult],
    base: RunResult | None,
    sync_base: RunResult | None,
) -> Table:
    table = Table(title=f"policies on {scenario} (simulated, one run)")
    columns = [
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
        "stale",
        "discarded",
        "pred MAE",
        "tail AUC",
        "decision µs",
        "vs round_robin",
    ]
    if sync_base is not None:
        columns.append("vs sync rr")
    moving = any(r.moves for r in results.values())
    if moving:  # running samples moved (their tokens prefilled again are in the JSON)
        columns.insert(columns.index("recomputed") + 1, "moves")
    for column in columns:
        if column == "policy":  # whole names: "round_robin+spec" must not be cut
            table.add_column(column, justify="left", no_wrap=True, min_width=16)
        else:
            table.add_column(column, justify="right")
    for name, r in results.items():
        mae, auc = r.predictor_mae, r.predictor_tail_auc
        row = [
            name,
            f"{r.makespan_s:.1f}",
            f"{r.groups_per_s:.3f}",
            f"{r.output_tokens_per_s:,.0f}",
            f"{r.bubble_ratio:.1%}",
            f"{r.tail_s:.1f}",
            f"{r.prefix_hit_rate:.1%}",
            str(r.preemptions),
            f"{r.recomputed_tokens:,}",
            *([str(r.moves)] if moving else []),
            f"{r.offpolicy_token_fraction:.1%}",
            str(r.max_staleness),
            f"{r.discarded_token_fraction:.0%}",
            "-" if mae is None else f"{mae:,.0f}",
            "-" if auc is None else f"{auc:.3f}",
            f"{r.decision_us:,.0f}",
            _times(_ratio(r, base)),
        ]
        if sync_base is not None:
            row.append(_times(_ratio(r, sync_base)))
        table.add_row(*row)
    return table


def _figures(
    results: dict[str, RunResult], lengths: list[int], out_dir: Path, label: str
) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, axes = plt.subplots(len(results), 1, figsize=(9, 1.6 + 1.4 * len(results)), squeeze=False)
    horizon = max(r.total_s for r in results.values())
    for ax, (name, r) in zip(axes[:, 0], results.items(), strict=True):
        grid = _batch_grid(r.timeline, r.engines, horizon)
        # A bin busy for most of its width counts as a batch of at least 1 (bin edges cut steps).
        grid[(grid >= 0.5) & (grid < 1)] = 1.0
        # Log colours from a batch of 1 up, idle (below 1) white: a lone tail sample shows.
        cmap = plt.get_cmap("viridis").with_extremes(under="white")
        image = ax.imshow(
            grid,
            aspect="auto",
            interpolation="nearest",
            extent=(0, horizon, r.engines - 0.5, -0.5),
            cmap=cmap,
            norm=LogNorm(vmin=1, vmax=max(2.0, float(grid.max()))),
        )
        ax.set_ylabel(name, rotation=0, ha="right", va="center")
        ax.set_yticks([])
        fig.colorbar(image, ax=ax, pad=0.01, label="batch")
    axes[-1, 0].set_xlabel("simulated time (s); colour: mean decode batch, log scale (white: idle)")
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
