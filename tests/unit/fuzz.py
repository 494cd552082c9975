"""Requests to throw at a gRPC service: a valid request changed in one to three places to
values at and past the edges of each field's type, and requests filled at random.

Every change is made by walking the request's descriptor, so a field added to the proto is
fuzzed without a change here. Seeded: a failure names the seed and the changes, and
``mutant(seed_request, Random(seed))`` makes the same request again.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

# The statuses a service may answer a request with, whatever is in it. UNKNOWN and INTERNAL
# (an exception escaped a handler), DEADLINE_EXCEEDED (it hung) and UNAVAILABLE (it fell
# over) are not among them.
REFUSED = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
    }
)
# Refusals whose message must name a field of the request (the rest may be about the
# service: its queue is full, its engine is loading weights).
NAMES_A_FIELD = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE})

_I32 = (0, 1, -1, 2, 3, 7, 255, 256, 257, 1_000, 65_536, 10**6, 2**31 - 1, -(2**31), 2**31 - 2)
_I64 = (*_I32, 2**32, 2**53 + 1, 2**63 - 1, -(2**63), 10**15)
_U32 = (0, 1, 2, 256, 2**31, 2**32 - 1)
_U64 = (*_U32, 2**63, 2**64 - 1)
_FLOATS = (
    0.0,
    -0.0,
    1.0,
    -1.0,
    0.5,
    1.5,
    2.0,
    1e-45,
    1e-30,
    3.4e38,
    math.nan,
    math.inf,
    -math.inf,
    1e6,
    -1e6,
)
_DOUBLES = (*_FLOATS, 1e300, -1e300, 5e-324)
_STRINGS = (
    "",
    " ",
    "x",
    "0",
    "-1",
    "\x00",
    "\n",
    "\t ",
    "²",  # a digit to str.isdigit, not to int()
    "١٢",  # Arabic-Indic digits: int() reads them
    "😀",
    "\u202e",
    "%s%n{0}",
    "../../etc/passwd",
    "/",
    ":",
    "a:b:c",
    "localhost:0",
    "localhost:99999",
    "localhost:²",
    "[::1]:1",
    "127.0.0.1:1",
    "host:-1",
    "x" * 129,
    "x" * 4_097,
    "é" * 70_000,
    "x" * 1_100_000,
)
_BYTES = (b"", b"\x00", b"\xff" * 17, bytes(range(256)), b"x" * 70_000)
_VALUES: dict[int, tuple[object, ...]] = {
    FieldDescriptor.CPPTYPE_INT32: _I32,
    FieldDescriptor.CPPTYPE_INT64: _I64,
    FieldDescriptor.CPPTYPE_UINT32: _U32,
    FieldDescriptor.CPPTYPE_UINT64: _U64,
    FieldDescriptor.CPPTYPE_FLOAT: _FLOATS,
    FieldDescriptor.CPPTYPE_DOUBLE: _DOUBLES,
    FieldDescriptor.CPPTYPE_STRING: _STRINGS,
}
_LENGTHS = (2, 3, 9, 129, 257, 2_000, 70_000)
_COPIES = (2, 3, 17, 257, 1_100)
# What one change may add to a request, so that a mutant stays one a client could send
# (the services' message limit is 256 MiB; past that gRPC itself refuses it).
_MAX_ADDED_BYTES = 16 * 1024 * 1024


# A field's or a message's descriptor: protobuf's pure-Python classes or upb's, which the
# stubs type apart.
Field = Any


@dataclass(frozen=True)
class Change:
    """One place of a request and what was done to it, to name in a failure."""

    path: str
    what: str

    def __str__(self) -> str:
        return f"{self.path}: {self.what}"


def mutant(valid: Message, rng: random.Random, changes: int = 0) -> tuple[Message, list[Change]]:
    """A copy of ``valid`` changed in ``changes`` places (one to three when 0)."""
    message = type(valid)()
    message.CopyFrom(valid)
    made: list[Change] = []
    for _ in range(changes or rng.choice((1, 1, 1, 2, 3))):
        places = list(_places(message, ""))
        if not places:
            break
        made.append(rng.choice(places)(rng))
    return message, made


def filled(descriptor_type: type[Message], rng: random.Random) -> tuple[Message, list[Change]]:
    """A request of that type whose fields are each set (or left out) at random."""
    message = descriptor_type()
    made: list[Change] = []
    _fill(message, "", rng, made, depth=0)
    return message, made


def requests(
    valid: Message, rng: random.Random, count: int
) -> Iterator[tuple[Message, list[Change]]]:
    """``count`` requests: mostly mutants of ``valid``, one in five filled at random."""
    for _ in range(count):
        if rng.random() < 0.2:
            yield filled(type(valid), rng)
        else:
            yield mutant(valid, rng)


def field_names(descriptor: Any) -> set[str]:
    """Every field name of a message type and the types it holds."""
    names: set[str] = set()
    seen: set[str] = set()
    todo = [descriptor]
    while todo:
        current = todo.pop()
        if current.full_name in seen:
            continue
        seen.add(current.full_name)
        for field in current.fields:
            names.add(field.name)
            if field.message_type is not None:
                todo.append(field.message_type)
    return names


Call = Callable[[Any], Awaitable[Any]]  # sends one request (of the RPC it fuzzes)


@dataclass(frozen=True)
class Campaign:
    """How many requests each RPC gets, the seed of the first RPC's (the next RPC's is
    ``offset`` more), and whether each request is printed before it is sent."""

    count: int
    seed: int
    trace: bool = False

    @classmethod
    def from_env(cls, count: int, seed: int) -> Campaign:
        """The test's own campaign, or a longer one from the environment:
        ``ROLLSERVE_FUZZ_MUTANTS=5000 ROLLSERVE_FUZZ_SEED=$RANDOM`` (``ROLLSERVE_FUZZ_TRACE=1``
        prints each request); a failure names its seed."""
        return cls(
            count=int(os.environ.get("ROLLSERVE_FUZZ_MUTANTS", count)),
            seed=int(os.environ.get("ROLLSERVE_FUZZ_SEED", seed)),
            trace=bool(os.environ.get("ROLLSERVE_FUZZ_TRACE")),
        )

    async def check(
        self,
        name: str,
        call: Call,
        valid: Message,
        alive: Callable[[], Awaitable[None]],
        *,
        offset: int = 0,
    ) -> dict[str, int]:
        """``check_rpc`` with this campaign's count, seed (+ ``offset``) and trace."""
        return await check_rpc(
            name,
            call,
            valid,
            seed=self.seed + offset,
            count=self.count,
            alive=alive,
            trace=self.trace,
        )


async def check_rpc(
    name: str,
    call: Call,
    valid: Message,
    *,
    seed: int,
    count: int,
    alive: Callable[[], Awaitable[None]],
    trace: bool = False,
) -> dict[str, int]:
    """Sends ``count`` requests made from ``valid`` (``requests``) one by one through
    ``call``; asserts each answer is OK or a refusal that names a field, and that the service
    is ``alive`` after each. Returns how many answers had each status."""
    names = field_names(valid.DESCRIPTOR)
    seen: dict[str, int] = {}
    for i, (request, changes) in enumerate(requests(valid, random.Random(seed), count)):
        what = f"{name} #{i} (seed {seed}): " + "; ".join(map(str, changes))
        if trace:
            print(what[:300], flush=True)
        try:
            await call(request)
            code = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or ""
            assert code in REFUSED, f"{what}: {code.name}: {details}"
            # gRPC's own: the refusal's message made the trailers too big to send
            assert "metadata size" not in details, f"{what}: {details}"
            if code in NAMES_A_FIELD:
                assert any(n in details for n in names), f"{what}: names no field: {details}"
        seen[code.name] = seen.get(code.name, 0) + 1
        await alive()
    return seen


# ---------------------------------------------------------------- places to change

Place = Callable[[random.Random], Change]


def _places(message: Message, prefix: str) -> Iterator[Place]:
    """A change for every field of ``message`` and of the messages it holds."""
    for field in message.DESCRIPTOR.fields:
        path = f"{prefix}{field.name}"
        if _is_map(field):
            yield _map_change(message, field, path)
        elif field.is_repeated:
            yield _repeated_change(message, field, path)
            values = getattr(message, field.name)
            if field.message_type is not None:
                for i, element in enumerate(values):
                    yield from _places(element, f"{path}[{i}].")
            else:
                for i in range(len(values)):
                    yield _element_change(values, field, i, f"{path}[{i}]")
        elif field.message_type is not None:
            yield _message_change(message, field, path)
            if message.HasField(field.name):
                yield from _places(getattr(message, field.name), f"{path}.")
        else:
            yield _scalar_change(message, field, path)


def _scalar_change(message: Message, field: Field, path: str) -> Place:
    def change(rng: random.Random) -> Change:
        if field.has_presence and rng.random() < 0.15:
            message.ClearField(field.name)
            return Change(path, "left out")
        value = _edge(field, rng)
        setattr(message, field.name, value)
        return Change(path, _show(value))

    return change


def _element_change(values: object, field: Field, index: int, path: str) -> Place:
    def change(rng: random.Random) -> Change:
        value = _edge(field, rng)
        values[index] = value  # type: ignore[index]
        return Change(path, _show(value))

    return change


def _repeated_change(message: Message, field: Field, path: str) -> Place:
    def change(rng: random.Random) -> Change:
        values = getattr(message, field.name)
        choice = rng.randrange(4)
        if choice == 0 or (choice == 1 and not values):
            message.ClearField(field.name)
            return Change(path, "emptied")
        if choice == 1:
            first = values[0]
            copies = _fitting(rng.choice(_COPIES), _size(first))
            if field.message_type is not None:
                for _ in range(copies - 1):
                    values.add().CopyFrom(first)
            else:
                values.extend([first] * (copies - 1))
            return Change(path, f"its first element {copies} times")
        if field.message_type is not None:
            values.add()
            return Change(path, "an empty element added")
        if choice == 2:
            value = _edge(field, rng)
            values.append(value)
            return Change(path, f"{_show(value)} appended")
        value = _edge(field, rng)
        count = _fitting(rng.choice(_LENGTHS), _size(value))
        message.ClearField(field.name)
        getattr(message, field.name).extend([value] * count)
        return Change(path, f"{count} x {_show(value)}")

    return change


def _map_change(message: Message, field: Field, path: str) -> Place:
    key_field = field.message_type.fields_by_name["key"]
    value_field = field.message_type.fields_by_name["value"]

    def change(rng: random.Random) -> Change:
        entries = getattr(message, field.name)
        if rng.random() < 0.25:
            message.ClearField(field.name)
            return Change(path, "emptied")
        count = rng.choice((1, 1, 2, 300, 5_000))
        added = 0
        for i in range(count):
            key = _edge(key_field, rng)
            key = f"{key}{i}" if isinstance(key, str) and count > 1 else key
            value = None if value_field.message_type is not None else _edge(value_field, rng)
            added += _size(key) + _size(value)
            if added > _MAX_ADDED_BYTES:
                count = i
                break
            if value is None:
                entries[key].SetInParent()
            else:
                entries[key] = value
        return Change(path, f"{count} entries")

    return change


def _message_change(message: Message, field: Field, path: str) -> Place:
    def change(rng: random.Random) -> Change:
        if message.HasField(field.name) and rng.random() < 0.5:
            message.ClearField(field.name)
            return Change(path, "left out")
        getattr(message, field.name).Clear()
        getattr(message, field.name).SetInParent()
        return Change(path, "empty")

    return change


# ---------------------------------------------------------------- values


def _edge(field: Field, rng: random.Random) -> object:
    cpp = field.cpp_type
    if cpp == FieldDescriptor.CPPTYPE_BOOL:
        return rng.random() < 0.5
    if cpp == FieldDescriptor.CPPTYPE_ENUM:
        numbers = [v.number for v in field.enum_type.values]
        return rng.choice([*numbers, max(numbers) + 1, 99, -1])
    if field.type == FieldDescriptor.TYPE_BYTES:
        return rng.choice(_BYTES)
    values = _VALUES.get(cpp)
    if values is None:
        raise TypeError(f"no edge values for {field.full_name} (cpp type {cpp})")
    return rng.choice(values)


def _fill(
    message: Message, prefix: str, rng: random.Random, made: list[Change], depth: int
) -> None:
    for field in message.DESCRIPTOR.fields:
        if rng.random() < 0.4:
            continue
        path = f"{prefix}{field.name}"
        if _is_map(field):
            made.append(_map_change(message, field, path)(rng))
        elif field.message_type is not None:
            if depth >= 3:
                continue
            count = rng.choice((1, 1, 2, 3)) if field.is_repeated else 1
            for i in range(count):
                child = getattr(message, field.name)
                child = child.add() if field.is_repeated else child
                child.SetInParent()
                where = f"{path}[{i}]." if field.is_repeated else f"{path}."
                _fill(child, where, rng, made, depth + 1)
        elif field.is_repeated:
            count = rng.choice((1, 2, 5, 40))
            values = [_edge(field, rng) for _ in range(count)]
            getattr(message, field.name).extend(values)
            made.append(Change(path, f"{count} values"))
        else:
            value = _edge(field, rng)
            setattr(message, field.name, value)
            made.append(Change(path, _show(value)))


def _size(value: object) -> int:
    """About what ``value`` takes on the wire."""
    if isinstance(value, Message):
        return value.ByteSize() + 2
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass")) + 2
    if isinstance(value, bytes):
        return len(value) + 2
    return 10


def _fitting(count: int, size: int) -> int:
    """``count`` copies of something of ``size`` bytes, fewer where they would pass
    ``_MAX_ADDED_BYTES`` (at least two, so that the change still repeats it)."""
    return max(2, min(count, _MAX_ADDED_BYTES // max(size, 1)))


def _is_map(field: Field) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}... ({len(text)} characters)"


# ---------------------------------------------------------------- JSON bodies (an HTTP API)

# Values a JSON body may hold where the message wants another: every JSON type, numbers
# past every proto type's range, strings that look like numbers, nesting.
_JSON_EDGES: tuple[object, ...] = (
    None,
    True,
    False,
    0,
    -1,
    1.5,
    -0.0,
    2**31,
    2**63,
    2**64,
    10**30,
    1e308,
    "",
    "1",
    "1e3",
    "NaN",
    "Infinity",
    "0x10",
    " 7 ",
    "x" * 200,
    [],
    [None],
    [[1, 2]],
    {},
    {"x": 1},
    {"": None},
)
# Bodies that are no JSON object of the message: not JSON at all, or JSON of another shape.
_RAW_BODIES: tuple[bytes, ...] = (
    b"",
    b" ",
    b"{",
    b"}",
    b"nul",
    b"[]",
    b"[1, 2]",
    b'"text"',
    b"3",
    b"null",
    b"true",
    b"\xff\xfe\x00",
    b'{"groups": [}',
    b'{"a": 1,}',
    b"NaN",
    b'{"groups": NaN}',
    b"[" * 100_000 + b"]" * 100_000,
    b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    b'{"groups": [{"n": 2}]}' + b" " * 10,
    '{"groups": [{"group_id": "é\\ud800"}]}'.encode(),
)


def json_bodies(valid: Message, rng: random.Random, count: int) -> Iterator[tuple[bytes, str]]:
    """``count`` HTTP bodies made from ``valid`` in proto3's JSON mapping, with what was
    done to each: a request of ``requests`` as JSON, a value of the JSON changed to one of
    another type or out of range, a field added or left out, or a raw body that is no JSON
    object (one in ten)."""
    for _ in range(count):
        roll = rng.random()
        if roll < 0.1:
            raw = rng.choice(_RAW_BODIES)
            yield raw, f"raw body {_show(raw)}"
            continue
        if roll < 0.4:
            request, changes = next(requests(valid, rng, 1))
            document = _as_json(request)
            what = "; ".join(map(str, changes))
        else:
            document, what = _as_json(valid), ""
        if roll >= 0.3:
            what = f"{what}; {_json_change(document, rng)}".strip("; ")
        yield json.dumps(document, allow_nan=True).encode(), what


def _as_json(message: Message) -> Any:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def _json_change(document: Any, rng: random.Random) -> str:
    """Changes one place of ``document`` (a dict or list tree) in place; says what."""
    places: list[tuple[Any, Any, str]] = []  # (container, key, path)

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                places.append((node, key, f"{path}.{key}"))
                walk(value, f"{path}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                places.append((node, i, f"{path}[{i}]"))
                walk(value, f"{path}[{i}]")

    walk(document, "")
    dicts = [node for node, _, _ in places if isinstance(node, dict)] or [document]
    kind = rng.random()
    if kind < 0.15 and isinstance(document, dict):
        target = rng.choice(dicts)
        name = rng.choice(("nope", "runId", "run_id", "groupId", "N", "sampling", "__proto__"))
        value = rng.choice(_JSON_EDGES)
        target[name] = value
        return f"added {name}={_show(value)}"
    if kind < 0.25 and places:
        node, key, path = rng.choice(places)
        del node[key]
        return f"{path} left out"
    if not places:
        return "unchanged"
    node, key, path = rng.choice(places)
    value = rng.choice(_JSON_EDGES)
    node[key] = value
    return f"{path}={_show(value)}"
