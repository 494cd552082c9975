import pytest
from rollserve.scheduler.core import create_policy, policy_names
from rollserve.scheduler.core.policies.least_outstanding import LeastOutstandingTokens

from tests.unit.builders import engine, queued, snapshot


def test_factory_knows_default_and_rejects_unknown() -> None:
    assert "least_outstanding" in policy_names()
    assert create_policy("least_outstanding").name == "least_outstanding"
    with pytest.raises(ValueError, match="unknown"):
        create_policy("nope")


def test_whole_group_goes_to_engine_with_fewest_outstanding_tokens() -> None:
    plan = LeastOutstandingTokens().plan(
        snapshot([queued("a")], [engine("e0", outstanding=500), engine("e1", outstanding=100)])
    )
    assert [(a.group_key, a.engine_id) for a in plan.assignments] == [("a", "e1")]


def test_charges_each_placement_so_groups_spread() -> None:
    groups = [queued(f"g{i}", n=4, max_tokens=100, seq=i) for i in range(4)]
    plan = LeastOutstandingTokens().plan(snapshot(groups, [engine("e0"), engine("e1")]))
    placed = [a.engine_id for a in plan.assignments]
    assert placed == ["e0", "e1", "e0", "e1"]


def test_skips_unhealthy_and_full_engines() -> None:
    plan = LeastOutstandingTokens().plan(
        snapshot(
            [queued("a", n=4)],
            [
                engine("sick", healthy=False),
                engine("full", capacity=8, inflight=6),
                engine("ok", outstanding=10**6),
            ],
        )
    )
    assert [a.engine_id for a in plan.assignments] == ["ok"]


def test_strict_order_by_priority_then_arrival_and_no_bypass() -> None:
    big_first = queued("big", n=10, seq=1)
    small = queued("small", n=1, seq=2)
    urgent = queued("urgent", n=2, seq=3, priority=-1)
    plan = LeastOutstandingTokens().plan(
        snapshot([big_first, small, urgent], [engine("e0", capacity=12, inflight=4)])
    )
    # urgent (priority -1) first; then big does not fit in the 6 left, and small must wait behind it
    assert [a.group_key for a in plan.assignments] == ["urgent"]


def test_idle_engine_takes_group_larger_than_its_capacity() -> None:
    plan = LeastOutstandingTokens().plan(
        snapshot([queued("huge", n=100)], [engine("e0", capacity=16)])
    )
    assert [a.engine_id for a in plan.assignments] == ["e0"]


def test_no_engines_means_empty_plan() -> None:
    assert LeastOutstandingTokens().plan(snapshot([queued("a")], [])).assignments == ()
