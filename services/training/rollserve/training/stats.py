"""``rollserve workload stats``: the shape of the workload, measured on a model with vLLM.

Two passes over a prompt set, each ``samples`` samples per prompt at temperature 1.0 (every
sample its own seed, the seeds of the two passes disjoint), on vLLM's ``AsyncLLM`` with the
engine service's own engine arguments. From pass 1:

- response length (tokens): median, p99, max, ``p99_over_median``, ``max_over_median``;
- ``prompt_variance_share``: the share of the variance of response length that prompt
  identity explains (one-way ANOVA: between-prompt sum of squares over total sum of squares);
- ``accuracy``: mean verifier score; ``mixed_group_share``: share of prompts whose samples are
  neither all right nor all wrong (the groups in which GRPO has a signal).

From both passes: ``top10_overlap``, the share of the prompts in the top 10% by mean response
length in pass 1 that are also in the top 10% in pass 2. Figures: a histogram of pass-1
lengths and a scatter of pass-1 vs pass-2 mean length per prompt (PNG).
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollserve.workload import PromptRow, score

__all__ = ["TARGETS", "PassResult", "StatsConfig", "WorkloadStats", "measure", "shape_of"]

# (key, lower bound, upper bound): the shape the workload must have (issue 3).
TARGETS: tuple[tuple[str, float, float], ...] = (
    ("p99_over_median", 8.0, math.inf),
    ("max_over_median", 20.0, math.inf),
    ("prompt_variance_share", 0.5, 0.8),
    ("top10_overlap", 0.5, 1.0),
    ("accuracy", 0.3, 0.8),
    ("mixed_group_share", 0.5, 1.0),
)


@dataclass(frozen=True)
class StatsConfig:
    model: Path
    data: Path
    samples: int = 8
    temperature: float = 1.0
    max_model_len: int = 2048
    max_num_seqs: int = 128
    seed: int = 0
    omp_threads: int = 0  # 0: all cores but one


@dataclass
class PassResult:
    """Per prompt, per sample: response length (tokens), score, finish reason."""

    lengths: list[list[int]]
    scores: list[list[float]]
    truncated: int
    wall_s: float

    @property
    def output_tokens(self) -> int:
        return sum(sum(row) for row in self.lengths)


@dataclass
class WorkloadStats:
    prompts: int
    samples_per_prompt: int
    median: float
    p99: float
    max: int
    mean: float
    p99_over_median: float
    max_over_median: float
    prompt_variance_share: float
    top10_overlap: float
    accuracy: float
    mixed_group_share: float
    truncated_share: float
    output_tokens_per_s: float
    per_kind: dict[str, dict[str, float]] = field(default_factory=dict)

    def checks(self) -> list[tuple[str, float, float, float, bool]]:
        """(key, value, low, high, met) for each target."""
        out = []
        for key, low, high in TARGETS:
            value = float(getattr(self, key))
            out.append((key, value, low, high, low <= value <= high))
        return out


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def variance_share(groups: Sequence[Sequence[float]]) -> float:
    """Between-group sum of squares over the total: the share prompt identity explains."""
    values = [v for g in groups for v in g]
    mean = statistics.fmean(values)
    total = sum((v - mean) ** 2 for v in values)
    between = sum(len(g) * (statistics.fmean(g) - mean) ** 2 for g in groups)
    return between / total if total > 0 else 0.0


def top_overlap(first: Sequence[float], second: Sequence[float], share: float = 0.1) -> float:
    """Share of the top ``share`` of ``first`` (by value) also in the top of ``second``."""
    k = max(1, round(len(first) * share))
    top1 = set(sorted(range(len(first)), key=lambda i: (-first[i], i))[:k])
    top2 = set(sorted(range(len(second)), key=lambda i: (-second[i], i))[:k])
    return len(top1 & top2) / k


def shape_of(rows: Sequence[PromptRow], pass1: PassResult, pass2: PassResult) -> WorkloadStats:
    lengths = sorted(v for g in pass1.lengths for v in g)
    median = _quantile(lengths, 0.5)
    p99 = _quantile(lengths, 0.99)
    scores = [s for g in pass1.scores for s in g]
    mixed = sum(1 for g in pass1.scores if 0 < sum(g) < len(g))
    per_kind: dict[str, dict[str, float]] = {}
    for kind in sorted({r.kind for r in rows}):
        idx = [i for i, r in enumerate(rows) if r.kind == kind]
        kind_lengths = sorted(v for i in idx for v in pass1.lengths[i])
        per_kind[kind] = {
            "prompts": len(idx),
            "median_length": _quantile(kind_lengths, 0.5),
            "accuracy": statistics.fmean(s for i in idx for s in pass1.scores[i]),
        }
    n_samples = len(lengths)
    return WorkloadStats(
        prompts=len(rows),
        samples_per_prompt=len(pass1.lengths[0]),
        median=median,
        p99=p99,
        max=lengths[-1],
        mean=statistics.fmean(lengths),
        p99_over_median=p99 / median,
        max_over_median=lengths[-1] / median,
        prompt_variance_share=variance_share(pass1.lengths),
        top10_overlap=top_overlap(
            [statistics.fmean(g) for g in pass1.lengths],
            [statistics.fmean(g) for g in pass2.lengths],
        ),
        accuracy=statistics.fmean(scores),
        mixed_group_share=mixed / len(rows),
        truncated_share=pass1.truncated / n_samples,
        output_tokens_per_s=(pass1.output_tokens + pass2.output_tokens)
        / (pass1.wall_s + pass2.wall_s),
        per_kind=per_kind,
    )


async def _generate(
    cfg: StatsConfig,
    rows: Sequence[PromptRow],
    progress: Callable[[str, int, int], None] | None,
) -> tuple[PassResult, PassResult]:
    from rollserve.engine.service import build_engine_args
    from rollserve.engine.settings import EngineSettings, apply_environment, resolve_device

    settings = EngineSettings(
        model=cfg.model,
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        omp_num_threads=cfg.omp_threads,
        seed=cfg.seed,
    )
    device = resolve_device(settings)
    apply_environment(settings, device)

    from tokenizers import Tokenizer
    from vllm import SamplingParams
    from vllm.inputs import tokens_input
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    tokenizer = Tokenizer.from_file(str(cfg.model / "tokenizer.json"))
    prompts = [tokenizer.encode(row.prompt).ids for row in rows]
    too_long = [
        r.prompt_key for r, p in zip(rows, prompts, strict=True) if len(p) >= cfg.max_model_len
    ]
    if too_long:
        raise ValueError(
            f"{len(too_long)} prompt(s) leave no room for a response in max_model_len "
            f"({cfg.max_model_len}), e.g. {too_long[0]}"
        )
    llm = AsyncLLM.from_engine_args(build_engine_args(settings, device))
    done = 0
    total = 2 * len(rows) * cfg.samples

    async def one(llm: Any, pass_no: int, i: int, j: int) -> tuple[int, float, bool]:
        nonlocal done
        params = SamplingParams(
            n=1,
            temperature=cfg.temperature,
            max_tokens=cfg.max_model_len - len(prompts[i]),
            seed=cfg.seed + (pass_no * len(rows) + i) * cfg.samples + j,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        final = None
        async for out in llm.generate(tokens_input(prompts[i]), params, f"p{pass_no}-{i}-{j}"):
            final = out
        assert final is not None
        completion = final.outputs[0]
        text = tokenizer.decode(list(completion.token_ids), skip_special_tokens=True)
        done += 1
        if progress is not None and done % 200 == 0:
            progress("generating", done, total)
        return (
            len(completion.token_ids),
            score(rows[i], text),
            completion.finish_reason == "length",
        )

    results = []
    try:
        for pass_no in (0, 1):
            start = time.perf_counter()
            out = await asyncio.gather(
                *(one(llm, pass_no, i, j) for i in range(len(rows)) for j in range(cfg.samples))
            )
            wall = time.perf_counter() - start
            lengths = [
                [out[i * cfg.samples + j][0] for j in range(cfg.samples)] for i in range(len(rows))
            ]
            scores = [
                [out[i * cfg.samples + j][1] for j in range(cfg.samples)] for i in range(len(rows))
            ]
            results.append(PassResult(lengths, scores, sum(o[2] for o in out), wall))
    finally:
        llm.shutdown()
        del llm  # its finalizer runs now, not at interpreter exit
        gc.collect()
    return results[0], results[1]


def measure(
    cfg: StatsConfig,
    rows: Sequence[PromptRow],
    progress: Callable[[str, int, int], None] | None = None,
) -> tuple[WorkloadStats, PassResult, PassResult]:
    """Runs both passes on vLLM and returns the shape and the raw passes."""
    pass1, pass2 = asyncio.run(_generate(cfg, rows, progress))
    return shape_of(rows, pass1, pass2), pass1, pass2


def write_figures(pass1: PassResult, pass2: PassResult, out_dir: Path, label: str) -> list[Path]:
    """``lengths_hist.png`` and ``pass1_vs_pass2.png`` in ``out_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    lengths = [v for g in pass1.lengths for v in g]
    median = statistics.median(lengths)
    hist = out_dir / "lengths_hist.png"
    fig, ax = plt.subplots(figsize=(7, 4.2))
    top = max(lengths)
    # Log-spaced bins on whole tokens (no empty slivers between small integers).
    edges = sorted({round(math.exp(k * math.log(top + 1) / 60)) for k in range(61)})
    ax.hist(lengths, bins=edges, color="#3a6ea5")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.axvline(median, color="black", linestyle="--", linewidth=1, label=f"median {median:.0f}")
    p99 = _quantile(sorted(lengths), 0.99)
    ax.axvline(p99, color="#c0392b", linestyle="--", linewidth=1, label=f"p99 {p99:.0f}")
    ax.set_xlabel("response length (tokens)")
    ax.set_ylabel("samples")
    ax.set_title(f"Response lengths, {len(lengths)} samples ({label})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(hist, dpi=120)
    plt.close(fig)

    scatter = out_dir / "pass1_vs_pass2.png"
    m1 = [statistics.fmean(g) for g in pass1.lengths]
    m2 = [statistics.fmean(g) for g in pass2.lengths]
    fig, ax = plt.subplots(figsize=(5.5, 5.5))
    ax.scatter(m1, m2, s=6, alpha=0.5, color="#3a6ea5")
    low, high = min(m1 + m2), max(m1 + m2)
    ax.plot([low, high], [low, high], color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("pass 1: mean response length per prompt (tokens)")
    ax.set_ylabel("pass 2: mean response length per prompt (tokens)")
    ax.set_title(f"Per-prompt mean length, two passes ({label})")
    fig.tight_layout()
    fig.savefig(scatter, dpi=120)
    plt.close(fig)
    return [hist, scatter]


def to_json(stats: WorkloadStats) -> dict[str, Any]:
    from dataclasses import asdict

    out = asdict(stats)
    out["targets"] = {
        key: {"value": value, "low": low, "high": high if math.isfinite(high) else None, "met": met}
        for key, value, low, high, met in stats.checks()
    }
    decoded: dict[str, Any] = json.loads(json.dumps(out))
    return decoded
