"""Fair share between runs: the turn of each queued group.

Several trainers may share one fleet (one run each). Without this, runs at the same
priority level go in arrival order, so a run that queued ten thousand groups holds every
engine until they are all placed, and a trainer that comes next waits for all of them.

Algorithm (start-time fair queuing over sample slots, with equal weights)
------------------------------------------------------------------------
1. A run is *active* while it has groups queued. Each active run keeps ``given``, the
   samples the scheduler started for it while it was active: its virtual time. A run that
   becomes active starts at the least ``given`` of the runs active then (0 if none): it is
   owed nothing for the time it had nothing queued, and loses nothing by it.
2. Each of a run's queued groups, in the run's own order (priority, then arrival), starts
   at ``given`` plus the samples of the run's groups ahead of it.
3. Its *turn* is that start divided by the quantum, rounded down, counted from the least
   active run's: the quantum is the fleet's sample slots over the number of active runs,
   so turn 0 holds each run's next fair share of the fleet, turn 1 the share after it.
4. Policies place groups by turn first, then by their own order (priority, longest work,
   arrival: see each policy). Within a turn they are free, so ``rl`` still places the
   longest work of a turn first; across turns, each run gets its share before any run gets
   more than its share. Slots no other run asks for go to whoever has work (a run alone
   gets the whole fleet).

With one active run every turn is 0 and nothing changes. Within a run, turns never
decrease along its order, so a run's own priorities hold. Samples count alike whatever
their length: a run of long responses holds its slots longer.

Costs O(q log q) a plan for q queued groups, and only while two runs or more have groups
queued.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Waiting:
    """A queued group, as fair share sees it."""

    key: str
    run_id: str
    priority: int
    seq: int
    samples: int  # pending samples


class FairShare:
    """The runs' virtual times (samples started for each while it had work queued) and the
    turns they give queued groups. Not thread-safe; the scheduler's loop owns it."""

    def __init__(self) -> None:
        self._given: dict[str, float] = {}

    def started(self, run_id: str, samples: int) -> None:
        """The scheduler started ``samples`` samples of the run."""
        if run_id in self._given:
            self._given[run_id] += samples

    def active(self, runs: Collection[str]) -> None:
        """``runs`` have groups queued, no other run has: what ``turns`` notes first, for a
        caller that knows fewer than two runs wait and skips it."""
        for run_id in [r for r in self._given if r not in runs]:  # no longer active
            del self._given[run_id]
        start = min(self._given.values(), default=0.0)
        for run_id in runs:
            self._given.setdefault(run_id, start)

    def turns(self, queued: Iterable[Waiting], slots: int) -> dict[str, int]:
        """Each queued group's turn (by key) over a fleet of ``slots`` sample slots; empty
        (every turn 0) while fewer than two runs have groups queued."""
        runs: dict[str, list[Waiting]] = {}
        for group in queued:
            runs.setdefault(group.run_id, []).append(group)
        self.active(runs)
        if len(runs) < 2:
            return {}
        quantum = max(1.0, slots / len(runs))
        first = int(min(self._given.values()) // quantum)
        turns: dict[str, int] = {}
        for run_id, groups in runs.items():
            ahead = self._given[run_id]
            for group in sorted(groups, key=lambda g: (g.priority, g.seq)):
                turns[group.key] = int(ahead // quantum) - first
                ahead += group.samples
        return turns
