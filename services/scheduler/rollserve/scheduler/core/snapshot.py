"""What a policy sees (a snapshot) and what it returns (a plan).

Plain frozen records: the edges build them from live state, a policy reads them
and never mutates anything, so every policy can be unit-tested on hand-built input.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class QueuedGroup:
    """A group waiting for an engine, in arrival order within the queue."""

    key: str  # scheduler-wide id: "<run_id>/<group_id>"
    n: int
    prompt_len: int
    max_tokens: int
    priority: int = 0  # lower runs first
    seq: int = 0  # arrival order, ties broken by it
    prompt_key: str = ""

    @property
    def max_new_tokens(self) -> int:
        """Upper bound of the tokens the group will generate."""
        return self.n * self.max_tokens


@dataclass(frozen=True, slots=True)
class EngineView:
    engine_id: str
    healthy: bool
    capacity_samples: int  # most samples the scheduler runs on it at once
    inflight_samples: int = 0
    outstanding_tokens: int = 0  # upper bound of tokens still to generate

    @property
    def free_samples(self) -> int:
        return max(0, self.capacity_samples - self.inflight_samples)


@dataclass(frozen=True, slots=True)
class Snapshot:
    queue: tuple[QueuedGroup, ...]
    engines: tuple[EngineView, ...]


@dataclass(frozen=True, slots=True)
class Assign:
    """Run the whole group ``group_key`` on ``engine_id``."""

    group_key: str
    engine_id: str


@dataclass(frozen=True, slots=True)
class Plan:
    assignments: tuple[Assign, ...] = field(default_factory=tuple)
