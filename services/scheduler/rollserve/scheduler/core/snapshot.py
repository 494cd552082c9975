"""What a policy sees (a snapshot) and what it returns (a plan).

Plain frozen records: the edges build them from live state, a policy reads them
and never mutates anything, so every policy can be unit-tested on hand-built input.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class QueuedGroup:
    """A group with samples waiting for an engine, in arrival order within the queue."""

    key: str  # scheduler-wide id: "<run_id>/<group_id>"
    n: int
    prompt_len: int
    max_tokens: int
    priority: int = 0  # lower runs first
    seq: int = 0  # arrival order, ties broken by it (one a group: the runtime's are)
    # Fair share between runs (``core.fairshare``): lower goes first (compared as a pair),
    # before priority; (0, 0) for every group while one run has groups queued.
    turn: tuple[int, int] = (0, 0)
    # Whose group it is: the run (whole-group policies keep strict order within a run only).
    run_id: str = ""
    prompt_key: str = ""
    # Indices of the samples still to place; empty means all n (the group is untouched).
    samples: tuple[int, ...] = ()
    # The prompt, for policies that track prefixes (may be empty when the edge omits it).
    prompt_token_ids: tuple[int, ...] = ()
    # Predicted response length of one sample, tokens (None: nothing to predict from).
    predicted_len: float | None = None
    # Per pending sample (aligned with ``pending``), when known one by one: an oracle's true
    # lengths in a simulation. Empty: every sample is ``predicted_len``.
    predicted_lens: tuple[float, ...] = ()
    # Per pending sample (aligned with ``pending``): tokens it generated before it was
    # preempted, kept and resumed from. Empty: none was preempted.
    progress: tuple[int, ...] = ()

    @property
    def pending(self) -> tuple[int, ...]:
        """The sample indices to place."""
        return self.samples or tuple(range(self.n))

    def relabelled(
        self, priority: int, turn: tuple[int, int], predicted_len: float | None
    ) -> QueuedGroup:
        """The same group with these (what moves between plans while its samples do not);
        a deep queue's are made at every plan, at half ``dataclasses.replace``'s cost."""
        return QueuedGroup(
            key=self.key,
            n=self.n,
            prompt_len=self.prompt_len,
            max_tokens=self.max_tokens,
            priority=priority,
            seq=self.seq,
            turn=turn,
            run_id=self.run_id,
            prompt_key=self.prompt_key,
            samples=self.samples,
            prompt_token_ids=self.prompt_token_ids,
            predicted_len=predicted_len,
            predicted_lens=self.predicted_lens,
            progress=self.progress,
        )

    @property
    def max_new_tokens(self) -> int:
        """Upper bound of the tokens the pending samples will generate."""
        return len(self.pending) * self.max_tokens

    @property
    def expected_new_tokens(self) -> float:
        """Predicted tokens of the pending samples; the upper bound when there is no prediction."""
        if self.predicted_lens:
            return sum(min(length, self.max_tokens) for length in self.predicted_lens)
        per_sample = self.max_tokens if self.predicted_len is None else self.predicted_len
        return len(self.pending) * min(per_sample, self.max_tokens)


@dataclass(frozen=True, slots=True)
class EngineView:
    engine_id: str
    healthy: bool
    capacity_samples: int  # most samples the scheduler runs on it at once
    inflight_samples: int = 0
    outstanding_tokens: int = 0  # upper bound of tokens still to generate
    predicted_outstanding: float = 0.0  # predicted tokens still to generate (0: unknown)
    predicted_longest: float = 0.0  # of its running samples, the most predicted tokens left
    kv_capacity_tokens: int = 0  # KV cache size in tokens (0: unknown)
    kv_used_tokens: int = 0  # KV held by its running samples, tokens
    # The most urgent (lowest) priority value among its running samples; None when none runs.
    urgent_priority: int | None = None

    @property
    def free_samples(self) -> int:
        return max(0, self.capacity_samples - self.inflight_samples)


@dataclass(frozen=True, slots=True)
class RunningSample:
    """A sample being generated, for a policy that moves work while it runs
    (``Policy.moves_running``)."""

    group_key: str
    index: int
    engine_id: str
    prompt_len: int
    max_tokens: int  # of the whole sample, the tokens of earlier rounds included
    progress: int  # tokens generated so far, over every round
    predicted_left: float = 0.0  # predicted tokens still to generate (0: unknown)
    preemptions: int = 0  # times it was moved or stopped so far
    priority: int = 0
    prompt_key: str = ""


@dataclass(frozen=True, slots=True)
class Snapshot:
    queue: tuple[QueuedGroup, ...]
    engines: tuple[EngineView, ...]
    now: float = 0.0  # seconds, on the clock of whoever built the snapshot
    # The running samples, filled only for a policy that moves running work.
    running: tuple[RunningSample, ...] = ()


@dataclass(frozen=True, slots=True)
class Assign:
    """Run samples of group ``group_key`` on ``engine_id``: ``samples`` (indices), or all of
    its pending samples when empty."""

    group_key: str
    engine_id: str
    samples: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Preempt:
    """Stop running sample ``index`` of ``group_key`` on ``engine_id`` and keep what it
    generated. It resumes (prompt + partial response as the prompt, ``max_tokens`` reduced by
    what it has) on ``to_engine``, or, when that is empty, goes back to the queue."""

    group_key: str
    index: int
    engine_id: str
    to_engine: str = ""


@dataclass(frozen=True, slots=True)
class Plan:
    assignments: tuple[Assign, ...] = field(default_factory=tuple)
    preempts: tuple[Preempt, ...] = field(default_factory=tuple)
