"""The trim loop's schedule (rollserve.scheduler.trim.TrimSchedule): pure, no edges."""

from __future__ import annotations

import pytest
from rollserve.scheduler.trim import TrimSchedule


def rounds_looked(schedule: TrimSchedule, run: str, rounds: int, **found: int) -> list[int]:
    """The rounds (of the next ``rounds``) in which ``run`` is looked at, each look finding
    ``found`` (removed, left; inactive)."""
    looked = []
    for _ in range(rounds):
        if run in schedule.due():
            looked.append(schedule.round)
            schedule.looked(run, found["removed"], found["left"], active=False)
        schedule.next_round()
    return looked


def test_a_run_where_nothing_happens_is_looked_at_less_and_less_often() -> None:
    schedule = TrimSchedule(max_skip=8)
    schedule.touch(["idle"])
    looked = rounds_looked(schedule, "idle", 40, removed=0, left=5)
    assert looked == [0, 2, 6, 14, 22, 30, 38]  # skips of 2, 4, 8, then 8 at most


def test_a_run_that_got_entries_or_had_some_removed_is_looked_at_every_round() -> None:
    schedule = TrimSchedule(max_skip=8)
    schedule.touch(["r"])
    rounds_looked(schedule, "r", 10, removed=0, left=5)  # backed off
    schedule.touch(["r"])  # delivered to again
    assert rounds_looked(schedule, "r", 3, removed=1, left=5) == [10, 11, 12]


def test_an_active_run_is_looked_at_every_round_and_an_empty_idle_one_leaves() -> None:
    schedule = TrimSchedule()
    schedule.touch(["busy", "done"])
    seen = []
    for _ in range(5):
        due = schedule.due(active=["busy"])
        seen.append(due)
        for run in due:
            schedule.looked(run, removed=0, left=3 if run == "busy" else 0, active=run == "busy")
        schedule.next_round()
    assert seen == [["busy", "done"]] + [["busy"]] * 4
    assert "busy" in schedule and "done" not in schedule and len(schedule) == 1
    # an active run the schedule does not hold (nothing delivered yet) is not looked at
    assert schedule.due(active=["new"]) == ["busy"]


def test_max_skip_is_checked() -> None:
    with pytest.raises(ValueError, match="max_skip"):
        TrimSchedule(max_skip=0)
