"""``rollserve bench dtype``: the same engine in float32 and in bfloat16, side by side.

vLLM's CPU backend runs bfloat16 under ``dtype auto`` (it downcasts a float32 checkpoint,
and keeps a bfloat16 one), and a CPU without AVX-512 BF16 or AMX emulates bfloat16; the
engine service therefore runs the model in float32 there (``EngineSettings``
``resolve_dtype``; a 16-bit checkpoint where its float32 weights fit). This benchmark is the
measurement behind that rule, to run on any CPU: for each dtype a child process builds the
engine exactly as the service does (``EngineSettings`` with that dtype, ``apply_environment``,
``build_engine_args``, vLLM's AsyncLLM), decodes batches of 1, 8 and 64 sequences of a fixed
length (``ignore_eos``) several times, and reports the wall time of a decode step (a batch's
time over its tokens a sequence). It then scores the sampled tokens with the trainer's
float32 forward pass (transformers, as ``rollserve.training.grpo`` loads the model) and
reports how far the engine's logprobs are from it: the on-policy ratio GRPO starts from.

The dtypes run one after another, each in a fresh process (vLLM wants one), in alternating
order over ``--rounds``; the table gives each batch's median step per dtype and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, get_args

from rich.console import Console
from rich.table import Table
from rollserve.engine.settings import Dtype, DtypeChoice, EngineSettings

DTYPES = ("float32", "bfloat16")
NAMED_DTYPES = tuple(name for name in get_args(Dtype) if name != "auto")
"""The dtypes the engine takes by name (``EngineSettings.dtype`` less ``auto``)."""
MAX_MODEL_LEN = int(EngineSettings.model_fields["max_model_len"].default)
"""The engine service's context (its ``EngineSettings`` default), which each sample fills."""


@dataclass(frozen=True)
class DtypeConfig:
    model: Path | None = None  # default: the shipped reasoner
    dtypes: tuple[str, ...] = DTYPES
    batches: tuple[int, ...] = (1, 8, 64)
    tokens: int = 256  # decoded a sequence, every batch
    prompt_tokens: int = 32
    repeats: int = 3  # timed runs of each batch a round, after one untimed
    rounds: int = 1  # children per dtype, the order alternating
    omp_threads: int = 1  # per engine (the dev stack's)
    seed: int = 0

    def __post_init__(self) -> None:
        if len(set(self.dtypes)) != len(self.dtypes) or not self.dtypes:
            raise ValueError(f"dtypes ({','.join(self.dtypes)}) must be distinct and given")
        for name in self.dtypes:
            if name not in NAMED_DTYPES:
                raise ValueError(
                    f"dtypes: {name!r} is not {', '.join(NAMED_DTYPES[:-1])} or {NAMED_DTYPES[-1]}"
                )
        if not self.batches or min(self.batches) < 1 or max(self.batches) > 256:
            raise ValueError(f"batches ({self.batches}) must each be 1 to 256")
        for name in ("tokens", "prompt_tokens", "repeats", "rounds", "omp_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be at least 1")
        if self.tokens + self.prompt_tokens > MAX_MODEL_LEN:
            raise ValueError(
                f"tokens + prompt_tokens ({self.tokens + self.prompt_tokens}) must fit the "
                f"engine's max_model_len of {MAX_MODEL_LEN}"
            )


@dataclass
class DtypeRun:
    """One child's measurements: each batch's timed walls, and the logprob agreement."""

    dtype: str
    resolved: str  # what vLLM ran (its model config), e.g. float32
    walls: dict[int, list[float]] = field(default_factory=dict)
    logprob_diffs: list[float] = field(default_factory=list)

    def step_ms(self, batch: int, tokens: int) -> float:
        """The median timed wall of this batch over its tokens a sequence, in ms."""
        return statistics.median(self.walls[batch]) / tokens * 1000


def order_of_rounds(dtypes: tuple[str, ...], rounds: int) -> list[str]:
    """The children to run: every dtype once a round, reversed every other round."""
    out: list[str] = []
    for r in range(rounds):
        out.extend(dtypes if r % 2 == 0 else tuple(reversed(dtypes)))
    return out


def merge(runs: list[DtypeRun]) -> dict[str, DtypeRun]:
    """The runs of each dtype as one (walls and diffs of all its rounds together)."""
    merged: dict[str, DtypeRun] = {}
    for run in runs:
        into = merged.setdefault(run.dtype, DtypeRun(run.dtype, run.resolved))
        if into.resolved != run.resolved:
            raise RuntimeError(f"{run.dtype} ran as {into.resolved} and as {run.resolved}")
        for batch, walls in run.walls.items():
            into.walls.setdefault(batch, []).extend(walls)
        into.logprob_diffs.extend(run.logprob_diffs)
    return merged


def agreement(diffs: list[float]) -> dict[str, float]:
    """|engine logprob - trainer logprob| over the sampled tokens: mean, p99, max."""
    if not diffs:
        return {"tokens": 0, "mean": 0.0, "p99": 0.0, "max": 0.0}
    ordered = sorted(diffs)
    return {
        "tokens": len(ordered),
        "mean": statistics.fmean(ordered),
        "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "max": ordered[-1],
    }


def summarize(cfg: DtypeConfig, runs: dict[str, DtypeRun], auto: DtypeChoice) -> dict[str, Any]:
    """The JSON of the benchmark: per dtype, each batch's median step and the agreement; per
    batch, each dtype's step over the first dtype's; what ``dtype auto`` gives here, and why."""
    first = cfg.dtypes[0]
    out: dict[str, Any] = {
        "settings": {**asdict(cfg), "model": str(cfg.model)},
        "auto": auto.dtype,
        "auto_why": auto.why,
    }
    out["dtypes"] = {
        name: {
            "resolved": run.resolved,
            "step_ms": {str(b): run.step_ms(b, cfg.tokens) for b in cfg.batches},
            "walls_s": {str(b): run.walls[b] for b in cfg.batches},
            "logprob_vs_trainer": agreement(run.logprob_diffs),
        }
        for name, run in runs.items()
    }
    out["vs_" + first] = {
        name: {
            str(b): run.step_ms(b, cfg.tokens) / runs[first].step_ms(b, cfg.tokens)
            for b in cfg.batches
        }
        for name, run in runs.items()
    }
    return out


def print_table(cfg: DtypeConfig, result: dict[str, Any], console: Console) -> None:
    first = cfg.dtypes[0]
    table = Table(
        title=f"one decode step, ms (median of {cfg.repeats * cfg.rounds} runs of "
        f"{cfg.tokens} tokens a sequence); the engine as the service builds it"
    )
    table.add_column("batch", justify="right")
    for name in cfg.dtypes:
        table.add_column(f"{name} ms", justify="right")
    for name in cfg.dtypes[1:]:
        table.add_column(f"{name} / {first}", justify="right")
    for b in cfg.batches:
        row = [str(b)]
        row += [f"{result['dtypes'][n]['step_ms'][str(b)]:.2f}" for n in cfg.dtypes]
        row += [f"{result['vs_' + first][n][str(b)]:.2f}x" for n in cfg.dtypes[1:]]
        table.add_row(*row)
    console.print(table)
    for name in cfg.dtypes:
        a = result["dtypes"][name]["logprob_vs_trainer"]
        console.print(
            f"{name} (vLLM ran {result['dtypes'][name]['resolved']}): engine logprobs vs the "
            f"trainer's float32 forward pass over {a['tokens']} sampled tokens: mean "
            f"|diff| {a['mean']:.5f}, p99 {a['p99']:.5f}, max {a['max']:.5f}"
        )
    console.print(f"the engine's dtype auto is {result['auto']} here: {result['auto_why']}")


def run_dtype(cfg: DtypeConfig, console: Console | None = None) -> dict[str, Any]:
    """Runs the children and returns (and prints) the summary."""
    console = console or Console()
    from rollserve.assets import reasoner_dir
    from rollserve.engine.settings import choose_dtype

    model = cfg.model or reasoner_dir()
    cfg = DtypeConfig(**{**asdict(cfg), "model": model})
    auto = choose_dtype(EngineSettings(model=model), "cpu")
    runs: list[DtypeRun] = []
    for name in order_of_rounds(cfg.dtypes, cfg.rounds):
        console.print(f"running {name} …")
        start = time.perf_counter()
        runs.append(_run_child(cfg, name))
        console.print(f"  {name}: {time.perf_counter() - start:.0f} s with start-up")
    result = summarize(cfg, merge(runs), auto)
    print_table(cfg, result, console)
    return result


def _run_child(cfg: DtypeConfig, dtype: str) -> DtypeRun:
    argv = [
        sys.executable,
        "-m",
        "rollserve.bench.dtype",
        "--child",
        dtype,
        json.dumps({**asdict(cfg), "model": str(cfg.model)}),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout)[-3000:]
        raise RuntimeError(f"the {dtype} engine failed (exit {proc.returncode}):\n{tail}")
    data = json.loads(lines[-1])
    return DtypeRun(
        dtype=dtype,
        resolved=data["resolved"],
        walls={int(b): w for b, w in data["walls"].items()},
        logprob_diffs=data["logprob_diffs"],
    )


# --- the child: one engine in one dtype ---------------------------------------------------


class Sampled(NamedTuple):
    """A sample of the scored batch: its prompt, its tokens and the engine's logprobs."""

    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]


def config_from_json(text: str) -> DtypeConfig:
    """The parent's `DtypeConfig`, as `_run_child` hands it to the child in JSON."""
    raw = json.loads(text)
    return DtypeConfig(
        **{
            **raw,
            "model": Path(raw["model"]),
            "dtypes": tuple(raw["dtypes"]),
            "batches": tuple(raw["batches"]),
        }
    )


async def _measure(cfg: DtypeConfig, dtype: str) -> dict[str, Any]:
    from rollserve.engine.service import build_engine_args
    from rollserve.engine.settings import apply_environment

    assert cfg.model is not None  # run_dtype fills it in
    settings = EngineSettings.model_validate(
        {"model": cfg.model, "dtype": dtype, "omp_num_threads": cfg.omp_threads, "seed": cfg.seed}
    )
    apply_environment(settings, "cpu")
    from vllm import SamplingParams
    from vllm.inputs import tokens_input
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(build_engine_args(settings, "cpu"))
    resolved = str(llm.model_config.dtype).removeprefix("torch.")
    vocab = llm.model_config.get_vocab_size()
    sampled: list[Sampled] = []

    async def one(prompt: list[int], seed: int, rid: str, keep: bool) -> None:
        params = SamplingParams(
            max_tokens=cfg.tokens,
            ignore_eos=True,  # a fixed length; min_tokens would mask EOS in the logprobs
            temperature=1.0,
            seed=seed,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        async for out in llm.generate(tokens_input(prompt), params, rid):
            if out.finished and keep:
                c = out.outputs[0]
                ids = list(c.token_ids)
                lps = [c.logprobs[i][t].logprob for i, t in enumerate(ids)]
                sampled.append(Sampled(prompt, ids, lps))

    walls: dict[str, list[float]] = {}
    try:
        for batch in cfg.batches:
            prompts = [
                [3 + (cfg.seed + b * 7 + j * 3) % (vocab - 3) for j in range(cfg.prompt_tokens)]
                for b in range(batch)
            ]
            for rep in range(cfg.repeats + 1):  # the first is untimed
                keep = rep == 1 and batch == max(cfg.batches)
                start = time.perf_counter()
                await asyncio.gather(
                    *(
                        one(p, cfg.seed + 1000 * rep + i, f"b{batch}-r{rep}-{i}", keep)
                        for i, p in enumerate(prompts)
                    )
                )
                if rep:
                    walls.setdefault(str(batch), []).append(time.perf_counter() - start)
    finally:
        llm.shutdown()
    return {"resolved": resolved, "walls": walls, "logprob_diffs": _vs_trainer(cfg, sampled)}


def _vs_trainer(cfg: DtypeConfig, sampled: list[Sampled]) -> list[float]:
    """|engine logprob - the trainer's float32 logprob| of every sampled token."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(cfg.model, dtype=torch.float32).eval()
    diffs: list[float] = []
    with torch.no_grad():
        for prompt, ids, lps in sampled:
            logits = model(torch.tensor([prompt + ids])).logits[0].float()
            logp = torch.log_softmax(logits, -1)
            n = len(prompt)
            for i, (token, engine_lp) in enumerate(zip(ids, lps, strict=True)):
                diffs.append(abs(float(logp[n + i - 1, token]) - engine_lp))
    return diffs


def _child_main(dtype: str, text: str) -> int:
    print(json.dumps(asyncio.run(_measure(config_from_json(text), dtype))), flush=True)
    return 0


# --- the command ---------------------------------------------------------------------------


def _csv_ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated integers") from None


def add_bench_dtype(bench_sub: Any) -> None:
    """Registers ``dtype`` under ``rollserve bench``."""
    from rollserve.cli.argtypes import positive_int
    from rollserve.cli.paths import output_file

    d = DtypeConfig()
    p: argparse.ArgumentParser = bench_sub.add_parser(
        "dtype", help="the engine in float32 and in bfloat16: step time and logprobs, real vLLM"
    )
    p.add_argument("--model", type=Path, help="default: the shipped trained reasoner")
    p.add_argument(
        "--dtypes", default=",".join(d.dtypes), help="comma-separated; ratios to the first"
    )
    p.add_argument("--batches", type=_csv_ints, default=d.batches, help="default 1,8,64")
    p.add_argument("--tokens", type=positive_int, default=d.tokens, help="a sequence, decoded")
    p.add_argument("--prompt-tokens", type=positive_int, default=d.prompt_tokens)
    p.add_argument("--repeats", type=positive_int, default=d.repeats)
    p.add_argument("--rounds", type=positive_int, default=d.rounds)
    p.add_argument("--omp-threads", type=positive_int, default=d.omp_threads)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", type=output_file)
    p.set_defaults(func=_cmd_bench_dtype)


def _cmd_bench_dtype(args: argparse.Namespace) -> int:
    try:
        cfg = DtypeConfig(
            model=args.model,
            dtypes=tuple(x.strip() for x in args.dtypes.split(",")),
            batches=args.batches,
            tokens=args.tokens,
            prompt_tokens=args.prompt_tokens,
            repeats=args.repeats,
            rounds=args.rounds,
            omp_threads=args.omp_threads,
            seed=args.seed,
        )
    except ValueError as exc:
        raise SystemExit(f"rollserve bench dtype: {exc}") from None
    result = run_dtype(cfg)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
        Console().print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        sys.exit(_child_main(sys.argv[2], sys.argv[3]))
    raise SystemExit("run it as `rollserve bench dtype`")
