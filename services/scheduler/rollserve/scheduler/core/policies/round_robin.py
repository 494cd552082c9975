"""round_robin: every sample is its own request, sent to the next engine in a cycle.

A baseline, kept for comparison. It stands for verl's default rollout: verl repeats
each prompt ``n`` times (``interleave=True``) and its ``AsyncLLMServerManager`` sends
every sample as its own request to the server with the fewest requests sent so far.
That count only ever grows (nothing lowers it when a request finishes), so the choice
cycles over the servers in a fixed order: round robin per sample, and the ``n`` samples
of a group land on consecutive engines, each engine prefilling the shared prompt again.

Algorithm
---------
1. Order the queue by (turn, priority, arrival); lower values first (a turn is the
   fair share between runs, ``core.fairshare``: the same for all while one run has work).
2. Order the engines by engine id: that order is the cycle.
3. For each pending sample of each group in that order, send it to the next engine in
   the cycle, starting after the engine that got the previous sample (in this call or
   in an earlier one: the cursor is kept between calls), that is healthy and has a free
   slot (``free_samples``, less what this plan already placed there). Full and unhealthy
   engines are skipped; the cursor moves past the engine that got the sample.
4. Stop when no engine has a free slot; the samples not placed stay queued.

The plan holds one ``Assign`` per (group, engine) pair with the sample indices placed
there. The cursor is an engine id, so engines that join or leave do not reset it.

Where it differs from verl: verl knows no capacity (its servers queue requests without
bound); here an engine takes at most ``capacity_samples`` and a full one is skipped,
which is what any cycle over engines with a slot limit does. verl starts its cycle in a
random server order; here the cycle is by engine id, so plans are deterministic.
It has no settings.
"""

from __future__ import annotations

from bisect import bisect_right

from rollserve.scheduler.core.policy import sample_plan
from rollserve.scheduler.core.snapshot import Plan, Snapshot


class RoundRobin:
    name = "round_robin"
    whole_groups = False
    moves_running = False
    uses_predictions = False

    def __init__(self) -> None:
        self._last_engine: str | None = None  # the engine that got the latest sample

    def plan(self, snapshot: Snapshot) -> Plan:
        free = {e.engine_id: e.free_samples for e in snapshot.engines if e.healthy}
        cycle = sorted(free)
        placed: dict[tuple[str, str], list[int]] = {}
        for group in sorted(snapshot.queue, key=lambda g: (g.turn, g.priority, g.seq)):
            for index in group.pending:
                target = self._next_engine(cycle, free)
                if target is None:
                    return sample_plan(placed)
                free[target] -= 1
                self._last_engine = target
                placed.setdefault((group.key, target), []).append(index)
        return sample_plan(placed)

    def _next_engine(self, cycle: list[str], free: dict[str, int]) -> str | None:
        """The first engine after the cursor, in the cycle, with a free slot."""
        start = 0 if self._last_engine is None else bisect_right(cycle, self._last_engine)
        for step in range(len(cycle)):
            engine_id = cycle[(start + step) % len(cycle)]
            if free[engine_id] > 0:
                return engine_id
        return None
