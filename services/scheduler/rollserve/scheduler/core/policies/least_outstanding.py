"""least_outstanding: whole groups to the engine with the fewest outstanding tokens.

Algorithm
---------
1. Order the queue by (turn, priority, arrival); lower values first (a turn is the
   fair share between runs, ``core.fairshare``: the same for all while one run has work).
2. For each group in that order, consider the healthy engines with room for all its
   pending samples (``n``, or fewer when some were requeued after an engine failed:
   ``inflight_samples + pending <= capacity_samples``), or idle ones.
3. Among them pick the one with the fewest outstanding tokens: the upper bound of
   tokens its running groups may still generate (``n * max_tokens`` minus what was
   generated so far). Ties go to the engine with fewer in-flight samples, then to
   the lowest engine id, so the plan is deterministic.
4. Charge the pending samples' ``max_tokens`` each to that engine and continue.

A group that fits on no engine stays queued, and so do the groups of its run behind
it: strict order within a run, no head-of-line bypass, so a large group is never
starved by its run's small ones. Other runs' groups go on (with fair share a run's
group may come before another run's at an earlier turn that cannot be placed yet),
but not onto the engine with the most free samples, kept for the group that did not
fit: it fills up for that group as its samples end, so small groups of other runs do
not starve it either. With one run this is plain strict order. It has no settings.

The whole group goes to one engine so that the engine prefills the shared prompt
once and all samples hit its prefix cache (the default of OpenRLHF and ROLL).
"""

from __future__ import annotations

from dataclasses import dataclass

from rollserve.scheduler.core.snapshot import Assign, EngineView, Plan, Snapshot


@dataclass(slots=True)
class _Load:
    engine_id: str
    free_samples: int
    inflight_samples: int
    outstanding_tokens: int

    @classmethod
    def of(cls, engine: EngineView) -> _Load:
        return cls(
            engine.engine_id,
            engine.free_samples,
            engine.inflight_samples,
            engine.outstanding_tokens,
        )

    def fits(self, n: int) -> bool:
        # An idle engine takes any group, even one larger than its capacity:
        # otherwise such a group would block the queue forever.
        return self.free_samples >= n or self.inflight_samples == 0

    def sort_key(self) -> tuple[int, int, str]:
        return (self.outstanding_tokens, self.inflight_samples, self.engine_id)

    def room_key(self) -> tuple[int, int, str]:
        """Least for the engine with the most free samples, then the fewest outstanding
        tokens, then the lowest id."""
        return (-self.free_samples, self.outstanding_tokens, self.engine_id)


class LeastOutstandingTokens:
    name = "least_outstanding"
    whole_groups = True
    moves_running = False
    uses_predictions = False

    def plan(self, snapshot: Snapshot) -> Plan:
        loads = [_Load.of(e) for e in snapshot.engines if e.healthy and e.capacity_samples > 0]
        assignments: list[Assign] = []
        blocked: set[str] = set()  # runs whose next group fits nowhere: their rest waits
        for group in sorted(snapshot.queue, key=lambda g: (g.turn, g.priority, g.seq)):
            if group.run_id in blocked:
                continue
            pending = len(group.pending)
            fitting = [load for load in loads if load.fits(pending)]
            if not fitting:
                blocked.add(group.run_id)
                if not loads:
                    break
                # The engine that takes it soonest is kept for it (strict order, across runs).
                loads.remove(min(loads, key=_Load.room_key))
                continue
            best = min(fitting, key=_Load.sort_key)
            best.free_samples -= pending
            best.inflight_samples += pending
            best.outstanding_tokens += group.max_new_tokens
            assignments.append(Assign(group.key, best.engine_id))
        return Plan(tuple(assignments))
