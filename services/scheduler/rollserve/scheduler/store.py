"""The scheduler's durable state in Redis, and the idempotent stream writer.

Redis 6.2/7 streams have no producer-side deduplication, so delivery is a Lua
script that adds the group id to the run's ``ended`` set and appends the stream
entry only when the id was new, and removes the group from ``pending`` in the
same atomic step. A retried or replayed delivery therefore never produces a
second entry, and a crash can never leave a delivered group pending (or the
reverse). Submission is atomic the same way: all groups of a call are checked
against ``pending`` and ``ended`` and written together, or none is.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import redis.asyncio as aioredis
from rollserve.client.wire import (
    RUNS_KEY,
    GroupResult,
    encode_entry,
    ended_key,
    pending_key,
    stream_key,
)
from rollserve.scheduler.state import GroupSpec

# KEYS: pending, ended, runs. ARGV: run_id, then group_id, body pairs.
# Returns the first group id that is already pending or ended, or nothing.
_SUBMIT = """
for i = 2, #ARGV, 2 do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 1
     or redis.call('SISMEMBER', KEYS[2], ARGV[i]) == 1 then
    return ARGV[i]
  end
end
for i = 2, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
end
redis.call('SADD', KEYS[3], ARGV[1])
return false
"""

# KEYS: ended, pending, stream. ARGV: group_id, maxlen (0 = none), then field, value pairs.
# Returns the new entry id, or nothing when the group had already ended.
_DELIVER = """
local fresh = redis.call('SADD', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
if fresh == 0 then
  return false
end
local args = {'XADD', KEYS[3]}
if tonumber(ARGV[2]) > 0 then
  table.insert(args, 'MAXLEN')
  table.insert(args, '~')
  table.insert(args, ARGV[2])
end
table.insert(args, '*')
for i = 3, #ARGV do
  table.insert(args, ARGV[i])
end
return redis.call(unpack(args))
"""

# KEYS: ended, pending. ARGV: group ids. Returns the ids that were pending.
_CANCEL = """
local out = {}
for i = 1, #ARGV do
  if redis.call('HDEL', KEYS[2], ARGV[i]) == 1 then
    redis.call('SADD', KEYS[1], ARGV[i])
    table.insert(out, ARGV[i])
  end
end
return out
"""

_spec_encoder = msgspec.msgpack.Encoder()
_spec_decoder = msgspec.msgpack.Decoder(GroupSpec)


def _raw(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class DuplicateGroup(ValueError):
    def __init__(self, run_id: str, group_id: str) -> None:
        super().__init__(
            f"group_id {group_id!r} was already submitted in run {run_id!r} "
            "(group ids are unique per run)"
        )
        self.group_id = group_id


class Store:
    def __init__(self, client: aioredis.Redis, stream_maxlen: int = 0) -> None:
        self._redis = client
        self._stream_maxlen = stream_maxlen
        self._submit = client.register_script(_SUBMIT)
        self._deliver = client.register_script(_DELIVER)
        self._cancel = client.register_script(_CANCEL)

    @classmethod
    def from_url(cls, url: str, stream_maxlen: int = 0) -> Store:
        return cls(aioredis.Redis.from_url(url), stream_maxlen)

    async def ping(self) -> None:
        await self._redis.ping()

    async def close(self) -> None:
        await self._redis.aclose()

    async def add_pending(self, run_id: str, specs: Sequence[GroupSpec]) -> None:
        """Persists the groups, or raises DuplicateGroup and persists none."""
        argv: list[str | bytes] = [run_id]
        for spec in specs:
            argv += [spec.group_id, _spec_encoder.encode(spec)]
        keys = [pending_key(run_id), ended_key(run_id), RUNS_KEY]
        duplicate = await self._submit(keys=keys, args=argv)
        if duplicate is not None:
            raise DuplicateGroup(run_id, _text(duplicate))

    async def deliver(self, result: GroupResult) -> str | None:
        """Appends the group's entry once; returns its id, or None if it had ended before."""
        fields = encode_entry(result)
        argv: list[str | bytes | int] = [result.group_id, self._stream_maxlen]
        for name, value in fields.items():
            argv += [name, value]
        keys = [ended_key(result.run_id), pending_key(result.run_id), stream_key(result.run_id)]
        entry_id = await self._deliver(keys=keys, args=argv)
        return None if entry_id is None else _text(entry_id)

    async def cancel(self, run_id: str, group_ids: Sequence[str]) -> list[str]:
        if not group_ids:
            return []
        keys = [ended_key(run_id), pending_key(run_id)]
        cancelled = await self._cancel(keys=keys, args=list(group_ids))
        return [_text(g) for g in cancelled]

    async def load_pending(self) -> list[GroupSpec]:
        """Every accepted group that has not ended, oldest first (for recovery)."""
        specs: list[GroupSpec] = []
        for run in sorted(await self._redis.smembers(RUNS_KEY)):
            run_id = _text(run)
            bodies = await self._redis.hgetall(pending_key(run_id))
            specs += (_spec_decoder.decode(_raw(body)) for body in bodies.values())
        specs.sort(key=lambda s: s.submitted_at)
        return specs
