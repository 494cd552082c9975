"""``rollserve bench bound``: what placement can give a synchronous step without knowing which
sample will be long.

The ``oracle`` of ``rollserve bench policies`` is told every sample's true length, so it can
give the step's longest sample an engine with little else on it. A real scheduler cannot: the
best it can know before a step runs is each prompt's length distribution (its history), and a
group's samples are alike until they run. This command asks how much any placement made from
that knowledge could gain, in expectation over the samples' lengths, and how much the
clairvoyant placement gains on the same draws.

Model (the ``rl`` policy's own cost model, :mod:`rollserve.scheduler.core.policies.rl`): the
samples placed on an engine start together and it finishes after
``T = base_s * max(L) + sum(per_seq_s * L + per_kv_token_s * L * (prompt + L / 2))``; the step
ends with the slowest engine. The coefficients are the scenario profile's. No KV limit, no
engine-side preemption and no prefill: a model of the step's decode, not a simulation (the
discrete-event mode is that).

Knowledge: one step of the scenario (the one ``bench policies`` measures after its warm-up
steps). Each group's samples are drawn again and again from a lognormal around the group's own
log-mean (``log(1 + L)``, the mean of its true samples: what a perfect predictor of the prompt
knows) with the step's pooled within-group log-spread, capped at ``max_tokens``.

Placements, each a count of every group's samples per engine:

- ``spread``: the step's samples dealt over the engines in turn (``round_robin``'s placement;
  ``rl`` makes the same one here, a group's samples being alike);
- ``segregated``: the ``r`` groups of highest log-mean dealt over ``k`` engines of their own,
  the rest over the others; the best ``(k, r)`` of a grid on the search draws;
- ``searched``: from the better of those two, one sample moved between engines at a time while
  the mean makespan over the search draws falls (first improvement, passes until none helps or
  ``max_passes``);
- ``clairvoyant``: on every evaluation draw, ``rl`` told that draw's true lengths (the
  ``oracle``), placing afresh for it.

Every placement is scored on evaluation draws it was not chosen on (the search fits its own
draws). The table gives the expected makespan and the speed over ``spread``: if the best
non-clairvoyant placement is far from the clairvoyant one, no policy that knows only the
prompts' distributions comes within that distance of the oracle.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from rollserve.scheduler.core.policies.rl import RLSettings
    from rollserve.sim.scenarios import SimGroup

SEGREGATED_RISKY = (1, 2, 3, 4, 6, 8, 12, 16)  # the grid's numbers of risky groups
CLAIRVOYANT = "clairvoyant (rl told each draw's lengths)"


@dataclass(frozen=True)
class BoundConfig:
    scenario: str = "S1"
    engines: int | None = None
    warm_steps: int = 1  # the step scored is the one after these (as bench policies)
    draws: int = 200  # evaluation draws; the search uses as many others
    max_passes: int = 8
    seed: int = 0
    json_path: Path | None = None


@dataclass(frozen=True)
class StepModel:
    """One step's groups as the model sees them: per sample its group, prompt length and the
    log-mean and log-spread of its length."""

    group_of: np.ndarray  # [S] group index of each sample
    prompt: np.ndarray  # [S] prompt tokens
    mu: np.ndarray  # [G] log-mean of log(1 + L)
    sd: float  # pooled within-group log-spread
    max_tokens: np.ndarray  # [S]
    true_lens: np.ndarray  # [S] the scenario's own draw

    @classmethod
    def of(cls, groups: list[SimGroup]) -> StepModel:
        ys = [np.log1p(np.asarray(g.output_lens, dtype=float)) for g in groups]
        dof = sum(len(y) - 1 for y in ys)
        scatter = sum(float(((y - y.mean()) ** 2).sum()) for y in ys)
        return cls(
            group_of=np.concatenate([np.full(g.n, i) for i, g in enumerate(groups)]),
            prompt=np.concatenate([np.full(g.n, g.prompt_len, dtype=float) for g in groups]),
            mu=np.array([y.mean() for y in ys]),
            sd=math.sqrt(scatter / dof) if dof > 0 else 0.0,
            max_tokens=np.concatenate([np.full(g.n, g.max_tokens, dtype=float) for g in groups]),
            true_lens=np.concatenate([np.asarray(g.output_lens, dtype=float) for g in groups]),
        )

    @property
    def samples(self) -> int:
        return len(self.group_of)

    def draw(self, rng: np.random.Generator, draws: int) -> np.ndarray:
        """``[draws, S]`` lengths from every sample's distribution."""
        z = rng.standard_normal((draws, self.samples))
        lens = np.expm1(self.mu[self.group_of] + self.sd * z)
        clipped: np.ndarray = np.clip(np.rint(lens), 1, self.max_tokens)
        return clipped


class Makespans:
    """Makespans of a placement (an engine per sample) over a set of draws, kept up to date
    as single samples move (the local search's inner loop)."""

    def __init__(
        self, lens: np.ndarray, model: StepModel, cfg: RLSettings, engine_of: np.ndarray, e: int
    ) -> None:
        self.lens = lens
        self.base = cfg.base_s
        self.work = cfg.per_seq_s * lens + cfg.per_kv_token_s * lens * (model.prompt + lens / 2)
        self.engine_of = engine_of.copy()
        self.members = [list(np.flatnonzero(engine_of == k)) for k in range(e)]
        draws = lens.shape[0]
        self.rest = np.zeros((draws, e))
        self.longest = np.zeros((draws, e))
        for k, members in enumerate(self.members):
            if members:
                self.rest[:, k] = self.work[:, members].sum(axis=1)
                self.longest[:, k] = self.lens[:, members].max(axis=1)

    def mean(self) -> float:
        return float((self.base * self.longest + self.rest).max(axis=1).mean())

    def moved(self, sample: int, target: int) -> float:
        """The mean makespan were ``sample`` on ``target``; changes nothing."""
        source = int(self.engine_of[sample])
        rest = self.rest.copy()
        longest = self.longest.copy()
        rest[:, source] -= self.work[:, sample]
        rest[:, target] += self.work[:, sample]
        others = [s for s in self.members[source] if s != sample]
        longest[:, source] = self.lens[:, others].max(axis=1) if others else 0.0
        longest[:, target] = np.maximum(longest[:, target], self.lens[:, sample])
        return float((self.base * longest + rest).max(axis=1).mean())

    def move(self, sample: int, target: int) -> None:
        source = int(self.engine_of[sample])
        self.members[source].remove(sample)
        self.members[target].append(sample)
        self.engine_of[sample] = target
        self.rest[:, source] -= self.work[:, sample]
        self.rest[:, target] += self.work[:, sample]
        others = self.members[source]
        self.longest[:, source] = self.lens[:, others].max(axis=1) if others else 0.0
        self.longest[:, target] = np.maximum(self.longest[:, target], self.lens[:, sample])


def dealt(model: StepModel, engines: int, risky: int = 0, own: int = 0) -> np.ndarray:
    """An engine per sample: the ``risky`` groups of highest log-mean dealt in turn over the
    first ``own`` engines, the others over the rest (``risky`` 0: every sample over every
    engine, ``round_robin``'s placement)."""
    order = np.argsort(-model.mu, kind="stable")
    top = set(order[:risky].tolist()) if risky else set()
    engine_of = np.empty(model.samples, dtype=int)
    turn = {True: 0, False: 0}
    for s, g in enumerate(model.group_of.tolist()):
        is_top = g in top
        pool, first = (own, 0) if is_top else (engines - own, own)
        engine_of[s] = first + turn[is_top] % pool
        turn[is_top] += 1
    return engine_of


def search(makespans: Makespans, engines: int, max_passes: int) -> int:
    """Moves single samples while the mean makespan falls; the passes made."""
    best = makespans.mean()
    passes = 0
    while passes < max_passes:
        passes += 1
        improved = False
        for sample in range(len(makespans.engine_of)):
            for target in range(engines):
                if target == makespans.engine_of[sample]:
                    continue
                value = makespans.moved(sample, target)
                if value < best - 1e-9:
                    makespans.move(sample, target)
                    best, improved = value, True
                    break
        if not improved:
            break
    return passes


def clairvoyant(
    lens: np.ndarray, groups: list[SimGroup], model: StepModel, cfg: RLSettings, engines: int
) -> np.ndarray:
    """Per draw, the makespan of ``rl`` told that draw's true lengths."""
    from rollserve.scheduler.core.policies.rl import RLPolicy
    from rollserve.scheduler.core.snapshot import EngineView, QueuedGroup, Snapshot

    views = tuple(
        EngineView(engine_id=f"e{k:04d}", healthy=True, capacity_samples=model.samples)
        for k in range(engines)
    )
    index = {view.engine_id: k for k, view in enumerate(views)}
    starts = np.concatenate([[0], np.cumsum([g.n for g in groups])])
    by_key = {g.key: i for i, g in enumerate(groups)}
    out = np.empty(lens.shape[0])
    for d in range(lens.shape[0]):
        queue = tuple(
            QueuedGroup(
                key=g.key,
                n=g.n,
                prompt_len=g.prompt_len,
                max_tokens=g.max_tokens,
                seq=i,
                prompt_key=g.prompt_key,
                predicted_lens=tuple(lens[d, starts[i] : starts[i + 1]].tolist()),
            )
            for i, g in enumerate(groups)
        )
        plan = RLPolicy(cfg).plan(Snapshot(queue, views))
        engine_of = np.empty(model.samples, dtype=int)
        for assign in plan.assignments:
            i = by_key[assign.group_key]
            for j in assign.samples or range(groups[i].n):
                engine_of[starts[i] + j] = index[assign.engine_id]
        out[d] = Makespans(lens[d : d + 1], model, cfg, engine_of, engines).mean()
    return out


def run_bound(cfg: BoundConfig, console: Console | None = None) -> dict[str, Any]:
    from rollserve.sim.profile import load_profile, rl_settings
    from rollserve.sim.scenarios import load_scenario

    console = console or Console(width=150)
    if cfg.draws < 2:
        raise ValueError(f"draws ({cfg.draws}) must be at least 2")
    if cfg.warm_steps < 0:
        raise ValueError(f"warm_steps ({cfg.warm_steps}) must be at least 0")
    scenario = load_scenario(cfg.scenario)
    if cfg.engines is not None:
        scenario = replace(scenario, engines=cfg.engines)
    scenario = replace(scenario, steps=cfg.warm_steps + 1)
    groups = scenario.steps_of_groups()[cfg.warm_steps]
    profile = load_profile(scenario.profile)
    rl = rl_settings(profile)
    engines = scenario.engines
    if engines < 2:
        raise ValueError(
            f"engines ({engines}) must be at least 2: on one there is nothing to place"
        )
    model = StepModel.of(groups)
    rng = np.random.default_rng(cfg.seed)
    fit, held = model.draw(rng, cfg.draws), model.draw(rng, cfg.draws)
    console.print(
        f"[bold]MODELLED[/bold] {scenario.name}, one synchronous step of {len(groups)} groups x "
        f"{scenario.n} on {engines} engines ({profile.name}'s step costs, rl's cost model); "
        f"lengths drawn {cfg.draws} times around each group's own log-mean with the step's "
        f"within-group log-spread {model.sd:.2f}"
    )

    spread = dealt(model, engines)
    grid = [
        (own, risky)
        for own in range(1, engines)
        for risky in SEGREGATED_RISKY
        if risky < len(groups) and risky * scenario.n >= own
    ]

    def on_fit(engine_of: np.ndarray) -> float:
        return Makespans(fit, model, rl, engine_of, engines).mean()

    best_grid = min(grid, key=lambda kr: on_fit(dealt(model, engines, kr[1], kr[0])))
    segregated = dealt(model, engines, best_grid[1], best_grid[0])
    start = min((spread, segregated), key=on_fit)
    searching = Makespans(fit, model, rl, start, engines)
    passes = search(searching, engines, cfg.max_passes)
    placements = {
        "spread": spread,
        f"segregated (k={best_grid[0]}, r={best_grid[1]})": segregated,
        f"searched ({passes} passes)": searching.engine_of,
    }
    scores = {
        name: Makespans(held, model, rl, engine_of, engines).mean()
        for name, engine_of in placements.items()
    }
    fitted = {name: on_fit(engine_of) for name, engine_of in placements.items()}
    seer = float(clairvoyant(held, groups, model, rl, engines).mean())
    scores[CLAIRVOYANT] = seer
    true_step = {
        "spread": Makespans(model.true_lens[None, :], model, rl, spread, engines).mean(),
        "clairvoyant": float(clairvoyant(model.true_lens[None, :], groups, model, rl, engines)[0]),
    }

    base = scores["spread"]
    table = Table(title="expected step makespan over fresh draws (modelled)")
    for column in ("placement", "knows", "makespan s", "on its search draws", "vs spread"):
        table.add_column(column, justify="left" if column in ("placement", "knows") else "right")
    rows: dict[str, Any] = {}
    for name, value in scores.items():
        knows = "each sample's length" if name == CLAIRVOYANT else "group log-means"
        searched_on = fitted.get(name)
        table.add_row(
            name,
            knows,
            f"{value:.1f}",
            "" if searched_on is None else f"{searched_on:.1f}",
            f"{base / value:.3f}x",
        )
        rows[name] = {
            "expected_makespan_s": value,
            "on_search_draws_s": searched_on,
            "vs_spread": base / value,
            "knows": knows,
        }
    console.print(table)
    best_blind = min(v for k, v in scores.items() if k != CLAIRVOYANT)
    console.print(
        f"best placement from the groups' distributions: {base / best_blind:.3f}x spread; "
        f"clairvoyant: {base / seer:.3f}x; the best blind placement is "
        f"{best_blind / seer - 1:.1%} slower than the clairvoyant"
    )
    console.print(
        f"on the scenario's own draw: spread {true_step['spread']:.1f} s, clairvoyant "
        f"{true_step['clairvoyant']:.1f} s ({true_step['spread'] / true_step['clairvoyant']:.3f}x)"
    )
    out = {
        "scenario": scenario.name,
        "profile": profile.name,
        "engines": engines,
        "groups": len(groups),
        "n": scenario.n,
        "draws": cfg.draws,
        "seed": cfg.seed,
        "within_group_log_sd": model.sd,
        "placements": rows,
        "blind_over_clairvoyant": best_blind / seer,
        "scenario_draw": true_step,
        "modelled": True,
    }
    if cfg.json_path is not None:
        cfg.json_path.parent.mkdir(parents=True, exist_ok=True)
        cfg.json_path.write_text(json.dumps(out, indent=2) + "\n")
        console.print(f"wrote {cfg.json_path}")
    return out
