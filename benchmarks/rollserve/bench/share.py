"""``rollserve bench share``: what handing engines the outputs other engines made is worth, on
real engines that speculate with the ``rollout`` drafter.

An engine's rollout drafter drafts a sample from the earlier outputs of its prompt that it
holds. Alone it holds those it made; the scheduler keeps every prompt's newest outputs and has
each Generate call carry the ones its engine lacks, and sends each output that finishes to
the engines running its group's other samples at once (AddOutputs; ``rollserve.scheduler.
outputs``; the scheduler's ``--earlier-outputs-per-prompt``, 0 to turn it off, and
``--no-earlier-outputs-push``). This benchmark runs the same
work on two dev stacks side by side, alike but for that:

- ``shared``: the scheduler's default (outputs handed over);
- ``own``: ``--earlier-outputs-per-prompt 0`` (each engine drafts from what it made), or
  the scheduler flags ``--own-args`` gives (``--no-earlier-outputs-push``: outputs handed
  over with a call of their prompt only, not pushed to engines running their group).

A round takes ``--groups`` prompts no other round has and runs ``--epochs`` passes over them
on each stack, an epoch's groups submitted at once and waited for (a synchronous step), with
the same sampling seeds on both; the stacks' order alternates from round to round so that
the machine's drift hits both alike. Reported per stack: seconds, groups and output tokens a
second, tokens a drafted verification pass made (1 + accepted / passes with drafts), the
share of output tokens that were accepted drafts, and the outputs the scheduler handed over;
epoch 0 (no prompt has outputs yet) apart from the later ones. The ratio column is
``shared`` over ``own`` of the pooled tokens a second.

Temperature 1: a draft changes how fast a sample is made, not its law, but the two stacks'
samples differ draw by draw (a seeded sample's draws depend on the drafts its engine made), so
their lengths and the time they take differ by chance too; more rounds narrow that, and epoch
0, where the two stacks are alike, shows how far chance goes.

Outputs are handed over only where a prompt's samples run on an engine that did not make its
earlier ones: a policy that splits groups (``round_robin``), or one whose placement moves
from epoch to epoch (``rl``). ``least_outstanding`` with a step's groups submitted at once
places each prompt on the same engine every epoch, and hands nothing over.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
import uuid
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollserve.cli.argtypes import positive_int

ARMS = ("shared", "own")
OWN_ARGS = ("--earlier-outputs-per-prompt", "0")
DEFAULT_ENGINE_ARGS = (
    "--spec-method=rollout",
    "--spec-max-batch=16",
    "--spec-factor=1",
    "--spec-min-share=0.3",
)
PARTS = ("all", "epoch 0", "later")
TABLE_WIDTH = 150  # the table's width even where the console reports 80 (not a terminal)
PROMPTS = 1000  # in the shipped prompt set: rounds x groups may not exceed it


@dataclass(frozen=True)
class ShareConfig:
    model: Path | None = None  # None: the shipped trained reasoner
    groups: int = 16  # prompts a round
    n: int = 4
    epochs: int = 4
    max_tokens: int = 1024
    engines: int = 2
    rounds: int = 4
    seed: int = 0
    policy: str = "least_outstanding"
    engine_args: tuple[str, ...] = DEFAULT_ENGINE_ARGS
    scheduler_args: tuple[str, ...] = ()
    own_args: tuple[str, ...] = OWN_ARGS  # the ``own`` stack's scheduler flags besides
    timeout_s: float = 1800.0  # an epoch's deadline
    json_path: Path | None = None
    run_dir: Path | None = None

    def __post_init__(self) -> None:
        for name in ("groups", "n", "epochs", "max_tokens", "engines", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 1")
        if self.epochs < 2:
            raise ValueError(f"epochs ({self.epochs}) must be >= 2: epoch 0 has no outputs yet")
        if self.engines < 2:
            raise ValueError(f"engines ({self.engines}) must be >= 2: one engine makes them all")
        if self.groups * self.rounds > PROMPTS:
            raise ValueError(
                f"groups x rounds ({self.groups} x {self.rounds}) exceeds the {PROMPTS} "
                "prompts of the shipped set: each round needs prompts of its own"
            )
        from rollserve.scheduler.core.policy import policy_names

        if self.policy not in policy_names():
            raise ValueError(
                f"policy ({self.policy!r}) unknown; known: {', '.join(policy_names())}"
            )
        args = self.engine_args
        if "--spec-method=rollout" not in args and (
            ("--spec-method", "rollout") not in set(itertools.pairwise(args))
        ):
            raise ValueError(
                "engine_args must speculate with the rollout drafter (--spec-method=rollout): "
                "no other engine takes earlier outputs"
            )


@dataclass(slots=True)
class Epoch:
    """One epoch of one round on one stack."""

    arm: str
    round: int
    epoch: int
    seconds: float
    groups: int
    tokens: int  # output tokens
    passes: int  # verification passes that carried drafts
    accepted: int  # draft tokens accepted
    proposed: int  # draft tokens proposed
    handed: int  # earlier outputs the scheduler handed to engines in the epoch (both ways)
    pushed: int = 0  # of those, pushed to engines running their groups (AddOutputs)
    # each sample's tokens by "group id/index", to set the stacks' samples side by side
    samples: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False)


@dataclass(slots=True)
class Totals:
    seconds: float = 0.0
    groups: int = 0
    tokens: int = 0
    passes: int = 0
    accepted: int = 0
    proposed: int = 0
    handed: int = 0
    pushed: int = 0

    def add(self, e: Epoch) -> None:
        self.seconds += e.seconds
        self.groups += e.groups
        self.tokens += e.tokens
        self.passes += e.passes
        self.accepted += e.accepted
        self.proposed += e.proposed
        self.handed += e.handed
        self.pushed += e.pushed

    def figures(self) -> dict[str, float]:
        return {
            "seconds": round(self.seconds, 3),
            "groups": self.groups,
            "tokens": self.tokens,
            "groups_per_s": self.groups / self.seconds if self.seconds else 0.0,
            "tokens_per_s": self.tokens / self.seconds if self.seconds else 0.0,
            "tokens_per_drafted_pass": 1 + self.accepted / self.passes if self.passes else 0.0,
            "accepted_share": self.accepted / self.tokens if self.tokens else 0.0,
            "acceptance": self.accepted / self.proposed if self.proposed else 0.0,
            "outputs_handed": self.handed,
            "outputs_pushed": self.pushed,
        }


@dataclass
class Summary:
    """Pooled figures by stack and by part (``all``, ``epoch 0``, ``later``)."""

    figures: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)

    @classmethod
    def of(cls, epochs: Sequence[Epoch]) -> Summary:
        figures: dict[str, dict[str, dict[str, float]]] = {}
        for arm in ARMS:
            parts = {"all": Totals(), "epoch 0": Totals(), "later": Totals()}
            for e in epochs:
                if e.arm != arm:
                    continue
                parts["all"].add(e)
                parts["epoch 0" if e.epoch == 0 else "later"].add(e)
            figures[arm] = {name: totals.figures() for name, totals in parts.items()}
        return cls(figures)

    def ratio(self, part: str, figure: str = "tokens_per_s") -> float:
        """``shared`` over ``own`` of a pooled figure (0 where ``own``'s is 0)."""
        own = self.figures["own"][part][figure]
        return self.figures["shared"][part][figure] / own if own else 0.0


def run_epoch(
    client: Any, arm: str, chosen: Sequence[Any], cfg: ShareConfig, *, rnd: int, epoch: int
) -> Epoch:
    """Submits one epoch's groups at once and waits for every one of them."""
    from rollserve.client import PromptGroup, SamplingParams

    by_id = {f"r{rnd}-e{epoch}-g{g.index}": g for g in chosen}
    handed_before, pushed_before = _handed(client)
    start = time.perf_counter()
    client.submit(
        [
            PromptGroup(
                group_id=group_id,
                prompt_token_ids=g.prompt_token_ids,
                n=cfg.n,
                sampling=SamplingParams(
                    temperature=1.0, max_tokens=cfg.max_tokens, seed=g.seed + 100_000 * epoch
                ),
                prompt_key=g.prompt_key,
                epoch=epoch,
            )
            for group_id, g in by_id.items()
        ]
    )
    tokens = passes = accepted = proposed = received = 0
    samples: dict[str, tuple[int, ...]] = {}
    for item in client.groups(limit=len(by_id), timeout_s=cfg.timeout_s):
        result = item.result
        if result.error:
            raise RuntimeError(f"{arm}: group {result.group_id} failed: {result.error}")
        for s in result.samples:
            samples[f"{result.group_id}/{s.index}"] = tuple(s.token_ids)
            tokens += len(s.token_ids)
            passes += s.spec_drafts
            accepted += s.spec_accepted_tokens
            proposed += s.spec_proposed_tokens
        received += 1
        item.done()
    seconds = time.perf_counter() - start
    if received < len(by_id):
        raise RuntimeError(f"{arm}: {received} of {len(by_id)} groups in {cfg.timeout_s:g} s")
    handed, pushed = _handed(client)
    return Epoch(
        arm,
        rnd,
        epoch,
        seconds,
        received,
        tokens,
        passes,
        accepted,
        proposed,
        handed - handed_before,
        pushed - pushed_before,
        samples,
    )


def _handed(client: Any) -> tuple[int, int]:
    """Outputs the stack's scheduler handed to engines (with calls, and pushed), and of
    those pushed, since it started."""
    status = client.status()
    pushed = int(status.earlier_outputs_pushed)
    return int(status.earlier_outputs_sent) + pushed, pushed


def identical_samples(epochs: Sequence[Epoch]) -> tuple[int, int]:
    """Samples whose tokens are the same on both stacks, of those both made."""
    made: dict[str, dict[str, tuple[int, ...]]] = {arm: {} for arm in ARMS}
    for e in epochs:
        made[e.arm].update(e.samples)
    both = made["shared"].keys() & made["own"].keys()
    return sum(made["shared"][k] == made["own"][k] for k in both), len(both)


def run_share(cfg: ShareConfig) -> Summary:
    from rich.console import Console
    from rollserve.assets import reasoner_dir
    from rollserve.bench.workload import bench_groups
    from rollserve.cli.stack import DevStack, StackConfig
    from rollserve.client import RolloutClient

    console = Console()
    model = cfg.model or reasoner_dir()
    prompts = bench_groups(model, cfg.groups * cfg.rounds, cfg.n, cfg.max_tokens, cfg.seed)
    epochs: list[Epoch] = []
    with ExitStack() as ctx:
        clients = {}
        for arm in ARMS:
            scheduler_args = ("--policy", cfg.policy, *cfg.scheduler_args)
            if arm == "own":
                scheduler_args += cfg.own_args
            console.print(
                f"[bold]{arm}[/bold]: starting the dev stack ({cfg.engines} engines "
                f"{' '.join(cfg.engine_args)}; scheduler {' '.join(scheduler_args)}) …"
            )
            stack = ctx.enter_context(
                DevStack(
                    StackConfig(
                        model=model,
                        engines=cfg.engines,
                        engine_args=cfg.engine_args,
                        scheduler_args=scheduler_args,
                        run_dir=None if cfg.run_dir is None else cfg.run_dir / arm,
                    )
                )
            )
            clients[arm] = ctx.enter_context(
                RolloutClient(
                    stack.scheduler_address, stack.redis_url, f"share-{uuid.uuid4().hex[:8]}"
                )
            )
        for rnd in range(cfg.rounds):
            chosen = prompts[rnd * cfg.groups : (rnd + 1) * cfg.groups]
            order = ARMS if rnd % 2 == 0 else ARMS[::-1]
            for arm in order:
                for epoch in range(cfg.epochs):
                    e = run_epoch(clients[arm], arm, chosen, cfg, rnd=rnd, epoch=epoch)
                    epochs.append(e)
                    console.print(
                        f"round {rnd} {arm:6s} epoch {epoch}: {e.seconds:6.1f} s, "
                        f"{e.tokens} tokens, {1 + e.accepted / max(e.passes, 1):.2f} tokens a "
                        f"drafted pass, {e.handed} outputs handed over"
                    )
    summary = Summary.of(epochs)
    console.width = max(console.width, TABLE_WIDTH)
    console.print(table(summary, cfg))
    same, total = identical_samples(epochs)
    console.print(
        f"samples identical on both stacks: {same} of {total} (same seeds; a speculating "
        "engine's draws depend on its drafts, so the samples may differ, their law not)"
    )
    if cfg.json_path is not None:
        cfg.json_path.write_text(
            json.dumps(
                {
                    "config": {
                        **{k: v for k, v in asdict(cfg).items() if k not in ("json_path",)},
                        "model": str(model),
                        "run_dir": None if cfg.run_dir is None else str(cfg.run_dir),
                    },
                    "summary": summary.figures,
                    "ratio_tokens_per_s": {p: summary.ratio(p) for p in PARTS},
                    "identical_samples": [same, total],
                    "epochs": [
                        {k: v for k, v in asdict(e).items() if k != "samples"} for e in epochs
                    ],
                },
                indent=2,
            )
        )
    return summary


def table(summary: Summary, cfg: ShareConfig) -> Any:
    from rich.table import Table

    t = Table(
        title=f"bench share: {cfg.rounds} rounds x {cfg.epochs} epochs x {cfg.groups} groups x "
        f"{cfg.n} on {cfg.engines} engines ({cfg.policy}; own: {' '.join(cfg.own_args)})"
    )
    for column in (
        "part",
        "stack",
        "seconds",
        "groups/s",
        "tokens/s",
        "tokens/drafted pass",
        "accepted share",
        "outputs handed (pushed)",
        "tokens/s vs own",
    ):
        t.add_column(column, justify="left" if column in ("part", "stack") else "right")
    for part in PARTS:
        for arm in ARMS:
            f = summary.figures[arm][part]
            t.add_row(
                part,
                arm,
                f"{f['seconds']:.1f}",
                f"{f['groups_per_s']:.2f}",
                f"{f['tokens_per_s']:.0f}",
                f"{f['tokens_per_drafted_pass']:.2f}",
                f"{100 * f['accepted_share']:.1f}%",
                f"{int(f['outputs_handed'])} ({int(f['outputs_pushed'])})",
                f"{summary.ratio(part):.3f}x" if arm == "shared" else "1",
            )
    return t


def add_bench_share(bench_sub: Any) -> None:
    """Registers ``share`` under ``rollserve bench``."""
    from rollserve.cli.paths import output_dir, output_file

    p: argparse.ArgumentParser = bench_sub.add_parser(
        "share",
        help="engines drafting from every engine's outputs (the scheduler hands them over) "
        "against each drafting from its own, on real engines",
    )
    d = ShareConfig()
    p.add_argument("--model", type=Path, help="default: the shipped trained reasoner")
    p.add_argument("--groups", type=positive_int, default=d.groups, help="prompts a round")
    p.add_argument("--n", type=positive_int, default=d.n, help="samples per group")
    p.add_argument("--epochs", type=positive_int, default=d.epochs, help="passes a round")
    p.add_argument("--max-tokens", type=positive_int, default=d.max_tokens)
    p.add_argument("--engines", type=positive_int, default=d.engines, help="per stack")
    p.add_argument("--rounds", type=positive_int, default=d.rounds)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--policy", default=d.policy, help="the scheduler's policy on both stacks")
    p.add_argument(
        "--engine-args",
        default=" ".join(d.engine_args),
        help="engine flags on both stacks, one string (must use --spec-method=rollout)",
    )
    p.add_argument("--scheduler-args", default="", help="more scheduler flags, both stacks")
    p.add_argument(
        "--own-args",
        default=" ".join(OWN_ARGS),
        help="the own stack's scheduler flags besides (--no-earlier-outputs-push: outputs "
        "handed over with calls only, to measure the push)",
    )
    p.add_argument("--run-dir", type=output_dir, help="keep every process's log here")
    p.add_argument("--json", type=output_file)
    p.set_defaults(func=_cmd_share)


def _cmd_share(args: argparse.Namespace) -> int:
    try:
        cfg = ShareConfig(
            model=args.model,
            groups=args.groups,
            n=args.n,
            epochs=args.epochs,
            max_tokens=args.max_tokens,
            engines=args.engines,
            rounds=args.rounds,
            seed=args.seed,
            policy=args.policy,
            engine_args=tuple(args.engine_args.split()),
            scheduler_args=tuple(args.scheduler_args.split()),
            own_args=tuple(args.own_args.split()),
            json_path=args.json,
            run_dir=args.run_dir,
        )
    except ValueError as e:
        raise SystemExit(f"rollserve bench share: {e}") from None
    run_share(cfg)
    return 0
