"""The stream entry format: what the scheduler writes is what every reader decodes."""

from __future__ import annotations

import json

import pytest
from rollserve.client.wire import (
    MAX_STATUS_DETAILS,
    SCHEMA_VERSION,
    FinishReason,
    GroupResult,
    GroupStatus,
    Sample,
    SchemaError,
    VersionSegment,
    decode_entry,
    encode_entry,
    ended_key,
    pending_key,
    quoted,
    status_details,
    stream_key,
    version_key,
)


def make_result(group_id: str = "q17-e3", n: int = 2) -> GroupResult:
    return GroupResult(
        run_id="run-1",
        group_id=group_id,
        status=GroupStatus.DELIVERED,
        prompt_key="q17",
        prompt_token_ids=[1, 2, 3],
        samples=[
            Sample(
                sample_id=f"{group_id}/{i}",
                index=i,
                token_ids=[10 + i, 11 + i],
                logprobs=[-0.5, -1.25],
                finish_reason=FinishReason.STOP if i == 0 else FinishReason.LENGTH,
                engine_id="engine-0",
                versions=[VersionSegment(version=3, length=1), VersionSegment(version=4, length=1)],
                num_prompt_tokens=3,
                cached_prompt_tokens=2,
                preemptions=1,
                resumed_tokens=1,
                started_at=100.0,
                finished_at=101.5,
            )
            for i in range(n)
        ],
        metadata={"epoch": "3"},
        submitted_at=99.0,
        finished_at=101.5,
    )


def as_read(fields: dict[str, bytes]) -> dict[bytes, bytes]:
    """The fields as redis-py returns them from XREADGROUP."""
    return {k.encode(): v for k, v in fields.items()}


def test_roundtrip_keeps_every_field() -> None:
    result = make_result()
    assert decode_entry(as_read(encode_entry(result))) == result


def test_failed_group_roundtrips_without_samples() -> None:
    result = GroupResult(
        run_id="run-1", group_id="g", status=GroupStatus.FAILED, error="engine-2 died", attempts=3
    )
    decoded = decode_entry(as_read(encode_entry(result)))
    assert decoded == result
    assert decoded.samples == []
    assert decoded.num_output_tokens == 0


def test_entry_fields_are_version_group_id_and_json_body() -> None:
    fields = encode_entry(make_result("g-7"))
    assert set(fields) == {"v", "group_id", "body"}
    assert fields["v"] == SCHEMA_VERSION.encode() == b"1"
    assert fields["group_id"] == b"g-7"
    body = json.loads(fields["body"])
    assert body["status"] == "delivered"
    sample = body["samples"][0]
    assert sample["finish_reason"] == "stop"
    assert sample["versions"] == [[3, 1], [4, 1]]  # [version, length] pairs, as documented


def test_reader_ignores_fields_it_does_not_know() -> None:
    """Version policy: adding a field with a default keeps the version."""
    fields = encode_entry(make_result())
    body = json.loads(fields["body"])
    body["new_field"] = {"anything": 1}
    body["samples"][0]["new_sample_field"] = 2
    fields["body"] = json.dumps(body).encode()
    assert decode_entry(as_read(fields)) == make_result()


@pytest.mark.parametrize("version", [b"2", b"0", b"", None])
def test_unknown_version_is_rejected(version: bytes | None) -> None:
    fields = as_read(encode_entry(make_result()))
    if version is None:
        del fields[b"v"]
    else:
        fields[b"v"] = version
    with pytest.raises(SchemaError, match="schema version"):
        decode_entry(fields)


def test_missing_body_is_rejected() -> None:
    fields = as_read(encode_entry(make_result()))
    del fields[b"body"]
    with pytest.raises(SchemaError, match="no 'body'"):
        decode_entry(fields)


@pytest.mark.parametrize(
    "body",
    [b"not json", b"{}", b'{"run_id": "r", "group_id": "g", "status": "exploded"}'],
)
def test_bad_body_is_rejected(body: bytes) -> None:
    fields = as_read(encode_entry(make_result()))
    fields[b"body"] = body
    with pytest.raises(SchemaError, match="does not decode"):
        decode_entry(fields)


def test_keys_of_a_run_share_a_hash_tag() -> None:
    assert stream_key("run-1") == "rollserve:{run-1}:groups"
    assert pending_key("run-1") == "rollserve:{run-1}:pending"
    assert ended_key("run-1") == "rollserve:{run-1}:ended"
    assert version_key("run-1") == "rollserve:{run-1}:version"


def test_derived_numbers() -> None:
    result = make_result(n=3)
    assert result.num_output_tokens == 6
    assert result.latency_s == pytest.approx(2.5)
    assert result.oldest_version == 3
    assert make_result(n=0).oldest_version is None


def test_status_details_are_cut_to_what_grpc_trailers_carry() -> None:
    short = "groups[0].n (0) must be at least 1"
    assert status_details(short) == short
    long = "é" * 100_000
    cut = status_details(long)
    assert len(cut) <= MAX_STATUS_DETAILS and cut.endswith("(100000 characters in all)")
    # percent-encoded in the trailers: 3 bytes a UTF-8 byte, within gRPC's 16 KiB
    assert 3 * len(cut.encode()) < 16 * 1024


def test_quoted_text_is_cut_and_says_how_long_it_was() -> None:
    assert quoted("e0") == "'e0'"
    assert quoted("x" * 101) == f"{'x' * 100!r}... (101 characters)"


def test_a_version_segment_unpacks_as_the_stream_s_pair() -> None:
    """stream-format.md gives ``versions`` as ``[version, length]`` pairs: the SDK's segments
    unpack so too (``for version, length in sample.versions``)."""
    result = decode_entry(as_read(encode_entry(make_result(n=1))))
    pairs = [(version, length) for s in result.samples for version, length in s.versions]
    assert pairs == [(3, 1), (4, 1)]
