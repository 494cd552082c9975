"""The baseline policies: round_robin, least_loaded, cache_aware.

Nothing is faked: the policies are pure core, fed hand-built snapshots from
``tests.unit.builders``; each test reads the plan they return.
"""

import pytest
from rollserve.scheduler.core import EngineView, Plan, Snapshot, create_policy, policy_names
from rollserve.scheduler.core.policies.cache_aware import CacheAware, _PrefixTree
from rollserve.scheduler.core.policies.least_loaded import LeastLoaded
from rollserve.scheduler.core.policies.round_robin import RoundRobin

from tests.unit.builders import engine, queued, snapshot

P = tuple(range(1, 11))  # a 10-token prompt
Q = tuple(range(101, 106))  # 5 tokens, nothing shared with P
R = tuple(range(201, 209))  # 8 tokens, nothing shared with P or Q
BIG = 1000  # a capacity no test fills


def placed(plan: Plan) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(a.group_key, a.engine_id, a.samples) for a in plan.assignments]


def four_engines() -> list[EngineView]:
    return [engine(f"e{i}") for i in range(4)]


# round_robin


def test_round_robin_spreads_a_group_over_engines_and_keeps_its_cursor() -> None:
    policy = RoundRobin()
    first = policy.plan(snapshot([queued("g", n=8)], four_engines()))
    assert placed(first) == [
        ("g", "e0", (0, 4)),
        ("g", "e1", (1, 5)),
        ("g", "e2", (2, 6)),
        ("g", "e3", (3, 7)),
    ]
    second = policy.plan(snapshot([queued("h", n=3)], four_engines()))
    assert placed(second) == [("h", "e0", (0,)), ("h", "e1", (1,)), ("h", "e2", (2,))]
    third = policy.plan(snapshot([queued("k", n=2)], four_engines()))
    assert placed(third) == [("k", "e3", (0,)), ("k", "e0", (1,))]


def test_round_robin_skips_unhealthy_and_full_engines() -> None:
    engines = [
        engine("a", healthy=False),
        engine("b", capacity=4, inflight=4),
        engine("c", capacity=2),
        engine("d"),
    ]
    plan = RoundRobin().plan(snapshot([queued("g", n=5)], engines))
    # c fills after two samples (counting this plan's own placements); d takes the rest
    assert placed(plan) == [("g", "c", (0, 2)), ("g", "d", (1, 3, 4))]


def test_round_robin_stops_when_no_engine_has_a_free_slot() -> None:
    groups = [queued("a", n=2, seq=1), queued("b", n=4, seq=2)]
    engines = [engine("e0", capacity=2), engine("e1", capacity=1)]
    plan = RoundRobin().plan(snapshot(groups, engines))
    assert placed(plan) == [("a", "e0", (0,)), ("a", "e1", (1,)), ("b", "e0", (0,))]


def test_round_robin_places_only_pending_samples_in_queue_order() -> None:
    groups = [
        queued("late", n=8, seq=1, samples=(5, 7)),
        queued("urgent", n=1, seq=2, priority=-1),
    ]
    plan = RoundRobin().plan(snapshot(groups, [engine("e0"), engine("e1")]))
    assert placed(plan) == [("urgent", "e0", (0,)), ("late", "e1", (5,)), ("late", "e0", (7,))]


# least_loaded


def test_least_loaded_sends_whole_group_to_fewest_outstanding_tokens() -> None:
    engines = [engine("e0", outstanding=500), engine("e1", outstanding=100), engine("e2")]
    policy = LeastLoaded()
    plan = policy.plan(snapshot([queued("a", n=8), queued("b", n=8, seq=1)], engines))
    # whole groups (samples=() means all pending); b goes to e1 once a is charged to e2
    assert placed(plan) == [("a", "e2", ()), ("b", "e1", ())]
    assert policy.name == "least_loaded"
    assert policy.whole_groups


def test_least_loaded_never_splits_a_group_over_engines() -> None:
    engines = [engine("e0", capacity=8, inflight=4), engine("e1", capacity=8, inflight=4)]
    plan = LeastLoaded().plan(snapshot([queued("a", n=8)], engines))
    assert plan.assignments == ()  # 4 + 4 free slots, but on two engines: the group waits


def test_least_loaded_makes_room_for_the_pending_samples_of_a_requeued_group() -> None:
    # 3 of a's 8 samples were requeued after an engine failed: 3 free slots are room enough,
    # and only those 3 are charged, so b still fits on the same engine.
    engines = [engine("e0", capacity=8, inflight=2)]
    group = queued("a", n=8, samples=(1, 4, 6))
    plan = LeastLoaded().plan(snapshot([group, queued("b", n=3, seq=1)], engines))
    assert placed(plan) == [("a", "e0", ()), ("b", "e0", ())]


# cache_aware


def test_cache_aware_sends_a_repeated_prompt_where_it_went_before() -> None:
    policy = CacheAware()
    engines = [engine("e0", capacity=BIG), engine("e1", capacity=BIG)]
    first = policy.plan(snapshot([queued("a", n=4, prompt=P)], engines))
    # trees start empty and equal: e0 by id; the next samples match e0's tree fully
    assert placed(first) == [("a", "e0", (0, 1, 2, 3))]
    loaded = [engine("e0", capacity=BIG, inflight=4), engine("e1", capacity=BIG)]
    second = policy.plan(snapshot([queued("b", n=2, prompt=P)], loaded))
    assert placed(second) == [("b", "e0", (0, 1))]


def test_cache_aware_sends_a_new_prompt_to_the_smallest_tree() -> None:
    policy = CacheAware()
    engines = [engine("e0", capacity=BIG), engine("e1", capacity=BIG)]
    groups = [
        queued("p", n=1, seq=1, prompt=P),  # e0 (both empty)
        queued("q", n=1, seq=2, prompt=Q),  # e1: tree of 0 tokens < 10
        queued("r", n=1, seq=3, prompt=R),  # e1 again: 5 tokens < 10, not by turn
    ]
    plan = policy.plan(snapshot(groups, engines))
    assert placed(plan) == [("p", "e0", (0,)), ("q", "e1", (0,)), ("r", "e1", (0,))]


@pytest.mark.parametrize(
    ("shared", "expected"),
    [(6, "e0"), (5, "e1")],  # 6/10 > 0.5 follows the match; 5/10 is not above it
)
def test_cache_aware_follows_a_match_only_above_the_cache_threshold(
    shared: int, expected: str
) -> None:
    policy = CacheAware()
    engines = [engine("e0", capacity=BIG), engine("e1", capacity=BIG)]
    policy.plan(snapshot([queued("p", n=1, prompt=P)], engines))
    variant = P[:shared] + tuple(range(900, 900 + len(P) - shared))
    plan = policy.plan(snapshot([queued("v", n=1, prompt=variant)], engines))
    assert placed(plan) == [("v", expected, (0,))]


@pytest.mark.parametrize(
    ("load_e0", "load_e1", "expected"),
    [
        (33, 0, "e1"),  # 33 - 0 > 32 and 33 > 1.1 * 0: imbalanced, least loaded
        (32, 0, "e0"),  # 32 - 0 is not above 32: balanced, follows the cache
        (400, 360, "e1"),  # 40 > 32 and 400 > 396: imbalanced
        (400, 364, "e0"),  # 36 > 32 but 400 < 1.1 * 364: balanced
    ],
)
def test_cache_aware_goes_to_least_loaded_only_when_both_thresholds_are_passed(
    load_e0: int, load_e1: int, expected: str
) -> None:
    policy = CacheAware()
    idle = [engine("e0", capacity=BIG), engine("e1", capacity=BIG)]
    policy.plan(snapshot([queued("p", n=1, prompt=P)], idle))  # P now in e0's tree
    busy = [
        engine("e0", capacity=BIG, inflight=load_e0),
        engine("e1", capacity=BIG, inflight=load_e1),
    ]
    plan = policy.plan(snapshot([queued("again", n=1, prompt=P)], busy))
    assert placed(plan) == [("again", expected, (0,))]


def test_cache_aware_counts_its_own_placements_in_the_load() -> None:
    engines = [engine("e0", capacity=BIG), engine("e1", capacity=BIG)]
    plan = CacheAware().plan(snapshot([queued("g", n=40, prompt=P)], engines))
    # the group piles onto e0 until it leads by 33; from then on the balance check and
    # the cache (both trees now hold P; ties to e0) take turns
    assert placed(plan) == [
        ("g", "e0", (*range(33), 34, 36, 38)),
        ("g", "e1", (33, 35, 37, 39)),
    ]


def test_cache_aware_respects_capacity_and_health() -> None:
    policy = CacheAware()
    engines = [
        engine("e0", capacity=2),
        engine("e1", capacity=1),
        engine("sick", capacity=BIG, healthy=False),
    ]
    plan = policy.plan(snapshot([queued("g", n=5, prompt=P), queued("h", seq=1)], engines))
    assert placed(plan) == [("g", "e0", (0, 1)), ("g", "e1", (2,))]


def test_cache_aware_matches_groups_without_tokens_by_prompt_key() -> None:
    engines = [engine("e0", capacity=BIG), engine("e1", capacity=BIG)]
    groups = [
        queued("a", n=1, seq=1, prompt_key="row-1"),
        queued("b", n=1, seq=2, prompt_key="row-2"),
        queued("c", n=1, seq=3, prompt_key="row-1"),
    ]
    plan = CacheAware().plan(snapshot(groups, engines))
    assert placed(plan) == [("a", "e0", (0,)), ("b", "e1", (0,)), ("c", "e0", (0,))]


def test_cache_aware_evicts_least_recently_used_prompts_over_max_tree_tokens() -> None:
    policy = CacheAware(max_tree_tokens=len(P))
    one = [engine("e0", capacity=BIG)]
    policy.plan(
        snapshot([queued("p", n=1, seq=1, prompt=P), queued("q", seq=2, n=1, prompt=Q)], one)
    )
    # e0's tree held 15 tokens; the eviction at the end of the plan dropped P (older)
    two = [engine("e0", capacity=BIG), engine("e1", capacity=BIG)]
    plan = policy.plan(snapshot([queued("q2", n=1, seq=1, prompt=Q)], two))
    assert placed(plan) == [("q2", "e0", (0,))]  # Q still matches e0
    plan = policy.plan(snapshot([queued("p2", n=1, seq=1, prompt=P)], two))
    assert placed(plan) == [("p2", "e1", (0,))]  # P forgotten: smallest tree, e1 (0 < 5)


def test_cache_aware_forgets_engines_that_leave() -> None:
    policy = CacheAware()
    both = [engine("e0", capacity=BIG), engine("e1", capacity=BIG)]
    policy.plan(snapshot([queued("a", n=1, prompt=P)], both))  # e0
    policy.plan(snapshot([queued("b", n=1, prompt=P)], [engine("e1", capacity=BIG)]))  # e1
    plan = policy.plan(snapshot([queued("c", n=1, prompt=P)], both))
    assert placed(plan) == [("c", "e1", (0,))]  # e0 came back with an empty tree


def test_prefix_tree_splits_edges_and_matches_partial_prefixes() -> None:
    tree = _PrefixTree()
    tree.insert((1, 2, 3, 4), now=1)
    tree.insert((1, 2, 9), now=2)  # splits the edge after (1, 2)
    tree.insert((1, 2), now=3)  # ends on the split point: no new tokens
    assert tree.size == 5
    assert [tree.match(p) for p in [(1, 2, 3, 4, 5), (1, 2, 9), (1, 2, 3, 7), (2,), ()]] == [
        4,
        3,
        3,
        0,
        0,
    ]
    tree.evict(max_tokens=3)  # (3, 4) is the least recently used leaf
    assert (tree.size, tree.match((1, 2, 3, 4)), tree.match((1, 2, 9))) == (3, 2, 3)


def test_cache_aware_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="cache_threshold"):
        CacheAware(cache_threshold=1.5)
    with pytest.raises(ValueError, match="balance_abs_threshold"):
        CacheAware(balance_abs_threshold=-1)
    with pytest.raises(ValueError, match="max_tree_tokens"):
        CacheAware(max_tree_tokens=0)


# all policies


def test_factory_knows_every_policy() -> None:
    expected = {
        "least_outstanding": True,
        "least_loaded": True,
        "round_robin": False,
        "cache_aware": False,
    }
    assert set(expected) <= set(policy_names())
    for name, whole_groups in expected.items():
        policy = create_policy(name)
        assert (policy.name, policy.whole_groups) == (name, whole_groups)


def _rounds(engines_order: list[int]) -> list[Snapshot]:
    def engines(inflight: int) -> list[EngineView]:
        views = [engine(f"e{i}", capacity=12, inflight=inflight * (i % 2)) for i in range(4)]
        return [views[i] for i in engines_order]

    return [
        snapshot(
            [
                queued("a", n=6, seq=1, prompt=P),
                queued("b", n=4, seq=2, prompt=Q),
                queued("c", n=3, seq=3, prompt_key="row-c"),
            ],
            engines(0),
        ),
        snapshot(
            [queued("d", n=5, seq=4, prompt=P[:7] + R), queued("e", n=8, seq=5, prompt=R)],
            engines(3),
        ),
    ]


@pytest.mark.parametrize("name", ["round_robin", "least_loaded", "cache_aware"])
def test_plans_are_deterministic_whatever_the_engine_order(name: str) -> None:
    results = []
    for order in ([0, 1, 2, 3], [3, 1, 0, 2], [0, 1, 2, 3]):
        policy = create_policy(name)
        results.append([placed(policy.plan(s)) for s in _rounds(order)])
    assert results[0] == results[1] == results[2]
    assert results[0][0]  # the first round places something
