"""The rl policy on hand-built snapshots. Nothing is faked: the snapshots are the plain records
the scheduler builds, the policy the real one."""

from __future__ import annotations

import math
import random
from collections import defaultdict
from dataclasses import replace

import pytest
from rollserve.scheduler.core.policies.rl import RLPolicy, RLSettings
from rollserve.scheduler.core.policy import create_policy
from rollserve.scheduler.core.snapshot import (
    EngineView,
    Plan,
    Preempt,
    QueuedGroup,
    RunningSample,
    Snapshot,
)


def group(
    key: str,
    predicted: float | None = None,
    *,
    n: int = 4,
    lens: tuple[float, ...] = (),
    prompt_len: int = 100,
    priority: int = 0,
    seq: int = 0,
) -> QueuedGroup:
    return QueuedGroup(
        key=key,
        n=n,
        prompt_len=prompt_len,
        max_tokens=32768,
        priority=priority,
        seq=seq,
        prompt_key=f"p-{key}",
        predicted_len=predicted,
        predicted_lens=lens,
    )


def engine(engine_id: str, capacity: int = 64, **kw: float) -> EngineView:
    return EngineView(engine_id=engine_id, healthy=True, capacity_samples=capacity, **kw)  # type: ignore[arg-type]


def placed(plan: Plan) -> dict[str, list[tuple[str, int]]]:
    """engine id -> (group key, sample index), in plan order."""
    out: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for a in plan.assignments:
        assert a.samples, "rl names the samples it places"
        out[a.engine_id] += [(a.group_key, i) for i in a.samples]
    return out


def test_registered_and_places_every_sample_once() -> None:
    policy = create_policy("rl")
    assert policy.name == "rl" and not policy.whole_groups
    queue = (group("a", 500), group("b", 50, seq=1), group("c", None, seq=2))
    plan = policy.plan(Snapshot(queue, (engine("e0"), engine("e1"))))
    samples = sorted(s for ss in placed(plan).values() for s in ss)
    assert samples == sorted((g.key, i) for g in queue for i in range(4))


def test_longest_sample_gets_the_engine_with_least_other_work() -> None:
    # With every sample's length known (an oracle), the longest one should share its engine
    # with as little work as possible: the other engines take the short samples.
    lens = (20000.0, 100.0, 100.0, 100.0, 100.0, 100.0, 100.0, 100.0)
    queue = (group("a", n=8, lens=lens),)
    plan = RLPolicy().plan(Snapshot(queue, (engine("e0"), engine("e1"), engine("e2"))))
    by_engine = placed(plan)
    long_engine = next(e for e, ss in by_engine.items() if ("a", 0) in ss)
    assert by_engine[long_engine] == [("a", 0)]


def test_long_groups_are_spread_and_short_groups_stay_whole() -> None:
    # A long group's samples are worth an engine each; a short group with a long prompt is
    # cheaper kept whole than prefilled again on another engine.
    queue = (
        group("long", 10000, n=2, prompt_len=100),
        group("short", 10, n=4, prompt_len=2000, seq=1),
    )
    plan = RLPolicy().plan(Snapshot(queue, (engine("e0"), engine("e1"), engine("e2"))))
    by_engine = placed(plan)
    long_engines = {e for e, ss in by_engine.items() for k, _ in ss if k == "long"}
    short_engines = {e for e, ss in by_engine.items() for k, _ in ss if k == "short"}
    assert len(long_engines) == 2
    assert len(short_engines) == 1


def test_predicted_load_of_running_work_counts() -> None:
    # e0 is busy with a long sample predicted to run 5000 more tokens; new work goes to e1.
    busy = engine("e0", inflight_samples=1, predicted_outstanding=5000.0, predicted_longest=5000.0)
    plan = RLPolicy().plan(Snapshot((group("a", 1000, n=1),), (busy, engine("e1"))))
    assert list(placed(plan)) == ["e1"]


def test_kv_room_holds_back_work_that_would_make_an_engine_preempt() -> None:
    # e0 runs samples; a 3000-token sample of a 100-token prompt would need 3100 more KV
    # tokens, which e0 does not have: it stays queued, and so does everything after it.
    full = engine(
        "e0",
        inflight_samples=2,
        predicted_outstanding=100.0,
        kv_capacity_tokens=4000,
        kv_used_tokens=1000,
    )
    queue = (group("big", 3000, n=1), group("small", 10, n=1, seq=1))
    assert RLPolicy().plan(Snapshot(queue, (full,))).assignments == ()
    # An idle engine takes one sample whatever its predicted KV.
    idle = engine("e1", kv_capacity_tokens=1000)
    plan = RLPolicy().plan(Snapshot((group("big", 3000, n=2),), (idle,)))
    assert sum(len(a.samples) for a in plan.assignments) == 1


def test_capacity_and_priority() -> None:
    queue = (group("low", 10000, n=4, priority=1), group("high", 10, n=4, priority=0, seq=1))
    plan = RLPolicy().plan(Snapshot(queue, (engine("e0", capacity=5),)))
    samples = [s for ss in placed(plan).values() for s in ss]
    assert len(samples) == 5
    # Priority before length: every sample of the high-priority group, then the longest.
    assert [k for k, _ in samples] == ["high"] * 4 + ["low"]


def test_deterministic_and_remembers_where_a_prompt_went() -> None:
    queue = (group("a", 300, n=2), group("b", 200, n=2, seq=1))
    engines = (engine("e0"), engine("e1"), engine("e2"))
    first, second = RLPolicy(), RLPolicy()
    assert first.plan(Snapshot(queue, engines)) == second.plan(Snapshot(queue, engines))
    # The same prompt later goes back to an engine that holds it, other things equal.
    again = first.plan(Snapshot((group("a", 300, n=1),), engines))
    held = {a.engine_id for a in first.plan(Snapshot(queue, engines)).assignments}
    assert {a.engine_id for a in again.assignments} <= held


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="kv_headroom"):
        RLSettings(kv_headroom=0)
    with pytest.raises(ValueError, match="base_s"):
        RLSettings(base_s=-1)
    with pytest.raises(ValueError, match="default_len"):
        RLSettings(default_len=0)


def test_the_scheduler_gives_rl_its_engines_step_costs() -> None:
    from pydantic import ValidationError
    from rollserve.scheduler.server import build_policy
    from rollserve.scheduler.settings import SchedulerSettings
    from rollserve.sim.profile import load_profile

    cpu = load_profile("cpu-tiny")
    settings = SchedulerSettings(redis_url="redis://x", policy="rl", cost_profile="cpu-tiny")
    policy = build_policy(settings)
    assert isinstance(policy, RLPolicy)
    assert policy.settings.base_s == cpu.step_base_s
    assert policy.settings.per_kv_token_s == cpu.per_kv_token_s
    # Without a profile, the GPU-class defaults; other policies ignore it.
    plain = build_policy(SchedulerSettings(redis_url="redis://x", policy="rl"))
    assert isinstance(plain, RLPolicy) and plain.settings == RLSettings()
    other = SchedulerSettings(redis_url="redis://x", policy="round_robin", cost_profile="cpu-tiny")
    assert build_policy(other).name == "round_robin"
    with pytest.raises(ValidationError, match="no shipped profile"):
        SchedulerSettings(redis_url="redis://x", policy="rl", cost_profile="tpu-v9")


def running(
    key: str, index: int, engine_id: str, left: float, *, priority: int = 0, progress: int = 100
) -> RunningSample:
    return RunningSample(
        group_key=key,
        index=index,
        engine_id=engine_id,
        prompt_len=100,
        max_tokens=32768,
        progress=progress,
        predicted_left=left,
        priority=priority,
    )


def test_samples_predicted_short_do_not_pile_onto_a_few_engines() -> None:
    # Six engines take one sample each of a group predicted long; by the cost model they are
    # busy for its whole length, so the 64 samples predicted short would all go to the
    # other two. The count cap keeps every engine within 1.25x of an even share.
    engines = tuple(engine(f"e{i}") for i in range(8))
    shorts = [group(f"s{i}", 200, n=4, prompt_len=100, seq=i + 1) for i in range(16)]
    queue = (group("long", 5000, n=6, prompt_len=100), *shorts)

    def counts(policy: RLPolicy) -> list[int]:
        plan = policy.plan(Snapshot(queue, engines))
        return sorted(len(s) for s in placed(plan).values())

    assert counts(RLPolicy(RLSettings(count_slack=0))) == [1, 1, 1, 1, 1, 1, 32, 32]
    capped = counts(RLPolicy())
    assert sum(capped) == 70 and max(capped) == math.ceil(1.25 * 70 / 8) == 11
    # Running samples count toward the share, and the cap never leaves work unplaced.
    busy = (engine("e0", inflight_samples=40), *engines[1:])
    plan = RLPolicy().plan(Snapshot(queue, busy))
    assert sum(len(s) for s in placed(plan).values()) == 70
    assert len(placed(plan).get("e0", [])) == 0  # 40 running already: above its share
    with pytest.raises(ValueError, match="count_slack"):
        RLSettings(count_slack=0.5)


def test_new_work_stays_off_engines_running_more_urgent_work() -> None:
    # e0 runs a sample carried over from the last step (priority 0, in its view); this
    # step's group (priority 1) goes to the other engines while they have room.
    queue = (group("new", 100, n=4, priority=1),)
    engines = (engine("e0", inflight_samples=1, urgent_priority=0), engine("e1"), engine("e2"))
    policy = RLPolicy()
    assert not policy.moves_running  # the engines' views are enough
    plan = policy.plan(Snapshot(queue, engines))
    assert "e0" not in placed(plan) and sum(len(s) for s in placed(plan).values()) == 4
    # Without another engine with room, the work is not held back.
    full = (
        engine("e0", inflight_samples=1, urgent_priority=0),
        engine("e1", capacity=1, inflight_samples=1, urgent_priority=1),
    )
    plan = policy.plan(Snapshot(queue, full))
    assert [e for e in placed(plan)] == ["e0"]
    # Off, or with work of one priority, e0 is used like any engine.
    off = RLPolicy(RLSettings(isolate_priorities=False, move_running=False))
    same = (engine("e0", inflight_samples=1, urgent_priority=1), *engines[1:])
    for p, views in ((off, engines), (RLPolicy(), same)):
        plan = p.plan(Snapshot((group("new", 100, n=12, priority=1),), views))
        assert "e0" in placed(plan)


def test_moves_split_long_running_samples_sharing_an_engine() -> None:
    policy = RLPolicy(RLSettings(move_running=True))
    assert policy.moves_running
    two = (running("a", 0, "e0", 20000), running("a", 1, "e0", 20000, progress=50))
    engines = (engine("e0", inflight_samples=2), engine("e1"))
    # Off by default: rl reads the running samples (for priorities) but moves none.
    assert RLPolicy().plan(Snapshot((), engines, running=two)).preempts == ()
    plan = policy.plan(Snapshot((), engines, running=two))
    assert plan.assignments == ()
    # Either would do; the one with less context to prefill again on e1 goes.
    assert plan.preempts == (Preempt("a", 1, "e0", "e1"),)
    # One sample alone is never moved; a sample moved max_preemptions times stays.
    alone = Snapshot((), engines, running=two[:1])
    assert policy.plan(alone).preempts == ()
    tired = tuple(replace(s, preemptions=2) for s in two)
    assert policy.plan(Snapshot((), engines, running=tired)).preempts == ()
    # Nothing is moved while work is still queued.
    plan = policy.plan(Snapshot((group("q", 10, n=200),), engines, running=two))
    assert plan.preempts == ()
    # A move that saves little is not made.
    short = (running("a", 0, "e0", 20000), running("b", 0, "e0", 10))
    assert policy.plan(Snapshot((), engines, running=short)).preempts == ()


def test_a_deep_queue_is_placed_in_the_order_of_a_sort_of_every_sample() -> None:
    """The policy looks only at the first samples of its order (as many as there are free
    slots, and one): they are those a sort of every queued sample by (turn, priority,
    longest predicted first, seq, index) puts first, whatever mix of whole, partial and
    per-sample-predicted groups the queue holds; with views of a plan before (the policy
    keeps their entries) among new ones under the same keys."""
    rng = random.Random(7)
    policy = RLPolicy()
    earlier: dict[str, QueuedGroup] = {}
    for trial in range(300):
        queue = []
        for g, seq in enumerate(rng.sample(range(10_000), rng.randrange(1, 60))):
            n = rng.choice((1, 2, 4, 8))
            samples = tuple(rng.sample(range(n), rng.randrange(1, n + 1)))
            pending = tuple(sorted(samples)) if len(samples) < n else tuple(range(n))
            lens = tuple(rng.choice((10.0, 300.0, 5000.0)) for _ in pending)
            queue.append(
                QueuedGroup(
                    key=f"g{g}",
                    n=n,
                    prompt_len=100,
                    max_tokens=rng.choice((64, 4096)),
                    priority=rng.randrange(2),
                    seq=seq,
                    turn=(rng.randrange(2), rng.randrange(2)),
                    samples=samples if len(samples) < n else (),
                    predicted_len=rng.choice((None, 20.0, 900.0)),
                    predicted_lens=lens if rng.random() < 0.3 else (),
                )
            )
        queue = [earlier[q.key] if q.key in earlier and rng.random() < 0.5 else q for q in queue]
        earlier = {q.key: q for q in queue}
        every = []
        for q in queue:
            lengths = q.predicted_lens or (q.predicted_len or 1024.0,) * len(q.pending)
            for index, length in zip(q.pending, lengths, strict=True):
                capped = max(1.0, min(length, q.max_tokens))
                every.append(((q.turn, q.priority, -capped, q.seq, index), capped, q.key))
        every.sort()
        entries, queued, _ = policy._entries(tuple(queue))
        assert queued == len(every)
        limit = rng.randrange(1, len(every) + 3)
        first = [(length, i, group.key) for length, i, group in policy._first(entries, limit)]
        assert first == [(length, key[4], g) for key, length, g in every[:limit]], trial
