import itertools
import random

import pytest
from rollserve.client.wire import FinishReason
from rollserve.scheduler.state import GroupRecord, MadeBefore, SampleState

from tests.unit.builders import spec


def test_sample_states_are_ordered_so_terminal_is_one_comparison() -> None:
    assert not SampleState.QUEUED.is_terminal
    assert not SampleState.PREEMPTED.is_terminal
    assert SampleState.FINISHED.is_terminal
    assert SampleState.FAILED.is_terminal
    assert SampleState.CANCELLED.is_terminal


def state_of(record: GroupRecord) -> SampleState:
    return record.state


def pending_of(record: GroupRecord) -> tuple[int, ...]:
    return record.pending


def test_group_lifecycle() -> None:
    record = GroupRecord.new(spec(n=2, max_tokens=8), seq=1)
    assert record.state == SampleState.QUEUED and pending_of(record) == (0, 1)
    record.start([0, 1], "e0", now=1.0)
    assert state_of(record) == SampleState.RUNNING and record.attempts == 1
    assert pending_of(record) == ()
    record.add_tokens(0, [1, 2, 3], [-0.1, -0.2, -0.3])
    assert record.running_progress() == (3, 0)
    record.finish_sample(0, FinishReason.STOP, 5, 0, now=2.0)
    assert state_of(record) == SampleState.RUNNING and not record.all_finished
    assert record.finished_lengths() == (3,)
    record.add_tokens(1, [4], [-1.0])
    record.finish_sample(1, FinishReason.LENGTH, 5, 5, now=3.0)
    assert record.all_finished and state_of(record) == SampleState.FINISHED
    samples = record.to_samples()
    assert [s.sample_id for s in samples] == ["g0/0", "g0/1"]
    assert samples[0].token_ids == [1, 2, 3] and samples[0].logprobs == [-0.1, -0.2, -0.3]
    assert samples[1].finish_reason == FinishReason.LENGTH and samples[1].cached_prompt_tokens == 5
    assert samples[0].versions[0].length == 3
    assert {s.engine_id for s in samples} == {"e0"}


def test_samples_of_a_group_run_on_several_engines_and_rounds() -> None:
    record = GroupRecord.new(spec(n=3), seq=1)
    record.start([2], "e1", now=1.0)
    assert pending_of(record) == (0, 1)
    record.start([0], "e0", now=2.0)
    assert pending_of(record) == (1,)
    record.start([1], "e1", now=3.0)
    for index in (0, 1, 2):
        record.add_tokens(index, [index], [-1.0])
        record.finish_sample(index, FinishReason.STOP, 5, 0)
    samples = record.to_samples()
    assert [s.engine_id for s in samples] == ["e0", "e1", "e1"]
    assert [s.started_at for s in samples] == [2.0, 3.0, 1.0]


def test_requeue_forgets_unfinished_work_and_keeps_finished_samples() -> None:
    record = GroupRecord.new(spec(n=3), seq=1)
    record.start([0, 1, 2], "e0")
    record.add_tokens(0, [1, 2], [-1.0, -1.0])
    record.finish_sample(0, FinishReason.STOP, 5, 0)
    record.add_tokens(1, [1, 2], [-1.0, -1.0])
    assert record.requeue([0, 1], "engine died") == (1,)  # 0 had finished
    assert record.pending == (1,)
    assert [s.state for s in record.samples] == [
        SampleState.FINISHED,
        SampleState.QUEUED,
        SampleState.RUNNING,
    ]
    assert record.samples[0].token_ids == [1, 2] and record.samples[1].token_ids == []
    assert record.last_error == "engine died" and record.attempts == 1
    record.start([1], "e1")
    assert record.attempts == 2 and record.samples[1].engine_id == "e1"


def test_transitions_outside_the_state_machine_raise() -> None:
    record = GroupRecord.new(spec(n=2), seq=1)
    with pytest.raises(RuntimeError, match="QUEUED -> FINISHED"):
        record.finish_sample(0, FinishReason.STOP, 5, 0)
    record.start([0], "e0")
    with pytest.raises(RuntimeError, match="RUNNING -> RUNNING"):
        record.start([0], "e1")


def test_cancel_and_fail_leave_finished_samples_alone() -> None:
    record = GroupRecord.new(spec(n=3), seq=1)
    record.start([0, 1], "e0")
    record.finish_sample(0, FinishReason.STOP, 5, 0)
    record.cancel()
    assert [s.state for s in record.samples] == [
        SampleState.FINISHED,
        SampleState.CANCELLED,
        SampleState.CANCELLED,
    ]
    other = GroupRecord.new(spec(n=2), seq=2)
    other.start([1], "e0")
    other.fail()
    assert {s.state for s in other.samples} == {SampleState.FAILED}


def test_a_preempted_sample_keeps_its_tokens_and_resuming_is_not_a_new_attempt() -> None:
    record = GroupRecord.new(spec(n=2, max_tokens=8), seq=1)
    record.start([0, 1], "e0", now=1.0)
    record.add_tokens(0, [1, 2], [-0.1, -0.2])
    record.preempt(0)
    assert record.samples[0].state == SampleState.QUEUED and pending_of(record) == (0,)
    assert record.progress(pending_of(record)) == (2,)
    with pytest.raises(RuntimeError, match="QUEUED -> PREEMPTED"):
        record.preempt(0)
    record.start([0], "e1", now=2.0)
    assert record.attempts == 1
    record.add_tokens(0, [3], [-0.3])
    for index in (0, 1):
        record.finish_sample(index, FinishReason.STOP, 5, 0)
    moved, stayed = record.to_samples()
    assert moved.token_ids == [1, 2, 3] and moved.logprobs == [-0.1, -0.2, -0.3]
    assert (moved.preemptions, moved.resumed_tokens, moved.engine_id) == (1, 2, "e1")
    assert moved.started_at == 1.0
    assert (stayed.preemptions, stayed.resumed_tokens) == (0, 0)


def test_an_engine_failure_after_a_preemption_starts_the_sample_over() -> None:
    record = GroupRecord.new(spec(n=1), seq=1)
    record.start([0], "e0", now=1.0)
    record.add_tokens(0, [1, 2], [-0.1, -0.2])
    record.preempt(0)
    record.start([0], "e1", now=2.0)
    record.add_tokens(0, [3], [-0.3])
    assert record.requeue([0], "e1 died") == (0,)
    sample = record.samples[0]
    assert sample.token_ids == [] and sample.logprobs == []
    assert (sample.preemptions, sample.resumed_tokens) == (0, 0)
    record.start([0], "e2", now=3.0)
    assert record.attempts == 2


def test_speculation_counts_add_up_over_a_samples_calls_and_go_with_a_restart() -> None:
    record = GroupRecord.new(spec(n=2, max_tokens=8), seq=1)
    record.start([0, 1], "e0", now=1.0)
    record.add_tokens(0, [1, 2], [-0.1, -0.2])
    record.add_spec(0, 8, 3, 2)  # the preempted call's count
    record.preempt(0)
    record.start([0], "e1", now=2.0)
    record.add_tokens(0, [3], [-0.3])
    record.add_spec(0, 4, 1, 1)
    record.add_spec(1, 4, 4, 1)
    for index in (0, 1):
        record.finish_sample(index, FinishReason.STOP, 5, 0)
    resumed, other = record.to_samples()
    assert (resumed.spec_proposed_tokens, resumed.spec_accepted_tokens) == (12, 4)
    assert (other.spec_proposed_tokens, other.spec_accepted_tokens) == (4, 4)
    assert (resumed.spec_drafts, other.spec_drafts) == (3, 1)

    restarted = GroupRecord.new(spec(n=1), seq=2)
    restarted.start([0], "e0", now=1.0)
    restarted.add_spec(0, 8, 3, 2)
    restarted.requeue([0], "e0 died")
    sample = restarted.samples[0]
    assert (sample.spec_proposed_tokens, sample.spec_accepted_tokens, sample.spec_drafts) == (
        0,
        0,
        0,
    )


def test_every_change_of_a_sample_state_bumps_the_revision_and_tokens_do_not() -> None:
    # The scheduler reuses a queued group's view while its revision stands still.
    record = GroupRecord.new(spec("g", n=3), seq=0)
    seen = [record.revision]
    assert record.untouched and record.pending == (0, 1, 2)  # (a deep queue's usual group)

    def changed() -> bool:
        seen.append(record.revision)
        return seen[-1] > seen[-2]

    record.start((0, 1), "e0")
    assert changed() and not record.untouched
    record.add_tokens(0, [1, 2], [-0.1, -0.2])
    assert not changed()
    record.preempt(0)
    assert changed()
    record.finish_sample(1, FinishReason.STOP, 4, 0)
    assert changed()
    record.start((0,), "e1")
    assert changed()
    record.requeue((0,), "engine e1 is gone")
    assert changed()
    record.cancel()
    assert changed()
    record.fail()  # nothing left to end: still counted as a change, never missed
    assert changed()


def test_tokens_are_recorded_with_the_policy_version_they_arrived_under() -> None:
    record = GroupRecord.new(spec(n=2, max_tokens=16), seq=1)
    record.start([0, 1], "e0", now=1.0)
    record.add_tokens(0, [1, 2], [-0.1, -0.2], version=3)
    record.add_tokens(0, [3], [-0.3], version=3)
    record.add_tokens(0, [], [], version=4)  # nothing new: no segment
    record.add_tokens(0, [4, 5, 6], [-0.4, -0.5, -0.6], version=5)
    record.add_tokens(1, [7], [-0.7], version=5)
    record.preempt(1)  # kept tokens keep their versions
    record.start([1], "e1", now=2.0)
    record.add_tokens(1, [8], [-0.8], version=6)
    for index in (0, 1):
        record.finish_sample(index, FinishReason.STOP, 5, 0)
    first, second = record.to_samples()
    assert [(v.version, v.length) for v in first.versions] == [(3, 3), (5, 3)]
    assert [(v.version, v.length) for v in second.versions] == [(5, 1), (6, 1)]


def test_tokens_made_before_a_publish_keep_its_version_before_however_they_arrived() -> None:
    """Publishes 1 -> 2 at 2 tokens (its engine had made 4) and 2 -> 3 at 5 tokens (count
    not in yet: every token counts as made before it)."""
    record = GroupRecord.new(spec(n=1, max_tokens=16), seq=1)
    record.start([0], "e0", now=1.0)
    sample = record.samples[0]
    record.add_tokens(0, [1, 2], [-0.1, -0.2], version=1)
    sample.made_before.append(MadeBefore(1, start=2, end=4))
    record.add_tokens(0, [3, 4, 5], [-0.3, -0.4, -0.5], version=2)
    pending = MadeBefore(2, start=5)
    sample.made_before.append(pending)
    record.add_tokens(0, [6, 7], [-0.6, -0.7], version=3)
    assert [(v.version, v.length) for v in sample.labels()] == [(1, 4), (2, 3)]
    pending.end = 6  # the count came
    assert [(v.version, v.length) for v in sample.labels()] == [(1, 4), (2, 2), (3, 1)]
    pending.end = 99  # a count beyond what arrived caps only what arrives
    assert [(v.version, v.length) for v in sample.labels()] == [(1, 4), (2, 3)]


def test_labels_agree_with_capping_token_by_token() -> None:
    """``labels()`` works on runs; the reference caps every token on its own."""
    rng = random.Random(7)
    for _ in range(500):
        record = GroupRecord.new(spec(n=1, max_tokens=4096), seq=1)
        record.start([0], "e0", now=1.0)
        sample = record.samples[0]
        version = 0
        for _ in range(rng.randrange(1, 6)):
            count = rng.randrange(1, 9)
            record.add_tokens(0, [1] * count, [-0.1] * count, version)
            if rng.random() < 0.6:  # a publish now, its count somewhere around here
                end = rng.choice([None, rng.randrange(0, len(sample.token_ids) + 12)])
                sample.made_before.append(MadeBefore(version, len(sample.token_ids), end))
            version += rng.randrange(0, 3)
        arrived = [v for v, n in sample.versions for _ in range(n)]
        for made in sample.made_before:
            stop = len(arrived) if made.end is None else made.end
            arrived = [min(v, made.version) if p < stop else v for p, v in enumerate(arrived)]
        expected = [(v, len(list(run))) for v, run in itertools.groupby(arrived)]
        assert [(seg.version, seg.length) for seg in sample.labels()] == expected


def test_a_sample_started_over_forgets_the_versions_of_its_lost_tokens() -> None:
    record = GroupRecord.new(spec(n=1, max_tokens=16), seq=1)
    record.start([0], "e0", now=1.0)
    record.add_tokens(0, [1, 2], [-0.1, -0.2], version=1)
    record.samples[0].made_before.append(MadeBefore(1, start=2))
    record.requeue([0], "engine died")
    record.start([0], "e1", now=2.0)
    record.add_tokens(0, [3], [-0.3], version=2)
    record.finish_sample(0, FinishReason.STOP, 5, 0)
    [sample] = record.to_samples()
    assert sample.token_ids == [3]
    assert [(v.version, v.length) for v in sample.versions] == [(2, 1)]


@pytest.mark.parametrize("end", ["cancel", "fail"])
def test_a_group_that_ends_before_any_sample_ran_makes_its_samples_only_if_read(
    end: str,
) -> None:
    """A group's samples are made when first read: a Submit of 10,000 groups of 64 spent
    2.3 s of the event loop making them, and cancelling (a DeleteRun of a deep queue) made
    them all again for nothing. Ended untouched, they are made in the state it ended in."""
    record = GroupRecord.new(spec("g", n=64), seq=1)
    assert record.untouched and record.state == SampleState.QUEUED
    assert record.pending == tuple(range(64)) and record.pending_count == 64
    assert record._samples is None  # (none made by any of those)
    getattr(record, end)()
    assert record._samples is None and not record.untouched
    ended = SampleState.CANCELLED if end == "cancel" else SampleState.FAILED
    assert record.state == ended and record.pending == () and record.pending_count == 0
    assert {s.state for s in record.samples} == {ended} and len(record.samples) == 64
