"""``rollserve bench push-cost``: what an engine pays for outputs pushed to it while it runs.

The scheduler pushes outputs that finished on one engine to the engines that run their
group's other samples (the Engine's ``AddOutputs``), at most once every
``--earlier-outputs-push-interval-s`` an engine. Each push goes from the engine service to
the rollout drafter in vLLM's engine core by ``collective_rpc``, which vLLM runs between two
steps. This benchmark puts a number on that pause, on one real engine that speculates with
the ``rollout`` drafter: ``--calls`` Generate calls of ``--n`` samples each, of fresh random
prompts (temperature 1, seeded), run together while a client pushes one output
of ``--output-tokens`` tokens of one of those prompts (each in turn) at a fixed rate, one push
in flight at a time (each waits for the one before); the rates run in turn, their order
reversed every other repeat, each with prompts of its own. Reported per rate: output tokens a
second of the calls (pooled over the repeats), their ratio to rate 0's, the pushes a second
achieved and the median latency of a push.

The model is by default a tiny random Llama (``rollserve.engine.tiny_model``, made in a
temporary folder): its samples run to ``--max-tokens``, so every run is the same work and the
time it takes measures the cost (the trained reasoner's samples end by chance, and a run's
time would follow its longest sample). The pushed outputs are random tokens: they cost the
drafter what any output of their length costs (it indexes every n-gram) and give it nothing
to draft from, so the ratio is the cost alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollserve.bench.share import DEFAULT_ENGINE_ARGS
from rollserve.cli.argtypes import positive_int

TABLE_WIDTH = 120


@dataclass(frozen=True)
class PushCostConfig:
    model: Path | None = None  # None: a tiny random Llama made for the run
    rates: tuple[float, ...] = (0.0, 1.0, 20.0)  # pushes a second; 0: none
    repeats: int = 4
    calls: int = 8  # Generate calls that run together (a group's prompt each)
    n: int = 16
    max_tokens: int = 1024
    prompt_tokens: int = 64
    output_tokens: int = 300  # of each pushed output
    seed: int = 0
    engine_args: tuple[str, ...] = DEFAULT_ENGINE_ARGS
    json_path: Path | None = None
    run_dir: Path | None = None

    def __post_init__(self) -> None:
        for name in ("repeats", "calls", "n", "max_tokens", "prompt_tokens", "output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 1")
        if not self.rates or 0.0 not in self.rates:
            raise ValueError(f"rates ({self.rates}) must include 0, the run without pushes")
        if any(not 0 <= r <= 1000 for r in self.rates):
            raise ValueError(f"rates ({self.rates}) must each be in [0, 1000] a second")
        if len(set(self.rates)) != len(self.rates):
            raise ValueError(f"rates ({self.rates}) name a rate twice")


@dataclass
class Run:
    rate: float
    repeat: int
    seconds: float
    tokens: int
    latencies_s: list[float] = field(default_factory=list)  # of each push


@dataclass
class Summary:
    """Pooled figures by rate: tokens_per_s, vs_none, pushes_per_s, push_ms (median)."""

    figures: dict[float, dict[str, float]]

    @classmethod
    def of(cls, runs: Sequence[Run]) -> Summary:
        figures: dict[float, dict[str, float]] = {}
        for rate in sorted({r.rate for r in runs}):
            mine = [r for r in runs if r.rate == rate]
            seconds = sum(r.seconds for r in mine)
            latencies = [s for r in mine for s in r.latencies_s]
            figures[rate] = {
                "seconds": seconds,
                "tokens": sum(r.tokens for r in mine),
                "tokens_per_s": sum(r.tokens for r in mine) / seconds if seconds else 0.0,
                "pushes": len(latencies),
                "pushes_per_s": len(latencies) / seconds if seconds else 0.0,
                "push_ms": 1e3 * statistics.median(latencies) if latencies else 0.0,
            }
        base = figures.get(0.0, {}).get("tokens_per_s", 0.0)
        for f in figures.values():
            f["vs_none"] = f["tokens_per_s"] / base if base else 0.0
        return cls(figures)


def schedule(cfg: PushCostConfig) -> list[tuple[int, float]]:
    """(repeat, rate) in the order they run: the rates in turn, reversed every other repeat."""
    order: list[tuple[int, float]] = []
    for repeat in range(cfg.repeats):
        rates = cfg.rates if repeat % 2 == 0 else cfg.rates[::-1]
        order += [(repeat, rate) for rate in rates]
    return order


@dataclass(frozen=True)
class Target:
    """The engine a run goes to, and what it pushes."""

    address: str
    vocab_size: int
    rng: random.Random


async def one_run(
    target: Target, tag: str, prompts: Sequence[Sequence[int]], rate: float, cfg: PushCostConfig
) -> tuple[float, int, list[float]]:
    """A Generate call of each prompt, together, with pushes at ``rate`` (to each prompt in
    turn); (seconds, output tokens, push latencies)."""
    import grpc
    from rollserve.engine.service import SERVER_OPTIONS
    from rollserve.v1 import rollserve_pb2 as pb
    from rollserve.v1 import rollserve_pb2_grpc as pb_grpc

    sampling = pb.SamplingParams(max_tokens=cfg.max_tokens, temperature=1.0, seed=cfg.seed)
    latencies: list[float] = []
    done = asyncio.Event()
    async with grpc.aio.insecure_channel(target.address, options=SERVER_OPTIONS) as channel:
        stub = pb_grpc.EngineStub(channel)

        async def push() -> None:
            turn = 0
            while not done.is_set():
                prompt = prompts[turn % len(prompts)]
                turn += 1
                output = [target.rng.randrange(target.vocab_size) for _ in range(cfg.output_tokens)]
                add = pb.AddOutputsRequest(
                    prompts=[
                        pb.PromptOutputs(
                            prompt_token_ids=prompt, outputs=[pb.EarlierOutput(token_ids=output)]
                        )
                    ]
                )
                start = time.perf_counter()
                await stub.AddOutputs(add, timeout=60)
                latencies.append(time.perf_counter() - start)
                with_rest = 1 / rate - (time.perf_counter() - start)
                if with_rest > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(done.wait(), with_rest)

        async def generate(index: int, prompt: Sequence[int]) -> int:
            request = pb.GenerateRequest(
                request_id=f"{tag}-{index}", prompt_token_ids=prompt, n=cfg.n, sampling=sampling
            )
            tokens = 0
            async for message in stub.Generate(request, timeout=1800):
                kind = message.WhichOneof("kind")
                if kind == "chunk":
                    tokens += sum(len(d.token_ids) for d in message.chunk.deltas)
                elif kind == "complete":
                    tokens += len(message.complete.token_ids)
                elif kind == "error":
                    raise RuntimeError(f"the engine failed the call: {message.error.message}")
            return tokens

        pusher = asyncio.create_task(push()) if rate > 0 else None
        start = time.perf_counter()
        try:
            made = await asyncio.gather(*(generate(i, p) for i, p in enumerate(prompts)))
            seconds = time.perf_counter() - start
        finally:
            done.set()
            if pusher is not None:
                await pusher
        tokens = sum(made)
    return seconds, tokens, latencies


def run_push_cost(cfg: PushCostConfig) -> Summary:
    from rich.console import Console

    console = Console(width=TABLE_WIDTH)
    with tempfile.TemporaryDirectory(prefix="rollserve-push-cost-") as tmp:
        if cfg.model is not None:
            return _measure(cfg, cfg.model, console)
        from rollserve.engine.tiny_model import make_tiny_model

        console.print("making a tiny random Llama …")
        return _measure(cfg, make_tiny_model(Path(tmp) / "tiny"), console)


def _measure(cfg: PushCostConfig, model: Path, console: Any) -> Summary:
    from rollserve.cli.stack import DevStack, StackConfig

    order = schedule(cfg)
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = random.Random(cfg.seed)
    prompts = [
        [rng.randrange(vocab_size) for _ in range(cfg.prompt_tokens)]
        for _ in range((len(order) + 1) * cfg.calls)
    ]
    runs: list[Run] = []
    stack_config = StackConfig(
        model=model, engines=1, engine_args=cfg.engine_args, run_dir=cfg.run_dir
    )
    console.print(f"starting one engine ({' '.join(cfg.engine_args)}) …")
    with DevStack(stack_config) as stack:
        target = Target(stack.engines[0].address, vocab_size, random.Random(cfg.seed))

        def call(index: int, rate: float) -> tuple[float, int, list[float]]:
            mine = prompts[index * cfg.calls : (index + 1) * cfg.calls]
            return asyncio.run(one_run(target, f"push-cost-{index}", mine, rate, cfg))

        call(len(order), 0.0)  # warm-up: the first call pays for what the engine sets up
        for index, (repeat, rate) in enumerate(order):
            seconds, tokens, latencies = call(index, rate)
            runs.append(Run(rate, repeat, seconds, tokens, latencies))
            console.print(
                f"repeat {repeat} rate {rate:g}/s: {seconds:.1f} s, {tokens} tokens, "
                f"{len(latencies)} pushes"
            )
    summary = Summary.of(runs)
    console.print(table(summary, cfg))
    if cfg.json_path is not None:
        cfg.json_path.write_text(
            json.dumps(
                {
                    "config": {
                        **{k: v for k, v in asdict(cfg).items() if k not in ("json_path",)},
                        "model": str(model),
                        "run_dir": str(cfg.run_dir) if cfg.run_dir else None,
                    },
                    "summary": {str(rate): f for rate, f in summary.figures.items()},
                    "runs": [asdict(r) for r in runs],
                },
                indent=2,
            )
        )
        console.print(f"wrote {cfg.json_path}")
    return summary


def table(summary: Summary, cfg: PushCostConfig) -> Any:
    from rich.table import Table

    t = Table(
        title=f"bench push-cost: {cfg.repeats} repeats, one engine, {cfg.calls} calls x "
        f"{cfg.n} samples (at most {cfg.max_tokens} tokens) together, pushed outputs of "
        f"{cfg.output_tokens} tokens"
    )
    for column in ("pushes/s asked", "seconds", "tokens/s", "vs none", "pushes/s", "push ms"):
        t.add_column(column, justify="right")
    for rate, f in summary.figures.items():
        t.add_row(
            f"{rate:g}",
            f"{f['seconds']:.1f}",
            f"{f['tokens_per_s']:.0f}",
            f"{f['vs_none']:.3f}x",
            f"{f['pushes_per_s']:.1f}",
            f"{f['push_ms']:.1f}",
        )
    return t


def _rates(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"rates ({text!r}) must be comma-separated numbers of pushes a second"
        ) from None


def add_bench_push_cost(bench_sub: Any) -> None:
    """Registers ``push-cost`` under ``rollserve bench``."""
    from rollserve.cli.paths import output_dir, output_file

    p: argparse.ArgumentParser = bench_sub.add_parser(
        "push-cost",
        help="what outputs pushed to a running engine (AddOutputs) cost it, on a real engine",
    )
    d = PushCostConfig()
    p.add_argument("--model", type=Path, help="default: a tiny random Llama made for the run")
    p.add_argument(
        "--rates",
        type=_rates,
        default=d.rates,
        help="pushes a second, comma-separated; must include 0 (default 0,1,20)",
    )
    p.add_argument("--repeats", type=positive_int, default=d.repeats)
    p.add_argument(
        "--calls", type=positive_int, default=d.calls, help="Generate calls that run together"
    )
    p.add_argument("--n", type=positive_int, default=d.n, help="samples of each call")
    p.add_argument("--max-tokens", type=positive_int, default=d.max_tokens)
    p.add_argument("--prompt-tokens", type=positive_int, default=d.prompt_tokens)
    p.add_argument("--output-tokens", type=positive_int, default=d.output_tokens)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--engine-args",
        default=" ".join(d.engine_args),
        help="engine flags, one string (must use --spec-method=rollout to take outputs)",
    )
    p.add_argument("--run-dir", type=output_dir, help="keep every process's log here")
    p.add_argument("--json", type=output_file)
    p.set_defaults(func=_cmd_push_cost)


def _cmd_push_cost(args: argparse.Namespace) -> int:
    try:
        cfg = PushCostConfig(
            model=args.model,
            rates=args.rates,
            repeats=args.repeats,
            calls=args.calls,
            n=args.n,
            max_tokens=args.max_tokens,
            prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens,
            seed=args.seed,
            engine_args=tuple(args.engine_args.split()),
            json_path=args.json,
            run_dir=args.run_dir,
        )
    except ValueError as e:
        raise SystemExit(f"rollserve bench push-cost: {e}") from None
    run_push_cost(cfg)
    return 0
