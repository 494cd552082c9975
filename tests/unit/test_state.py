from rollserve.client.wire import FinishReason
from rollserve.scheduler.state import GroupRecord, SampleState

from tests.unit.builders import spec


def test_sample_states_are_ordered_so_terminal_is_one_comparison() -> None:
    assert not SampleState.QUEUED.is_terminal
    assert not SampleState.PREEMPTED.is_terminal
    assert SampleState.FINISHED.is_terminal
    assert SampleState.FAILED.is_terminal
    assert SampleState.CANCELLED.is_terminal


def state_of(record: GroupRecord) -> SampleState:
    return record.state


def test_group_lifecycle_and_outstanding_tokens() -> None:
    record = GroupRecord.new(spec(n=2, max_tokens=8), seq=1)
    assert record.state == SampleState.QUEUED
    record.start("e0", now=1.0)
    assert state_of(record) == SampleState.RUNNING and record.attempts == 1
    assert record.outstanding_tokens == 16
    record.add_tokens(0, [1, 2, 3], [-0.1, -0.2, -0.3])
    assert record.outstanding_tokens == 13
    record.finish_sample(0, FinishReason.STOP, 5, 0, now=2.0)
    assert state_of(record) == SampleState.RUNNING and not record.all_finished
    record.add_tokens(1, [4], [-1.0])
    record.finish_sample(1, FinishReason.LENGTH, 5, 5, now=3.0)
    assert record.all_finished and state_of(record) == SampleState.FINISHED
    samples = record.to_samples()
    assert [s.sample_id for s in samples] == ["g0/0", "g0/1"]
    assert samples[0].token_ids == [1, 2, 3] and samples[0].logprobs == [-0.1, -0.2, -0.3]
    assert samples[1].finish_reason == FinishReason.LENGTH and samples[1].cached_prompt_tokens == 5
    assert samples[0].versions[0].length == 3


def test_requeue_forgets_partial_work_and_keeps_attempt_count() -> None:
    record = GroupRecord.new(spec(n=2), seq=1)
    record.start("e0")
    record.add_tokens(0, [1, 2], [-1.0, -1.0])
    record.requeue("engine died")
    assert record.state == SampleState.QUEUED
    assert record.generated_tokens == 0 and record.engine_id == "" and record.attempts == 1
    assert record.last_error == "engine died"


def test_cancel_leaves_finished_samples_alone() -> None:
    record = GroupRecord.new(spec(n=2), seq=1)
    record.start("e0")
    record.finish_sample(0, FinishReason.STOP, 5, 0)
    record.cancel()
    assert [s.state for s in record.samples] == [SampleState.FINISHED, SampleState.CANCELLED]
