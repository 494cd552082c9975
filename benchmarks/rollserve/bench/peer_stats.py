"""What ``rollserve bench peer`` sends and what it records, the same for every side.

The prompt stream is the default prompt set in a seeded order; group ``j`` of the stream has the
same prompt and the same seeds (sample ``i``: ``seed + 1000 * j + i``) on every side, so with
the same engine settings both sides are asked for the same draws. A side records, per measured
step, the groups it delivered to the trainer and how long the step took; :func:`summarize`
turns that into the figures of the table, scoring every delivered sample with the workload's
verifier.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollserve.sim.scenarios import SimGroup
from rollserve.workload import PromptRow, read_prompt_set, score

SEED_STRIDE = 1000  # stream group j's samples use seed + SEED_STRIDE * j + i


@dataclass(frozen=True)
class StreamGroup:
    """Group ``index`` of the prompt stream."""

    index: int
    prompt_key: str
    prompt_token_ids: tuple[int, ...]
    seed: int  # sample i uses seed + i

    @property
    def group_id(self) -> str:
        return f"g{self.index}"


class PromptStream:
    """The default prompt set (or ``prompts``) in the order ``seed`` shuffles it, repeated as
    needed, tokenized with the model's tokenizer; also scores responses (the reward)."""

    def __init__(self, model: Path, prompts: Path | None, seed: int) -> None:
        from rollserve.assets import default_prompts
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
        self.rows: list[PromptRow] = read_prompt_set(prompts or default_prompts())
        self._order = list(range(len(self.rows)))
        random.Random(seed).shuffle(self._order)
        self._by_key = {row.prompt_key: row for row in self.rows}
        self.seed = seed

    def group(self, index: int) -> StreamGroup:
        row = self.rows[self._order[index % len(self._order)]]
        return StreamGroup(
            index=index,
            prompt_key=row.prompt_key,
            prompt_token_ids=tuple(self._tokenizer.encode(row.prompt).ids),
            seed=self.seed + SEED_STRIDE * index,
        )

    def groups(self, start: int = 0) -> Iterator[StreamGroup]:
        index = start
        while True:
            yield self.group(index)
            index += 1

    def reward(self, prompt_key: str, token_ids: Sequence[int]) -> float:
        text = self._tokenizer.decode(list(token_ids), skip_special_tokens=True)
        return score(self._by_key[prompt_key], text)


@dataclass(frozen=True)
class DeliveredSample:
    token_ids: tuple[int, ...]
    finish_reason: str
    engine: str  # the engine that generated it, where the side knows it ("" otherwise)
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    # Tokens labelled with an older policy version than the trainer's when it took the
    # sample (rollserve's rows publish a version a step; the router's has no versions).
    offpolicy_tokens: int = 0
    # Unix seconds: when it was sent to an engine and when it was done (rollserve: the
    # scheduler's first dispatch and its end; the router: the driver's request and reply).
    started_at: float = 0.0
    finished_at: float = 0.0
    # Speculative decoding: draft tokens the engine proposed for the sample, those it
    # accepted, and its passes that carried drafts (rollserve's rows; 0 where the engine did
    # not speculate).
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_drafts: int = 0


@dataclass(frozen=True)
class DeliveredGroup:
    index: int  # in the prompt stream
    prompt_key: str
    launch_step: int  # measured steps count from 0; warm-up steps are negative
    delivery_step: int
    samples: tuple[DeliveredSample, ...]
    failed: str = ""  # the error of a group the side reported failed

    @property
    def staleness(self) -> int:
        return self.delivery_step - self.launch_step

    @property
    def output_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)


@dataclass(frozen=True)
class StepRecord:
    step: int
    wall_s: float
    groups: int
    output_tokens: int
    due: int = 0  # groups the batch waited for (staleness bound); rollserve only
    publish_s: float = 0.0  # the publish of a version after the step; rollserve only


@dataclass
class SideRun:
    """One measured run of one side: K steps after the warm-up."""

    name: str
    steps: list[StepRecord] = field(default_factory=list)
    groups: list[DeliveredGroup] = field(default_factory=list)
    wall_s: float = 0.0
    start_at: float = 0.0  # unix seconds when the measured steps began
    # Prefix-cache counters over the measured steps, where the side reads them from engines.
    cache_queries: int = 0
    cache_hits: int = 0
    samples_per_engine: dict[str, int] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    dropped_at_end: int = 0  # groups launched and never delivered (the carried-over tail)
    engines: int = 0
    # Seconds the side's vLLM engine cores computed and waited for a CPU in the measured
    # steps: their busy time, near enough (``rollserve.bench.cpu.engine_core_time``).
    engine_core_cpu_s: float = 0.0
    engine_core_wait_s: float = 0.0

    @property
    def groups_per_s(self) -> float:
        """Groups delivered (not failed) per second of the measured steps."""
        delivered = sum(1 for g in self.groups if not g.failed)
        return delivered / self.wall_s if self.wall_s > 0 else 0.0


def median_index(runs: Sequence[SideRun]) -> int:
    """The index of the run whose groups/s is the median (the lower middle one of an even
    count)."""
    order = sorted(range(len(runs)), key=lambda i: runs[i].groups_per_s)
    return order[(len(order) - 1) // 2]


@dataclass(frozen=True)
class RowSummary:
    name: str
    steps: int
    groups: int
    failed_groups: int
    wall_s: float
    groups_per_s: float
    makespan_s: float  # mean step time
    max_step_s: float
    output_tokens: int
    output_tokens_per_s: float
    mean_response_tokens: float
    mean_reward: float
    mixed_group_share: float
    length_cut_share: float  # samples that stopped at max_tokens
    staleness: dict[int, int]  # staleness (steps) -> delivered groups
    prefix_hit_rate: float
    engine_share: dict[str, float]  # share of delivered samples each engine generated
    dropped_at_end: int
    # 1 - the engine cores' busy time (computing, or runnable and waiting for a CPU) /
    # (engines x wall time): the share of the engines' time with nothing to compute.
    bubble_ratio: float
    # The engine cores' waits for a CPU / (engines x wall time): time they had work but the
    # machine's CPUs were taken (by the other engine or the processes around them).
    cpu_wait_share: float
    # Share of the delivered output tokens made under an older policy version than the
    # trainer's when it took them (a version is published each step).
    offpolicy_token_fraction: float
    # Speculative decoding over the delivered samples: draft tokens proposed and accepted,
    # and the verification passes that carried them.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    drafted_passes: int = 0


def summarize(run: SideRun, stream: PromptStream) -> RowSummary:
    delivered = [g for g in run.groups if not g.failed]
    samples = [s for g in delivered for s in g.samples]
    rewards = [[stream.reward(g.prompt_key, s.token_ids) for s in g.samples] for g in delivered]
    flat = [r for group in rewards for r in group]
    engines = Counter(run.samples_per_engine)
    total_engine = sum(engines.values())
    steps = [s.wall_s for s in run.steps]
    output_tokens = sum(g.output_tokens for g in delivered)
    wall = run.wall_s
    return RowSummary(
        name=run.name,
        steps=len(run.steps),
        groups=len(delivered),
        failed_groups=len(run.groups) - len(delivered),
        wall_s=wall,
        groups_per_s=run.groups_per_s,
        makespan_s=statistics.fmean(steps) if steps else 0.0,
        max_step_s=max(steps, default=0.0),
        output_tokens=output_tokens,
        output_tokens_per_s=output_tokens / wall if wall > 0 else 0.0,
        mean_response_tokens=output_tokens / len(samples) if samples else 0.0,
        mean_reward=statistics.fmean(flat) if flat else 0.0,
        mixed_group_share=(
            sum(1 for g in rewards if 0 < sum(g) < len(g)) / len(rewards) if rewards else 0.0
        ),
        length_cut_share=(
            sum(1 for s in samples if s.finish_reason == "length") / len(samples)
            if samples
            else 0.0
        ),
        staleness=dict(sorted(Counter(g.staleness for g in delivered).items())),
        prefix_hit_rate=run.cache_hits / run.cache_queries if run.cache_queries else 0.0,
        engine_share={e: c / total_engine for e, c in sorted(engines.items()) if total_engine},
        dropped_at_end=run.dropped_at_end,
        bubble_ratio=bubble_ratio(
            run.engine_core_cpu_s + run.engine_core_wait_s, run.engines, wall
        ),
        cpu_wait_share=run.engine_core_wait_s / (run.engines * wall)
        if run.engines and wall > 0
        else float("nan"),
        offpolicy_token_fraction=(
            sum(s.offpolicy_tokens for s in samples) / output_tokens if output_tokens else 0.0
        ),
        draft_tokens=sum(s.spec_proposed_tokens for s in samples),
        accepted_draft_tokens=sum(s.spec_accepted_tokens for s in samples),
        drafted_passes=sum(s.spec_drafts for s in samples),
    )


def engine_time_shares(runs: Sequence[SideRun]) -> tuple[float, float]:
    """The share of a row's engine time (engines x wall time, all its rounds) its engine
    cores computed, and waited for a CPU; NaN, NaN where it was not measured."""
    capacity = max((r.engines for r in runs), default=0) * sum(r.wall_s for r in runs)
    computing = sum(r.engine_core_cpu_s for r in runs)
    if capacity <= 0 or computing <= 0:
        return float("nan"), float("nan")
    waiting = sum(r.engine_core_wait_s for r in runs)
    return min(1.0, computing / capacity), min(1.0, waiting / capacity)


def bubble_ratio(busy_s: float, engines: int, wall_s: float) -> float:
    """1 - busy engine time / (engines x wall time); NaN where the run did not measure it."""
    if engines < 1 or wall_s <= 0 or busy_s <= 0:
        return float("nan")
    return idle_share(busy_s / (engines * wall_s), 0.0)


def idle_share(computing: float, waiting: float) -> float:
    """The engines' idle share, what computing and waiting for a CPU leave, in [0, 1] (NaN
    where those were not measured)."""
    left = 1.0 - computing - waiting
    return left if math.isnan(left) else min(1.0, max(0.0, left))


def same_draws(a: SideRun, b: SideRun) -> tuple[int, int]:
    """Samples both runs delivered (same stream group and index) and how many of them have the
    same tokens: with the same seeds and engine settings the two sides draw the same responses,
    up to the numerics of different batch compositions."""
    theirs = {g.index: g.samples for g in b.groups if not g.failed}
    both = same = 0
    for group in a.groups:
        other = theirs.get(group.index)
        if other is None or group.failed:
            continue
        for mine, their in zip(group.samples, other, strict=False):
            both += 1
            same += mine.token_ids == their.token_ids
    return both, same


def stream_trace(runs: Sequence[SideRun], stream: PromptStream, start: int) -> list[SimGroup]:
    """The stream's groups from ``start`` on, for as long as every one of them was delivered
    by some run, with the lengths that run recorded (the first run's where several did): the
    workload as the simulator replays it (``rollserve.sim.scenarios``, a trace). The groups
    before ``start`` (the warm-up) and after the first gap are left out, so the trace is the
    stream in its order."""
    lengths: dict[int, tuple[int, ...]] = {}
    for run in runs:
        for group in run.groups:
            if not group.failed:
                lengths.setdefault(group.index, tuple(len(s.token_ids) for s in group.samples))
    out: list[SimGroup] = []
    index = start
    while index in lengths:
        g = stream.group(index)
        out.append(
            SimGroup(
                key=g.group_id,
                prompt_key=g.prompt_key,
                epoch=index // len(stream.rows),
                prompt_len=len(g.prompt_token_ids),
                prefix_id="",
                prefix_len=0,
                max_tokens=0,  # not in a trace: the scenario's
                output_lens=lengths[index],
            )
        )
        index += 1
    return out
