"""One scheduler per Redis database: a lease in Redis.

The scheduler's durable state is global to its Redis database: the set of runs and each
run's pending groups. A starting scheduler recovers the pending groups of every run, so two
schedulers on one database would each run the other's groups (delivery stays exactly once,
since the stream write is idempotent, but the work is done twice and a Submit to one is
never seen by the other until it restarts). The lease makes that impossible:

- **take**: at start, ``SET rollserve:scheduler:lease <holder> NX PX ttl``. If another
  scheduler holds it, try again every ``ttl / 10`` for up to ``wait_s`` (a holder that crashed
  stops renewing, so its lease ends within ``ttl``), then fail with an error that names the
  holder.
- **keep**: renew every ``ttl / 10`` (``PEXPIRE``, only while the value is still this
  holder's, in one script). A renewal that finds another holder or no lease means the lease
  is lost. So does no successful renewal for ``2 ttl / 3`` (Redis unreachable, or a renewal
  that hangs: each is cut off at that deadline): the holder gives up a third of the ttl
  before the lease can end in Redis, so it has stopped before another scheduler can take
  over. A renewal that comes later than that because the process stalled (its event loop
  busy, the machine paused), or one that did not answer by then, is still tried: if the
  lease still names this holder, no other scheduler held it meanwhile, and the holder goes
  on; if not, or if Redis does not answer within the rest of the ttl, the lease is lost.
  While such a renewal is under way the holder is in doubt (``in_doubt``, ``sure()``): it
  starts no new work, since another scheduler may be running the same groups. On loss the
  caller must stop acting at once.
- **release**: at a clean stop, ``DEL`` (only while still this holder's), so the next
  scheduler starts without waiting.

The holder id names the host, the process and a random boot id, so the error a second
scheduler gets says where the first one runs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
import redis.exceptions
from rollserve.client.wire import KEY_PREFIX

log = logging.getLogger(__name__)

LEASE_KEY = f"{KEY_PREFIX}:scheduler:lease"

# KEYS: lease. ARGV: holder, ttl ms. 1 when renewed, 0 when the lease is not the holder's.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

# KEYS: lease. ARGV: holder. 1 when released, 0 when the lease was not the holder's.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class LeaseHeld(Exception):
    """Another scheduler holds the lease."""


class LeaseLost(Exception):
    """The lease ended while this scheduler held it."""


def holder_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class SchedulerLease:
    """``clock`` and ``sleep`` are where the lease reads the time and waits between tries
    and renewals: the real ones, or a test's virtual ones."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        ttl_s: float,
        wait_s: float,
        holder: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if ttl_s <= 0 or wait_s < 0:
            raise ValueError(f"ttl_s ({ttl_s}) must be > 0 and wait_s ({wait_s}) >= 0")
        self.holder = holder or holder_id()
        self.ttl_s = ttl_s
        self.wait_s = wait_s
        self._clock = clock
        self._sleep = sleep
        self._redis = client
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._renewed_at = 0.0  # monotonic time of the last successful take or renewal
        self._doubt: asyncio.Event | None = None  # set when the late renewal under way ends

    @property
    def _ttl_ms(self) -> int:
        return max(1, round(self.ttl_s * 1000))

    @property
    def interval_s(self) -> float:
        """Time between renewals: a tenth of the ttl (as Kubernetes' leader election retries
        every 2 s of a 15 s lease), so that a renewal held up by a busy event loop or a busy
        Redis has more tries before the holder gives up."""
        return self.ttl_s / 10

    @property
    def valid_s(self) -> float:
        """How long after its last successful renewal the holder still counts on the lease:
        two thirds of the ttl, so it gives up a third of the ttl before the lease can end in
        Redis."""
        return self.ttl_s * 2 / 3

    async def take(self) -> None:
        """Takes the lease, waiting up to ``wait_s`` for a holder's to end; LeaseHeld if not."""
        deadline = self._clock() + self.wait_s
        while True:
            started = self._clock()
            if await self._redis.set(LEASE_KEY, self.holder, nx=True, px=self._ttl_ms):
                self._renewed_at = started
                log.info("took the scheduler lease %s as %s", LEASE_KEY, self.holder)
                return
            other = await self._redis.get(LEASE_KEY)
            if other is None:
                continue  # it ended between the two calls: try again at once
            name = other.decode() if isinstance(other, bytes) else str(other)
            left = deadline - self._clock()
            if left <= 0:
                raise LeaseHeld(
                    f"another scheduler ({name}) holds {LEASE_KEY} on this Redis database: "
                    "one scheduler per database, since each recovers every run's pending "
                    "groups. Stop it, or give this one another database "
                    f"(redis://HOST:PORT/N); waited {self.wait_s:g} s (lease_wait_s) for its "
                    "lease to end"
                )
            log.info("scheduler lease held by %s; waiting up to %.1f s for it to end", name, left)
            await self._sleep(min(self.interval_s, left))

    @property
    def in_doubt(self) -> bool:
        """A late renewal is under way: whether the lease is still this holder's is not
        known until it ends."""
        return self._doubt is not None

    async def sure(self) -> None:
        """Returns once no late renewal is under way (at once when none is)."""
        while (doubt := self._doubt) is not None:
            await doubt.wait()

    async def renew(self) -> None:
        """Extends the lease; LeaseLost if it is another's or none, or if no renewal has
        succeeded for ``valid_s`` and a late one does not either (a renewal that has not
        answered by ``valid_s`` is cut off, and tried late). A Redis error before that is
        logged and tolerated."""
        started = self._clock()
        left = self._renewed_at + self.valid_s - started
        if left <= 0:
            await self._renew_late()
            return
        try:
            renewed = await asyncio.wait_for(
                self._renew(keys=[LEASE_KEY], args=[self.holder, self._ttl_ms]), timeout=left
            )
        except TimeoutError:
            # Its answer may have come during a stall, after the deadline had passed: asked
            # again, Redis says whether the lease is still this holder's.
            if self._clock() - self._renewed_at >= self.valid_s:
                await self._renew_late()
                return
            log.warning("a renewal of the scheduler lease did not answer in time; will retry")
            return
        except redis.exceptions.RedisError as e:
            if self._clock() - self._renewed_at >= self.valid_s:
                raise LeaseLost(
                    f"could not renew {LEASE_KEY} for {self.valid_s:g} s ({e!r}); its "
                    f"{self.ttl_s:g} s ttl may end and another scheduler take it"
                ) from e
            log.warning("could not renew the scheduler lease (%r); will retry", e)
            return
        if not renewed:
            raise LeaseLost(f"{LEASE_KEY} is no longer held by {self.holder}")
        self._renewed_at = started

    async def _renew_late(self) -> None:
        """A renewal past ``valid_s``: the process stalled (a Submit's work on the event
        loop, a paused machine), or Redis did not answer in time. The lease may have ended
        and been taken; it counts only if Redis says at once that it is still this
        holder's, in the script that extends it (then no other scheduler held it: the key
        names whoever took it last). The lease then runs from when it was asked."""
        asked = self._clock()
        since = asked - self._renewed_at
        why = (
            f"no renewal of {LEASE_KEY} for {since:.1f} s (the holder gives up after "
            f"{self.valid_s:g} s of its {self.ttl_s:g} s ttl unless Redis says it is still "
            "its own)"
        )
        doubt = self._doubt = asyncio.Event()
        try:
            renewed = await asyncio.wait_for(
                self._renew(keys=[LEASE_KEY], args=[self.holder, self._ttl_ms]),
                timeout=self.ttl_s - self.valid_s,
            )
        except (redis.exceptions.RedisError, TimeoutError) as e:
            raise LeaseLost(f"{why}, and the renewal now failed ({e!r})") from e
        finally:
            self._doubt = None
            doubt.set()
        if not renewed:
            raise LeaseLost(f"{why}, and it is no longer held by {self.holder}")
        log.warning(
            "renewed the scheduler lease %.1f s after the last renewal (past the %g s the "
            "holder counts on): this process stalled, its event loop busy or the machine "
            "paused; the lease was still its own",
            since,
            self.valid_s,
        )
        self._renewed_at = asked

    async def keep(self) -> None:
        """Renews every ``interval_s`` until cancelled or the lease is lost (LeaseLost)."""
        while True:
            deadline = self._renewed_at + self.valid_s
            await self._sleep(max(0.0, min(self.interval_s, deadline - self._clock())))
            await self.renew()

    async def release(self) -> None:
        """Gives the lease up if still held; a Redis error is logged (it then expires)."""
        try:
            await self._release(keys=[LEASE_KEY], args=[self.holder])
        except redis.exceptions.RedisError as e:
            log.warning("could not release the scheduler lease (%s); it expires by itself", e)
