"""Group and sample state machines, kept in memory by the scheduler.

Sample: ``QUEUED -> RUNNING -> (PREEMPTED -> QUEUED)* -> FINISHED | FAILED``, and
``CANCELLED`` from any non-terminal state. A preempted sample keeps the tokens and logprobs
it generated: its next start resumes it (the engine gets prompt + partial response as the
prompt). A running sample whose engine failed goes back to ``QUEUED`` with nothing kept
(``RUNNING -> QUEUED``). The enum is ordered so that ``state.is_terminal`` is one
comparison, and ``_NEXT`` lists every allowed transition: anything else is a bug and raises.

Each sample records the engine it runs on: the samples of a group may be placed on several
engines and over several dispatch rounds. A group is as far as its least advanced
sample; it is delivered when all of its samples are finished.

The durable copy lives in Redis (``store.py``): a group is written as pending before
it is acknowledged to the caller and removed atomically with its delivery, so a
restarted scheduler re-runs exactly the groups that were not delivered.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
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


_NEXT: dict[SampleState, frozenset[SampleState]] = {
    SampleState.QUEUED: frozenset({SampleState.RUNNING, SampleState.FAILED, SampleState.CANCELLED}),
    SampleState.RUNNING: frozenset(
        {
            SampleState.QUEUED,  # its engine failed: run it again, from scratch
            SampleState.PREEMPTED,
            SampleState.FINISHED,
            SampleState.FAILED,
            SampleState.CANCELLED,
        }
    ),
    SampleState.PREEMPTED: frozenset(
        {SampleState.QUEUED, SampleState.FAILED, SampleState.CANCELLED}
    ),
}


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
    # Pass over the dataset, for the length predictor; None until the runtime resolves
    # the default (specs written before this field existed decode as None too).
    epoch: int | None = None
    # Each sample also goes to the run's samples stream as it finishes.
    stream_samples: bool = False

    @property
    def key(self) -> str:
        return group_key(self.run_id, self.group_id)


def group_key(run_id: str, group_id: str) -> str:
    return f"{run_id}/{group_id}"


@dataclass(eq=False, slots=True)
class MadeBefore:
    """A publish without weights moved the run on from ``version`` when the sample had
    ``start`` tokens: those before ``end`` (of the whole sample) were made under
    ``version``, whenever they arrive. ``end`` is None until the engine says how many it
    had made (vLLM holds some back), and every token counts as made before until then."""

    version: int
    start: int
    end: int | None = None


@dataclass(slots=True)
class SampleRecord:
    index: int
    state: SampleState = SampleState.QUEUED
    engine_id: str = ""  # where it runs or ran last
    attempts: int = 0  # runs from its first token (resuming after a preemption is not one)
    preemptions: int = 0  # times it was stopped with its tokens kept, in this run
    resumed_tokens: int = 0  # tokens it had when resumed, summed over its resumptions
    resuming: bool = False  # queued by a preemption: its next start resumes the run
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # The run's policy version when each token arrived, as [version, count] runs over
    # token_ids in order; ``labels()`` caps them by ``made_before`` (the stream's versions).
    versions: list[list[int]] = field(default_factory=list)
    made_before: list[MadeBefore] = field(default_factory=list)  # oldest publish first
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    # Speculative decoding, summed over the calls of this run (a resumed sample has several)
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_drafts: int = 0  # verification passes that carried draft tokens
    started_at: float = 0.0  # first dispatch
    finished_at: float = 0.0

    def _move(self, to: SampleState) -> None:
        if to not in _NEXT.get(self.state, frozenset()):
            raise RuntimeError(f"sample {self.index}: no transition {self.state.name} -> {to.name}")
        self.state = to

    def start(self, engine_id: str, now: float) -> None:
        self._move(SampleState.RUNNING)
        self.engine_id = engine_id
        if self.resuming:
            self.resuming = False
            self.resumed_tokens += len(self.token_ids)
        else:
            self.attempts += 1
        self.started_at = self.started_at or now

    def preempt(self) -> None:
        """Stopped on its engine with its tokens and logprobs kept, and back to the queue to
        be resumed (``RUNNING -> PREEMPTED -> QUEUED`` in one step, as vLLM's preempt frees,
        marks and re-queues a request)."""
        self._move(SampleState.PREEMPTED)
        self.preemptions += 1
        self.resuming = True
        self._move(SampleState.QUEUED)

    def finish(
        self, reason: FinishReason, num_prompt_tokens: int, cached_prompt_tokens: int, now: float
    ) -> None:
        self._move(SampleState.FINISHED)
        self.finish_reason = reason
        self.num_prompt_tokens = num_prompt_tokens
        self.cached_prompt_tokens = cached_prompt_tokens
        self.finished_at = now

    def requeue(self) -> None:
        """Back to the queue with nothing kept (the engine that held it is gone): the next
        run starts from its first token, so the counts of preemptions go too."""
        self._move(SampleState.QUEUED)
        self.token_ids.clear()
        self.logprobs.clear()
        self.versions.clear()
        self.made_before.clear()
        self.preemptions = 0
        self.resumed_tokens = 0
        self.spec_proposed_tokens = 0
        self.spec_accepted_tokens = 0
        self.spec_drafts = 0
        self.finish_reason = None
        self.num_prompt_tokens = 0
        self.cached_prompt_tokens = 0

    def end(self, state: SampleState) -> None:
        """Cancelled or failed, unless it already ended."""
        if not self.state.is_terminal:
            self._move(state)

    def labels(self) -> list[VersionSegment]:
        """The policy version of each token, as runs over token_ids: the version it arrived
        under, or that of a publish it was made before if older."""
        if not self.made_before:
            return [VersionSegment(v, n) for v, n in self.versions]
        total = len(self.token_ids)
        caps = [
            (total if m.end is None else min(m.end, total), m.version) for m in self.made_before
        ]
        runs: list[VersionSegment] = []
        start = 0
        for arrived, count in self.versions:  # split each run where a cap ends inside it
            cuts = sorted({start + count, *(end for end, _ in caps if start < end < start + count)})
            for stop in cuts:
                version = min([arrived, *(v for end, v in caps if start < end)])
                if runs and runs[-1].version == version:
                    runs[-1] = VersionSegment(version, runs[-1].length + stop - start)
                else:
                    runs.append(VersionSegment(version, stop - start))
                start = stop
        return runs


@dataclass(slots=True)
class GroupRecord:
    spec: GroupSpec
    seq: int  # arrival order in this scheduler process
    # Its samples, made when first read (``samples``): most of a deep queue never is until
    # it runs, and a Submit of 10,000 groups of 64 spent 2.3 s of the event loop making them.
    _samples: list[SampleRecord] | None = None
    # The state its samples are made in: QUEUED, or how the group ended if it ended before
    # any was made (cancelling a deep queue made them all for nothing).
    _made_as: SampleState = SampleState.QUEUED
    last_error: str = ""
    # Bumped by every change of a sample's state (the methods below are the only ways to
    # change one): the queued samples and their kept tokens are the same while it is.
    revision: int = 0
    # Finished samples as written to the run's samples stream (``stream_samples``): the
    # group's entry carries them as they were, whatever is learnt of their tokens' versions
    # later.
    streamed: dict[int, Sample] = field(default_factory=dict)
    # Its first call's place in the engines' queues (the runtime's ``EngineTags``): its later
    # calls (a sample resumed, or requeued after an engine failed) take the same.
    engine_tag: int | None = None

    @classmethod
    def new(cls, spec: GroupSpec, seq: int) -> GroupRecord:
        return cls(spec, seq)

    @property
    def samples(self) -> list[SampleRecord]:
        samples = self._samples
        if samples is None:
            state = self._made_as
            samples = self._samples = [SampleRecord(i, state) for i in range(self.spec.n)]
        return samples

    @property
    def state(self) -> SampleState:
        if self.untouched:
            return SampleState.QUEUED
        return min(s.state for s in self.samples)

    @property
    def untouched(self) -> bool:
        """No sample of it ever left the queue: all queued, none with tokens (told without
        reading its samples: most of a deep queue is so)."""
        return self.revision == 0

    @property
    def pending(self) -> tuple[int, ...]:
        """Indices of the samples waiting for an engine."""
        if self.untouched:
            return tuple(range(self.spec.n))
        return tuple(s.index for s in self.samples if s.state == SampleState.QUEUED)

    @property
    def pending_count(self) -> int:
        """How many samples wait for an engine (of an untouched group, without making its
        samples: Status counts every queued group's)."""
        return self.spec.n if self.untouched else len(self.pending)

    @property
    def attempts(self) -> int:
        """Runs of its most run sample (1 when no engine failed it)."""
        return max(s.attempts for s in self.samples)

    @property
    def generated_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)

    @property
    def all_finished(self) -> bool:
        return all(s.state == SampleState.FINISHED for s in self.samples)

    def finished_lengths(self) -> tuple[int, ...]:
        """Response lengths of the finished samples that ran to their natural end."""
        return tuple(
            len(s.token_ids)
            for s in self.samples
            if s.state == SampleState.FINISHED and s.finish_reason != FinishReason.ABORT
        )

    def progress(self, indices: Sequence[int]) -> tuple[int, ...]:
        """Tokens each of samples ``indices`` has generated so far."""
        return tuple(len(self.samples[i].token_ids) for i in indices)

    def running_progress(self) -> tuple[int, ...]:
        """Tokens generated so far by each running sample."""
        return tuple(len(s.token_ids) for s in self.samples if s.state == SampleState.RUNNING)

    def start(self, indices: Sequence[int], engine_id: str, now: float | None = None) -> None:
        """Samples ``indices`` (queued) now run on ``engine_id``."""
        now = time.time() if now is None else now
        for index in indices:
            self.samples[index].start(engine_id, now)
        self.revision += 1

    def preempt(self, index: int) -> None:
        """Running sample ``index`` was stopped with its tokens kept: it is queued to resume."""
        self.samples[index].preempt()
        self.revision += 1

    def requeue(self, indices: Sequence[int], error: str) -> tuple[int, ...]:
        """Their engine failed: those of ``indices`` still running go back to the queue with
        nothing kept (finished ones stay finished). Returns the indices requeued."""
        self.last_error = error
        running = tuple(i for i in indices if self.samples[i].state == SampleState.RUNNING)
        for index in running:
            self.samples[index].requeue()
        self.revision += 1
        return running

    def cancel(self) -> None:
        self._end_all(SampleState.CANCELLED)

    def fail(self) -> None:
        self._end_all(SampleState.FAILED)

    def _end_all(self, state: SampleState) -> None:
        if self._samples is None:  # none made (none ever left the queue): made so if read
            self._made_as = state
        else:
            for s in self._samples:
                s.end(state)
        self.revision += 1

    def add_tokens(
        self, index: int, token_ids: list[int], logprobs: list[float], version: int = 0
    ) -> None:
        """New tokens of sample ``index``, received while the run's policy was ``version``."""
        if not token_ids:
            return
        sample = self.samples[index]
        sample.token_ids.extend(token_ids)
        sample.logprobs.extend(logprobs)
        versions = sample.versions
        if versions and versions[-1][0] == version:
            versions[-1][1] += len(token_ids)
        else:
            versions.append([version, len(token_ids)])

    def add_spec(self, index: int, proposed: int, accepted: int, drafts: int = 0) -> None:
        """Draft tokens an engine call proposed for sample ``index`` and accepted, in
        ``drafts`` verification passes."""
        sample = self.samples[index]
        sample.spec_proposed_tokens += proposed
        sample.spec_accepted_tokens += accepted
        sample.spec_drafts += drafts

    def finish_sample(
        self,
        index: int,
        reason: FinishReason,
        num_prompt_tokens: int,
        cached_prompt_tokens: int,
        now: float | None = None,
    ) -> None:
        now = time.time() if now is None else now
        self.samples[index].finish(reason, num_prompt_tokens, cached_prompt_tokens, now)
        self.revision += 1

    def stream(self, index: int) -> Sample:
        """Finished sample ``index`` as it is now, kept as the group's from now on."""
        sample = self.streamed[index] = self._to_sample(self.samples[index])
        return sample

    def restore(self, sample: Sample) -> None:
        """Sample ``sample.index`` (queued) finished in an earlier process, which wrote it to
        the samples stream: it is finished with what that process kept."""
        record = self.samples[sample.index]
        if record.state != SampleState.QUEUED:
            raise RuntimeError(f"sample {sample.index}: restored while {record.state.name}")
        record.state = SampleState.FINISHED
        record.token_ids = list(sample.token_ids)
        record.logprobs = list(sample.logprobs)
        record.versions = [[segment.version, segment.length] for segment in sample.versions]
        record.finish_reason = sample.finish_reason
        record.engine_id = sample.engine_id
        record.attempts = 1
        record.finished_at = sample.finished_at
        self.streamed[sample.index] = sample
        self.revision += 1

    def to_samples(self) -> list[Sample]:
        return [self.streamed.get(s.index) or self._to_sample(s) for s in self.samples]

    def _to_sample(self, s: SampleRecord) -> Sample:
        assert s.finish_reason is not None, "to_samples needs every sample finished"
        return Sample(
            sample_id=f"{self.spec.group_id}/{s.index}",
            index=s.index,
            token_ids=list(s.token_ids),
            logprobs=list(s.logprobs),
            finish_reason=s.finish_reason,
            engine_id=s.engine_id,
            versions=s.labels(),
            num_prompt_tokens=s.num_prompt_tokens,
            cached_prompt_tokens=s.cached_prompt_tokens,
            preemptions=s.preemptions,
            resumed_tokens=s.resumed_tokens,
            spec_proposed_tokens=s.spec_proposed_tokens,
            spec_accepted_tokens=s.spec_accepted_tokens,
            spec_drafts=s.spec_drafts,
            started_at=s.started_at,
            finished_at=s.finished_at,
        )
