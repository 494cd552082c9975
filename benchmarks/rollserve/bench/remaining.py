"""``rollserve bench remaining``: how well a running sample's tokens left can be told.

The scheduler predicts every running sample at every plan (what each engine still has to
do, and, for a policy that moves running work, which samples to move). It knows a running
sample by its prompt and its progress: the length predictor's fit of the group conditioned
on ``L > progress``. The simulator showed what a sharper estimate is worth (moves told each
sample's true tokens left bring S1's synchronous step within 1.5% of the oracle, told them
10% off within 5-10%: ``docs/policies.md``), and that it must come from the sample's own
tokens. This benchmark measures candidates for that on real rollouts, side by side, at points
of each sample's run (a quarter, half and three quarters of its length by default):

- ``progress``: what the scheduler uses, the length predictor's fit of the group (its
  prompt's history and the siblings finished by then) conditioned on the sample's progress;
- ``aligned``: a candidate, :func:`align`, where it answers, ``progress`` where it does not.
  A policy asked the same prompt again often retraces an earlier answer, in whole or in
  stretches (what the rollout drafter's acceptance rests on): where a sample's last tokens
  fall in an earlier output of its prompt, that output's length after that point is an
  estimate of what the sample has left;
- ``resampled`` (with ``--resample K``): not an estimate but the bound on every estimate made
  from what a sample shows at that point. The sample's own state (prompt and tokens so far)
  is continued K more times on the dev stack, sampled as the rollouts were, and the median of
  what the continuations made is set against what the sample made: nothing computed from the
  state (its tokens, the model's hidden states) knows more than the state's own continuations
  do. It runs on the samples of the last epoch (``--resample-samples``: every one in the tail,
  then others at random), and the other rows then cover just those; the rollouts must be the
  model's own (``--model``), with their ``--max-tokens``.

Replay: epochs in order, an epoch's groups as one step. The predictor learns an epoch's
lengths at its end, and the prompt's outputs of earlier epochs are the aligner's; within a
group, samples run side by side at the same pace, so a sibling counts as finished (its
length learnt, its output aligned with) at a point ``p`` of a sample when its length is at
most ``p``. Errors are relative, ``|estimate - true| / true`` of the tokens left, reported as
the median and the shares within 5%, 10% and 25%, and absolute (MAE, tokens); ``tail`` is the
samples at or past the ``--tail-quantile`` of their epoch's lengths.

The rollouts are those ``rollserve bench drafts --save FILE`` writes (``--samples FILE``), a
run's delivered groups read from its Redis stream (``--stream RUN --redis-url URL``, as
``bench drafts`` reads them: a prompt's k-th group is its epoch k), or made here on the dev
stack with the shipped trained reasoner (``--groups``, ``--n``, ``--epochs``).

The aligner
-----------
:func:`align` takes the prompt's earlier outputs (the latest ``outputs_per_prompt``) and the
sample's tokens so far:

1. **Anchor**: the sample's last ``anchor`` tokens, looked for in each output (token-aligned
   occurrences, at most ``max_occurrences`` an output; ``bytes.find`` over 4 bytes a token).
2. **Match**: at each occurrence, how many of the sample's last tokens agree with the
   output's before the occurrence's end, up to ``max_match`` (a binary search over suffix
   lengths: a suffix that agrees has every shorter one agree).
3. **Per output**, the occurrence with the longest match counts (a tie: the one nearest the
   sample's progress, as a loop repeats its text at several places).
4. **Vote**: the outputs whose match reaches ``min_match`` tokens each say
   ``len(output) - end`` tokens are left; the answer is their median (the lower middle one for
   an even count), at least 1. No output reaching ``min_match``: no answer.

It is not in the scheduler: on the trained reasoner's rollouts it is sharper than
``progress`` for the typical sample and no better in the tail, the samples that set a
synchronous step's end (``docs/policies.md`` has the figures).
"""

from __future__ import annotations

import argparse
import array
import json
import random
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollserve.bench.drafts import (
    Rollout,
    add_rollout_args,
    given_rollouts,
    make_rollouts,
    tail_start,
)
from rollserve.cli.argtypes import positive_int
from rollserve.scheduler.core.predictor import LengthPredictor

METHODS = ("progress", "aligned", "resampled")
_TOKEN_BYTES = 4  # array("i") on every platform CPython supports


@dataclass(frozen=True, slots=True)
class AlignerSettings:
    """The aligner's settings; see the module docstring for what each does."""

    outputs_per_prompt: int = 8
    anchor: int = 4
    min_match: int = 4
    max_match: int = 256
    max_occurrences: int = 64

    def __post_init__(self) -> None:
        for name in ("outputs_per_prompt", "anchor", "max_occurrences"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 1")
        if self.min_match < self.anchor:
            raise ValueError(f"min_match ({self.min_match}) must be >= anchor ({self.anchor})")
        if self.max_match < self.min_match:
            raise ValueError(
                f"max_match ({self.max_match}) must be >= min_match ({self.min_match})"
            )


@dataclass(frozen=True, slots=True)
class Alignment:
    """What the earlier outputs say of a running sample."""

    left: int  # tokens still to come (>= 1)
    outputs: int  # earlier outputs that voted
    match: int  # the longest agreement among them, in tokens


def align(
    outputs: Sequence[Sequence[int]], tokens: Sequence[int], settings: AlignerSettings
) -> Alignment | None:
    """Tokens still to come of a running sample that has generated ``tokens``, by the latest
    ``outputs_per_prompt`` of its prompt's earlier ``outputs``; None when none agrees."""
    s = settings
    if len(tokens) < s.min_match:
        return None
    tail = _pack(tokens[-s.max_match :])
    anchor = tail[-s.anchor * _TOKEN_BYTES :]
    votes: list[tuple[int, int]] = []  # (tokens left, match)
    for output in outputs[-s.outputs_per_prompt :]:
        packed = _pack(output)
        best = _best_occurrence(packed, tail, anchor, len(tokens), s)
        if best is not None and best[0] >= s.min_match:
            votes.append((len(output) - best[1], best[0]))
    if not votes:
        return None
    lefts = sorted(left for left, _ in votes)
    median = lefts[(len(lefts) - 1) // 2]
    return Alignment(max(median, 1), len(votes), max(match for _, match in votes))


def _pack(tokens: Sequence[int]) -> bytes:
    return array.array("i", tokens).tobytes()


def _best_occurrence(
    output: bytes, tail: bytes, anchor: bytes, progress: int, s: AlignerSettings
) -> tuple[int, int] | None:
    """(match, end in tokens) of the occurrence of ``anchor`` in ``output`` that agrees with
    the most of ``tail``'s last tokens (a tie: the end nearest ``progress``)."""
    best: tuple[int, int] | None = None
    best_key = (0, 0)
    limit = len(tail) // _TOKEN_BYTES
    start, found = 0, 0
    while found < s.max_occurrences:
        at = output.find(anchor, start)
        if at < 0:
            break
        start = at + 1
        if at % _TOKEN_BYTES:
            continue  # inside a token, not at one
        found += 1
        end = (at + len(anchor)) // _TOKEN_BYTES
        # Longest m in [anchor, min(limit, end)] with the last m tokens agreeing.
        lo, hi = s.anchor, min(limit, end)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if (
                output[(end - mid) * _TOKEN_BYTES : end * _TOKEN_BYTES]
                == tail[-mid * _TOKEN_BYTES :]
            ):
                lo = mid
            else:
                hi = mid - 1
        key = (lo, -abs(end - progress))
        if best is None or key > best_key:
            best, best_key = (lo, end), key
    return best


@dataclass
class Errors:
    """Estimates of tokens left against the true ones, for one row of the table."""

    relative: list[float] = field(default_factory=list)
    absolute: list[float] = field(default_factory=list)
    aligned: int = 0  # estimates the aligner gave

    def add(self, estimate: float, true: int, aligned: bool) -> None:
        self.relative.append(abs(estimate - true) / true)
        self.absolute.append(abs(estimate - true))
        self.aligned += aligned

    @property
    def n(self) -> int:
        return len(self.relative)

    def within(self, share: float) -> float:
        return sum(e <= share for e in self.relative) / self.n if self.n else 0.0

    def summary(self) -> dict[str, float]:
        return {
            "samples": self.n,
            "aligned_share": self.aligned / self.n if self.n else 0.0,
            "median_relative_error": statistics.median(self.relative) if self.n else 0.0,
            "within_5pct": self.within(0.05),
            "within_10pct": self.within(0.10),
            "within_25pct": self.within(0.25),
            "mae_tokens": statistics.fmean(self.absolute) if self.n else 0.0,
        }


RowKey = tuple[float, str, str]  # (fraction, "all" | "tail", method)


StateKey = tuple[int, int, int]  # (rollout's position in the list, sample index, progress)


def measure(
    rollouts: Sequence[Rollout],
    fractions: Sequence[float],
    settings: AlignerSettings,
    tail_quantile: float = 0.9,
    resampled: dict[StateKey, list[int]] | None = None,
) -> dict[RowKey, Errors]:
    """The estimates at each of ``fractions`` of every sample's run, epoch by epoch. With
    ``resampled`` (the tokens each continuation of a state made, :func:`resample`), only
    those states, and the ``resampled`` row: their median, the best any estimate from the
    sample's state can do (the continuations are draws of what that state goes on to)."""
    predictor = LengthPredictor()
    outputs: dict[str, list[tuple[int, ...]]] = defaultdict(list)  # prompt -> earlier outputs
    rows: dict[RowKey, Errors] = defaultdict(Errors)
    by_epoch: dict[int, list[tuple[int, Rollout]]] = defaultdict(list)
    for position, r in enumerate(rollouts):
        by_epoch[r.epoch].append((position, r))
    for epoch in sorted(by_epoch):
        groups = by_epoch[epoch]
        predictor.advance_epoch(epoch)
        tail = tail_start([len(x) for _, r in groups for x in r.responses], tail_quantile)
        for position, r in groups:
            for i, response in enumerate(r.responses):
                for fraction in fractions:
                    progress = int(fraction * len(response))
                    state = (position, i, progress)
                    if progress < 1 or (resampled is not None and state not in resampled):
                        continue
                    made = estimates(
                        r, i, progress, predictor=predictor, outputs=outputs, settings=settings
                    )
                    if resampled is not None:
                        made["resampled"] = (float(statistics.median(resampled[state])), False)
                    true = len(response) - progress
                    for which in ("all", "tail") if len(response) >= tail else ("all",):
                        for method, (estimate, aligned) in made.items():
                            rows[(fraction, which, method)].add(estimate, true, aligned)
        for _, r in groups:
            for response in r.responses:
                predictor.observe(r.prompt_key, len(response), epoch, len(r.prompt_token_ids))
                outputs[r.prompt_key].append(response)
    return rows


def pick_states(
    rollouts: Sequence[Rollout],
    fractions: Sequence[float],
    count: int,
    tail_quantile: float = 0.9,
    seed: int = 0,
) -> list[StateKey]:
    """States to continue: of the last epoch's samples, every one in its tail, then others
    drawn at random, ``count`` samples in all, each at every point of ``fractions``."""
    last = max(r.epoch for r in rollouts)
    samples = [
        (p, i) for p, r in enumerate(rollouts) if r.epoch == last for i in range(len(r.responses))
    ]
    tail = tail_start([len(rollouts[p].responses[i]) for p, i in samples], tail_quantile)
    long = [s for s in samples if len(rollouts[s[0]].responses[s[1]]) >= tail]
    rest = [s for s in samples if len(rollouts[s[0]].responses[s[1]]) < tail]
    random.Random(seed).shuffle(rest)
    picked = (long + rest)[:count]
    states = []
    for p, i in sorted(picked):
        length = len(rollouts[p].responses[i])
        for fraction in fractions:
            if int(fraction * length) >= 1:
                states.append((p, i, int(fraction * length)))
    return sorted(set(states))


def resample(
    model: Path,
    rollouts: Sequence[Rollout],
    states: Sequence[StateKey],
    *,
    n: int,
    max_tokens: int,
    seed: int,
    engines: int,
) -> dict[StateKey, list[int]]:
    """``n`` continuations of each state on the dev stack, sampled as the rollouts were
    (temperature 1, ``max_tokens`` over the whole response): the tokens each made."""
    import uuid

    from rollserve.cli.stack import DevStack, StackConfig
    from rollserve.client import PromptGroup, RolloutClient, SamplingParams

    by_id: dict[str, StateKey] = {}
    groups = []
    for k, (position, index, progress) in enumerate(states):
        r = rollouts[position]
        if progress >= max_tokens:
            raise ValueError(
                f"a sample of {r.prompt_key} has {progress} tokens at a point to continue from: "
                f"--max-tokens ({max_tokens}) must be the rollouts' own, above it"
            )
        group_id = f"s{k}"
        by_id[group_id] = (position, index, progress)
        groups.append(
            PromptGroup(
                group_id=group_id,
                prompt_token_ids=[*r.prompt_token_ids, *r.responses[index][:progress]],
                n=n,
                sampling=SamplingParams(
                    temperature=1.0, max_tokens=max_tokens - progress, seed=seed + 1000 * k
                ),
                prompt_key=f"{r.prompt_key}/{index}@{progress}",
            )
        )
    made: dict[StateKey, list[int]] = {}
    with (
        DevStack(StackConfig(model=model, engines=engines)) as stack,
        RolloutClient(
            stack.scheduler_address, stack.redis_url, f"remaining-{uuid.uuid4().hex[:8]}"
        ) as client,
    ):
        client.submit(groups)
        for item in client.groups(limit=len(groups), timeout_s=3600):
            result = item.result
            if result.error:
                raise RuntimeError(f"group {result.group_id} failed: {result.error}")
            made[by_id[result.group_id]] = [len(sample.token_ids) for sample in result.samples]
            item.done()
    return made


def estimates(
    r: Rollout,
    index: int,
    progress: int,
    *,
    predictor: LengthPredictor,
    outputs: dict[str, list[tuple[int, ...]]],
    settings: AlignerSettings,
) -> dict[str, tuple[float, bool]]:
    """Each method's tokens left of sample ``index`` of ``r`` at ``progress``, and whether
    the aligner gave it; ``predictor`` and ``outputs`` (by prompt) hold the earlier epochs."""
    response = r.responses[index]
    finished = [x for j, x in enumerate(r.responses) if j != index and len(x) <= progress]
    fit = predictor.fit(r.prompt_key, len(r.prompt_token_ids), [len(x) for x in finished])
    by_progress = max(0.0, fit.mean_above(progress) - progress)
    earlier = outputs.get(r.prompt_key, [])
    alignment = align((*earlier, *finished), response[:progress], settings)
    return {
        "progress": (by_progress, False),
        "aligned": (by_progress, False) if alignment is None else (float(alignment.left), True),
    }


def _fractions(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated numbers") from None
    if not values or any(not 0.0 < v < 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: each fraction must be between 0 and 1")
    return values


def add_bench_remaining(bench_sub: Any) -> None:
    """Registers ``remaining`` under ``rollserve bench``."""
    from rollserve.bench.drafts import quantile_arg
    from rollserve.cli.paths import output_file

    p: argparse.ArgumentParser = bench_sub.add_parser(
        "remaining",
        help="a running sample's tokens left: the length predictor given its progress against "
        "the output aligner, on real rollouts",
    )
    add_rollout_args(p, epochs=3)
    p.add_argument(
        "--fractions",
        type=_fractions,
        default=(0.25, 0.5, 0.75),
        help="points of each sample's run to estimate at (comma-separated, in (0, 1))",
    )
    p.add_argument(
        "--tail-quantile",
        type=quantile_arg,
        default=0.9,
        help="the tail: samples at or past this quantile of their epoch's lengths",
    )
    defaults = AlignerSettings()
    p.add_argument("--outputs-per-prompt", type=positive_int, default=defaults.outputs_per_prompt)
    p.add_argument("--anchor", type=positive_int, default=defaults.anchor)
    p.add_argument("--min-match", type=positive_int, default=defaults.min_match)
    p.add_argument(
        "--resample",
        type=int,
        default=0,
        metavar="K",
        help="continue each chosen sample's state K times on the dev stack and set the median "
        "of the continuations beside the estimates: the best any estimate from that state can "
        "do (0: off)",
    )
    p.add_argument(
        "--resample-samples",
        type=positive_int,
        default=64,
        help="samples of the last epoch to continue: every one in the tail, then others",
    )
    p.add_argument("--json", type=output_file)
    p.set_defaults(func=_cmd_remaining)


def _cmd_remaining(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=130)  # the table whole, even when stdout is not a terminal
    try:
        settings = AlignerSettings(
            outputs_per_prompt=args.outputs_per_prompt,
            anchor=args.anchor,
            min_match=args.min_match,
            max_match=max(AlignerSettings().max_match, args.min_match),
        )
        if args.resample < 0 or args.resample == 1:
            raise ValueError(f"--resample ({args.resample}) must be 0 (off) or at least 2")
        from rollserve.assets import reasoner_dir

        model = args.model or reasoner_dir()
        given = given_rollouts(args)
        if given is not None:
            rollouts, source = given
        else:
            console.print(
                f"making rollouts on the dev stack: {args.groups} groups x {args.n}, "
                f"{args.epochs} epoch(s), {model} …"
            )
            rollouts = make_rollouts(
                model,
                groups=args.groups,
                n=args.n,
                epochs=args.epochs,
                max_tokens=args.max_tokens,
                seed=args.seed,
                engines=args.engines,
            )
            source = f"{model} (made here on the dev stack, seed {args.seed})"
        resampled = None
        if args.resample:
            states = pick_states(
                rollouts, args.fractions, args.resample_samples, args.tail_quantile, args.seed
            )
            console.print(
                f"continuing {len(states)} states {args.resample} times each on the dev stack, "
                f"{model} …"
            )
            resampled = resample(
                model,
                rollouts,
                states,
                n=args.resample,
                max_tokens=args.max_tokens,
                seed=args.seed,
                engines=args.engines,
            )
    except (ValueError, OSError) as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    rows = measure(rollouts, args.fractions, settings, args.tail_quantile, resampled)
    epochs = len({r.epoch for r in rollouts})
    samples = sum(len(r.responses) for r in rollouts)
    table = Table(
        title=f"tokens left of a running sample: {samples} samples over {epochs} epoch(s) of "
        f"{source}; aligner: anchor {settings.anchor}, min match {settings.min_match}, "
        f"{settings.outputs_per_prompt} outputs a prompt"
        + (
            f"; only the {len(resampled)} states continued {args.resample} times each"
            if resampled is not None
            else ""
        )
    )
    for column in (
        "at",
        "samples",
        "method",
        "n",
        "aligned",
        "median error",
        "within 5%",
        "within 10%",
        "within 25%",
        "MAE tokens",
    ):
        table.add_column(column, justify="left" if column in ("samples", "method") else "right")
    report_rows = []
    for fraction in args.fractions:
        for which in ("all", "tail"):
            for method in METHODS:
                errors = rows.get((fraction, which, method))
                if errors is None or not errors.n:
                    continue
                s = errors.summary()
                report_rows.append(
                    {"fraction": fraction, "samples_of": which, "method": method, **s}
                )
                table.add_row(
                    f"{fraction:g}",
                    which,
                    method,
                    str(errors.n),
                    f"{s['aligned_share']:.0%}" if method == "aligned" else "",
                    f"{s['median_relative_error']:.0%}",
                    f"{s['within_5pct']:.0%}",
                    f"{s['within_10pct']:.0%}",
                    f"{s['within_25pct']:.0%}",
                    f"{s['mae_tokens']:.1f}",
                )
    console.print(table)
    if args.json is not None:
        report = {
            "source": source,
            "settings": {
                "outputs_per_prompt": settings.outputs_per_prompt,
                "anchor": settings.anchor,
                "min_match": settings.min_match,
                "max_match": settings.max_match,
                "tail_quantile": args.tail_quantile,
                "fractions": list(args.fractions),
                "resample": args.resample,
                "resample_samples": args.resample_samples if args.resample else 0,
            },
            "rows": report_rows,
        }
        if resampled is not None:
            # Each continued state: what the sample made from it and what its continuations did.
            report["states"] = [
                {
                    "prompt_key": rollouts[position].prompt_key,
                    "epoch": rollouts[position].epoch,
                    "index": index,
                    "progress": progress,
                    "left": len(rollouts[position].responses[index]) - progress,
                    "continuations": made,
                }
                for (position, index, progress), made in sorted(resampled.items())
            ]
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return 0
