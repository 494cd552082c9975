"""The SDK's PromptGroup: what it checks before anything is sent, and its wire form."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis.exceptions
from grpc import StatusCode
from grpc.aio import AioRpcError, Metadata
from rollserve.client import InvalidArgument, PromptGroup, SamplingParams
from rollserve.client.errors import ResourceExhausted, error_from_rpc, refuses_scripting
from rollserve.client.types import (
    WEIGHTS_TIMEOUT_S,
    publish_timeout_s,
    publish_version_request,
)
from rollserve.client.wire import MAX_EPOCH


def test_epoch_is_optional_and_goes_on_the_wire() -> None:
    unset = PromptGroup(group_id="g", prompt_token_ids=[1, 2], n=2).to_proto()
    assert not unset.HasField("epoch")
    first = PromptGroup(group_id="g", prompt_token_ids=[1, 2], n=2, epoch=0).to_proto()
    assert first.HasField("epoch") and first.epoch == 0
    assert PromptGroup(group_id="g", prompt_text="hi", n=1, epoch=7).to_proto().epoch == 7


@pytest.mark.parametrize("epoch", [-1, MAX_EPOCH + 1])
def test_an_epoch_out_of_range_is_refused_with_its_value(epoch: int) -> None:
    with pytest.raises(InvalidArgument, match=rf"epoch \({epoch}\) must be in 0\.\.{MAX_EPOCH}"):
        PromptGroup(group_id="g", prompt_token_ids=[1], n=1, epoch=epoch)


@pytest.mark.parametrize(
    ("version", "words"),
    [
        (-1, r"version \(-1\) must be in 0\.\.2147483647"),
        (2**31, r"version \(2147483648\)"),
        (True, "must be an int, got bool"),
        (1.0, "must be an int, got float"),
    ],
)
def test_a_policy_version_out_of_range_or_not_an_int_is_refused(
    version: object, words: str
) -> None:
    with pytest.raises(InvalidArgument, match=words):
        publish_version_request("run", version)  # type: ignore[arg-type]


def test_a_policy_version_goes_on_the_wire_with_its_run() -> None:
    request = publish_version_request("run-1", 12)
    assert (request.run_id, request.version) == ("run-1", 12)


def test_a_publish_that_loads_weights_waits_longer_than_other_calls() -> None:
    assert publish_timeout_s(30.0, "", None) == 30.0
    assert publish_timeout_s(30.0, "/ckpt/step-1", None) == WEIGHTS_TIMEOUT_S
    assert publish_timeout_s(3600.0, "/ckpt/step-1", None) == 3600.0
    assert publish_timeout_s(30.0, "/ckpt/step-1", 5.0) == 5.0
    request = publish_version_request("run-1", 2, "/ckpt/step-2")
    assert request.weights_path == "/ckpt/step-2"
    with pytest.raises(InvalidArgument, match="weights_path must be a str, got PosixPath"):
        publish_version_request("run-1", 2, Path("/ckpt"))  # type: ignore[arg-type]


def test_a_seed_out_of_int64_or_whose_last_sample_passes_it_is_refused() -> None:
    with pytest.raises(InvalidArgument, match=r"seed \(9223372036854775808\) must fit in int64"):
        SamplingParams(seed=2**63)
    with pytest.raises(InvalidArgument, match=r"top_k \(2147483648\)"):
        SamplingParams(top_k=2**31)
    last = SamplingParams(seed=2**63 - 2)
    assert PromptGroup(group_id="g", prompt_token_ids=[1], n=2, sampling=last).to_proto()
    with pytest.raises(
        InvalidArgument, match=r"sampling\.seed \(9223372036854775806\) \+ n - 1 \(2\)"
    ):
        PromptGroup(group_id="g", prompt_token_ids=[1], n=3, sampling=last)


def test_a_temperature_outside_vllms_range_is_refused() -> None:
    assert SamplingParams(temperature=2.0).to_proto().temperature == 2.0
    for hot in (2.5, math.inf, math.nan, -0.1):
        with pytest.raises(InvalidArgument, match=r"temperature \(.*\) must be in \[0, 2\]"):
            SamplingParams(temperature=hot)


def test_the_status_lists_the_engines_dtypes_once_each_leaving_out_those_not_said() -> None:
    from rollserve.client.types import SchedulerStatus
    from rollserve.v1 import rollserve_pb2 as pb

    said = ["float32", "bfloat16", "float32", ""]  # the last: a simulated engine's
    engines = [pb.EngineStatus(engine_id=f"e{i}", dtype=d) for i, d in enumerate(said)]
    status = SchedulerStatus.from_proto(pb.StatusResponse(engines=engines))
    assert status.engine_dtypes == ("bfloat16", "float32")
    assert SchedulerStatus.from_proto(pb.StatusResponse()).engine_dtypes == ()


def test_one_stop_string_is_one_stop_string_not_its_characters() -> None:
    assert SamplingParams(stop="</s>").stop == ("</s>",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


def test_the_least_int32_priority_is_sent() -> None:
    group = PromptGroup(group_id="g", prompt_token_ids=[1], n=1, priority=-(2**31))
    assert group.to_proto().priority == -(2**31)


def test_numpy_integers_pass_as_token_ids_and_counts() -> None:
    np = pytest.importorskip("numpy")
    ids = np.array([5, 6, 7], dtype=np.int64)
    group = PromptGroup(
        group_id="g",
        prompt_token_ids=ids,
        n=np.int64(2),
        sampling=SamplingParams(max_tokens=np.int32(8), temperature=np.float32(0.5)),
    )
    wire = group.to_proto()
    assert list(wire.prompt_token_ids) == [5, 6, 7] and wire.n == 2
    assert wire.sampling.max_tokens == 8


GROUP: dict[str, Any] = {"group_id": "g", "prompt_token_ids": [1], "n": 1}


@pytest.mark.parametrize(
    ("make", "given", "message"),
    [
        (SamplingParams, {"temperature": "1"}, "temperature must be a number, got str"),
        (SamplingParams, {"max_tokens": 1.5}, "max_tokens must be an int, got float"),
        (SamplingParams, {"seed": True}, "seed must be an int, got bool"),
        (SamplingParams, {"stop_token_ids": ["1"]}, r"stop_token_ids\[0\] must be an int"),
        (
            PromptGroup,
            {**GROUP, "prompt_token_ids": [1.0]},
            r"prompt_token_ids\[0\] must be an int, got float",
        ),
        (PromptGroup, {**GROUP, "group_id": 5}, "group_id must be a str"),
        (PromptGroup, {**GROUP, "n": "2"}, "n must be an int"),
        (PromptGroup, {**GROUP, "sampling": {}}, "sampling must be a SamplingParams, got dict"),
        (
            PromptGroup,
            {**GROUP, "group_id": "g" * 257},
            "group_id is 257 characters; it must be 1 to 256",
        ),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_with_its_argument_named(
    make: Callable[..., object], given: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        make(**given)


def test_a_message_too_large_for_the_scheduler_is_invalid_not_a_full_queue() -> None:
    """RESOURCE_EXHAUSTED is a full queue, retried later, except where gRPC refuses a message
    over the server's size limit: the same call would be refused every time. Faked: the
    refused call (gRPC's own error object, as a channel raises it)."""
    too_large = AioRpcError(
        StatusCode.RESOURCE_EXHAUSTED,
        Metadata(),
        Metadata(),
        "SERVER: Received message larger than max (262144022 vs. 67108864)",
        None,
    )
    error = error_from_rpc(too_large, "Submit")
    assert isinstance(error, InvalidArgument) and not isinstance(error, ResourceExhausted)
    assert "(262144022 vs. 67108864)" in str(error) and "send fewer groups a call" in str(error)
    full = AioRpcError(StatusCode.RESOURCE_EXHAUSTED, Metadata(), Metadata(), "queue full", None)
    assert isinstance(error_from_rpc(full, "Submit"), ResourceExhausted)


def test_a_scripting_refusal_is_told_apart_in_each_redis_wording() -> None:
    """Redis 6.2 names the command ('evalsha'), Redis 7 a subcommand ('script|load'); both
    are an ACL without scripting (the heartbeat's advice), not a refusal of the keys.
    Faked: the errors, as redis-py raises them (a Redis 7 server is not at hand here)."""
    for text in (
        "NOPERM this user has no permissions to run the 'evalsha' command",
        "NOPERM User u has no permissions to run the 'script|load' command",
        "unknown command 'EVALSHA', with args beginning with: ",
    ):
        assert refuses_scripting(redis.exceptions.ResponseError(text)), text
    keys = "NOPERM No permissions to access a key"
    assert not refuses_scripting(redis.exceptions.ResponseError(keys))
