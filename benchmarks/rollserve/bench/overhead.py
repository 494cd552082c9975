"""``rollserve bench overhead``: rollserve vs vLLM's AsyncLLM called directly.

The same batch of prompt groups, the same engine settings, the same seeds, in one
run: through the whole rollserve path (SDK -> scheduler -> one engine service ->
Redis stream -> SDK) and straight through ``AsyncLLM`` in a child process
(``rollserve.bench.direct``). Both engines are up for the whole run (an idle one
costs no CPU); the rounds alternate between them, flipping the order each round,
and the table reports medians. Each round also reads the CPU seconds every part of
the side spent (``rollserve.bench.cpu``): wall time on a shared machine moves with the
machine, CPU seconds for the same work much less, and they show where a gap comes from.

Both sides ask for identical work: every sample is an n=1 request with its own
seed and a logprob per token, so the token counts of both sides must match; the
table shows them so a reader can check. Both run their engine core at normal priority
and everything else at the dev stack's control-plane niceness (the direct side's
AsyncLLM frontend as much as rollserve's engine frontend, scheduler and Redis): see
``rollserve.engine.cpu_priority``. Run it on an otherwise quiet machine: any other busy
process outranks the niced control plane and skews the ratio against rollserve.
Goal: ``overhead_ratio`` (rollserve wall time / direct wall time) at most 1.05.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rollserve.bench.cpu import CpuMeter
from rollserve.bench.workload import BenchGroup, bench_groups
from rollserve.cli.stack import CONTROL_PLANE_NICE, DevStack, StackConfig, engine_threads
from rollserve.client import PromptGroup, RolloutClient, SamplingParams

GOAL = 1.05


@dataclass(frozen=True)
class OverheadConfig:
    model: Path | None = None
    groups: int = 256
    n: int = 4
    max_tokens: int = 1024
    repeats: int = 7
    seed: int = 0
    omp_threads: int = 0  # both sides alike; 0: the dev stack's default for one engine
    json_path: Path | None = None


@dataclass(frozen=True)
class SideResult:
    wall_s: list[float]
    output_tokens: int
    cpu_s: list[dict[str, float]]  # per round, CPU seconds per part

    @property
    def median_s(self) -> float:
        return statistics.median(self.wall_s)

    def cpu_median(self) -> dict[str, float]:
        """Per part, the median over rounds of its CPU seconds in a round."""
        parts = dict.fromkeys(part for row in self.cpu_s for part in row)
        return {p: statistics.median(row.get(p, 0.0) for row in self.cpu_s) for p in parts}

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.median_s


def _to_prompt_groups(groups: list[BenchGroup], prefix: str) -> list[PromptGroup]:
    return [
        PromptGroup(
            group_id=f"{prefix}-{g.index}",
            prompt_token_ids=g.prompt_token_ids,
            n=g.n,
            sampling=SamplingParams(temperature=1.0, max_tokens=g.max_tokens, seed=g.seed),
            prompt_key=g.prompt_key,
        )
        for g in groups
    ]


class RollserveSide:
    """The whole rollserve path: SDK -> scheduler -> engine service -> Redis -> SDK."""

    def __init__(self, stack: DevStack, groups: list[BenchGroup]) -> None:
        self._stack = stack
        self._groups = groups
        self._rep = 0
        engine, scheduler = stack.engines[0].popen.pid, stack.scheduler_pid()
        trees = {"engine": engine, "scheduler": scheduler}
        if stack.redis is not None and stack.redis.pid:
            trees["redis"] = stack.redis.pid
        self.cpu = CpuMeter(trees, {"driver": os.getpid()})

    def run(self) -> tuple[float, int]:
        self._rep += 1
        run_id = f"bench-{uuid.uuid4().hex[:8]}"
        with RolloutClient(self._stack.scheduler_address, self._stack.redis_url, run_id) as client:
            start = time.perf_counter()
            client.submit(_to_prompt_groups(self._groups, f"r{self._rep}"))
            received = 0
            tokens = 0
            for item in client.groups(limit=len(self._groups), timeout_s=1800):
                tokens += item.result.num_output_tokens
                item.done()
                received += 1
            wall = time.perf_counter() - start
        if received != len(self._groups):
            raise RuntimeError(f"rollserve delivered {received} of {len(self._groups)} groups")
        return wall, tokens


class DirectSide:
    """AsyncLLM in a child process (``rollserve.bench.direct``), driven line by line."""

    def __init__(
        self,
        model: Path,
        groups: list[BenchGroup],
        work_dir: Path,
        omp_threads: int,
        frontend_nice: int,
    ) -> None:
        spec = work_dir / "groups.json"
        spec.write_text(json.dumps([asdict(g) for g in groups]))
        self._log = (work_dir / "direct.log").open("wb")
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rollserve.bench.direct",
                "--model",
                str(model),
                "--groups",
                str(spec),
                "--frontend-nice",
                str(frontend_nice),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            start_new_session=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": str(omp_threads)},
        )
        self._log_path = work_dir / "direct.log"
        self._reply()  # "ready"
        # Its frontend is the process itself; its engine core, a child.
        self.cpu = CpuMeter({"engine": self._proc.pid}, {"driver": os.getpid()})

    def _reply(self) -> str:
        assert self._proc.stdout is not None
        # vLLM logs to stdout too: skip lines until our own ("ready" or a JSON object).
        while line := self._proc.stdout.readline():
            if line.strip() == "ready" or line.startswith("{"):
                return line
        tail = self._log_path.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"the direct AsyncLLM process ended early:\n{tail}")

    def run(self) -> tuple[float, int]:
        assert self._proc.stdin is not None
        self._proc.stdin.write("run\n")
        self._proc.stdin.flush()
        out = json.loads(self._reply())
        return float(out["wall_s"]), int(out["output_tokens"])

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError):
            if self._proc.stdin is not None:
                self._proc.stdin.write("quit\n")
                self._proc.stdin.close()
        try:
            self._proc.wait(60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._log.close()


def alternate(
    sides: dict[str, RollserveSide | DirectSide], repeats: int, console: Console
) -> dict[str, SideResult]:
    """One warm-up run per side, then ``repeats`` rounds, the order flipping each round."""
    names = list(sides)
    for name in names:
        sides[name].run()
    walls: dict[str, list[float]] = {name: [] for name in names}
    cpus: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    tokens: dict[str, int] = {}
    for rep in range(repeats):
        for name in names if rep % 2 == 0 else reversed(names):
            side = sides[name]
            before = side.cpu.read()
            wall, count = side.run()
            cpu = CpuMeter.delta(before, side.cpu.read())
            walls[name].append(wall)
            cpus[name].append(cpu)
            tokens[name] = count
            console.print(
                f"  round {rep + 1}/{repeats} {name}: {wall:.2f} s, {count} tokens, "
                f"CPU s {sum(cpu.values()):.2f}"
            )
    return {name: SideResult(walls[name], tokens[name], cpus[name]) for name in names}


def cpu_table(results: dict[str, SideResult]) -> Table:
    """Median CPU seconds per round of every part of every side, side by side."""
    medians = {name: side.cpu_median() for name, side in results.items()}
    parts = list(dict.fromkeys(part for m in medians.values() for part in m))
    table = Table(title="CPU seconds per round (medians)")
    table.add_column("part")
    for name in results:
        table.add_column(name, justify="right")
    for part in [*parts, "total"]:
        cells = []
        for m in medians.values():
            value = sum(m.values()) if part == "total" else m.get(part)
            cells.append("-" if value is None else f"{value:.2f}")
        table.add_row(part, *cells)
    return table


def run_overhead(cfg: OverheadConfig, console: Console | None = None) -> dict[str, object]:
    console = console or Console()
    from rollserve.assets import reasoner_dir

    model = cfg.model or reasoner_dir()
    console.print(f"model: {model}")
    groups = bench_groups(model, cfg.groups, cfg.n, cfg.max_tokens, cfg.seed)
    console.print(
        f"{cfg.groups} groups x n={cfg.n}, max_tokens {cfg.max_tokens}, "
        f"{cfg.repeats} timed rounds (+1 warm-up) per side, alternating"
    )
    threads = cfg.omp_threads or engine_threads(1)
    console.print(
        f"starting both: the rollserve stack (1 engine) and AsyncLLM alone, "
        f"{threads} OpenMP thread(s) each, frontends at niceness {CONTROL_PLANE_NICE} …"
    )
    with (
        tempfile.TemporaryDirectory(prefix="rollserve-bench-") as tmp,
        DevStack(StackConfig(model=model, engines=1, omp_threads=threads)) as stack,
    ):
        # The frontend of the direct side runs at the niceness of the stack's control plane.
        nice = stack.config.control_plane_nice
        direct_side = DirectSide(model, groups, Path(tmp), threads, nice)
        try:
            results = alternate(
                {"rollserve": RollserveSide(stack, groups), "direct": direct_side},
                cfg.repeats,
                console,
            )
        finally:
            direct_side.close()
    ours, direct = results["rollserve"], results["direct"]
    ratio = ours.median_s / direct.median_s

    table = Table(title="rollserve overhead (medians of one run)")
    for column in ("path", "wall s (median)", "wall s (all)", "output tokens", "tokens/s"):
        table.add_column(column, justify="right" if column != "path" else "left")
    for name, side in (("rollserve", ours), ("AsyncLLM direct", direct)):
        table.add_row(
            name,
            f"{side.median_s:.3f}",
            " ".join(f"{w:.2f}" for w in side.wall_s),
            str(side.output_tokens),
            f"{side.tokens_per_s:,.0f}",
        )
    console.print(table)
    console.print(cpu_table(results))
    verdict = "meets" if ratio <= GOAL else "misses"
    console.print(f"overhead_ratio = {ratio:.3f} ({verdict} the goal of {GOAL})")
    report: dict[str, object] = {
        "overhead_ratio": ratio,
        "goal": GOAL,
        "groups": cfg.groups,
        "n": cfg.n,
        "max_tokens": cfg.max_tokens,
        "repeats": cfg.repeats,
        "omp_threads": threads,
        "control_plane_nice": CONTROL_PLANE_NICE,
        "rollserve": {
            "wall_s": ours.wall_s,
            "median_s": ours.median_s,
            "output_tokens": ours.output_tokens,
            "tokens_per_s": ours.tokens_per_s,
            "cpu_s": ours.cpu_median(),
            "cpu_s_rounds": ours.cpu_s,
        },
        "direct": {
            "wall_s": direct.wall_s,
            "median_s": direct.median_s,
            "output_tokens": direct.output_tokens,
            "tokens_per_s": direct.tokens_per_s,
            "cpu_s": direct.cpu_median(),
            "cpu_s_rounds": direct.cpu_s,
        },
    }
    if cfg.json_path is not None:
        cfg.json_path.write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"wrote {cfg.json_path}")
    return report
