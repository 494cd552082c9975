"""``rollserve bench overhead``: rollserve vs vLLM's AsyncLLM called directly.

The same batch of prompt groups, the same engine settings, the same seeds, in one
run: first through the whole rollserve path (SDK -> scheduler -> one engine
service -> Redis stream -> SDK), then straight through ``AsyncLLM`` in a child
process (``rollserve.bench.direct``), each repeated and reported as medians.

Both sides ask for identical work: every sample is an n=1 request with its own
seed and a logprob per token, so the token counts of both sides must match; the
table shows them so a reader can check. Goal: ``overhead_ratio`` (rollserve wall
time / direct wall time) at most 1.05.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rollserve.bench.workload import BenchGroup, bench_groups
from rollserve.cli.models import default_model_dir, ensure_tiny_model
from rollserve.cli.stack import DevStack, StackConfig
from rollserve.client import PromptGroup, RolloutClient, SamplingParams

GOAL = 1.05


@dataclass(frozen=True)
class OverheadConfig:
    model: Path | None = None
    groups: int = 64
    n: int = 4
    max_tokens: int = 256
    repeats: int = 3
    seed: int = 0
    json_path: Path | None = None


@dataclass(frozen=True)
class SideResult:
    wall_s: list[float]
    output_tokens: int

    @property
    def median_s(self) -> float:
        return statistics.median(self.wall_s)

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
            prompt_key=f"p{g.index}",
        )
        for g in groups
    ]


def run_rollserve(model: Path, groups: list[BenchGroup], repeats: int) -> SideResult:
    walls: list[float] = []
    tokens = 0
    with DevStack(StackConfig(model=model, engines=1)) as stack:
        for rep in range(repeats + 1):  # the first round warms up and is not counted
            run_id = f"bench-{uuid.uuid4().hex[:8]}"
            with RolloutClient(stack.scheduler_address, stack.redis_url, run_id) as client:
                start = time.perf_counter()
                client.submit(_to_prompt_groups(groups, f"r{rep}"))
                received = 0
                rep_tokens = 0
                for item in client.groups(limit=len(groups), timeout_s=1800):
                    rep_tokens += item.result.num_output_tokens
                    item.done()
                    received += 1
                wall = time.perf_counter() - start
            if received != len(groups):
                raise RuntimeError(f"rollserve delivered {received} of {len(groups)} groups")
            if rep > 0:
                walls.append(wall)
                tokens = rep_tokens
    return SideResult(walls, tokens)


def run_direct(model: Path, groups: list[BenchGroup], repeats: int) -> SideResult:
    spec = json.dumps([asdict(g) for g in groups])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollserve.bench.direct",
            "--model",
            str(model),
            "--repeats",
            str(repeats),
        ],
        input=spec.encode(),
        capture_output=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"direct AsyncLLM run failed:\n{proc.stderr.decode()[-4000:]}")
    last = proc.stdout.decode().strip().splitlines()[-1]
    out = json.loads(last)
    return SideResult([float(x) for x in out["wall_s"]], int(out["output_tokens"]))


def run_overhead(cfg: OverheadConfig, console: Console | None = None) -> dict[str, object]:
    console = console or Console()
    model = cfg.model or ensure_tiny_model(default_model_dir(), console)
    groups = bench_groups(model, cfg.groups, cfg.n, cfg.max_tokens, cfg.seed)
    console.print(
        f"{cfg.groups} groups x n={cfg.n}, max_tokens {cfg.max_tokens}, "
        f"{cfg.repeats} timed repeats (+1 warm-up) per side"
    )
    console.print("rollserve: SDK -> scheduler -> engine service -> Redis stream …")
    ours = run_rollserve(model, groups, cfg.repeats)
    console.print("direct: AsyncLLM in one process …")
    direct = run_direct(model, groups, cfg.repeats)
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
    verdict = "meets" if ratio <= GOAL else "misses"
    console.print(f"overhead_ratio = {ratio:.3f} ({verdict} the goal of {GOAL})")
    report: dict[str, object] = {
        "overhead_ratio": ratio,
        "goal": GOAL,
        "groups": cfg.groups,
        "n": cfg.n,
        "max_tokens": cfg.max_tokens,
        "repeats": cfg.repeats,
        "rollserve": {
            "wall_s": ours.wall_s,
            "median_s": ours.median_s,
            "output_tokens": ours.output_tokens,
            "tokens_per_s": ours.tokens_per_s,
        },
        "direct": {
            "wall_s": direct.wall_s,
            "median_s": direct.median_s,
            "output_tokens": direct.output_tokens,
            "tokens_per_s": direct.tokens_per_s,
        },
    }
    if cfg.json_path is not None:
        cfg.json_path.write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"wrote {cfg.json_path}")
    return report
