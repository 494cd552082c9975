"""The heartbeat's decisions in ConsumerState (which ids to re-claim, what a reply means),
without Redis: entries are built with ``encode_entry`` as the scheduler writes them and fed
to ``on_read`` as a read would return them; heartbeat replies are built by hand."""

from __future__ import annotations

import logging

import pytest
from rollserve.client.consumer import (
    HEARTBEAT_CHUNK,
    ConsumerConfig,
    ConsumerState,
    Deliver,
    HeartbeatReply,
    RawEntry,
    ReadNew,
    ReadPending,
    heartbeat_chunks,
    parse_heartbeat,
)
from rollserve.client.wire import GroupResult, GroupStatus, encode_entry

RUN = "run-1"
NOW = 100.0


def make_state(*, claim_idle_ms: int = 30_000, heartbeat: bool = True) -> ConsumerState:
    return ConsumerState(
        ConsumerConfig(
            run_id=RUN,
            consumer_group="trainer",
            consumer_name="me",
            claim_idle_ms=claim_idle_ms,
            block_ms=1000,
            heartbeat=heartbeat,
        )
    )


def entry(entry_id: str, group_id: str) -> RawEntry:
    result = GroupResult(run_id=RUN, group_id=group_id, status=GroupStatus.DELIVERED)
    fields = {k.encode(): v for k, v in encode_entry(result).items()}
    return RawEntry(entry_id, fields)


def read(state: ConsumerState, *entries: RawEntry) -> list[Deliver]:
    """A new iteration's read of new entries returning ``entries``; what it delivers."""
    state.restart()
    batch = state.on_read(ReadNew(count=64, block_ms=1), list(entries), NOW)
    return [d for d in batch.items if isinstance(d, Deliver)]


def hand_out_all(state: ConsumerState, delivered: list[Deliver]) -> None:
    for d in delivered:
        assert state.handed_out(d.entry_id, d.result.group_id)


def test_interval_is_a_third_of_the_claim_idle_time() -> None:
    assert make_state(claim_idle_ms=30_000).config.heartbeat_interval_s == pytest.approx(10.0)
    assert make_state(claim_idle_ms=300).config.heartbeat_interval_s == pytest.approx(0.1)


def test_nothing_held_nothing_to_beat() -> None:
    state = make_state()
    assert state.beat_ids() == []
    assert not state.needs_heartbeat


def test_read_ahead_and_handed_out_entries_are_beaten_until_acked() -> None:
    state = make_state()
    delivered = read(state, entry("1-0", "a"), entry("2-0", "b"))
    # Read for delivery, not handed out yet: held all the same.
    assert sorted(state.beat_ids()) == ["1-0", "2-0"]
    assert state.needs_heartbeat
    hand_out_all(state, delivered[:1])
    assert sorted(state.beat_ids()) == ["1-0", "2-0"]
    state.acked("1-0")
    assert state.beat_ids() == ["2-0"]
    hand_out_all(state, delivered[1:])
    state.acked("2-0")
    assert state.beat_ids() == []
    assert not state.needs_heartbeat


def test_entries_read_and_not_handed_out_stay_claimed_when_the_iteration_ends() -> None:
    """An iterator closed with entries read ahead (a step batcher closes it once its batch
    is complete): they stay this consumer's, beaten, and the next iteration's read of the
    pending list hands them out, not counted as deliveries. (They were no longer beaten:
    another trainer of the consumer group took the carried-over groups while this one
    trained, and its batcher then waited for them forever.)"""
    state = make_state()
    iteration = state.restart()
    batch = state.on_read(ReadNew(64, 1), [entry("1-0", "a"), entry("2-0", "b")], NOW)
    first = batch.items[0]
    assert isinstance(first, Deliver)
    assert state.handed_out(first.entry_id, first.result.group_id)
    state.stop_reading(iteration)
    assert sorted(state.beat_ids()) == ["1-0", "2-0"]
    state.restart()
    again = state.on_read(ReadPending("0", 64), [entry("1-0", "a"), entry("2-0", "b")], NOW)
    (second,) = again.items  # the one in the caller's hands is not handed out twice
    assert isinstance(second, Deliver) and second.entry_id == "2-0"
    assert second.delivery_count(pending_count=2) == 1
    assert state.handed_out(second.entry_id, second.result.group_id)
    state.acked("1-0")
    state.acked("2-0")
    assert state.beat_ids() == []


def test_an_entry_left_read_ahead_is_no_longer_beaten_once_lost_or_dropped() -> None:
    state = make_state()
    iteration = state.restart()
    state.on_read(ReadNew(64, 1), [entry("1-0", "a"), entry("2-0", "b")], NOW)
    state.stop_reading(iteration)
    state.on_heartbeat(["1-0", "2-0"], HeartbeatReply(claimed=["2-0"], taken={"1-0": "other"}))
    assert state.beat_ids() == ["2-0"]
    hand_out_all(state, read(state, entry("3-0", "b")))  # b's second entry goes first
    state.acked("3-0")
    batch = state.on_read(ReadPending("0", 64), [entry("2-0", "b")], NOW)
    assert batch.drop_ids == ["2-0"] and state.beat_ids() == []


def test_a_late_stop_of_an_old_iteration_keeps_the_new_ones_read_ahead() -> None:
    state = make_state()
    old = state.restart()
    state.restart()
    state.on_read(ReadNew(64, 1), [entry("1-0", "a")], NOW)
    state.stop_reading(old)
    assert state.beat_ids() == ["1-0"]


def test_heartbeat_off_beats_nothing() -> None:
    state = make_state(heartbeat=False)
    hand_out_all(state, read(state, entry("1-0", "a")))
    assert state.in_hand == 1
    assert state.beat_ids() == []
    assert not state.needs_heartbeat


def test_all_claimed_changes_nothing() -> None:
    state = make_state()
    hand_out_all(state, read(state, entry("1-0", "a"), entry("2-0", "b")))
    asked = state.beat_ids()
    assert state.on_heartbeat(asked, HeartbeatReply(claimed=list(asked), taken={})) == []
    assert sorted(state.beat_ids()) == ["1-0", "2-0"]


def test_entry_in_hand_taken_by_another_consumer_is_lost_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    state = make_state()
    hand_out_all(state, read(state, entry("1-0", "a"), entry("2-0", "b")))
    asked = state.beat_ids()
    with caplog.at_level(logging.WARNING, logger="rollserve.client.consumer"):
        (lost,) = state.on_heartbeat(asked, HeartbeatReply(claimed=["2-0"], taken={"1-0": "B"}))
    assert (lost.entry_id, lost.group_id, lost.holder, lost.in_hand) == ("1-0", "a", "B", True)
    assert "'a'" in caplog.text and "'B'" in caplog.text
    assert state.beat_ids() == ["2-0"]  # not beaten again (it would be taken back)
    assert state.in_hand == 2  # the caller still holds it; its done() acks it for the group
    (again,) = read(state, entry("1-0", "a"), entry("3-0", "c"))  # not handed out twice
    assert again.entry_id == "3-0"
    state.acked("1-0")
    assert state.in_hand == 1


def test_entry_no_longer_pending_is_no_longer_beaten(caplog: pytest.LogCaptureFixture) -> None:
    state = make_state()
    hand_out_all(state, read(state, entry("1-0", "a")))
    with caplog.at_level(logging.INFO, logger="rollserve.client.consumer"):
        (lost,) = state.on_heartbeat(["1-0"], HeartbeatReply(claimed=[], taken={}))
    assert lost.holder is None and lost.in_hand
    assert "no longer pending" in caplog.text
    assert not any(r.levelno >= logging.WARNING for r in caplog.records)
    assert state.beat_ids() == []


def test_entry_acked_while_the_heartbeat_ran_is_not_reported() -> None:
    state = make_state()
    hand_out_all(state, read(state, entry("1-0", "a")))
    asked = state.beat_ids()
    state.acked("1-0")  # the caller's XACK ran before the heartbeat's script
    assert state.on_heartbeat(asked, HeartbeatReply(claimed=[], taken={})) == []


def test_read_ahead_entry_taken_by_another_consumer_is_not_handed_out() -> None:
    state = make_state()
    first, second = read(state, entry("1-0", "a"), entry("2-0", "b"))
    assert state.handed_out(first.entry_id, first.result.group_id)
    (lost,) = state.on_heartbeat(
        state.beat_ids(), HeartbeatReply(claimed=["1-0"], taken={"2-0": "B"})
    )
    assert (lost.entry_id, lost.in_hand) == ("2-0", False)
    assert not state.handed_out(second.entry_id, second.result.group_id)
    assert state.in_hand == 1
    assert state.beat_ids() == ["1-0"]


def test_a_released_entry_is_given_up_parked_and_parked_again_if_claimed_back() -> None:
    state = make_state()
    hand_out_all(state, read(state, entry("1-0", "a"), entry("2-0", "b")))
    state.release("1-0")
    assert state.beat_ids() == ["2-0"]
    assert state.in_hand == 1
    assert state.to_park() == ["1-0"] and state.to_park() == []
    (again,) = read(state, entry("1-0", "a"), entry("3-0", "c"))  # not handed out again
    assert again.entry_id == "3-0"
    assert state.to_park() == ["1-0"]  # our own claim took it back: parked again
    state.release("9-0")  # not in hand: nothing to release
    assert "9-0" not in state.beat_ids() and state.to_park() == []
    assert state.parking_name == "me.released"


def test_heartbeat_chunks() -> None:
    ids = [f"{i}-0" for i in range(HEARTBEAT_CHUNK * 2 + 1)]
    chunks = heartbeat_chunks(ids)
    assert [len(c) for c in chunks] == [HEARTBEAT_CHUNK, HEARTBEAT_CHUNK, 1]
    assert [i for c in chunks for i in c] == ids
    assert heartbeat_chunks([]) == []


def test_parse_heartbeat() -> None:
    reply = parse_heartbeat([[b"1-0", b"2-0"], [b"3-0", b"B", b"4-0", b"C"]])
    assert reply == HeartbeatReply(claimed=["1-0", "2-0"], taken={"3-0": "B", "4-0": "C"})
    assert parse_heartbeat([[], []]) == HeartbeatReply(claimed=[], taken={})


def test_a_park_that_did_not_reach_redis_is_tried_again_unless_acknowledged() -> None:
    state = make_state()
    hand_out_all(state, read(state, entry("1-0", "a"), entry("2-0", "b")))
    state.release("1-0")
    state.release("2-0")
    ids = state.to_park()
    state.acked("2-0")  # (the caller acknowledged it meanwhile)
    state.park_failed(ids)
    assert state.to_park() == ["1-0"]
    assert state.park_args(["1-0"])[2:] == ["me.released", state.config.claim_idle_ms, "1-0"]
