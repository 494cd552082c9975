"""When the scheduler's trim loop looks at each run's stream again (``TrimSchedule``).

A run with groups here, or that got entries since the last look, or whose last look removed
some, is looked at every round. One whose look removed nothing while nothing happened in it
(its readers have stopped acknowledging, or have acknowledged all but the newest entries)
is looked at after 2, 4, ... rounds, at most ``max_skip``: a Redis holding the streams of
thousands of finished runs whose readers went away is not asked about each one every round,
and entries a returning reader acknowledges still go within ``max_skip`` rounds. A run
leaves the schedule once its stream is empty and it has nothing here.
"""

from __future__ import annotations

from collections.abc import Iterable

DEFAULT_MAX_SKIP = 64  # rounds: about 10 minutes at the default 10 s interval


class TrimSchedule:
    def __init__(self, max_skip: int = DEFAULT_MAX_SKIP) -> None:
        if max_skip < 1:
            raise ValueError(f"max_skip ({max_skip}) must be >= 1")
        self.max_skip = max_skip
        self.round = 0
        self._skip: dict[str, int] = {}  # run -> rounds between its looks
        self._due: dict[str, int] = {}  # run -> the round it is looked at next

    def __contains__(self, run: str) -> bool:
        return run in self._due

    def __len__(self) -> int:
        return len(self._due)

    def touch(self, runs: Iterable[str]) -> None:
        """These runs got entries, or are new to the schedule: look at them this round."""
        for run in runs:
            self._skip[run] = 1
            self._due[run] = self.round

    def due(self, active: Iterable[str] = ()) -> list[str]:
        """The runs to look at in this round (sorted): those due, and every ``active`` run
        (it has groups here) the schedule holds."""
        wanted = {run for run, due in self._due.items() if due <= self.round}
        wanted |= {run for run in active if run in self._due}
        return sorted(wanted)

    def looked(self, run: str, removed: int, left: int, active: bool) -> None:
        """What a look at the run found: ``removed`` entries trimmed, ``left`` in its stream."""
        if left == 0 and not active:
            self._skip.pop(run, None)
            self._due.pop(run, None)
            return
        skip = 1 if removed or active else min(2 * self._skip.get(run, 1), self.max_skip)
        self._skip[run] = skip
        self._due[run] = self.round + skip

    def next_round(self) -> None:
        self.round += 1
