"""The scheduler's durable state in Redis, and the idempotent stream writer.

Redis 6.2/7 streams have no producer-side deduplication, so delivery is a Lua
script that, only when the group is in the run's ``pending`` hash, removes it from
there, adds its id to the run's ``ended`` set and appends the stream entry, in
one atomic step. A retried or replayed delivery therefore never produces a
second entry, and a crash can never leave a delivered group pending (or the
reverse). Submission is atomic the same way: all groups of a call are checked
against ``pending`` and ``ended`` and written together, or none is.

The length predictor's history lives in three keys of the scheduler's predictor
namespace ``NS`` (hash-tagged, so one slot in Redis Cluster): ``rollserve:pred:{NS}:keys``
(hash prompt_key -> the key's record), ``rollserve:pred:{NS}:used`` (sorted set
prompt_key -> a counter value of its last write, for the eviction order; the counter is
``rollserve:pred:{NS}:clock``) and ``rollserve:pred:{NS}:globals`` (the prior and the
predictor's clock). A save writes the keys a
finished group touched and the globals in one script and trims the oldest keys beyond
the predictor's ``max_keys``: its cost is bounded per finished group. History is a hint,
not a delivery: a save lost in a crash loses one group's observations, never a sample.

A run's policy version (``PublishVersion``) is one integer key, ``rollserve:{RUN}:version``,
set by a script that refuses to lower it, so a late retry of an old publish cannot undo a
newer one. The fleet's weights (the last ``PublishVersion`` that gave a ``weights_path``)
are the hash ``rollserve:weights`` (``path``, ``version``, and ``run``, ``since``: the run
whose versions the engines' weights carry, from which of its versions): engines that join
later load them.

Every write of the scheduler's state is fenced by its lease (``rollserve.scheduler.lease``):
once the store made the lease, each script first checks, in the same atomic step, that the
lease key still names this holder, and refuses the write otherwise (``LeaseLost``). A
scheduler whose process stalled past its lease's ttl (a pause of the machine, a long
collection) while another took over cannot write after it wakes, before its own renewal
finds the lease gone: a group it accepted then would sit in Redis unseen by the scheduler
that runs, and a version it stored would be one that scheduler does not know.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import msgspec
import redis.asyncio as aioredis
import redis.exceptions
from redis.commands.core import AsyncScript
from rollserve.client.wire import (
    DELETES_KEPT_S,
    KEY_PREFIX,
    RUNS_KEY,
    WEIGHTS_KEY,
    GroupResult,
    SampleResult,
    deletes_key,
    encode_entry,
    encode_sample_entry,
    ended_key,
    pending_key,
    samples_stream_key,
    stream_key,
    streamed_key,
    version_key,
)
from rollserve.scheduler.lease import LEASE_KEY, LeaseLost, SchedulerLease
from rollserve.scheduler.state import GroupSpec

DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_CONNECTION_WAIT_S = 30.0

_FENCED = "ROLLSERVE_FENCED"
# Put before a script's own text: its last key is the lease and its last argument the holder
# ("" when the store holds no lease), both taken off before the script's text runs.
_FENCE = f"""
local holder = table.remove(ARGV)
local lease = table.remove(KEYS)
if holder ~= '' and redis.call('GET', lease) ~= holder then
  return redis.error_reply('{_FENCED}')
end
"""

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

# Appends ARGV[first..] (field, value pairs) to the stream, trimmed to about ``maxlen``
# entries when that is > 0; returns the entry id.
_XADD = """
local function xadd(stream, maxlen, first)
  local args = {'XADD', stream}
  if tonumber(maxlen) > 0 then
    table.insert(args, 'MAXLEN')
    table.insert(args, '~')
    table.insert(args, maxlen)
  end
  table.insert(args, '*')
  for i = first, #ARGV do
    table.insert(args, ARGV[i])
  end
  return redis.call(unpack(args))
end
"""

# KEYS: ended, pending, stream, streamed. ARGV: group_id, maxlen (0 = none), then field, value
# pairs. Returns the new entry id, or nothing when the group was not pending (it ended, or its
# run was deleted). The first write is SADD: under maxmemory Redis refuses it, before the
# script has changed anything (a script's writes before an error stay).
_DELIVER = (
    _XADD
    + """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 0 then
  return false
end
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('DEL', KEYS[4])
return xadd(KEYS[3], ARGV[2], 3)
"""
)

# KEYS: pending, ended, version, stream, samples stream, runs, weights, deletes. ARGV:
# run_id, the prefix of the run's streamed hashes (a group id completes one), how long the
# count of deletes stays (ms). The fleet's weights, if they name the run, name none after.
# The count tells a reader whose stream vanished that the run was deleted since it began.
# Returns 1 if the run had state. The count goes up after the deletes: under maxmemory Redis
# refuses a script whose first write needs memory, and a full Redis is when a run is deleted
# to free it.
_DELETE_RUN = """
for _, group_id in ipairs(redis.call('HKEYS', KEYS[1])) do
  redis.call('DEL', ARGV[2] .. group_id)
end
local existed = redis.call('SREM', KEYS[6], ARGV[1])
existed = existed + redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5])
if redis.call('HGET', KEYS[7], 'run') == ARGV[1] then
  redis.call('HSET', KEYS[7], 'run', '', 'since', 0)
  existed = existed + 1
end
redis.call('INCR', KEYS[8])
redis.call('PEXPIRE', KEYS[8], ARGV[3])
if existed > 0 then
  return 1
end
return 0
"""

# KEYS: pending, streamed, samples stream. ARGV: group_id, index, maxlen, the entry's body,
# then field, value pairs. Appends the entry and keeps the body in the group's streamed hash,
# once per sample, while the group is pending; returns the entry id, or nothing. XADD is the
# first write: refused (under maxmemory, or a key of another type), it leaves nothing behind
# for a retry to take for written (a script's writes before an error stay).
_DELIVER_SAMPLE = (
    _XADD
    + """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0
   or redis.call('HEXISTS', KEYS[2], ARGV[2]) == 1 then
  return false
end
local entry = xadd(KEYS[3], ARGV[3], 5)
redis.call('HSET', KEYS[2], ARGV[2], ARGV[4])
return entry
"""
)

# KEYS: ended, pending, then the streamed hash of each group id. ARGV: group ids.
# Returns the ids that were pending.
_CANCEL = """
local out = {}
for i = 1, #ARGV do
  if redis.call('HDEL', KEYS[2], ARGV[i]) == 1 then
    redis.call('SADD', KEYS[1], ARGV[i])
    redis.call('DEL', KEYS[2 + i])
    table.insert(out, ARGV[i])
  end
end
return out
"""

# KEYS: records, used, globals, clock. ARGV: max_keys, globals, then prompt_key, record pairs
# (least recently used first). Returns how many of the oldest keys were trimmed.
_SAVE_HISTORY = """
local pairs = (#ARGV - 2) / 2
local last = redis.call('INCRBY', KEYS[4], pairs)
for i = 3, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  redis.call('ZADD', KEYS[2], last - pairs + (i - 1) / 2, ARGV[i])
end
redis.call('SET', KEYS[3], ARGV[2])
local excess = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[1])
if excess <= 0 then
  return 0
end
local old = redis.call('ZRANGE', KEYS[2], 0, excess - 1)
redis.call('HDEL', KEYS[1], unpack(old))
redis.call('ZREMRANGEBYRANK', KEYS[2], 0, excess - 1)
return excess
"""

# KEYS: weights. ARGV: field, value pairs (the hash is replaced).
_SAVE_WEIGHTS = """
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], unpack(ARGV))
"""

# KEYS: weights.
_FORGET_WEIGHTS = """
redis.call('DEL', KEYS[1])
"""

# KEYS: version. ARGV: the new version. Returns {1, version, the version it replaced} when
# set (or already so), {0, current, current} when the current version is higher.
_PUBLISH_VERSION = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
local wanted = tonumber(ARGV[1])
if current > wanted then
  return {0, current, current}
end
redis.call('SET', KEYS[1], ARGV[1])
return {1, wanted, current}
"""

# KEYS: the history's records, its last-used times. ARGV: prompt keys. Forgets the keys.
_DROP_HISTORY = """
redis.call('HDEL', KEYS[1], unpack(ARGV))
redis.call('ZREM', KEYS[2], unpack(ARGV))
return 0
"""
_DROP_CHUNK = 1000

# KEYS: stream. ARGV: retention, ms. Removes the entries every consumer group of the stream
# has acknowledged that were written more than the retention ago; returns {removed, left}.
# A group has acknowledged every entry before its oldest pending one, or, with none pending,
# every entry up to the last one it was delivered (XTRIM MINID removes the ids below the one
# given: the next id after that one). Without a consumer group nothing is removed: no reader
# has read anything yet.
_TRIM_ACKED = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  return {0, 0}
end
local function parts(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function before(a, b)
  local ams, aseq = parts(a)
  local bms, bseq = parts(b)
  if ams ~= bms then
    return ams < bms
  end
  return aseq < bseq
end
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
if #groups == 0 then
  return {0, redis.call('XLEN', KEYS[1])}
end
local now = redis.call('TIME')
local cutoff = math.floor(tonumber(now[1]) * 1000 + tonumber(now[2]) / 1000) - tonumber(ARGV[1])
if cutoff <= 0 then
  return {0, redis.call('XLEN', KEYS[1])}
end
local bound = string.format('%d-0', cutoff)
for _, group in ipairs(groups) do
  local info = {}
  for i = 1, #group, 2 do
    info[group[i]] = group[i + 1]
  end
  local kept
  if tonumber(info['pending']) > 0 then
    kept = redis.call('XPENDING', KEYS[1], info['name'])[2]
  else
    local ms, seq = parts(info['last-delivered-id'])
    kept = string.format('%d-%d', ms, seq + 1)
  end
  if before(kept, bound) then
    bound = kept
  end
end
local removed = redis.call('XTRIM', KEYS[1], 'MINID', bound)
return {removed, redis.call('XLEN', KEYS[1])}
"""

_HISTORY_BATCH = 1000  # prompt keys read per round trip when loading history

_spec_encoder = msgspec.msgpack.Encoder()
_spec_decoder = msgspec.msgpack.Decoder(GroupSpec)
_sample_decoder = msgspec.json.Decoder(SampleResult)


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


@dataclass(frozen=True, slots=True)
class FleetWeights:
    """The weights every engine serves: the last ``PublishVersion`` with a ``weights_path``.
    Engines label tokens with the version of the weights that made them, in the numbering
    of ``run_id``, which has published weights since its version ``since``."""

    path: str
    version: int
    run_id: str
    since: int


@dataclass(frozen=True, slots=True)
class History:
    """The length predictor's saved state: key records oldest-used first, and the globals."""

    records: list[tuple[str, bytes]]
    globals: bytes | None


def history_keys(namespace: str) -> tuple[str, str, str, str]:
    """Redis keys of a predictor namespace: records (hash), use order (zset), globals
    (string) and the counter that orders writes."""
    prefix = f"{KEY_PREFIX}:pred:{{{namespace}}}"
    return f"{prefix}:keys", f"{prefix}:used", f"{prefix}:globals", f"{prefix}:clock"


# Redis's codes for a refusal that a later try may pass: out of memory under noeviction, a
# replica a failover turned read-only, a failed save (MISCONF), a busy script, a load from
# disk, too few replicas or a primary down. Redis 6 wraps an error inside a script
# ("ERR Error running script ...: -OOM command not allowed ..."), so the code is looked for
# after a dash too. (BUSYGROUP is another thing: the word must end.)
_LATER_CODES = re.compile(
    r"(?:^|-)(?:OOM|READONLY|MISCONF|BUSY|LOADING|NOREPLICAS|MASTERDOWN|TRYAGAIN)\b"
)
_LATER_ERRORS = (
    redis.exceptions.ConnectionError,  # (BusyLoadingError too)
    redis.exceptions.TimeoutError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.TryAgainError,
    redis.exceptions.MasterDownError,
)


def may_pass_later(exc: redis.exceptions.RedisError) -> bool:
    """Whether a write Redis refused with ``exc`` may pass if tried again (an outage, or a
    refusal of the moment); False for one no retry changes (WRONGTYPE, a script's error)."""
    if isinstance(exc, _LATER_ERRORS):
        return True
    return bool(_LATER_CODES.search(str(exc)))


class Store:
    def __init__(
        self, client: aioredis.Redis, stream_maxlen: int = 0, predictor_namespace: str = "default"
    ) -> None:
        self._redis = client
        self._stream_maxlen = stream_maxlen
        self._history_keys = list(history_keys(predictor_namespace))
        self._holder = ""  # the lease's holder once the store made it: writes are fenced
        self._fenced_out: Callable[[LeaseLost], None] | None = None
        self._submit = self._fenced(_SUBMIT)
        self._deliver = self._fenced(_DELIVER)
        self._deliver_sample = self._fenced(_DELIVER_SAMPLE)
        self._delete_run = self._fenced(_DELETE_RUN)
        self._cancel = self._fenced(_CANCEL)
        self._save_history = self._fenced(_SAVE_HISTORY)
        self._publish_version = self._fenced(_PUBLISH_VERSION)
        self._save_weights = self._fenced(_SAVE_WEIGHTS)
        self._forget_weights = self._fenced(_FORGET_WEIGHTS)
        self._trim_acked = self._fenced(_TRIM_ACKED)
        self._drop_history = self._fenced(_DROP_HISTORY)

    @classmethod
    def from_url(
        cls,
        url: str,
        stream_maxlen: int = 0,
        predictor_namespace: str = "default",
        *,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        connection_wait_s: float = DEFAULT_CONNECTION_WAIT_S,
    ) -> Store:
        """A store over at most ``max_connections`` connections to ``url``. A caller that finds
        them all in use waits up to ``connection_wait_s`` for one (then ConnectionError, as
        when Redis is down): deliveries of many groups finishing at once queue instead of
        failing with "Too many connections"."""
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=connection_wait_s
        )
        return cls(aioredis.Redis.from_pool(pool), stream_maxlen, predictor_namespace)

    async def ping(self) -> None:
        await self._redis.ping()

    def lease(
        self, ttl_s: float, wait_s: float, fenced_out: Callable[[LeaseLost], None] | None = None
    ) -> SchedulerLease:
        """The scheduler lease on this store's database (see rollserve.scheduler.lease). It
        shares the store's connections: a renewal that waits too long for one loses it.
        From now on the store writes only while the lease names its holder: a write Redis
        refuses calls ``fenced_out`` and raises LeaseLost."""
        lease = SchedulerLease(self._redis, ttl_s=ttl_s, wait_s=wait_s)
        self._holder = lease.holder
        self._fenced_out = fenced_out
        return lease

    def _fenced(self, source: str) -> AsyncScript:
        return self._redis.register_script(_FENCE + source)

    async def _write(
        self, script: AsyncScript, keys: Sequence[str], args: Sequence[str | bytes | int]
    ) -> object:
        """Runs a fenced script; LeaseLost, and nothing written, if another holds the lease."""
        try:
            return await script(keys=[*keys, LEASE_KEY], args=[*args, self._holder])
        except redis.exceptions.ResponseError as exc:
            if str(exc) != _FENCED:
                raise
            lost = LeaseLost(
                f"{LEASE_KEY} no longer names this scheduler ({self._holder}): another one "
                "took it over, and Redis refused this scheduler's write"
            )
            if self._fenced_out is not None:
                self._fenced_out(lost)
            raise lost from exc

    async def close(self) -> None:
        await self._redis.aclose()

    async def add_pending(self, run_id: str, specs: Sequence[GroupSpec]) -> None:
        """Persists the groups, or raises DuplicateGroup and persists none."""
        argv: list[str | bytes] = [run_id]
        for spec in specs:
            argv += [spec.group_id, _spec_encoder.encode(spec)]
        keys = [pending_key(run_id), ended_key(run_id), RUNS_KEY]
        duplicate = await self._write(self._submit, keys, argv)
        if duplicate is not None:
            raise DuplicateGroup(run_id, _text(cast(bytes, duplicate)))

    async def deliver(self, result: GroupResult) -> str | None:
        """Appends the group's entry once; returns its id, or None if it was not pending (it
        had ended before, or its run was deleted).
        The samples kept for it (``deliver_sample``) go with it."""
        fields = encode_entry(result)
        argv: list[str | bytes | int] = [result.group_id, self._stream_maxlen]
        for name, value in fields.items():
            argv += [name, value]
        run_id = result.run_id
        keys = [
            ended_key(run_id),
            pending_key(run_id),
            stream_key(run_id),
            streamed_key(run_id, result.group_id),
        ]
        entry_id = await self._write(self._deliver, keys, argv)
        return None if entry_id is None else _text(cast(bytes, entry_id))

    async def deliver_sample(self, result: SampleResult) -> str | None:
        """Appends the sample's entry to the run's samples stream and keeps it for its group
        (a restarted scheduler does not run it again), once, while the group is pending;
        returns the entry id, or None if it was written before or the group ended."""
        fields = encode_sample_entry(result)
        index = result.sample.index
        argv: list[str | bytes | int] = [result.group_id, index, self._stream_maxlen]
        argv += [fields["body"]]
        for name, value in fields.items():
            argv += [name, value]
        run_id = result.run_id
        keys = [
            pending_key(run_id),
            streamed_key(run_id, result.group_id),
            samples_stream_key(run_id),
        ]
        entry_id = await self._write(self._deliver_sample, keys, argv)
        return None if entry_id is None else _text(cast(bytes, entry_id))

    async def load_streamed(
        self, groups: Sequence[tuple[str, str]]
    ) -> dict[tuple[str, str], list[SampleResult]]:
        """The samples written to the samples stream of each pending ``(run_id, group_id)``,
        by index (one round trip)."""
        pipe = self._redis.pipeline(transaction=False)
        for run_id, group_id in groups:
            pipe.hgetall(streamed_key(run_id, group_id))
        out: dict[tuple[str, str], list[SampleResult]] = {}
        for group, bodies in zip(groups, await pipe.execute() if groups else [], strict=True):
            results = [_sample_decoder.decode(_raw(body)) for body in bodies.values()]
            out[group] = sorted(results, key=lambda r: r.sample.index)
        return out

    async def delete_run(self, run_id: str) -> bool:
        """Deletes all the run's state (its pending groups, the ids of its ended ones, its
        streams, its version; the fleet's weights name no run if they named it); whether it
        had any. A delivery in flight then writes nothing: its group is no longer pending."""
        keys = [
            pending_key(run_id),
            ended_key(run_id),
            version_key(run_id),
            stream_key(run_id),
            samples_stream_key(run_id),
            RUNS_KEY,
            WEIGHTS_KEY,
            deletes_key(run_id),
        ]
        prefix = streamed_key(run_id, "")
        kept_ms = DELETES_KEPT_S * 1000
        return bool(await self._write(self._delete_run, keys, [run_id, prefix, kept_ms]))

    async def trim_acked(
        self, run_id: str, retention_s: float, *, samples: bool = False
    ) -> tuple[int, int]:
        """Removes the entries of the run's stream (with ``samples``, of its samples stream)
        that every consumer group has acknowledged and that were written more than
        ``retention_s`` ago (none while no reader has made a consumer group); returns how
        many it removed and how many are left."""
        stream = samples_stream_key(run_id) if samples else stream_key(run_id)
        reply = await self._write(self._trim_acked, [stream], [round(retention_s * 1000)])
        removed, left = cast(list[int], reply)
        return int(removed), int(left)

    async def runs(self) -> list[str]:
        """Every run with state in Redis."""
        return sorted(_text(run) for run in await self._redis.smembers(RUNS_KEY))

    async def cancel(self, run_id: str, group_ids: Sequence[str]) -> list[str]:
        if not group_ids:
            return []
        keys = [ended_key(run_id), pending_key(run_id)]
        keys += [streamed_key(run_id, group_id) for group_id in group_ids]
        cancelled = cast(list[bytes], await self._write(self._cancel, keys, list(group_ids)))
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

    async def pending_groups(self, run_id: str, group_ids: Sequence[str]) -> list[GroupSpec]:
        """Those of the run's ``group_ids`` that are pending, oldest first."""
        if not group_ids:
            return []
        bodies = await self._redis.hmget(pending_key(run_id), list(group_ids))
        specs = [_spec_decoder.decode(_raw(body)) for body in bodies if body is not None]
        specs.sort(key=lambda s: s.submitted_at)
        return specs

    async def publish_version(self, run_id: str, version: int) -> tuple[bool, int, int]:
        """Sets the run's policy version unless it is higher already; returns whether it is
        now ``version``, the run's version, and the one it had before."""
        ok, current, before = cast(
            list[int], await self._write(self._publish_version, [version_key(run_id)], [version])
        )
        return bool(ok), int(current), int(before)

    async def load_versions(self, run_ids: Sequence[str]) -> dict[str, int]:
        """The policy version of each run (0 for one that never published)."""
        if not run_ids:
            return {}
        async with self._redis.pipeline(transaction=False) as pipe:
            for run_id in run_ids:
                pipe.get(version_key(run_id))
            values = await pipe.execute()
        return {
            run_id: 0 if value is None else int(value)
            for run_id, value in zip(run_ids, values, strict=True)
        }

    async def save_weights(self, weights: FleetWeights) -> None:
        fields: list[str | bytes | int] = ["path", weights.path, "version", weights.version]
        fields += ["run", weights.run_id, "since", weights.since]
        await self._write(self._save_weights, [WEIGHTS_KEY], fields)

    async def forget_weights(self) -> None:
        await self._write(self._forget_weights, [WEIGHTS_KEY], [])

    async def load_weights(self) -> FleetWeights | None:
        """The fleet's weights, or None while none were published."""
        saved = cast(dict[bytes, bytes], await self._redis.hgetall(WEIGHTS_KEY))
        if not saved:
            return None
        return FleetWeights(
            _text(saved[b"path"]),
            int(saved[b"version"]),
            _text(saved.get(b"run", b"")),
            int(saved.get(b"since", saved[b"version"])),
        )

    async def save_history(
        self, records: Mapping[str, bytes], globals_: bytes, max_keys: int
    ) -> int:
        """Writes predictor key records (least recently used first) and the globals, keeping
        the ``max_keys`` most recently written keys; returns how many old keys were dropped."""
        argv: list[str | bytes | int] = [max_keys, globals_]
        for prompt_key, record in records.items():
            argv += [prompt_key, record]
        return int(cast(int, await self._write(self._save_history, self._history_keys, argv)))

    async def load_history(self) -> History:
        """The saved predictor state, key records oldest-used first."""
        records_key, used_key, globals_key, _ = self._history_keys
        records: list[tuple[str, bytes]] = []
        start = 0
        while True:
            names = cast(
                list[bytes], await self._redis.zrange(used_key, start, start + _HISTORY_BATCH - 1)
            )
            if not names:
                break
            values = await self._redis.hmget(records_key, names)
            records += (
                (_text(name), _raw(value))
                for name, value in zip(names, values, strict=True)
                if value is not None
            )
            start += len(names)
        saved = await self._redis.get(globals_key)
        return History(records, None if saved is None else _raw(saved))

    async def drop_history_keys(self, prompt_keys: Sequence[str]) -> None:
        """Forgets saved key records (ones that no longer load)."""
        if prompt_keys:
            records_key, used_key, _, _ = self._history_keys
            for start in range(0, len(prompt_keys), _DROP_CHUNK):  # (Lua's unpack limit)
                chunk = prompt_keys[start : start + _DROP_CHUNK]
                await self._write(self._drop_history, [records_key, used_key], chunk)
