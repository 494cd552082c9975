"""Fair share between runs: the turn of each queued group.

Several trainers may share one fleet (one run each). Without this, runs at the same
priority level go in arrival order, so a run that queued ten thousand groups holds every
engine until they are all placed, and a trainer that comes next waits for all of them.

Algorithm (fair queuing over sample slots, with equal weights)
-------------------------------------------------------------
1. A run is *active* while it has groups queued. The *quantum* is the fleet's sample slots
   over the number of active runs: each run's fair share of the slots.
2. Each of a run's queued groups, in the run's own order (priority, then arrival), counts
   the run's samples running now plus those of its queued groups ahead of it (its *use*).
3. The group's turn is the pair (use, served), each divided by the quantum and rounded
   down, compared as a pair. Use comes first: a run that holds more than its share of the
   slots now waits for the runs below theirs (a trainer that comes while another's backlog
   fills the fleet gets the next slots that free, up to its share). *Served*, the samples
   the scheduler started for the run while it was active (a sample resumed after a
   preemption, or requeued after its engine failed, counts again: it takes a slot again),
   breaks ties between runs that
   hold as much: when a slot frees with nothing running, the run served less goes first, so
   two runs on one slot alternate rather than the older one winning every time. A run that
   becomes active starts at the least served count of the runs active then (0 if none): it
   is owed nothing for the time it had nothing queued, and loses nothing by it.
4. Policies place groups by turn first, then by their own order (priority, longest work,
   arrival: see each policy). Within a turn they are free, so ``rl`` still places the
   longest work of a turn first; across turns each run gets its share before any run gets
   more. Slots that no other run asks for go to whoever has work (a run alone gets the
   whole fleet). A whole-group policy keeps strict order within a run only: a group that
   fits on no engine holds back its run's later groups and keeps the engine nearest to
   taking it, not the other runs (``least_outstanding``).

With one active run every turn is (0, 0) and nothing changes. Within a run turns only grow
along its order, so a run's own priorities hold. A turn moves only when its own run's counts
cross a quantum (or the quantum changes), so the views of other runs stay as they are.
Samples count alike whatever their length, but a run of long responses holds its slots
longer, which its use counts.

Costs O(q log q) a plan for q queued groups, and only while two runs or more have groups
queued: ``turns`` alone takes 72 ms at 100,000 groups in two runs on this project's 2-core
machine (127 ms before session 37). The runtime keeps what it hands ``turns`` of each group
while the group does not change; its whole snapshot of a queue in two runs (the policy's
view, turns included) takes about 30 ms at 10,000 groups and 460 ms at 100,000 (80 and 1,100
ms before session 38; one run: 11 and 160 ms): ``rollserve bench decisions``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from operator import attrgetter


@dataclass(frozen=True, slots=True)
class Waiting:
    """A queued group, as fair share sees it."""

    key: str
    run_id: str
    priority: int
    seq: int
    samples: int  # pending samples


_RUN_ORDER = attrgetter("priority", "seq")  # a run's own order


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
        """Notes that ``runs``, and no others, have groups queued (``turns`` does it first;
        a caller that knows fewer than two runs wait may call this instead)."""
        for run_id in [r for r in self._given if r not in runs]:  # no longer active
            del self._given[run_id]
        start = min(self._given.values(), default=0.0)
        for run_id in runs:
            self._given.setdefault(run_id, start)

    def turns(
        self, queued: Iterable[Waiting], slots: int, running: Mapping[str, int]
    ) -> dict[str, tuple[int, int]]:
        """Each queued group's turn (by key) over a fleet of ``slots`` sample slots, where
        ``running`` says each run's samples running now (a run not in it: none); empty
        (every turn (0, 0)) while fewer than two runs have groups queued."""
        runs: dict[str, list[Waiting]] = {}
        for group in queued:
            runs.setdefault(group.run_id, []).append(group)
        self.active(runs)
        if len(runs) < 2:
            return {}
        quantum = max(1.0, slots / len(runs))
        turns: dict[str, tuple[int, int]] = {}
        for run_id, groups in runs.items():
            use = float(running.get(run_id, 0))
            served = int(self._given[run_id] // quantum)
            groups.sort(key=_RUN_ORDER)
            level, turn = -1, (0, 0)
            for group in groups:
                if use // quantum != level:  # (a turn a quantum, shared by its groups)
                    level = int(use // quantum)
                    turn = (level, served)
                turns[group.key] = turn
                use += group.samples
        return turns


class EngineTags:
    """The order an engine's own queue takes the calls the scheduler sent it: each call's
    *start tag* (start-time fair queuing over samples), sent as the call's priority (lower
    first).

    An engine may hold more calls than it runs (the scheduler fills it past its batch so
    that it never waits on a round trip), and those wait in its queue, out of the scheduler's
    reach. Sent in arrival order, a run that filled the engines before another came would
    keep their queues; the tags put the newcomer's calls first, as fair share places them.

    1. Each run has a counter; the *top* is the highest counter. A call takes its run's
       counter as its tag and moves the counter on by its samples, so a run's calls go in
       the order they were sent.
    2. A run whose counter is behind the *floor* starts there: it is owed nothing for the
       time it was idle. The floor is the oldest tag still in flight, but no lower than the
       top less the fleet's slots. The calls that can be waiting in the engines' queues are
       among the last slots' worth sent, so a run that comes goes before all of them, and a
       straggler of long ago (the long tail) does not hand it more than a fleet's worth.
    3. With nothing in flight every counter starts again at 0.

    Fair share decides how much each run gets placed; the tags only make the engines keep to
    the order of those decisions. The runtime gives a group's later calls (a sample resumed,
    or requeued after an engine failed) the tag of its first, so older work of a run stays
    ahead of its newer work, as the groups' own priorities (which order the scheduler's queue,
    not the engines') had it."""

    def __init__(self) -> None:
        self._next: dict[str, int] = {}
        self._top = 0

    def tag(self, run_id: str, samples: int, oldest: int | None, window: int) -> int:
        """The tag of a call of ``samples`` samples of run ``run_id``; ``oldest``: the least
        tag of the calls in flight (None: none is); ``window``: the fleet's sample slots."""
        if oldest is None:
            self._next.clear()
            self._top = oldest = 0
        floor = max(oldest, self._top - window)
        tag = max(self._next.get(run_id, 0), floor)
        self._next[run_id] = tag + samples
        self._top = max(self._top, tag + samples)
        return tag

    def forget(self, run_id: str) -> None:
        """Drops a run's counter (the run was deleted)."""
        self._next.pop(run_id, None)
