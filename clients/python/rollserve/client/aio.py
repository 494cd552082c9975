"""The asyncio twin of :class:`rollserve.client.RolloutClient`, over grpc.aio and redis.asyncio.

```python
async with AsyncRolloutClient("scheduler:50051", "redis://redis:6379/0", "grpo-7") as client:
    await client.submit(groups)
    async for received in client.groups(limit=64, timeout_s=600):
        train_on(received.result)
        await received.done()
```

The consumer bookkeeping (read order, duplicates, decoding, which entries the heartbeat
keeps claimed) is the same object as the sync client's,
:class:`rollserve.client.consumer.ConsumerState`. The heartbeat is an asyncio task of the
client's, running while groups are held and cancelled by ``close()``: a group held
unacknowledged, however long, stays this consumer's while the process (and its event loop)
lives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from types import TracebackType
from typing import cast

import grpc
import redis
import redis.asyncio
from rollserve.client.client import (
    DEFAULT_BLOCK_MS,
    DEFAULT_CLAIM_IDLE_MS,
    DEFAULT_RPC_TIMEOUT_S,
)
from rollserve.client.consumer import (
    CLAIM_START_CURSOR,
    DEFAULT_DEDUPE_CAPACITY,
    DEFAULT_READ_COUNT,
    HEARTBEAT_SCRIPT,
    PARK_SCRIPT,
    Batch,
    Budget,
    Claim,
    ConsumerConfig,
    ConsumerState,
    Deliver,
    NextRead,
    ReadNew,
    ReceivedBase,
    ReceivedSampleBase,
    StreamKind,
    check_run_id,
    default_consumer_name,
    deletes_count,
    heartbeat_chunks,
    heartbeat_error,
    heartbeat_refused,
    is_busygroup,
    is_nogroup,
    park_refused,
    parse_delivery_count,
    parse_heartbeat,
    parse_xautoclaim,
    parse_xreadgroup,
    redis_client,
    run_deleted,
)
from rollserve.client.credentials import NO_CREDENTIALS, SchedulerCredentials
from rollserve.client.errors import (
    ClientClosed,
    InvalidArgument,
    RunDeleted,
    error_from_rpc,
    refuses_scripting,
    stream_error,
)
from rollserve.client.types import (
    CancelResult,
    DeleteRunResult,
    PromptGroup,
    PublishResult,
    SchedulerStatus,
    cancel_request,
    publish_timeout_s,
    publish_version_request,
    submit_request,
)
from rollserve.client.wire import GroupResult, SampleResult
from rollserve.v1 import rollserve_pb2 as pb
from rollserve.v1 import rollserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class AsyncReceivedGroup(ReceivedBase):
    """A finished group from the stream. ``await done()`` acknowledges it (XACK)."""

    __slots__ = ("_client",)

    def __init__(
        self,
        result: GroupResult,
        entry_id: str,
        delivery_count: int,
        client: AsyncRolloutClient,
    ) -> None:
        super().__init__(result, entry_id, delivery_count)
        self._client = client

    async def done(self) -> bool:
        """Acknowledges the group. False if it was no longer pending in the consumer
        group (acknowledged already, here or by a consumer it was re-delivered to)."""
        return await self._client.ack(self) == 1


class AsyncReceivedSample(ReceivedSampleBase):
    """A finished sample from the samples stream. ``await done()`` acknowledges it (XACK)."""

    __slots__ = ("_client",)

    def __init__(
        self,
        result: SampleResult,
        entry_id: str,
        delivery_count: int,
        client: AsyncRolloutClient,
    ) -> None:
        super().__init__(result, entry_id, delivery_count)
        self._client = client

    async def done(self) -> bool:
        """Acknowledges the sample. False if it was no longer pending in the consumer group."""
        return await self._client.ack(self) == 1


class AsyncRolloutClient:
    """Same arguments and behaviour as :class:`rollserve.client.RolloutClient`.

    Use it from one event loop; create it inside the loop that uses it. The heartbeat
    (``heartbeat=True``) is a task on that loop: a loop blocked longer than
    ``claim_idle_ms`` (a long synchronous training step in a coroutine) stalls it, and
    other consumers take the held groups over; run such work in a thread
    (``asyncio.to_thread``).
    """

    def __init__(
        self,
        scheduler_address: str,
        redis_url: str,
        run_id: str,
        *,
        consumer_group: str = "trainer",
        consumer_name: str | None = None,
        claim_idle_ms: int = DEFAULT_CLAIM_IDLE_MS,
        block_ms: int = DEFAULT_BLOCK_MS,
        rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
        read_count: int = DEFAULT_READ_COUNT,
        dedupe_capacity: int = DEFAULT_DEDUPE_CAPACITY,
        heartbeat: bool = True,
        reads: StreamKind = "groups",
        credentials: SchedulerCredentials = NO_CREDENTIALS,
    ) -> None:
        self.config = ConsumerConfig(
            run_id=run_id,
            consumer_group=consumer_group,
            consumer_name=consumer_name if consumer_name is not None else default_consumer_name(),
            claim_idle_ms=claim_idle_ms,
            block_ms=block_ms,
            read_count=read_count,
            dedupe_capacity=dedupe_capacity,
            heartbeat=heartbeat,
            reads=reads,
        )
        self._rpc_timeout_s = rpc_timeout_s
        self._state = ConsumerState(self.config)
        self._redis = redis_client(redis.asyncio.Redis.from_url, redis_url, block_ms)
        self._channel = credentials.aio_channel(scheduler_address)
        self._metadata = credentials.metadata
        self._stub = pb_grpc.SchedulerStub(self._channel)
        self._heartbeat_script = self._redis.register_script(HEARTBEAT_SCRIPT)
        self._park_script = self._redis.register_script(PARK_SCRIPT)
        self._beater: asyncio.Task[None] | None = None  # runs while entries are held
        # What Redis answered to the last heartbeat it refused (not an outage): said by the
        # reader, since held groups are no longer kept claimed.
        self._heartbeat_refused: redis.ResponseError | None = None
        self._closed = False

    @property
    def run_id(self) -> str:
        return self.config.run_id

    @property
    def consumer_name(self) -> str:
        return self.config.consumer_name

    @property
    def stream(self) -> str:
        return self.config.stream

    # ------------------------------------------------------------ scheduler

    async def submit(self, groups: Sequence[PromptGroup]) -> int:
        """Queues the groups; all or none. Returns how many the scheduler accepted."""
        request = submit_request(self.run_id, groups)
        self._check_open("Submit")
        try:
            response = await self._stub.Submit(
                request, timeout=self._rpc_timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, "Submit") from exc
        return response.accepted

    async def cancel(self, group_ids: Sequence[str]) -> CancelResult:
        """Cancels queued or running groups; cancelled groups are never delivered."""
        request = cancel_request(self.run_id, group_ids)
        self._check_open("Cancel")
        try:
            response = await self._stub.Cancel(
                request, timeout=self._rpc_timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, "Cancel") from exc
        return CancelResult.from_proto(response)

    async def delete_run(self) -> DeleteRunResult:
        """Ends the run for good; see ``RolloutClient.delete_run``."""
        check_run_id(self.run_id)
        request = pb.DeleteRunRequest(run_id=self.run_id)
        self._check_open("DeleteRun")
        try:
            response = await self._stub.DeleteRun(
                request, timeout=self._rpc_timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, "DeleteRun") from exc
        return DeleteRunResult.from_proto(response)

    async def publish_version(
        self, version: int, weights_path: str = "", *, timeout_s: float | None = None
    ) -> PublishResult:
        """Makes ``version`` the run's policy version, loading ``weights_path`` into every
        engine first when given; see ``RolloutClient.publish_version``."""
        request = publish_version_request(self.run_id, version, weights_path)
        timeout = publish_timeout_s(self._rpc_timeout_s, weights_path, timeout_s)
        self._check_open("PublishVersion")
        try:
            response = await self._stub.PublishVersion(
                request, timeout=timeout, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, "PublishVersion") from exc
        return PublishResult.from_proto(response)

    async def status(self) -> SchedulerStatus:
        self._check_open("Status")
        try:
            response = await self._stub.Status(
                pb.StatusRequest(), timeout=self._rpc_timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, "Status") from exc
        return SchedulerStatus.from_proto(response)

    # --------------------------------------------------------------- stream

    async def groups(
        self, *, limit: int | None = None, timeout_s: float | None = None
    ) -> AsyncIterator[AsyncReceivedGroup]:
        """Finished groups of the run, each once; see ``RolloutClient.groups``."""
        self.config.check_reads("groups")
        async with contextlib.aclosing(self._deliveries(limit, timeout_s)) as deliveries:
            async for item, count in deliveries:
                result = cast(GroupResult, item.result)
                yield AsyncReceivedGroup(result, item.entry_id, count, self)

    async def samples(
        self, *, limit: int | None = None, timeout_s: float | None = None
    ) -> AsyncIterator[AsyncReceivedSample]:
        """Finished samples of the run's ``stream_samples`` groups, each once, as they
        finished (a client made with ``reads="samples"``); see ``RolloutClient.samples``."""
        self.config.check_reads("samples")
        async with contextlib.aclosing(self._deliveries(limit, timeout_s)) as deliveries:
            async for item, count in deliveries:
                result = cast(SampleResult, item.result)
                yield AsyncReceivedSample(result, item.entry_id, count, self)

    async def _deliveries(
        self, limit: int | None, timeout_s: float | None
    ) -> AsyncGenerator[tuple[Deliver, int], None]:
        """The entries to hand out, each with its delivery count."""
        budget = Budget(limit, timeout_s, time.monotonic())
        iteration = self._state.restart()
        try:
            while not budget.exhausted(now := time.monotonic()):
                self._check_open("reading the stream")  # (a read would open a connection)
                refused, self._heartbeat_refused = self._heartbeat_refused, None
                if refused is not None:  # (said once: a later refusal is said again)
                    raise heartbeat_error(refused, self.stream)
                batch = await self._read(self._state.next_read(now, budget))
                self._ensure_heartbeat()
                counts = await self._delivery_counts(batch)
                for item in batch.items:
                    if not isinstance(item, Deliver):
                        raise item
                    if not self._state.handed_out(item.entry_id, item.key):
                        continue
                    budget.took_one()
                    yield item, item.delivery_count(counts.get(item.entry_id, 1))
        finally:
            self._state.stop_reading(iteration)

    async def ack(self, *received: AsyncReceivedGroup | AsyncReceivedSample) -> int:
        """Acknowledges groups (one XACK); returns how many were still pending."""
        if not received:
            return 0
        ids = [r.entry_id for r in received]
        self._check_open("XACK")
        try:
            acked = int(await self._redis.xack(self.stream, self.config.consumer_group, *ids))
        except redis.RedisError as exc:
            raise stream_error(exc, f"XACK {self.stream}") from exc
        for entry_id in ids:
            self._state.acked(entry_id)
        return acked

    def release(self, *received: AsyncReceivedGroup | AsyncReceivedSample) -> None:
        """Stops keeping these groups claimed; see ``RolloutClient.release``. No I/O."""
        self._check_open("release")
        for r in received:
            self._state.release(r.entry_id)

    async def discard(self, entry_id: str) -> bool:
        """Acknowledges an entry without reading it (an :class:`UndecodableEntry`)."""
        self._check_open("XACK")
        try:
            acked = await self._redis.xack(self.stream, self.config.consumer_group, entry_id)
        except redis.RedisError as exc:
            raise stream_error(exc, f"XACK {self.stream}") from exc
        return int(acked) == 1

    @property
    def in_hand(self) -> int:
        """Groups handed out by ``groups()`` and not yet acknowledged."""
        return self._state.in_hand

    def _check_open(self, doing: str) -> None:
        if self._closed:
            raise ClientClosed(f"{doing}: this client is closed; make a new one")

    async def _read(self, op: NextRead) -> Batch:
        """Runs one read; returns what to do with its entries (duplicates acked already)."""
        config, cursor = self.config, CLAIM_START_CURSOR
        try:
            await self._ensure_group()
            await self._park()
            if isinstance(op, Claim):
                reply = await self._redis.xautoclaim(
                    config.stream,
                    config.consumer_group,
                    config.consumer_name,
                    min_idle_time=op.min_idle_ms,
                    start_id=op.cursor,
                    count=op.count,
                )
                cursor, entries = parse_xautoclaim(reply)
            else:
                entries = parse_xreadgroup(
                    await self._redis.xreadgroup(
                        config.consumer_group,
                        config.consumer_name,
                        {config.stream: op.start_id},
                        count=op.count,
                        block=op.block_ms if isinstance(op, ReadNew) else None,
                    )
                )
            batch = self._state.on_read(op, entries, time.monotonic(), next_cursor=cursor)
            if batch.drop:
                # Groups acknowledged before: redelivered, or a new run's under the same id
                # (deleted and submitted again while another reader made the group anew).
                deletes = deletes_count(await self._redis.get(config.deletes))
                if self._state.deleted_since(deletes):
                    raise RunDeleted(run_deleted(config))
                await self._redis.xack(config.stream, config.consumer_group, *batch.drop_ids)
            await self._park()
        except redis.RedisError as exc:
            if not is_nogroup(exc):
                raise stream_error(exc, f"reading {config.stream}") from exc
            self._state.group_lost()
            return Batch([], [])
        return batch

    async def _park(self) -> None:
        """Moves the released entries still pending here to the parking consumer, idle for
        ``claim_idle_ms``: the next claim scan of another consumer takes them. One another
        consumer took over meanwhile (its idle time had run out) stays with it."""
        ids = self._state.to_park()
        if not ids:
            return
        try:
            await self._park_script(keys=[self.config.stream], args=self._state.park_args(ids))
        except redis.RedisError as exc:
            if not refuses_scripting(exc):  # (an outage, a read-only replica: retried)
                self._state.park_failed(ids)
                raise
            park_refused(self.config.stream, len(ids), exc)  # taken over once idle instead

    async def _ensure_group(self) -> None:
        if self._state.group_ready:
            return
        # A stream that vanished under a reader: a deleted run's (its deletes counted one
        # more since), or one an operator removed. Only the latter is made again.
        before = deletes_count(await self._redis.get(self.config.deletes))
        if self._state.deleted_since(before):  # (None seen yet: its first group)
            raise RunDeleted(run_deleted(self.config))
        try:
            await self._redis.xgroup_create(
                self.stream, self.config.consumer_group, id="0", mkstream=True
            )
        except redis.ResponseError as exc:
            if not is_busygroup(exc):
                raise
        deletes = deletes_count(await self._redis.get(self.config.deletes))
        if deletes != before:  # deleted meanwhile: the stream made may be the deleted run's
            raise RunDeleted(run_deleted(self.config))
        self._state.deletes_seen = deletes
        if self.config.heartbeat:  # refused, held groups would be taken over: say it now
            try:
                await self._redis.script_load(HEARTBEAT_SCRIPT)
            except redis.ResponseError as exc:
                if not refuses_scripting(exc):
                    raise
                raise InvalidArgument(heartbeat_refused(exc)) from exc
        self._state.group_ready = True

    async def _delivery_counts(self, batch: Batch) -> dict[str, int]:
        """Delivery counts of the redelivered entries of a batch (one round trip)."""
        ids = batch.redelivered_ids
        if not ids:
            return {}
        pipe = self._redis.pipeline(transaction=False)
        for entry_id in ids:
            pipe.xpending_range(self.stream, self.config.consumer_group, entry_id, entry_id, 1)
        try:
            replies = await pipe.execute()
        except redis.RedisError as exc:
            raise stream_error(exc, f"XPENDING {self.stream}") from exc
        return {i: max(1, parse_delivery_count(r)) for i, r in zip(ids, replies, strict=True)}

    # ------------------------------------------------------------ heartbeat

    def _ensure_heartbeat(self) -> None:
        """Starts the heartbeat task if entries are held and none runs."""
        beating = self._beater is not None and not self._beater.done()
        if not beating and not self._closed and self._state.needs_heartbeat:
            self._beater = asyncio.create_task(
                self._beat_while_held(), name=f"rollserve-heartbeat-{self.consumer_name}"
            )

    async def _beat_while_held(self) -> None:
        """The heartbeat task: a beat every ``claim_idle_ms / 3`` until nothing is held;
        ``close()`` cancels it. Redis errors are logged and the next beat tries again."""
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s)
            ids = self._state.beat_ids()
            if not ids:
                self._beater = None  # no await since the check: _ensure_heartbeat starts anew
                return
            try:
                await self._beat(ids)
            except Exception:  # never the end of the heartbeat while groups are held
                log.exception("stream %s: heartbeat failed", self.config.stream)

    async def _beat(self, ids: list[str]) -> None:
        config = self.config
        for chunk in heartbeat_chunks(ids):
            try:
                raw = await self._heartbeat_script(
                    keys=[config.stream],
                    args=[config.consumer_group, config.consumer_name, *chunk],
                )
                reply = parse_heartbeat(raw)
            except redis.RedisError as exc:
                if isinstance(exc, redis.ResponseError) and not is_nogroup(exc):
                    self._heartbeat_refused = exc  # the reader raises it at its next step
                log.warning(
                    "stream %s: heartbeat of %d held entries failed (%s); retrying in %.1f s",
                    config.stream,
                    len(ids),
                    exc,
                    config.heartbeat_interval_s,
                )
                return
            self._heartbeat_refused = None
            self._state.on_heartbeat(chunk, reply)

    # ------------------------------------------------------------ lifecycle

    async def close(self) -> None:
        """Cancels the heartbeat (groups still held become claimable by other consumers
        after ``claim_idle_ms``) and closes the connections."""
        self._closed = True
        beater, self._beater = self._beater, None
        if beater is not None:
            beater.cancel()
            await asyncio.wait([beater])
        await self._redis.aclose()
        await self._channel.close(grace=None)

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
