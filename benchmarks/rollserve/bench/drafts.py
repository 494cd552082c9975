"""``rollserve bench drafts``: what a model-free drafter would give speculative decoding on a
model's own rollouts, measured without speculating.

Speculative decoding with a model-free drafter (vLLM's ``ngram``, suffix trees) proposes ``k``
tokens and the target model verifies them in one pass. vLLM's rejection sampler treats such a
draft as certain, so it accepts a drafted token ``d`` with probability ``p(d | context)``, the
very probability that plain sampling draws ``d`` there. The number of leading drafted tokens a
pass accepts therefore has the same distribution as the number of leading drafted tokens that
equal the tokens a plain sampled rollout went on to draw, and the rollout after a rejection is
distributed as the model's either way. So walking a plain rollout pass by pass (draft from what
came before, count the leading matches, move on by the matches plus the one token the pass
samples itself) gives what speculation would have given on that rollout, for any drafter,
without running it. This works at any temperature; it needs only that the drafts are made from
tokens that already exist when the pass runs.

Drafters compared (each sees only what exists when the pass runs):

- ``ngram``: vLLM's prompt-lookup drafter, exactly: the longest n-gram (``--min-n`` to
  ``--max-n``) ending the sample's prompt and output so far that occurs earlier in them, its
  earliest occurrence, and the ``k`` tokens after it.
- ``group``: the sample's siblings (the other samples of its group, same prompt, launched
  together): the longest suffix match in their prompt and output so far, taken to have made as
  many tokens as the sample itself (they decode side by side); the continuation most of the
  matches took, token by token. Seer's grouped drafts; in the tail the siblings are done.
- ``history``: the same prompt's rollouts in earlier epochs (by ``prompt_key``), the same way.
- ``group+ngram`` and ``all``: the longest match among those sources (a tie goes to the
  siblings, then to history).
- ``rollout``: the engine's own ``rollout`` drafter (``rollserve.engine.drafting``, the same
  code): the sample's own tokens, its siblings (no further than it has got) and the earlier
  epochs in one corpus, the longest match followed back up to ``--max-match`` tokens, the
  continuation most of its occurrences take.

The tail: a step's samples start together, so the tokens past the step's 90th percentile of
response length (``--tail-quantile``) are made while at most a tenth of its samples still run,
where an engine speculates (``--spec-max-batch``). The tail column is over those passes.

The rollouts are made here on the dev stack (the shipped trained reasoner by default, the
peer benchmark's sampling), read from a run's Redis stream (``--stream RUN --redis-url URL``,
without consuming it), or read with ``--samples FILE``: JSON lines, one group a line,
``{"prompt_key": str, "epoch": int, "prompt_token_ids": [int], "responses": [[int]]}``, which is
also what ``--save FILE`` writes; a trainer can write its own rollouts that way to measure them.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

from rollserve.cli.argtypes import positive_int
from rollserve.engine.drafting import NO_MATCH as _NO_MATCH
from rollserve.engine.drafting import DraftSettings, Match, PromptCorpus, vote

DRAFTERS = ("ngram", "group", "history", "group+ngram", "all", "rollout")
_SOURCES = {
    "ngram": (True, False, False),  # (self, siblings, history)
    "group": (False, True, False),
    "history": (False, False, True),
    "group+ngram": (True, True, False),
    "all": (True, True, True),
    "rollout": (True, True, True),  # the engine's drafter: one corpus of all three
}


@dataclass(frozen=True, slots=True)
class Rollout:
    """One group of one epoch: its prompt and its samples' response tokens."""

    prompt_key: str
    epoch: int
    prompt_token_ids: tuple[int, ...]
    responses: tuple[tuple[int, ...], ...]
    # When the engines speculated: draft tokens they proposed and accepted for the group,
    # and the verification passes that carried drafts.
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_drafts: int = 0


class _Index:
    """Where each n-gram (``min_n`` to ``max_n`` long) of a sequence ends, in order."""

    def __init__(self, tokens: Sequence[int], settings: DraftSettings) -> None:
        self.tokens = tuple(tokens)
        self.ends: dict[tuple[int, ...], list[int]] = {}
        for n in range(settings.min_n, settings.max_n + 1):
            for end in range(n, len(self.tokens) + 1):
                self.ends.setdefault(self.tokens[end - n : end], []).append(end)


def corpus_match(
    context: Sequence[int],
    corpus: Sequence[tuple[_Index, int]],
    settings: DraftSettings,
) -> Match:
    """The longest suffix of ``context`` found in the corpus (each index with how many of its
    tokens exist yet), and the continuation most of its occurrences took, token by token (a
    tie goes to the occurrence met first)."""
    for n in range(min(settings.max_n, len(context)), settings.min_n - 1, -1):
        key = tuple(context[len(context) - n :])
        found: list[tuple[tuple[int, ...], int, int]] = []  # (tokens, next, available)
        for index, available in corpus:
            for end in index.ends.get(key, ()):
                if end >= available:
                    break  # ends are ascending: the rest do not exist yet
                found.append((index.tokens, end, available))
        if found:
            return Match(n, vote(found, settings.k))
    return _NO_MATCH


class SelfMatcher:
    """vLLM's ``ngram`` drafter on one growing sequence (prompt, then the output so far):
    the longest suffix (``min_n`` to ``max_n``) that occurs earlier, at its earliest
    occurrence, and up to ``k`` tokens after it (no further than the sequence goes)."""

    def __init__(self, settings: DraftSettings) -> None:
        self.settings = settings
        self.tokens: list[int] = []
        self._first: dict[tuple[int, ...], int] = {}  # n-gram -> its earliest start

    def extend(self, tokens: Iterable[int]) -> None:
        s = self.settings
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in range(s.min_n, min(s.max_n, end) + 1):
                self._first.setdefault(tuple(self.tokens[end - n : end]), end - n)

    def match(self) -> Match:
        s, total = self.settings, len(self.tokens)
        for n in range(min(s.max_n, total), s.min_n - 1, -1):
            start = self._first.get(tuple(self.tokens[total - n :]))
            if start is not None and start < total - n:
                after = start + n
                return Match(n, tuple(self.tokens[after : min(after + s.k, total)]))
        return _NO_MATCH


@dataclass(slots=True)
class PassCounts:
    """Verification passes over some tokens, and what the drafts did in them."""

    passes: int = 0
    tokens: int = 0
    drafted_passes: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    def add(self, drafted: int, accepted: int, advanced: int) -> None:
        self.passes += 1
        self.tokens += advanced
        if drafted:
            self.drafted_passes += 1
            self.draft_tokens += drafted
            self.accepted_tokens += accepted

    def merge(self, other: PassCounts) -> None:
        self.passes += other.passes
        self.tokens += other.tokens
        self.drafted_passes += other.drafted_passes
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens

    @property
    def tokens_per_pass(self) -> float:
        return self.tokens / self.passes if self.passes else math.nan

    @property
    def tokens_per_position(self) -> float:
        """Tokens made per position the model verifies (a pass's own and its drafts): what
        speculation gives where a pass costs by the tokens in it, as on these CPUs."""
        positions = self.passes + self.draft_tokens
        return self.tokens / positions if positions else math.nan

    def to_json(self) -> dict[str, Any]:
        return {
            "passes": self.passes,
            "tokens": self.tokens,
            "tokens_per_pass": round(self.tokens_per_pass, 4) if self.passes else None,
            "tokens_per_position": round(self.tokens_per_position, 4) if self.passes else None,
            "drafted_passes": self.drafted_passes,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "draft_acceptance": (
                round(self.accepted_tokens / self.draft_tokens, 4) if self.draft_tokens else None
            ),
        }


class Drafter(Protocol):
    def __call__(self, t: int) -> Match:
        """The draft for the pass that makes output token ``t`` onward."""
        ...


def walk(
    response: Sequence[int], drafter: Drafter, tail_from: int
) -> tuple[PassCounts, PassCounts]:
    """Runs ``response`` pass by pass: each pass drafts from what exists, accepts the drafted
    tokens that match the response in order, and adds one more (the token the pass samples
    itself), or what is left of the response. The second counts are the passes that start at
    output token ``tail_from`` or later."""
    every, tail = PassCounts(), PassCounts()
    t = 0
    while t < len(response):
        draft = drafter(t).draft
        accepted = 0
        while accepted < len(draft) and t + accepted < len(response):
            if draft[accepted] != response[t + accepted]:
                break
            accepted += 1
        advanced = min(accepted + 1, len(response) - t)
        every.add(len(draft), accepted, advanced)
        if t >= tail_from:
            tail.add(len(draft), accepted, advanced)
        t += advanced
    return every, tail


class _SampleDrafter:
    """The drafts one sample would get from the chosen sources, pass by pass."""

    def __init__(
        self,
        name: str,
        *,
        prompt: Sequence[int],
        response: Sequence[int],
        siblings: Sequence[_Index],
        history: Sequence[_Index],
        settings: DraftSettings,
    ) -> None:
        use_self, use_siblings, use_history = _SOURCES[name]
        self.prompt_len = len(prompt)
        self.response = response
        self.settings = settings
        self.own: SelfMatcher | None = None
        if use_self:
            self.own = SelfMatcher(settings)
            self.own.extend(prompt)
        self.siblings = siblings if use_siblings else ()
        # earlier epochs exist whole from the start; siblings grow with the sample (below)
        self.history = [(i, len(i.tokens)) for i in history] if use_history else []
        self.context = list(prompt)

    def __call__(self, t: int) -> Match:
        grown = self.response[len(self.context) - self.prompt_len : t]
        self.context.extend(grown)
        if self.own is not None:
            self.own.extend(grown)
        available = self.prompt_len + t  # siblings have made as many tokens by now
        best = _NO_MATCH
        sources = ([(i, min(available, len(i.tokens))) for i in self.siblings], self.history)
        for corpus in sources:
            if corpus:
                found = corpus_match(self.context, corpus, self.settings)
                if found.length > best.length:
                    best = found
        if self.own is not None:
            own = self.own.match()
            if own.length > best.length:
                best = own
        return best


class _RolloutSampleDrafter:
    """The engine's ``rollout`` drafter for one sample: its prompt's corpus holds the earlier
    epochs' samples whole, the siblings as far as the sample has got, and the sample itself."""

    def __init__(
        self,
        *,
        prompt: Sequence[int],
        response: Sequence[int],
        siblings: Sequence[Sequence[int]],
        history: Sequence[Sequence[int]],
        settings: DraftSettings,
    ) -> None:
        self.corpus = PromptCorpus(prompt, settings)
        self.corpus.add_samples(history)
        self.siblings = self.corpus.add_samples(siblings)
        self.seq = self.corpus.add_sample()
        self.response = response
        self.k = settings.k

    def __call__(self, t: int) -> Match:
        have = self.corpus.output_len(self.seq)
        self.corpus.extend(self.seq, self.response[have:t])
        available = self.corpus.boundary_len + t
        return self.corpus.match(self.seq, self.k, {s: available for s in self.siblings})


@dataclass
class DrafterResult:
    name: str
    every: PassCounts = field(default_factory=PassCounts)
    tail: PassCounts = field(default_factory=PassCounts)
    tail_by_epoch: dict[int, PassCounts] = field(default_factory=dict)  # the tail, per epoch


def tail_start(lengths: Sequence[int], quantile: float) -> int:
    """The output position past which at most ``1 - quantile`` of the samples still run."""
    ordered = sorted(lengths)
    if not ordered:
        return 0
    return ordered[min(len(ordered) - 1, math.ceil(quantile * len(ordered)) - 1)]


def measure(
    rollouts: Sequence[Rollout],
    drafters: Sequence[str],
    settings: DraftSettings,
    tail_quantile: float = 0.9,
    *,
    history_engines: int = 1,
    seed: int = 0,
) -> list[DrafterResult]:
    """Every drafter over every sample of ``rollouts``; an epoch's groups are one step (the
    tail is past that step's ``tail_quantile`` of response length).

    ``history_engines`` > 1 walks a fleet of that many engines, each keeping only the
    outputs it made: every group (an epoch's samples of a prompt, whole) ran on an engine
    drawn at random (``seed``), with no regard to where the prompt ran before, and a sample's
    history is the earlier groups of its prompt that ran on its engine."""
    unknown = [d for d in drafters if d not in _SOURCES]
    if unknown:
        raise ValueError(f"unknown drafter {unknown[0]!r}; choose from {', '.join(DRAFTERS)}")
    if history_engines < 1:
        raise ValueError(f"history_engines ({history_engines}) must be at least 1")
    draw = random.Random(seed)
    engine_of = [draw.randrange(history_engines) for _ in rollouts]
    indexes = [
        [_Index((*r.prompt_token_ids, *resp), settings) for resp in r.responses] for r in rollouts
    ]
    lengths: dict[int, list[int]] = {}
    by_key: dict[str, list[int]] = {}
    for g, r in enumerate(rollouts):
        lengths.setdefault(r.epoch, []).extend(len(x) for x in r.responses)
        by_key.setdefault(r.prompt_key, []).append(g)
    tails = {epoch: tail_start(values, tail_quantile) for epoch, values in lengths.items()}
    earlier = [  # each group's earlier epochs of its prompt, on its engine
        [
            h
            for h in by_key[rollout.prompt_key]
            if rollouts[h].epoch < rollout.epoch and engine_of[h] == engine_of[g]
        ]
        for g, rollout in enumerate(rollouts)
    ]
    results = []
    for name in drafters:
        result = DrafterResult(name)
        for g, rollout in enumerate(rollouts):
            for i, response in enumerate(rollout.responses):
                drafter: Drafter
                if name == "rollout":
                    drafter = _RolloutSampleDrafter(
                        prompt=rollout.prompt_token_ids,
                        response=response,
                        siblings=[x for j, x in enumerate(rollout.responses) if j != i],
                        history=[x for h in earlier[g] for x in rollouts[h].responses],
                        settings=settings,
                    )
                else:
                    drafter = _SampleDrafter(
                        name,
                        prompt=rollout.prompt_token_ids,
                        response=response,
                        siblings=[x for j, x in enumerate(indexes[g]) if j != i],
                        history=[x for h in earlier[g] for x in indexes[h]],
                        settings=settings,
                    )
                every, tail = walk(response, drafter, tails[rollout.epoch])
                result.every.merge(every)
                result.tail.merge(tail)
                result.tail_by_epoch.setdefault(rollout.epoch, PassCounts()).merge(tail)
        results.append(result)
    return results


# --- reading, writing and making rollouts ---------------------------------------------------


def read_rollouts(path: Path) -> list[Rollout]:
    """JSON lines, one group a line; a ValueError that names the line and the field."""
    rollouts = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: a group is a JSON object, got {type(row).__name__}")
            rollouts.append(_rollout(row, where))
    if not rollouts:
        raise ValueError(f"{path}: no groups")
    return rollouts


def _tokens(value: Any, where: str, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise ValueError(f"{where}: {name} must be a list of token ids (integers >= 0)")
    return tuple(value)


def _rollout(row: dict[str, Any], where: str) -> Rollout:
    key, epoch = row.get("prompt_key"), row.get("epoch")
    if not isinstance(key, str) or not key:
        raise ValueError(f"{where}: prompt_key must be a non-empty string")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise ValueError(f"{where}: epoch must be an integer >= 0, got {epoch!r}")
    prompt = _tokens(row.get("prompt_token_ids"), where, "prompt_token_ids")
    responses = row.get("responses")
    if not isinstance(responses, list) or not responses:
        raise ValueError(f"{where}: responses must be a non-empty list of token-id lists")
    counts = []
    for name in ("spec_proposed", "spec_accepted", "spec_drafts"):
        value = row.get(name, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{where}: {name} must be an integer >= 0, got {value!r}")
        counts.append(value)
    return Rollout(
        key,
        epoch,
        prompt,
        tuple(_tokens(r, where, f"responses[{i}]") for i, r in enumerate(responses)),
        *counts,
    )


def read_stream(redis_url: str, run_id: str) -> list[Rollout]:
    """A run's delivered groups from its Redis stream, read without consuming them (XRANGE:
    no consumer group, nothing acknowledged). The k-th group of a ``prompt_key`` by
    submission is its epoch k; failed groups (no samples) are left out."""
    import redis
    from rollserve.client.wire import GroupStatus, decode_entry, stream_key

    results = []
    try:
        client = redis.Redis.from_url(redis_url)
        try:
            start = "-"
            while page := cast(
                list[tuple[bytes, dict[bytes, bytes]]],
                client.xrange(stream_key(run_id), min=start, max="+", count=500),
            ):
                for entry_id, fields in page:
                    result = decode_entry(fields)
                    if result.status == GroupStatus.DELIVERED and result.samples:
                        results.append(result)
                    start = f"({entry_id.decode()}"
        finally:
            client.close()
    except redis.RedisError as e:
        raise ValueError(f"cannot read run {run_id!r} at {redis_url}: {e}") from None
    if not results:
        raise ValueError(f"run {run_id!r} has no delivered groups in the stream at {redis_url}")
    results.sort(key=lambda r: (r.submitted_at, r.group_id))
    seen: Counter[str] = Counter()
    rollouts = []
    for r in results:
        key = r.prompt_key or r.group_id  # no key: no history, each group its own prompt
        ordered = sorted(r.samples, key=lambda s: s.index)
        rollouts.append(
            Rollout(
                key,
                seen[key],
                tuple(r.prompt_token_ids),
                tuple(tuple(s.token_ids) for s in ordered),
                sum(s.spec_proposed_tokens for s in ordered),
                sum(s.spec_accepted_tokens for s in ordered),
                sum(s.spec_drafts for s in ordered),
            )
        )
        seen[key] += 1
    return rollouts


def write_rollouts(path: Path, rollouts: Sequence[Rollout]) -> None:
    with path.open("w") as f:
        for r in rollouts:
            row = {
                "prompt_key": r.prompt_key,
                "epoch": r.epoch,
                "prompt_token_ids": list(r.prompt_token_ids),
                "responses": [list(x) for x in r.responses],
            }
            if r.spec_proposed:
                row |= {
                    "spec_proposed": r.spec_proposed,
                    "spec_accepted": r.spec_accepted,
                    "spec_drafts": r.spec_drafts,
                }
            f.write(json.dumps(row) + "\n")


def make_rollouts(
    model: Path, *, groups: int, n: int, epochs: int, max_tokens: int, seed: int, engines: int
) -> list[Rollout]:
    """``epochs`` passes over the same ``groups`` prompts on the dev stack, each epoch's groups
    at once, new sampling seeds each epoch, temperature 1 (the peer benchmark's sampling)."""
    import uuid

    from rollserve.bench.workload import bench_groups
    from rollserve.cli.stack import DevStack, StackConfig
    from rollserve.client import PromptGroup, RolloutClient, SamplingParams

    chosen = bench_groups(model, groups, n, max_tokens, seed)
    rollouts = []
    with (
        DevStack(StackConfig(model=model, engines=engines)) as stack,
        RolloutClient(
            stack.scheduler_address, stack.redis_url, f"drafts-{uuid.uuid4().hex[:8]}"
        ) as client,
    ):
        for epoch in range(epochs):
            by_id = {f"e{epoch}-g{g.index}": g for g in chosen}
            client.submit(
                [
                    PromptGroup(
                        group_id=group_id,
                        prompt_token_ids=g.prompt_token_ids,
                        n=n,
                        sampling=SamplingParams(
                            temperature=1.0, max_tokens=max_tokens, seed=g.seed + 100_000 * epoch
                        ),
                        prompt_key=g.prompt_key,
                        epoch=epoch,
                    )
                    for group_id, g in by_id.items()
                ]
            )
            for item in client.groups(limit=len(by_id), timeout_s=1800):
                result = item.result
                if result.error:
                    raise RuntimeError(f"group {result.group_id} failed: {result.error}")
                g = by_id[result.group_id]
                ordered = sorted(result.samples, key=lambda s: s.index)
                rollouts.append(
                    Rollout(
                        g.prompt_key,
                        epoch,
                        tuple(g.prompt_token_ids),
                        tuple(tuple(s.token_ids) for s in ordered),
                    )
                )
                item.done()
    return rollouts


@dataclass(frozen=True, slots=True)
class Speculated:
    """Rollouts made by a speculating engine, with what it reported."""

    rollouts: list[Rollout]
    nan_logprobs: int  # tokens whose logprob came back NaN
    tokens: int


def make_speculated_rollouts(
    model: Path,
    settings: DraftSettings,
    *,
    method: str = "ngram",
    groups: int,
    n: int,
    epochs: int,
    max_tokens: int,
    seed: int,
) -> Speculated:
    """The same groups and seeds as :func:`make_rollouts`, through one ``AsyncLLM`` that
    speculates in every step with ``method`` (vLLM's ``ngram`` or the engine's ``rollout``
    drafter) and ``settings`` (``drafts_direct.py``, a child process: NaN logprobs are
    counted there, where the engine service would fail the sample)."""
    import os
    import subprocess
    import sys
    import tempfile
    from dataclasses import asdict

    from rollserve.bench.workload import bench_groups

    chosen = bench_groups(model, groups, n, max_tokens, seed)
    with tempfile.TemporaryDirectory(prefix="rollserve-drafts-") as tmp:
        spec = Path(tmp) / "groups.json"
        spec.write_text(json.dumps({"groups": [asdict(g) for g in chosen], "epochs": epochs}))
        out = Path(tmp) / "rollouts.jsonl"
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "rollserve.bench.drafts_direct",
                f"--model={model}",
                f"--groups={spec}",
                f"--out={out}",
                f"--k={settings.k}",
                f"--min-n={settings.min_n}",
                f"--max-n={settings.max_n}",
                f"--method={method}",
                f"--spec-factor={settings.spec_factor}",
                f"--min-share={settings.min_share}",
            ],
            capture_output=True,
            text=True,
            check=False,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"the speculating engine failed (exit {done.returncode}): {done.stderr[-2000:]}"
            )
        totals = json.loads(done.stdout.strip().splitlines()[-1])
        return Speculated(read_rollouts(out), int(totals["nan_logprobs"]), int(totals["tokens"]))


# --- the command ------------------------------------------------------------------------------


def quantile_arg(text: str) -> float:
    """An argparse type: a number strictly between 0 and 1."""
    value = float(text)
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"{value} must be between 0 and 1")
    return value


def add_rollout_args(p: argparse.ArgumentParser, *, epochs: int) -> None:
    """Where a benchmark's rollouts come from: a file (``--samples``), a run's stream
    (``--stream``, ``--redis-url``), or made on the dev stack (the rest); see
    :func:`given_rollouts` and :func:`make_rollouts`."""
    p.add_argument("--samples", type=Path, help="rollouts as JSON lines (default: make them)")
    p.add_argument(
        "--stream",
        metavar="RUN",
        help="a run's delivered groups, read from its Redis stream (--redis-url) without "
        "consuming them",
    )
    p.add_argument("--redis-url", help="the Redis of --stream")
    p.add_argument("--model", type=Path, help="default: the shipped trained reasoner")
    p.add_argument("--groups", type=positive_int, default=64, help="prompts, one group each")
    p.add_argument("--n", type=positive_int, default=4, help="samples per group")
    p.add_argument(
        "--epochs", type=positive_int, default=epochs, help="passes over the same prompts"
    )
    p.add_argument("--max-tokens", type=positive_int, default=1024)
    p.add_argument("--engines", type=positive_int, default=2)
    p.add_argument("--seed", type=int, default=0)


def given_rollouts(args: argparse.Namespace) -> tuple[list[Rollout], str] | None:
    """The rollouts of ``--samples`` or ``--stream`` and where they came from; None when
    neither is given (they are to be made). ValueError for a contradiction."""
    if args.samples is not None and args.stream is not None:
        raise ValueError("give --samples or --stream, not both")
    if (args.stream is None) != (args.redis_url is None):
        raise ValueError("--stream RUN and --redis-url URL go together")
    if args.samples is not None:
        return read_rollouts(args.samples), str(args.samples)
    if args.stream is not None:
        return read_stream(args.redis_url, args.stream), f"run {args.stream} at {args.redis_url}"
    return None


def add_bench_drafts(bench_sub: Any) -> None:
    """Registers ``drafts`` under ``rollserve bench``."""
    from rollserve.cli.paths import output_file

    p: argparse.ArgumentParser = bench_sub.add_parser(
        "drafts",
        help="tokens a verification pass would give with model-free drafters (ngram, siblings, "
        "history), measured on plain rollouts",
    )
    add_rollout_args(p, epochs=2)
    p.add_argument("--save", type=output_file, help="write the rollouts used as JSON lines")
    p.add_argument(
        "--speculate",
        action="store_true",
        help="make the rollouts on one AsyncLLM that speculates with --spec-method (--k, "
        "--min-n, --max-n), and set what it accepted beside what the walk gives on the same "
        "rollouts",
    )
    p.add_argument(
        "--spec-method",
        choices=("ngram", "rollout"),
        default="ngram",
        help="the drafter of --speculate: vLLM's ngram or the engine's rollout drafter",
    )
    p.add_argument("--drafters", default=",".join(DRAFTERS), help="comma-separated")
    p.add_argument("--k", type=positive_int, default=4, help="draft tokens a pass")
    p.add_argument("--min-n", type=positive_int, default=2, help="shortest suffix matched")
    p.add_argument("--max-n", type=positive_int, default=5, help="longest suffix matched")
    p.add_argument(
        "--spec-factor",
        type=float,
        default=0.0,
        help="rollout: at most this many draft tokens per matched token (0: up to --k)",
    )
    p.add_argument(
        "--min-share",
        type=float,
        default=0.0,
        help="rollout: stop a draft where the share of occurrences agreeing falls below this",
    )
    p.add_argument(
        "--tail-quantile",
        type=quantile_arg,
        default=0.9,
        help="the tail: output past this quantile of a step's response lengths",
    )
    p.add_argument(
        "--history-engines",
        type=positive_int,
        default=1,
        help="walk a fleet of this many engines that each keep only their own outputs: every "
        "group ran whole on one drawn at random (--seed), so a sample's history is its "
        "prompt's earlier groups that ran there (1: every earlier group)",
    )
    p.add_argument("--json", type=output_file)
    p.set_defaults(func=_cmd_drafts)


def _cmd_drafts(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    try:
        settings = DraftSettings(
            k=args.k,
            min_n=args.min_n,
            max_n=args.max_n,
            spec_factor=args.spec_factor,
            min_share=args.min_share,
        )
        drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
        unknown = [d for d in drafters if d not in _SOURCES]
        if not drafters or unknown:
            raise ValueError(f"--drafters ({args.drafters!r}): choose from {', '.join(DRAFTERS)}")
        given = given_rollouts(args)
        if args.speculate and given is not None:
            raise ValueError("--speculate makes rollouts; it cannot go with --samples or --stream")
        nan_logprobs: int | None = None
        if given is not None:
            rollouts, source = given
        else:
            from rollserve.assets import reasoner_dir

            model = args.model or reasoner_dir()
            where = "on one speculating AsyncLLM" if args.speculate else "on the dev stack"
            console.print(
                f"making rollouts {where}: {args.groups} groups x {args.n}, "
                f"{args.epochs} epoch(s), {model} …"
            )
            shape = {
                "groups": args.groups,
                "n": args.n,
                "epochs": args.epochs,
                "max_tokens": args.max_tokens,
                "seed": args.seed,
            }
            if args.speculate:
                speculated = make_speculated_rollouts(
                    model, settings, method=args.spec_method, **shape
                )
                rollouts = speculated.rollouts
                nan_logprobs = speculated.nan_logprobs
                source = f"{model} (made here on one speculating AsyncLLM, seed {args.seed})"
            else:
                rollouts = make_rollouts(model, engines=args.engines, **shape)
                source = f"{model} (made here on the dev stack, seed {args.seed})"
    except (ValueError, OSError) as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    if args.save is not None:
        write_rollouts(args.save, rollouts)
    results = measure(
        rollouts,
        drafters,
        settings,
        args.tail_quantile,
        history_engines=args.history_engines,
        seed=args.seed,
    )
    samples = sum(len(r.responses) for r in rollouts)
    tokens = sum(len(x) for r in rollouts for x in r.responses)
    table = Table(
        title=f"model-free drafts on {samples} plain rollouts ({tokens} tokens), k={settings.k}, "
        f"n-grams {settings.min_n}-{settings.max_n}; tail: past the {args.tail_quantile:g} "
        "quantile of a step's lengths"
        + (
            f"; history: the engine's own, of {args.history_engines} (groups placed at random)"
            if args.history_engines > 1
            else ""
        )
    )
    for column in (
        "drafter",
        "tokens a pass",
        "tail: tokens a pass",
        "passes drafted",
        "drafts accepted",
        "tail: drafts accepted",
        "tail: tokens a position",
    ):
        table.add_column(column, justify="left" if column == "drafter" else "right")
    for r in results:
        table.add_row(
            r.name,
            f"{r.every.tokens_per_pass:.2f}",
            f"{r.tail.tokens_per_pass:.2f}",
            _share(r.every.drafted_passes, r.every.passes),
            _share(r.every.accepted_tokens, r.every.draft_tokens),
            _share(r.tail.accepted_tokens, r.tail.draft_tokens),
            f"{r.tail.tokens_per_position:.2f}",
        )
    console.print(table)
    engine = PassCounts(
        drafted_passes=sum(r.spec_drafts for r in rollouts),
        draft_tokens=sum(r.spec_proposed for r in rollouts),
        accepted_tokens=sum(r.spec_accepted for r in rollouts),
    )
    method = args.spec_method
    walked = next((r.every for r in results if r.name == method), None)
    if engine.draft_tokens:
        line = (
            f"the engine's own {method} drafts on these rollouts: {engine.accepted_tokens} of "
            f"{engine.draft_tokens} draft tokens accepted "
            f"({_share(engine.accepted_tokens, engine.draft_tokens)})"
        )
        if engine.drafted_passes:
            line += f", {_per_drafted_pass(engine)} tokens a drafted pass"
        if walked is not None:
            line += (
                f"; the walk's {method} on the same rollouts: "
                f"{_share(walked.accepted_tokens, walked.draft_tokens)}, "
                f"{_per_drafted_pass(walked)} tokens a drafted pass"
            )
        console.print(line)
    if nan_logprobs:
        console.print(
            f"the speculating engine returned NaN as the logprob of {nan_logprobs} tokens"
        )
    console.print(
        "tokens a pass = the --spec-accept of `rollserve bench policies` (its +spec rows "
        "speculate in the tail: use the tail's figure)"
    )
    history = next((r for r in results if r.name == "rollout"), None)
    if history is not None and len(history.tail_by_epoch) > 1:
        # Epoch k's samples have k earlier groups of their prompt (on their engine, when
        # --history-engines is 1): the simulator's acceptance by what an engine holds.
        by_epoch = _tail_by_epoch(history)
        group_size = max(len(r.responses) for r in rollouts)
        console.print(
            "rollout's tail by epoch (epoch k: k earlier groups of the prompt): "
            f"--spec-accept-by-history {','.join(f'{a:.2f}' for a in by_epoch)} "
            f"--spec-history-outputs {group_size}"
        )
    if args.json is not None:
        report = {
            "source": source,
            "settings": {
                "k": settings.k,
                "min_n": settings.min_n,
                "max_n": settings.max_n,
                "tail_quantile": args.tail_quantile,
                "history_engines": args.history_engines,
                "spec_factor": settings.spec_factor,
                "min_share": settings.min_share,
            },
            "groups": len(rollouts),
            "samples": samples,
            "samples_per_group": max(len(r.responses) for r in rollouts),
            "tokens": tokens,
            "drafters": {
                r.name: {
                    "all": r.every.to_json(),
                    "tail": r.tail.to_json(),
                    "tail_tokens_per_pass_by_epoch": [round(a, 4) for a in _tail_by_epoch(r)],
                }
                for r in results
            },
            "nan_logprobs": nan_logprobs,
        }
        if engine.draft_tokens:
            report["engine_drafts"] = {
                "method": method,
                "draft_tokens": engine.draft_tokens,
                "accepted_tokens": engine.accepted_tokens,
                "draft_acceptance": round(engine.accepted_tokens / engine.draft_tokens, 4),
                "drafted_passes": engine.drafted_passes,
            }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _tail_by_epoch(result: DrafterResult) -> list[float]:
    """The tail's tokens a pass in each epoch, in epoch order (epochs with no tail left out)."""
    return [
        counts.tokens_per_pass
        for _, counts in sorted(result.tail_by_epoch.items())
        if counts.passes
    ]


def _per_drafted_pass(counts: PassCounts) -> str:
    """Tokens a pass that carried drafts made (its own and the drafts accepted); "-" where
    no pass did."""
    if not counts.drafted_passes:
        return "-"
    return f"{1 + counts.accepted_tokens / counts.drafted_passes:.2f}"


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"
