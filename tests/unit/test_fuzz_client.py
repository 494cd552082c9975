"""The SDK refuses what the scheduler would refuse, before anything is sent: groups and
sampling made of values at the edges of each argument's type (seeded) either raise
``InvalidArgument`` naming the argument, or become a request whose every field holds what was
given; and what it reads from a stream decodes or is a SchemaError. Nothing faked; no server
(what the server does with requests is ``test_fuzz_api``'s)."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from rollserve.client import InvalidArgument, PromptGroup, SamplingParams
from rollserve.client.types import cancel_request, publish_version_request, submit_request
from rollserve.client.wire import (
    SCHEMA_VERSION,
    GroupResult,
    SchemaError,
    decode_entry,
    encode_entry,
)

from tests.unit.test_wire import make_result

INTS = (0, 1, -1, 2, 255, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**63 - 1, 2**63, -(2**63) - 1)
FLOATS = (0.0, -0.0, 0.5, 1.0, 1.5, -1.0, 1e-45, 1e-50, 1e300, math.nan, math.inf, -math.inf)
STRINGS = ("", " ", "x", "\x00", "²", "😀", "\ud800", "x" * 300, "é" * 5_000, "a/b", "run-1")
TOKEN_LISTS = ((), (5, 6, 7), (0,), (-1,), (2**31,), (2**31 - 1, 3), (1,) * 1000)
# Values of another type than the argument's: refused with the argument named too.
NOT_INTS = ("1", 1.5, None, True, b"x", [1])
NOT_FLOATS = ("1", None, True, [1.0])
NOT_STRINGS = (5, None, b"x", ["x"])
NOT_TOKEN_LISTS = ((1.0,), ("1",), (None,), (True,), (5, "6"))
CASES = 3_000


def sampling_kwargs(rng: random.Random) -> dict[str, Any]:
    choices: dict[str, tuple[Any, ...]] = {
        "temperature": FLOATS + NOT_FLOATS,
        "top_p": FLOATS + NOT_FLOATS,
        "top_k": INTS + NOT_INTS,
        "max_tokens": INTS + NOT_INTS,
        "stop": ((), ("</s>",), ("",), ("\ud800",), ("\x00", "x"), "</s>", (5,), ("x",) * 65),
        "stop_token_ids": TOKEN_LISTS + NOT_TOKEN_LISTS,
        "seed": (None, *INTS, *NOT_INTS),
    }
    return {k: rng.choice(v) for k, v in choices.items() if rng.random() < 0.4}


def group_kwargs(rng: random.Random) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"group_id": "g", "prompt_token_ids": (5, 6), "n": 2}
    choices: dict[str, tuple[Any, ...]] = {
        "group_id": STRINGS + NOT_STRINGS,
        "prompt_token_ids": TOKEN_LISTS + NOT_TOKEN_LISTS,
        "prompt_text": STRINGS + NOT_STRINGS,
        "n": INTS + NOT_INTS,
        "prompt_key": STRINGS + NOT_STRINGS + ("k" * 1025,),
        "priority": INTS + NOT_INTS,
        "epoch": (None, *INTS, 1_000_000, 1_000_001, *NOT_INTS),
        "metadata": (
            {},
            {"k": "v"},
            {"\ud800": "v"},
            {"k": "\ud800"},
            {"": ""},
            {"k": 5},
            {5: "v"},
            {"k": "\U0001f642" * 4096},
            ["k"],
        ),
    }
    for name, values in choices.items():
        if rng.random() < 0.3:
            kwargs[name] = rng.choice(values)
    return kwargs


def names_an_argument(message: str, kwargs: dict[str, Any]) -> bool:
    return any(name in message for name in (*kwargs, "prompt", "group", "sampling"))


@pytest.mark.parametrize("seed", range(4))
def test_a_group_is_refused_with_its_argument_named_or_sent_as_given(seed: int) -> None:
    rng = random.Random(seed)
    refused = sent = 0
    for i in range(CASES):
        sampling = sampling_kwargs(rng)
        group = group_kwargs(rng)
        what = f"case {i} (seed {seed}): sampling {sampling!r:.300}, group {group!r:.300}"
        try:
            params = SamplingParams(**sampling)
            made = PromptGroup(**group, sampling=params)
            request = submit_request("run-1", [made])
        except InvalidArgument as exc:
            assert names_an_argument(str(exc), {**sampling, **group}), f"{what}: {exc}"
            refused += 1
            continue
        sent += 1
        [wire] = request.groups
        assert wire.group_id == made.group_id, what
        assert list(wire.prompt_token_ids) == list(made.prompt_token_ids), what
        assert wire.prompt_text == made.prompt_text and wire.n == made.n, what
        assert wire.priority == made.priority and dict(wire.metadata) == made.metadata, what
        assert (wire.epoch if wire.HasField("epoch") else None) == made.epoch, what
        assert wire.sampling.max_tokens == params.max_tokens, what
        assert math.isfinite(wire.sampling.temperature) and wire.sampling.temperature >= 0, what
        assert 0 < wire.sampling.top_p <= 1, what
        assert (wire.sampling.seed if wire.sampling.HasField("seed") else None) == params.seed
    assert refused > 0 and sent > 0, (refused, sent)


@pytest.mark.parametrize("value", [*STRINGS, *(str(i) for i in INTS)])
def test_run_ids_group_ids_and_weights_paths_are_refused_or_sent(value: str) -> None:
    for make in (
        lambda: submit_request(value, [PromptGroup(group_id="g", prompt_token_ids=[1], n=1)]),
        lambda: cancel_request(value, ["g"]),
        lambda: cancel_request("run-1", [value]),
        lambda: publish_version_request("run-1", 1, value),
        lambda: publish_version_request(value, 1, ""),
    ):
        try:
            make()
        except InvalidArgument as exc:
            assert str(exc), value


@pytest.mark.parametrize("seed", range(2))
def test_a_stream_entry_decodes_or_is_a_schema_error(seed: int) -> None:
    """A reader meets what is in the stream, whoever wrote it: an entry of the scheduler's
    with its body's bytes flipped, cut, repeated or replaced decodes (to a GroupResult) or
    raises SchemaError, which the consumer hands the trainer as an undecodable entry."""
    rng = random.Random(seed)
    body = encode_entry(make_result())["body"]
    decoded = undecodable = 0
    for i in range(CASES):
        data = bytearray(body)
        for _ in range(rng.choice((1, 1, 2, 5))):
            where = rng.randrange(len(data))
            choice = rng.randrange(4)
            if choice == 0:
                data[where] = rng.randrange(256)
            elif choice == 1:
                del data[where:]
            elif choice == 2:
                data[where:where] = data[where : where + rng.randrange(1, 40)]
            else:
                data[where : where + 1] = rng.choice(STRINGS).encode("utf-8", "surrogatepass")
            if not data:
                break
        fields = {b"v": SCHEMA_VERSION.encode(), b"body": bytes(data)}
        try:
            result = decode_entry(fields)
        except SchemaError:
            undecodable += 1
            continue
        except Exception as exc:  # what the consumer does not catch
            pytest.fail(f"case {i} (seed {seed}): {bytes(data)[:200]!r}: {exc!r}")
        assert isinstance(result, GroupResult)
        decoded += 1
    assert undecodable > 0, (decoded, undecodable)
