"""Discrete-event mode: the scheduler's own policies over simulated engines, in virtual time.

The loop keeps, per engine, a :class:`~rollserve.sim.engine_model.SimEngine` and the time its
current step ends. Events are step completions, taken in time order:

1. at a completion, the samples that finished in that step are recorded (a group is done when
   its last sample is); when any did (or groups arrived), the policy is asked for a plan on a
   snapshot built as the scheduler runtime builds one (queue in arrival order, engine views
   with in-flight samples, capacity ``ceil(max_num_seqs * capacity_factor)``, outstanding and
   predicted tokens, KV use), and its assignments are added to the engines;
2. every engine with work and no step in progress starts a step now; the step's outcome is
   computed at its start (the engine's state moves on) and its completion is queued at
   ``now + duration``. Requests added to an engine during its step wait for its next step,
   as in vLLM.

Two ways to run a trainer's steps (trainer time is not modelled; step ``k`` generates with
policy version ``k``):

- **synchronous** (:func:`run_des`): each step submits its groups at once and ends when all of
  them are done. Every token is on-policy.
- **over-sampled, with tail deferral** (:func:`run_des_async`): the trainer asks for ``batch``
  groups a step. At a step's start the groups in flight (carried over) are topped up from the
  group stream to ``ceil(batch * (1 + oversample))``; the step ends when ``batch`` groups are
  done, and the rest run on into later steps (partial rollouts: they keep their tokens and go
  on under the new version). Staleness bound (``due``): by default a group with tokens of
  version ``k - max_staleness`` or older must be delivered in step ``k``, so step ``k`` also
  waits for those (they are done first because they carry the trainer's priority, their
  launch step); a group launched but still queued has no tokens and is not due yet. With
  ``due="launch"`` a group launched at step ``k - max_staleness`` or earlier is due in step
  ``k`` whether or not it has started: the rule of the SDK's ``StepBatcher``, which sees
  launches and not tokens, and so waits for more.
  Every delivered sample's tokens are counted per version: the off-policy fraction is the
  share of delivered tokens generated under an older version than the step's.

Weight updates (``DesConfig.weight_updates``): at each new version every engine lets its step
in flight end, starts nothing for the profile's ``weights_load_s``, and then recomputes its
running samples (prompt + tokens so far) with an empty prefix cache, as vLLM's in-place reload
leaves it (``SimEngine.new_weights``). Off, versions change for free.

Preemptions: a policy that moves running work (``Policy.moves_running``) is shown the running
samples and asked for a plan at every finished sample, queue or not. A ``Preempt`` aborts the
sample on its engine and keeps its tokens; it resumes on the target engine (or, with none,
from the queue) as a new request whose prompt is prompt + partial response, with
``max_tokens`` and its true length reduced by what it has, so the target prefills the whole
context again (the prompt part from its prefix cache when it holds it). Its tokens keep the
versions they were generated under. ``DesConfig.told_remaining`` tells such a policy each
running sample's true tokens left, exactly or off by a set log-error: what moving work could
do with a per-sample predictor of that quality.

Predictions: with a :class:`~rollserve.scheduler.core.predictor.LengthPredictor` the loop
predicts each queued group's length from the prompt's history, its finished siblings and its
running siblings' progress, exactly as the scheduler does, and observes every group when it
is done; with ``oracle="sample"`` the snapshot carries each sample's true length instead, and
with ``oracle="group"`` each sample is given its group's true mean length (what a perfect
predictor of a prompt could know before its samples run). The
prediction a sample had when it was placed is kept for the accuracy report.

Policies see one pseudo-token per ``PSEUDO_TOKEN`` prompt tokens (a stable hash of the prompt's
blocks), enough for prefix-tree policies and cheap at fleet scale. Results are simulated.
"""

from __future__ import annotations

import heapq
import math
import random
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from rollserve.scheduler.core.policy import Policy
from rollserve.scheduler.core.predictor import LengthPredictor, mean_absolute_error, tail_auc
from rollserve.scheduler.core.snapshot import (
    EngineView,
    Plan,
    Preempt,
    QueuedGroup,
    RunningSample,
    Snapshot,
)
from rollserve.sim.engine_model import SimEngine, SimRequest
from rollserve.sim.profile import CostProfile
from rollserve.sim.scenarios import SimGroup

__all__ = ["DesConfig", "RunResult", "StepStats", "run_des", "run_des_async"]

Oracle = Literal["sample", "group"] | None
"""What the snapshot is told instead of predictions: each sample's true length, or its group's
true mean; None: the predictor's estimates (or nothing)."""

PSEUDO_TOKEN = 16
TAIL_SHARE = 0.1  # tail time: while only the last 10% of a step's samples run


@dataclass(frozen=True)
class DesConfig:
    capacity_factor: float = 1.25
    # At every new policy version the engines load its weights, as a trainer publishing each
    # step has them do: each finishes its step in flight, pauses for the profile's
    # ``weights_load_s``, then recomputes its running samples with an empty prefix cache.
    weight_updates: bool = False
    # What a policy that moves running work is told of each running sample's tokens left:
    # None, the prediction (the predictor's, or the oracle's); a number, the true remaining
    # length times a factor exp(told_remaining * z), z drawn once per sample (a standard
    # normal, seeded by the sample's id): a per-sample predictor of that log-error, 0 exact.
    # Engine views sum the same figures; queued groups are predicted as without it.
    told_remaining: float | None = None
    told_seed: int = 0  # another seed draws other errors
    # The drafters' history of a prompt (``SpecDecoding.accept_by_history``, history hits):
    # each engine's own finished samples (False), or every engine's (True), as the scheduler
    # hands an engine the outputs of a prompt it lacks (``rollserve.scheduler.outputs``).
    shared_history: bool = False

    def __post_init__(self) -> None:
        told = self.told_remaining
        if told is not None and not (math.isfinite(told) and told >= 0):
            raise ValueError(f"told_remaining ({told}) must be a finite log-error sd >= 0")


@dataclass(frozen=True)
class StepStats:
    step: int
    start_s: float
    end_s: float
    groups: int
    samples: int
    output_tokens: int
    offpolicy_tokens: int
    max_staleness: int  # versions, over the step's delivered tokens
    tail_s: float
    # Steps since the launch of the step's earliest-launched delivered group (the staleness the
    # SDK's StepBatcher bounds; 0 in synchronous steps).
    launch_lag: int = 0

    @property
    def makespan_s(self) -> float:
        return self.end_s - self.start_s


@dataclass
class RunResult:
    policy: str
    engines: int
    profile: str
    steps: list[StepStats]
    busy_s: float
    prompt_tokens: int
    cached_prompt_tokens: int
    preemptions: int
    recomputed_tokens: int
    decisions: int
    decision_s: float
    # (predicted length when placed, true length) per placed sample with a prediction.
    predictions: list[tuple[float, int]] = field(default_factory=list)
    discarded_tokens: int = 0  # generated, then thrown away (tail batching's early stops)
    moves: int = 0  # running samples the policy preempted (Plan.preempts)
    moved_tokens: int = 0  # prompt + partial response prefilled again by those resumptions
    spec_steps: int = 0  # engine steps that speculated (speculative decoding in the profile)
    timeline: list[tuple[int, float, float, int]] = field(default_factory=list)
    # Samples started from scratch, and those of them started on an engine where a sample of
    # an earlier group of their prompt had finished: where a drafter keeping the engine's own
    # earlier outputs (the rollout drafter) has their prompt's history.
    fresh_starts: int = 0
    history_starts: int = 0
    simulated: bool = True

    @property
    def total_s(self) -> float:
        return self.steps[-1].end_s - self.steps[0].start_s if self.steps else 0.0

    @property
    def makespan_s(self) -> float:
        """Mean step makespan."""
        return sum(s.makespan_s for s in self.steps) / len(self.steps)

    @property
    def groups_per_s(self) -> float:
        return sum(s.groups for s in self.steps) / self.total_s

    @property
    def output_tokens_per_s(self) -> float:
        return sum(s.output_tokens for s in self.steps) / self.total_s

    @property
    def bubble_ratio(self) -> float:
        # Engine steps running across the last step's end count whole: clamp at 0.
        return max(0.0, 1.0 - self.busy_s / (self.engines * self.total_s))

    @property
    def tail_s(self) -> float:
        return sum(s.tail_s for s in self.steps) / len(self.steps)

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def history_hit_rate(self) -> float:
        """Share of samples started from scratch where their prompt's earlier outputs were."""
        return self.history_starts / self.fresh_starts if self.fresh_starts else 0.0

    @property
    def offpolicy_token_fraction(self) -> float:
        tokens = sum(s.output_tokens for s in self.steps)
        return sum(s.offpolicy_tokens for s in self.steps) / tokens if tokens else 0.0

    @property
    def discarded_token_fraction(self) -> float:
        """Tokens thrown away per token delivered."""
        return self.discarded_tokens / max(1, sum(s.output_tokens for s in self.steps))

    @property
    def max_staleness(self) -> int:
        return max((s.max_staleness for s in self.steps), default=0)

    @property
    def max_launch_lag(self) -> int:
        return max((s.launch_lag for s in self.steps), default=0)

    @property
    def decision_us(self) -> float:
        """Mean wall time of one policy call, microseconds (real, not simulated, time)."""
        return 1e6 * self.decision_s / self.decisions if self.decisions else 0.0

    @property
    def predictor_mae(self) -> float | None:
        """Mean absolute error of the predictions samples were placed with, tokens."""
        if not self.predictions:
            return None
        predicted, actual = zip(*self.predictions, strict=True)
        return mean_absolute_error(predicted, actual)

    @property
    def predictor_tail_auc(self) -> float | None:
        """How well those predictions rank the longest 10% of samples (1: perfectly)."""
        if len({a for _, a in self.predictions}) < 2:
            return None
        predicted, actual = zip(*self.predictions, strict=True)
        return tail_auc(predicted, actual)


def _pseudo_tokens(group: SimGroup) -> tuple[int, ...]:
    """One id per PSEUDO_TOKEN prompt tokens: shared-prefix blocks, then the prompt's own."""
    prefix_blocks = group.prefix_len // PSEUDO_TOKEN
    total = math.ceil(group.prompt_len / PSEUDO_TOKEN)
    ids = [zlib.crc32(f"{group.prefix_id}/{i}".encode()) for i in range(prefix_blocks)]
    ids += [zlib.crc32(f"{group.prompt_key}/{i}".encode()) for i in range(prefix_blocks, total)]
    return tuple(ids)


def _true_mean(group: SimGroup) -> float:
    return sum(min(n, group.max_tokens) for n in group.output_lens) / group.n


class _Group:
    """A group in the loop: what is queued, running and done, and its tokens per version."""

    def __init__(self, group: SimGroup, seq: int, priority: int) -> None:
        self.group = group
        self.seq = seq
        self.priority = priority
        self.pending = list(range(group.n))
        self.tokens = _pseudo_tokens(group)
        self.left = group.n
        self.finished: dict[int, int] = {}  # index -> output tokens
        self.finish_times: list[float] = []
        self.done_at = -1.0
        # Tokens generated per policy version, over all samples; and when a sample was last
        # counted, its progress then.
        self.versions: dict[int, int] = {}
        self.counted: dict[int, int] = {}
        # Queued samples that were preempted: index -> (tokens they keep and resume from,
        # times preempted).
        self.partial: dict[int, tuple[int, int]] = {}

    @property
    def done(self) -> bool:
        return self.left == 0

    def oldest_version(self) -> int | None:
        return min((v for v, n in self.versions.items() if n > 0), default=None)


@dataclass
class _Running:
    group: _Group
    index: int
    engine_id: str
    predicted: float | None
    carried: int = 0  # tokens generated in earlier rounds (before preemptions)
    moves: int = 0  # times preempted so far


class _Fleet:
    """Simulated engines, the policy and the predictor, driven in virtual time."""

    def __init__(
        self,
        policy: Policy,
        profile: CostProfile,
        engines: int,
        *,
        cfg: DesConfig,
        predictor: LengthPredictor | None,
        oracle: Oracle,
        keep_timeline: bool,
    ) -> None:
        self.policy = policy
        self.sims = {f"e{i:03d}": SimEngine(f"e{i:03d}", profile) for i in range(engines)}
        self.index_of = {eid: i for i, eid in enumerate(self.sims)}
        self.capacity = max(1, math.ceil(profile.max_num_seqs * cfg.capacity_factor))
        self.weight_updates = cfg.weight_updates
        self.weights_load_s = profile.weights_load_s
        self.predictor = predictor
        self.oracle = oracle
        self.told_remaining = cfg.told_remaining
        self.told_seed = cfg.told_seed
        self.told_factors: dict[str, float] = {}  # sample id -> its told_remaining error
        self.keep_timeline = keep_timeline
        self.running: dict[str, _Running] = {}
        self.per_engine: dict[str, set[str]] = {eid: set() for eid in self.sims}
        self.busy_until: dict[str, float] = dict.fromkeys(self.sims, -1.0)
        self.events: list[tuple[float, int, str, tuple[tuple[str, int], ...]]] = []
        self.counter = 0
        self.now = 0.0
        self.decisions = 0
        self.decision_s = 0.0
        self.timeline: list[tuple[int, float, float, int]] = []
        self.predictions: list[tuple[float, int]] = []
        self.queued: dict[str, _Group] = {}  # groups with samples to place, in arrival order
        self.touched: set[str] = set()
        self.version = 0
        self.discarded_tokens = 0  # generated, then thrown away by an abort
        self.moves = 0
        self.moved_tokens = 0
        # Per engine, the prompts it finished samples of, of which groups and how many of each
        # (prompt -> {group key: samples}): what a drafter that keeps an engine's earlier
        # outputs (the rollout drafter's history) would hold.
        self.finished_prompts: dict[str, dict[str, dict[str, int]]] = {eid: {} for eid in self.sims}
        if cfg.shared_history:  # one record that every engine reads
            shared: dict[str, dict[str, int]] = {}
            self.finished_prompts = dict.fromkeys(self.sims, shared)
        self.history_starts = 0  # samples started where an earlier group of their prompt ended
        self.fresh_starts = 0  # samples started from scratch

    # -- predictions ---------------------------------------------------------------------

    def _predict(self, g: _Group) -> float | None:
        if self.predictor is None:
            return None
        progress = [self._progress(rid, r) for rid, r in self._running_of(g)]
        return self.predictor.predict(
            g.group.prompt_key,
            g.group.prompt_len,
            finished_siblings=tuple(g.finished.values()),
            running_siblings_progress=progress,
        ).mean

    def _running_of(self, g: _Group) -> Iterable[tuple[str, _Running]]:
        for index in range(g.group.n):
            rid = f"{g.group.key}/{index}"
            r = self.running.get(rid)
            if r is not None:
                yield rid, r

    def _progress(self, rid: str, r: _Running) -> int:
        """Tokens a running sample has generated, over every round."""
        return r.carried + self.sims[r.engine_id].progress(rid)

    def _remaining(self, rid: str, r: _Running) -> float:
        """Predicted tokens a running sample has left."""
        progress = self._progress(rid, r)
        if self.told_remaining is not None:
            g = r.group.group
            left = max(0, min(g.output_lens[r.index], g.max_tokens) - progress)
            factor = self.told_factors.get(rid)
            if factor is None:
                seed = zlib.crc32(f"told/{self.told_seed}/{rid}".encode())
                z = random.Random(seed).gauss(0.0, 1.0)
                factor = self.told_factors[rid] = math.exp(self.told_remaining * z)
            return left * factor
        if self.oracle is not None:
            g = r.group.group
            known = (
                min(g.output_lens[r.index], g.max_tokens)
                if self.oracle == "sample"
                else _true_mean(g)
            )
            return max(0.0, known - progress)
        if r.predicted is None:
            return 0.0
        if progress < r.predicted:
            return r.predicted - progress
        assert self.predictor is not None  # predicted is None without one
        beyond = self.predictor.predict(
            r.group.group.prompt_key,
            r.group.group.prompt_len,
            running_siblings_progress=(progress,),
        ).mean
        return max(0.0, beyond - progress)

    # -- the policy ----------------------------------------------------------------------

    def queue(self) -> tuple[QueuedGroup, ...]:
        out = []
        for key, g in self.queued.items():
            sg = g.group
            predicted = self._predict(g)
            lens: tuple[float, ...] = ()
            if self.oracle == "sample":
                lens = tuple(float(min(sg.output_lens[i], sg.max_tokens)) for i in g.pending)
            elif self.oracle == "group":
                lens = (_true_mean(sg),) * len(g.pending)
            out.append(
                QueuedGroup(
                    key=key,
                    n=sg.n,
                    prompt_len=sg.prompt_len,
                    max_tokens=sg.max_tokens,
                    priority=g.priority,
                    seq=g.seq,
                    prompt_key=sg.prompt_key,
                    samples=tuple(g.pending) if len(g.pending) < sg.n else (),
                    prompt_token_ids=g.tokens,
                    predicted_len=predicted,
                    predicted_lens=lens,
                    progress=tuple(g.partial.get(i, (0, 0))[0] for i in g.pending)
                    if g.partial
                    else (),
                )
            )
        return tuple(out)

    def views(self) -> tuple[EngineView, ...]:
        result = []
        for eid, sim in self.sims.items():
            outstanding = 0
            lefts = []
            urgent: int | None = None
            for rid in self.per_engine[eid]:
                r = self.running[rid]
                outstanding += max(0, r.group.group.max_tokens - self._progress(rid, r))
                lefts.append(self._remaining(rid, r))
                if urgent is None or r.group.priority < urgent:
                    urgent = r.group.priority
            # fsum: the same sum in any order (a set's order changes with the hash seed, and
            # a float sum with its order, which would make runs differ from one process to
            # the next).
            predicted = math.fsum(lefts)
            longest = max(lefts, default=0.0)
            result.append(
                EngineView(
                    engine_id=eid,
                    healthy=True,
                    capacity_samples=self.capacity,
                    inflight_samples=len(self.per_engine[eid]),
                    outstanding_tokens=outstanding,
                    predicted_outstanding=predicted,
                    predicted_longest=longest,
                    kv_capacity_tokens=sim.kv_capacity_tokens,
                    kv_used_tokens=sim.kv_used_tokens,
                    urgent_priority=urgent,
                )
            )
        return tuple(result)

    def running_samples(self) -> tuple[RunningSample, ...]:
        out = []
        for eid in self.sims:
            for rid in sorted(self.per_engine[eid]):
                r = self.running[rid]
                sg = r.group.group
                out.append(
                    RunningSample(
                        group_key=sg.key,
                        index=r.index,
                        engine_id=eid,
                        prompt_len=sg.prompt_len,
                        max_tokens=sg.max_tokens,
                        progress=self._progress(rid, r),
                        predicted_left=self._remaining(rid, r),
                        preemptions=r.moves,
                        priority=r.group.priority,
                        prompt_key=sg.prompt_key,
                    )
                )
        return tuple(out)

    def dispatch(self) -> None:
        moving = self.policy.moves_running
        if not self.queued and not (moving and self.running):
            return
        queue = self.queue()
        predicted = {q.key: q.predicted_len for q in queue}
        running = self.running_samples() if moving else ()
        snapshot = Snapshot(queue, self.views(), now=self.now, running=running)
        t0 = time.perf_counter()
        plan: Plan = self.policy.plan(snapshot)
        self.decision_s += time.perf_counter() - t0
        self.decisions += 1
        name = self.policy.name
        for preempt in plan.preempts:
            self._preempt(preempt)
        for assign in plan.assignments:
            g = self.queued.get(assign.group_key)
            if g is None or assign.engine_id not in self.sims:
                raise RuntimeError(f"policy {name} planned an impossible {assign}")
            sg = g.group
            for index in list(assign.samples) or list(g.pending):
                if index not in g.pending:
                    raise RuntimeError(f"policy {name} placed {sg.key}/{index} twice")
                g.pending.remove(index)
                carried, moves = g.partial.pop(index, (0, 0))
                guess = predicted[sg.key]
                self._run(_Running(g, index, assign.engine_id, guess, carried, moves))
                if guess is not None and not carried:
                    self.predictions.append((guess, min(sg.output_lens[index], sg.max_tokens)))
            if not g.pending:
                del self.queued[assign.group_key]

    def _run(self, r: _Running) -> None:
        """Adds running sample ``r`` to its engine: from scratch, or resumed from its
        ``carried`` tokens (prompt + partial response as its prompt)."""
        sg = r.group.group
        rid = f"{sg.key}/{r.index}"
        groups = self.finished_prompts[r.engine_id].get(sg.prompt_key, {})
        earlier = sum(1 for key in groups if key != sg.key)
        outputs = sum(count for key, count in groups.items() if key != sg.key)
        spec = self.sims[r.engine_id].profile.spec
        accept = (
            spec.accept_for(earlier, outputs)
            if spec is not None and spec.accept_by_history
            else None
        )
        self.sims[r.engine_id].add(
            SimRequest(
                request_id=rid,
                prompt_len=sg.prompt_len + r.carried,
                output_len=sg.output_lens[r.index] - r.carried,
                max_tokens=sg.max_tokens - r.carried,
                prefix_id=sg.prompt_key,
                prefix_len=sg.prompt_len,
                system_id=sg.prefix_id,
                system_len=sg.prefix_len,
                priority=r.group.priority,
                accept_len=accept,
            )
        )
        self.running[rid] = r
        self.per_engine[r.engine_id].add(rid)
        self.touched.add(r.engine_id)
        if not r.carried:
            self.fresh_starts += 1
            self.history_starts += earlier > 0

    def _preempt(self, preempt: Preempt) -> None:
        """Stops a running sample, keeping its tokens; resumes it on ``to_engine`` or queues
        it. A sample whose last token is in its engine's current step has finished: the
        preemption comes too late and is dropped, as an abort that races a finish is."""
        rid = f"{preempt.group_key}/{preempt.index}"
        r = self.running.get(rid)
        target = preempt.to_engine
        if (
            r is None
            or r.engine_id != preempt.engine_id
            or target == r.engine_id
            or (target and target not in self.sims)
        ):
            raise RuntimeError(f"policy {self.policy.name} planned an impossible {preempt}")
        sg = r.group.group
        progress = self._progress(rid, r)
        if progress >= min(sg.output_lens[r.index], sg.max_tokens):
            return
        self.sims[r.engine_id].abort(rid)
        del self.running[rid]
        self.per_engine[r.engine_id].discard(rid)
        self.touched.add(r.engine_id)
        self.moves += 1
        self.moved_tokens += sg.prompt_len + progress
        moved = _Running(r.group, r.index, target, r.predicted, progress, r.moves + 1)
        if target:
            self._run(moved)
            return
        g = r.group
        g.partial[r.index] = (progress, moved.moves)
        g.pending.append(r.index)
        g.pending.sort()
        self.queued.setdefault(sg.key, g)

    # -- time ----------------------------------------------------------------------------

    def start_idle(self) -> None:
        """Starts a step on every touched engine that has work and no step in progress."""
        for eid in sorted(self.touched):
            sim = self.sims[eid]
            if self.busy_until[eid] <= self.now and sim.has_work():
                result = sim.step()
                end = self.now + result.duration_s
                self.busy_until[eid] = end
                if self.keep_timeline:
                    self.timeline.append((self.index_of[eid], self.now, end, result.decode_seqs))
                self.counter += 1
                done = tuple((f.request_id, f.output_tokens) for f in result.finished)
                heapq.heappush(self.events, (end, self.counter, eid, done))
        self.touched.clear()

    def submit(self, g: _Group) -> None:
        self.queued[g.group.key] = g

    def advance(self) -> list[_Group]:
        """Runs to the next step completion; returns the groups that finished with it."""
        if not self.events:
            raise RuntimeError(
                f"policy {self.policy.name} left {len(self.queued)} group(s) queued with "
                "every engine idle"
            )
        self.now, _, ended, done = heapq.heappop(self.events)
        self.touched.add(ended)
        completed = []
        for rid, round_tokens in done:
            r = self.running.get(rid)
            if r is None or r.engine_id != ended:
                continue  # aborted (or moved) while its last step ran
            del self.running[rid]
            self.per_engine[r.engine_id].discard(rid)
            g = r.group
            tokens = r.carried + round_tokens
            self._count(g, r.index, tokens)
            g.finished[r.index] = tokens
            g.finish_times.append(self.now)
            ran = self.finished_prompts[ended].setdefault(g.group.prompt_key, {})
            ran[g.group.key] = ran.get(g.group.key, 0) + 1
            g.left -= 1
            if g.done:
                g.done_at = self.now
                completed.append(g)
                if self.predictor is not None:
                    for length in g.finished.values():
                        self.predictor.observe(
                            g.group.prompt_key, length, g.group.epoch, g.group.prompt_len
                        )
        if done:  # only a finished sample frees a slot or KV for the queue
            self.dispatch()
        self.start_idle()
        return completed

    def abort(self, g: _Group) -> int:
        """Stops every sample of ``g`` and forgets it; returns the tokens thrown away."""
        thrown = sum(g.finished.values())
        for rid, r in list(self._running_of(g)):
            thrown += self._progress(rid, r)
            self.sims[r.engine_id].abort(rid)
            del self.running[rid]
            self.per_engine[r.engine_id].discard(rid)
            self.touched.add(r.engine_id)
        self.queued.pop(g.group.key, None)
        thrown += sum(tokens for tokens, _ in g.partial.values())
        g.partial.clear()
        self.discarded_tokens += thrown
        return thrown

    def _count(self, g: _Group, index: int, progress: int) -> None:
        """Counts the tokens sample ``index`` generated since last counted as this version's."""
        new = progress - g.counted.get(index, 0)
        if new > 0:
            g.versions[self.version] = g.versions.get(self.version, 0) + new
        g.counted[index] = progress

    def new_version(self) -> None:
        """The trainer published a new policy: tokens so far belong to the old one (and with
        weight updates, every engine loads it)."""
        for rid, r in self.running.items():
            self._count(r.group, r.index, self._progress(rid, r))
        self.version += 1
        if not self.weight_updates:
            return
        for eid, sim in self.sims.items():
            # The step in flight ends under the old weights (its outcome is already taken).
            resume = max(self.now, self.busy_until[eid]) + self.weights_load_s
            sim.new_weights()
            self.busy_until[eid] = resume
            self.counter += 1
            heapq.heappush(self.events, (resume, self.counter, eid, ()))

    def result(self, steps: list[StepStats]) -> RunResult:
        stats = [s.stats for s in self.sims.values()]
        return RunResult(
            policy=self.policy.name,
            engines=len(self.sims),
            profile=next(iter(self.sims.values())).profile.name,
            steps=steps,
            busy_s=sum(s.busy_s for s in stats),
            prompt_tokens=sum(s.prompt_tokens for s in stats),
            cached_prompt_tokens=sum(s.cached_prompt_tokens for s in stats),
            preemptions=sum(s.preemptions for s in stats),
            recomputed_tokens=sum(s.recomputed_tokens for s in stats),
            decisions=self.decisions,
            decision_s=self.decision_s,
            predictions=self.predictions,
            discarded_tokens=self.discarded_tokens,
            moves=self.moves,
            moved_tokens=self.moved_tokens,
            spec_steps=sum(s.spec_steps for s in stats),
            timeline=self.timeline,
            history_starts=self.history_starts,
            fresh_starts=self.fresh_starts,
        )


def _step_stats(
    step: int, start: float, end: float, delivered: Sequence[_Group], *, launched: bool = False
) -> StepStats:
    """The step's figures; with ``launched``, the groups' priorities are their launch steps."""
    finish = sorted(t for g in delivered for t in g.finish_times)
    cut = finish[max(0, math.ceil((1 - TAIL_SHARE) * len(finish)) - 1)] if finish else end
    tokens = sum(sum(g.versions.values()) for g in delivered)
    offpolicy = sum(n for g in delivered for v, n in g.versions.items() if v < step)
    oldest = [v for g in delivered if (v := g.oldest_version()) is not None]
    return StepStats(
        step=step,
        start_s=start,
        end_s=end,
        groups=len(delivered),
        samples=sum(g.group.n for g in delivered),
        output_tokens=tokens,
        offpolicy_tokens=offpolicy,
        max_staleness=max((step - v for v in oldest), default=0),
        tail_s=end - cut,
        launch_lag=max((step - g.priority for g in delivered), default=0) if launched else 0,
    )


def run_des(
    steps: Sequence[Sequence[SimGroup]],
    policy: Policy,
    profile: CostProfile,
    engines: int,
    *,
    cfg: DesConfig | None = None,
    predictor: LengthPredictor | None = None,
    oracle: Oracle = None,
    keep_timeline: bool = True,
) -> RunResult:
    """Runs every step synchronously with ``policy``; returns what happened (simulated)."""
    fleet = _Fleet(
        policy,
        profile,
        engines,
        cfg=cfg or DesConfig(),
        predictor=predictor,
        oracle=oracle,
        keep_timeline=keep_timeline,
    )
    out: list[StepStats] = []
    seq = 0
    for step_no, groups in enumerate(steps):
        start = fleet.now
        members = []
        for sg in groups:
            g = _Group(sg, seq, priority=0)
            seq += 1
            members.append(g)
            fleet.submit(g)
        fleet.dispatch()
        fleet.start_idle()
        left = len(members)
        while left:
            left -= len(fleet.advance())
        out.append(_step_stats(step_no, start, fleet.now, members))
        fleet.new_version()
    return fleet.result(out)


Due = Literal["tokens", "launch"]
"""When a carried group must be delivered (module docstring): ``tokens``, once it holds tokens
of version ``step - max_staleness`` or older; ``launch``, once it was launched at that step or
earlier (the SDK's ``StepBatcher``)."""


def _stale(g: _Group, oldest: int, due: Due = "tokens") -> bool:
    """Whether ``g`` must be delivered in a step whose oldest allowed version is ``oldest``."""
    if due == "launch":
        return g.priority <= oldest
    version = g.oldest_version()
    return version is not None and version <= oldest


def _has_batch(
    carried: list[_Group], batch: int, oldest: int, *, stop_rest: bool, due: Due = "tokens"
) -> bool:
    """Whether the step can end: ``batch`` groups done and none left that must be delivered
    (with ``stop_rest`` the others are stopped, not waited for)."""
    if sum(1 for g in carried if g.done) < batch:
        return False
    return stop_rest or not any(_stale(g, oldest, due) for g in carried if not g.done)


Tail = Literal["carry", "batch"]
"""What happens to the groups still running when a step has its batch: ``carry`` runs them on
into the next steps (partial rollouts, within the staleness bound); ``batch`` stops them and
defers their prompts to a long round (tail batching, as RollPacker does): once ``batch``
deferred prompts wait, a step runs just those, from scratch, to the end."""


def run_des_async(
    stream: Sequence[SimGroup],
    policy: Policy,
    profile: CostProfile,
    engines: int,
    *,
    batch: int,
    steps: int,
    oversample: float,
    max_staleness: int = 1,
    tail: Tail = "carry",
    due: Due = "tokens",
    cfg: DesConfig | None = None,
    predictor: LengthPredictor | None = None,
    oracle: Oracle = None,
    keep_timeline: bool = True,
) -> RunResult:
    """``steps`` trainer steps of ``batch`` groups each, over-sampled by ``oversample`` from
    ``stream`` (taken in order); the rest carried over within ``max_staleness`` versions (when
    a group is due: ``due``), or deferred to long rounds (``tail``; then long rounds follow the
    last step until no prompt is left deferred)."""
    if batch < 1 or steps < 1:
        raise ValueError(f"batch ({batch}) and steps ({steps}) must be >= 1")
    if not (math.isfinite(oversample) and oversample >= 0):
        raise ValueError(f"oversample ({oversample}) must be a finite number >= 0")
    if max_staleness < 0:
        raise ValueError(f"max_staleness ({max_staleness}) must be >= 0")
    if tail not in ("carry", "batch"):
        raise ValueError(f"tail ({tail!r}) must be 'carry' or 'batch'")
    if due not in ("tokens", "launch"):
        raise ValueError(f"due ({due!r}) must be 'tokens' or 'launch'")
    if tail == "carry" and oversample > 1:
        # By tokens too: at 2, every other step of P1 had twice the batch due.
        raise ValueError(
            f"oversample ({oversample}) must be at most 1 when the tail is carried: more "
            "carries more groups than a batch holds, and a step would have to deliver more "
            "than its batch to keep the staleness bound (the SDK's StepBatcher refuses it too)"
        )
    fleet = _Fleet(
        policy,
        profile,
        engines,
        cfg=cfg or DesConfig(),
        predictor=predictor,
        oracle=oracle,
        keep_timeline=keep_timeline,
    )
    in_flight = math.ceil(batch * (1 + oversample))
    cursor = 0
    launched = 0
    carried: list[_Group] = []  # launched, not delivered (running, queued or done)
    deferred: list[SimGroup] = []  # tail batching: prompts stopped early, for a long round
    out: list[StepStats] = []
    step_no = 0
    # In tail batching the prompts still deferred after the last step are owed: long rounds
    # run them (fewer than a batch in the last one), so that every prompt stopped early is
    # delivered within the run and its time counted.
    while step_no < steps or (tail == "batch" and deferred):
        start = fleet.now
        long_round = tail == "batch" and (len(deferred) >= batch or step_no >= steps)
        fresh: list[SimGroup] = []
        if long_round:
            fresh, deferred = deferred[:batch], deferred[batch:]
        while not long_round and len(carried) + len(fresh) < in_flight:
            if cursor == len(stream):
                raise ValueError(
                    f"the stream of {len(stream)} groups ran out at step {step_no}; "
                    f"{steps} steps of {batch} over-sampled by {oversample} need more"
                )
            fresh.append(stream[cursor])
            cursor += 1
        for group in fresh:
            # The launch step is the trainer's priority: carried-over groups run first.
            g = _Group(group, launched, priority=step_no)
            launched += 1
            carried.append(g)
            fleet.submit(g)
        fleet.dispatch()
        fleet.start_idle()
        # A long round runs its prompts to the end; otherwise a group with tokens of version
        # step - max_staleness or older is delivered in this step.
        oldest = step_no + 1 if long_round else step_no - max_staleness
        wanted = min(batch, len(carried)) if long_round else batch
        while not _has_batch(
            carried, wanted, oldest, stop_rest=tail == "batch" and not long_round, due=due
        ):
            fleet.advance()
        done = [g for g in carried if g.done]
        forced = [g for g in done if _stale(g, oldest, due)]
        rest = sorted((g for g in done if not _stale(g, oldest, due)), key=lambda g: g.done_at)
        delivered = forced + rest[: max(0, wanted - len(forced))]
        chosen = {id(g) for g in delivered}
        carried = [g for g in carried if id(g) not in chosen]
        if tail == "batch":
            for g in carried:
                if not g.done:
                    fleet.abort(g)
                    deferred.append(g.group)
            carried = [g for g in carried if g.done]
        out.append(_step_stats(step_no, start, fleet.now, delivered, launched=True))
        fleet.new_version()
        step_no += 1
    return fleet.result(out)
