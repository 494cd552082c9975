"""Discrete-event mode: the scheduler's own policies over simulated engines, in virtual time.

The loop keeps, per engine, a :class:`~rollserve.sim.engine_model.SimEngine` and the time its
current step ends. Events are step completions, taken in time order:

1. at a completion, the samples that finished in that step are delivered (a group is
   delivered when its last sample is), the policy is asked for a plan on a snapshot built
   exactly as the scheduler runtime builds one (queue in arrival order, engine views with
   in-flight samples, capacity ``ceil(max_num_seqs * capacity_factor)``, outstanding and
   predicted tokens, KV use), and its assignments are added to the engines;
2. every engine with work and no step in progress starts a step now; the step's outcome is
   computed at its start (the engine's state moves on) and its completion is queued at
   ``now + duration``. Requests added to an engine during its step wait for its next step,
   as in vLLM.

Synchronous RL: each step submits its groups at once and the next step starts when all of
them are delivered (trainer time is not modelled). Policies see one pseudo-token per
``PSEUDO_TOKEN`` prompt tokens (a stable hash of the prompt's blocks), enough for prefix-tree
policies and cheap at fleet scale. The result is labelled simulated.
"""

from __future__ import annotations

import heapq
import math
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rollserve.scheduler.core.policy import Policy
from rollserve.scheduler.core.snapshot import EngineView, Plan, QueuedGroup, Snapshot
from rollserve.sim.engine_model import SimEngine, SimRequest
from rollserve.sim.profile import CostProfile
from rollserve.sim.scenarios import SimGroup

__all__ = ["DesConfig", "RunResult", "StepStats", "run_des"]

PSEUDO_TOKEN = 16
TAIL_SHARE = 0.1  # tail time: while only the last 10% of a step's samples run

Predict = Callable[[SimGroup], float | None]
"""Predicted response length of one sample of a group (None: no prediction)."""


@dataclass(frozen=True)
class DesConfig:
    capacity_factor: float = 1.25


@dataclass(frozen=True)
class StepStats:
    step: int
    start_s: float
    end_s: float
    groups: int
    samples: int
    output_tokens: int
    tail_s: float

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
    timeline: list[tuple[int, float, float, int]] = field(default_factory=list)
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
        return 1.0 - self.busy_s / (self.engines * self.total_s)

    @property
    def tail_s(self) -> float:
        return sum(s.tail_s for s in self.steps) / len(self.steps)

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def decision_us(self) -> float:
        """Mean wall time of one policy call, microseconds (real, not simulated, time)."""
        return 1e6 * self.decision_s / self.decisions if self.decisions else 0.0


def _pseudo_tokens(group: SimGroup) -> tuple[int, ...]:
    """One id per PSEUDO_TOKEN prompt tokens: shared-prefix blocks, then the prompt's own."""
    prefix_blocks = group.prefix_len // PSEUDO_TOKEN
    total = math.ceil(group.prompt_len / PSEUDO_TOKEN)
    ids = [zlib.crc32(f"{group.prefix_id}/{i}".encode()) for i in range(prefix_blocks)]
    ids += [zlib.crc32(f"{group.prompt_key}/{i}".encode()) for i in range(prefix_blocks, total)]
    return tuple(ids)


@dataclass
class _Running:
    group: SimGroup
    index: int
    engine_id: str


class _Step:
    """The state of one synchronous step."""

    def __init__(self, groups: Sequence[SimGroup], predict: Predict | None, seq0: int) -> None:
        self.groups = {g.key: g for g in groups}
        self.pending: dict[str, list[int]] = {g.key: list(range(g.n)) for g in groups}
        self.seq = {g.key: seq0 + i for i, g in enumerate(groups)}
        self.tokens = {g.key: _pseudo_tokens(g) for g in groups}
        self.predicted = {g.key: predict(g) if predict else None for g in groups}
        self.left = {g.key: g.n for g in groups}
        self.finish_times: list[float] = []
        self.output_tokens = 0

    def queue(self) -> tuple[QueuedGroup, ...]:
        out = []
        for key, pending in self.pending.items():
            g = self.groups[key]
            out.append(
                QueuedGroup(
                    key=key,
                    n=g.n,
                    prompt_len=g.prompt_len,
                    max_tokens=g.max_tokens,
                    seq=self.seq[key],
                    prompt_key=g.prompt_key,
                    samples=tuple(pending) if len(pending) < g.n else (),
                    prompt_token_ids=self.tokens[key],
                    predicted_len=self.predicted[key],
                )
            )
        return tuple(out)


def run_des(
    steps: Sequence[Sequence[SimGroup]],
    policy: Policy,
    profile: CostProfile,
    engines: int,
    *,
    cfg: DesConfig | None = None,
    predict: Predict | None = None,
    keep_timeline: bool = True,
) -> RunResult:
    """Runs every step synchronously with ``policy``; returns what happened (simulated)."""
    cfg = cfg or DesConfig()
    sims = {f"e{i:03d}": SimEngine(f"e{i:03d}", profile) for i in range(engines)}
    index_of = {eid: i for i, eid in enumerate(sims)}
    capacity = max(1, math.ceil(profile.max_num_seqs * cfg.capacity_factor))
    running: dict[str, _Running] = {}
    per_engine: dict[str, set[str]] = {eid: set() for eid in sims}
    busy_until: dict[str, float] = dict.fromkeys(sims, -1.0)
    events: list[tuple[float, int, str, tuple[str, ...]]] = []
    counter = 0
    now = 0.0
    decisions = 0
    decision_s = 0.0
    timeline: list[tuple[int, float, float, int]] = []
    out_steps: list[StepStats] = []

    def views(state: _Step) -> tuple[EngineView, ...]:
        result = []
        for eid, sim in sims.items():
            outstanding = 0
            predicted = 0.0
            for rid in per_engine[eid]:
                r = running[rid]
                progress = sim.progress(rid)
                outstanding += max(0, r.group.max_tokens - progress)
                guess = state.predicted.get(r.group.key)
                if guess is not None:
                    predicted += max(0.0, guess - progress)
            result.append(
                EngineView(
                    engine_id=eid,
                    healthy=True,
                    capacity_samples=capacity,
                    inflight_samples=len(per_engine[eid]),
                    outstanding_tokens=outstanding,
                    predicted_outstanding=predicted,
                    kv_capacity_tokens=sim.kv_capacity_tokens,
                    kv_used_tokens=sim.kv_used_tokens,
                )
            )
        return tuple(result)

    def dispatch(state: _Step) -> None:
        nonlocal decisions, decision_s
        if not state.pending:
            return
        snapshot = Snapshot(state.queue(), views(state), now=now)
        t0 = time.perf_counter()
        plan: Plan = policy.plan(snapshot)
        decision_s += time.perf_counter() - t0
        decisions += 1
        for assign in plan.assignments:
            pending = state.pending.get(assign.group_key)
            if pending is None or assign.engine_id not in sims:
                raise RuntimeError(f"policy {policy.name} planned an impossible {assign}")
            indices = list(assign.samples) or list(pending)
            group = state.groups[assign.group_key]
            for index in indices:
                if index not in pending:
                    raise RuntimeError(f"policy {policy.name} placed {group.key}/{index} twice")
                pending.remove(index)
                rid = f"{group.key}/{index}"
                sims[assign.engine_id].add(
                    SimRequest(
                        request_id=rid,
                        prompt_len=group.prompt_len,
                        output_len=group.output_lens[index],
                        max_tokens=group.max_tokens,
                        prefix_id=group.prompt_key,
                        prefix_len=group.prompt_len,
                    )
                )
                running[rid] = _Running(group, index, assign.engine_id)
                per_engine[assign.engine_id].add(rid)
                touched.add(assign.engine_id)
            if not pending:
                del state.pending[assign.group_key]

    # Engines that may start a step now: the one whose step just ended and those that were
    # just given requests (checking every engine after every event costs O(engines)).
    touched: set[str] = set()

    def start_idle(state: _Step) -> None:
        nonlocal counter
        for eid in sorted(touched):
            sim = sims[eid]
            if busy_until[eid] <= now and sim.has_work():
                result = sim.step()
                end = now + result.duration_s
                busy_until[eid] = end
                if keep_timeline:
                    timeline.append((index_of[eid], now, end, result.decode_seqs))
                counter += 1
                done = tuple(f.request_id for f in result.finished)
                heapq.heappush(events, (end, counter, eid, done))
                for f in result.finished:
                    state.output_tokens += f.output_tokens
        touched.clear()

    seq0 = 0
    for step_no, groups in enumerate(steps):
        state = _Step(groups, predict, seq0)
        seq0 += len(groups)
        start = now
        dispatch(state)
        start_idle(state)
        while any(state.left.values()):
            if not events:
                raise RuntimeError(
                    f"policy {policy.name} left {len(state.pending)} group(s) queued with "
                    "every engine idle"
                )
            now, _, ended, done = heapq.heappop(events)
            touched.add(ended)
            for rid in done:
                r = running.pop(rid)
                per_engine[r.engine_id].discard(rid)
                state.left[r.group.key] -= 1
                state.finish_times.append(now)
            dispatch(state)
            start_idle(state)
        finish = sorted(state.finish_times)
        cut = finish[max(0, math.ceil((1 - TAIL_SHARE) * len(finish)) - 1)]
        out_steps.append(
            StepStats(
                step=step_no,
                start_s=start,
                end_s=now,
                groups=len(groups),
                samples=len(finish),
                output_tokens=state.output_tokens,
                tail_s=now - cut,
            )
        )
    stats = [s.stats for s in sims.values()]
    return RunResult(
        policy=policy.name,
        engines=engines,
        profile=profile.name,
        steps=out_steps,
        busy_s=sum(s.busy_s for s in stats),
        prompt_tokens=sum(s.prompt_tokens for s in stats),
        cached_prompt_tokens=sum(s.cached_prompt_tokens for s in stats),
        preemptions=sum(s.preemptions for s in stats),
        recomputed_tokens=sum(s.recomputed_tokens for s in stats),
        decisions=decisions,
        decision_s=decision_s,
        timeline=timeline,
    )
