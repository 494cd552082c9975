"""Group and sample state machines, kept in memory by the scheduler.

Sample: ``QUEUED -> RUNNING -> (PREEMPTED -> QUEUED)* -> FINISHED | FAILED``, and
``CANCELLED`` from any non-terminal state. The enum is ordered so that
``state.is_terminal`` is one comparison. A group is as far as its least advanced
sample; it is delivered when all of its samples are finished.

The durable copy lives in Redis (``store.py``): a group is written as pending before
it is acknowledged to the caller and removed atomically with its delivery, so a
restarted scheduler re-runs exactly the groups that were not delivered.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from rollserve.client.wire import FinishReason, Sample, VersionSegment


class SampleState(enum.IntEnum):
    QUEUED = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3
    FAILED = 4
    CANCELLED = 5

    @property
    def is_terminal(self) -> bool:
        return self >= SampleState.FINISHED


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """An accepted prompt group: validated, tokenized, immutable."""

    run_id: str
    group_id: str
    prompt_token_ids: tuple[int, ...]
    n: int
    sampling: SamplingSpec
    prompt_key: str = ""
    priority: int = 0
    metadata: tuple[tuple[str, str], ...] = ()
    submitted_at: float = 0.0

    @property
    def key(self) -> str:
        return group_key(self.run_id, self.group_id)


def group_key(run_id: str, group_id: str) -> str:
    return f"{run_id}/{group_id}"


@dataclass(slots=True)
class SampleRecord:
    index: int
    state: SampleState = SampleState.QUEUED
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    started_at: float = 0.0
    finished_at: float = 0.0

    def reset(self) -> None:
        """Back to the queue with nothing kept (the engine that held it is gone)."""
        self.state = SampleState.QUEUED
        self.token_ids.clear()
        self.logprobs.clear()
        self.finish_reason = None
        self.num_prompt_tokens = 0
        self.cached_prompt_tokens = 0


@dataclass(slots=True)
class GroupRecord:
    spec: GroupSpec
    seq: int  # arrival order in this scheduler process
    samples: list[SampleRecord]
    engine_id: str = ""
    attempts: int = 0
    last_error: str = ""

    @classmethod
    def new(cls, spec: GroupSpec, seq: int) -> GroupRecord:
        return cls(spec, seq, [SampleRecord(i) for i in range(spec.n)])

    @property
    def state(self) -> SampleState:
        return min(s.state for s in self.samples)

    @property
    def generated_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)

    @property
    def outstanding_tokens(self) -> int:
        """Upper bound of the tokens the group may still generate."""
        return sum(
            self.spec.sampling.max_tokens - len(s.token_ids)
            for s in self.samples
            if not s.state.is_terminal
        )

    @property
    def running_samples(self) -> int:
        return sum(1 for s in self.samples if s.state == SampleState.RUNNING)

    def start(self, engine_id: str, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self.engine_id = engine_id
        self.attempts += 1
        for s in self.samples:
            s.state = SampleState.RUNNING
            s.started_at = now

    def requeue(self, error: str) -> None:
        """The engine failed: forget partial work, queue again. Nothing was delivered."""
        self.engine_id = ""
        self.last_error = error
        for s in self.samples:
            s.reset()

    def cancel(self) -> None:
        for s in self.samples:
            if not s.state.is_terminal:
                s.state = SampleState.CANCELLED

    def add_tokens(self, index: int, token_ids: list[int], logprobs: list[float]) -> None:
        sample = self.samples[index]
        sample.token_ids.extend(token_ids)
        sample.logprobs.extend(logprobs)

    def finish_sample(
        self,
        index: int,
        reason: FinishReason,
        num_prompt_tokens: int,
        cached_prompt_tokens: int,
        now: float | None = None,
    ) -> None:
        sample = self.samples[index]
        sample.state = SampleState.FINISHED
        sample.finish_reason = reason
        sample.num_prompt_tokens = num_prompt_tokens
        sample.cached_prompt_tokens = cached_prompt_tokens
        sample.finished_at = time.time() if now is None else now

    @property
    def all_finished(self) -> bool:
        return all(s.state == SampleState.FINISHED for s in self.samples)

    def to_samples(self) -> list[Sample]:
        prefix = self.spec.group_id
        out: list[Sample] = []
        for s in self.samples:
            assert s.finish_reason is not None, "to_samples needs every sample finished"
            out.append(
                Sample(
                    sample_id=f"{prefix}/{s.index}",
                    index=s.index,
                    token_ids=list(s.token_ids),
                    logprobs=list(s.logprobs),
                    finish_reason=s.finish_reason,
                    engine_id=self.engine_id,
                    # Weight updates come later: every token is of policy version 0.
                    versions=[VersionSegment(0, len(s.token_ids))] if s.token_ids else [],
                    num_prompt_tokens=s.num_prompt_tokens,
                    cached_prompt_tokens=s.cached_prompt_tokens,
                    started_at=s.started_at,
                    finished_at=s.finished_at,
                )
            )
        return out
