"""The status each refusal of the scheduler's API gets (nothing faked: the mapping)."""

from __future__ import annotations

import grpc
import pytest
import redis.exceptions
from rollserve.scheduler.api import REFUSALS, refused
from rollserve.scheduler.lease import LeaseLost
from rollserve.scheduler.runtime import QueueFull, VersionBehind, WeightsNotLoaded
from rollserve.scheduler.store import DuplicateGroup
from rollserve.scheduler.validation import ValidationError


@pytest.mark.parametrize(
    ("exc", "code", "words"),
    [
        (ValidationError("n (0) must be >= 1"), grpc.StatusCode.INVALID_ARGUMENT, "n (0)"),
        (DuplicateGroup("r", "g"), grpc.StatusCode.ALREADY_EXISTS, "already submitted"),
        (VersionBehind("r", 1, 2), grpc.StatusCode.INVALID_ARGUMENT, "versions only go up"),
        (QueueFull("the queue holds 9"), grpc.StatusCode.RESOURCE_EXHAUSTED, "queue holds"),
        (WeightsNotLoaded("/c", ["e0: no"]), grpc.StatusCode.FAILED_PRECONDITION, "e0: no"),
        (LeaseLost("lease lost"), grpc.StatusCode.UNAVAILABLE, "lease lost"),
        (
            redis.exceptions.ConnectionError("refused"),
            grpc.StatusCode.UNAVAILABLE,
            "Redis is unreachable: refused",
        ),
        # Refusals of the moment: retried (the SDK's SchedulerUnavailable), not UNKNOWN.
        (redis.exceptions.TimeoutError("Timeout reading"), grpc.StatusCode.UNAVAILABLE, "now"),
        (
            redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'"),
            grpc.StatusCode.UNAVAILABLE,
            "Redis cannot take it now: command not allowed",
        ),
        (
            redis.exceptions.ResponseError("Error running script: -READONLY You can't write"),
            grpc.StatusCode.UNAVAILABLE,
            "READONLY",
        ),
        # One no retry passes
        (
            redis.exceptions.ResponseError("WRONGTYPE Operation against a key"),
            grpc.StatusCode.INTERNAL,
            "Redis refused it: WRONGTYPE",
        ),
    ],
)
def test_each_refusal_gets_its_status_and_keeps_its_message(
    exc: Exception, code: grpc.StatusCode, words: str
) -> None:
    assert isinstance(exc, REFUSALS)
    got = refused(exc)
    assert got.code == code and words in got.message
