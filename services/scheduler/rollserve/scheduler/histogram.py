"""Distributions the scheduler keeps of what it delivers, for its Prometheus endpoint: how
long a group took from Submit to its stream entry, how many tokens each sample made (the
long tail of an RL step, as it happens), and how stale the tokens were (off-policy); and of
its own work: how long each plan took. Pure: observed by the runtime, read by
``rollserve.scheduler.metrics``."""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field

__all__ = [
    "GROUP_LATENCY_BOUNDS_S",
    "OUTPUT_TOKENS_BOUNDS",
    "PLAN_BOUNDS_S",
    "STALENESS_BOUNDS",
    "Histogram",
]

GROUP_LATENCY_BOUNDS_S = (
    0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200
)  # fmt: skip
"""Upper bounds of the group latency buckets, seconds: a group of a small model on a CPU
takes under a second, an RL step of long reasoning up to hours."""
OUTPUT_TOKENS_BOUNDS = tuple(2**k for k in range(4, 18))  # 16 .. 131,072
"""Upper bounds of the sample length buckets, tokens: powers of two, as lengths spread."""
STALENESS_BOUNDS = (0, 1, 2, 3, 4, 8, 16)
"""Upper bounds of the staleness buckets, policy versions: 0 is on-policy, tail deferral
keeps most tokens within a version or two."""
PLAN_BOUNDS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)
"""Upper bounds of the plan duration buckets, seconds: a plan of a short queue takes about a
millisecond, one of 100,000 queued groups most of a second."""


@dataclass(slots=True)
class Histogram:
    """Observations counted in buckets of upper ``bounds`` (a value equal to a bound counts
    in its bucket, as Prometheus's ``le``), with one bucket above the last bound, and their
    sum."""

    name: str  # its metric's name after the rollserve_ prefix
    help: str
    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)  # per bucket, not cumulative; the last is +Inf
    sum: float = 0.0

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(set(self.bounds)) or not all(
            math.isfinite(b) for b in self.bounds
        ):
            raise ValueError(f"bounds {self.bounds} must be finite and rise strictly")
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float, times: int = 1) -> None:
        """Counts ``value`` ``times`` times (a run of tokens of one staleness, say)."""
        if math.isnan(value):
            raise ValueError("a histogram cannot count NaN")
        self.counts[bisect_left(self.bounds, value)] += times
        self.sum += value * times

    def copy(self) -> Histogram:
        """A copy that observations into this one do not change."""
        copied = Histogram(self.name, self.help, self.bounds)
        copied.counts = list(self.counts)
        copied.sum = self.sum
        return copied

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, observations at most le) per bucket, the last ``+Inf``: Prometheus's form."""
        les = [_le(bound) for bound in self.bounds] + ["+Inf"]
        running = 0
        buckets = []
        for le, count in zip(les, self.counts, strict=True):
            running += count
            buckets.append((le, running))
        return buckets


def _le(bound: float) -> str:
    return str(float(bound))
