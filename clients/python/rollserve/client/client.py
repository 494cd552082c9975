"""The trainer's client: submit prompt groups over gRPC, read finished groups from Redis.

```python
with RolloutClient("scheduler:50051", "redis://redis:6379/0", run_id="grpo-7") as client:
    client.submit([PromptGroup(group_id="q17-e3", prompt_token_ids=ids, n=8)])
    for received in client.groups(limit=64, timeout_s=600):
        train_on(received.result)
        received.done()  # XACK: only now is the group off the books
```

Delivery is at least once with duplicates suppressed: an entry stays pending in the
consumer group until ``done()``; if this process dies first, another consumer (or
this one, restarted with the same ``consumer_name``) gets it again. While the process
lives, a heartbeat thread keeps the groups it holds claimed, however long it holds them,
so other consumers take over only a dead (or hung) process's entries. See
:mod:`rollserve.client.consumer` for the read order, the heartbeat and the duplicate rules.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Generator, Iterator, Sequence
from types import TracebackType
from typing import cast

import grpc
import redis
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

DEFAULT_RPC_TIMEOUT_S = 30.0
DEFAULT_CLAIM_IDLE_MS = 30_000
DEFAULT_BLOCK_MS = 1_000
HEARTBEAT_JOIN_TIMEOUT_S = 5.0  # close() waits this long for a heartbeat in flight


class ReceivedGroup(ReceivedBase):
    """A finished group from the stream. ``done()`` acknowledges it (XACK)."""

    __slots__ = ("_client",)

    def __init__(
        self, result: GroupResult, entry_id: str, delivery_count: int, client: RolloutClient
    ) -> None:
        super().__init__(result, entry_id, delivery_count)
        self._client = client

    def done(self) -> bool:
        """Acknowledges the group. False if it was no longer pending in the consumer
        group (acknowledged already, here or by a consumer it was re-delivered to)."""
        return self._client.ack(self) == 1


class ReceivedSample(ReceivedSampleBase):
    """A finished sample from the samples stream. ``done()`` acknowledges it (XACK)."""

    __slots__ = ("_client",)

    def __init__(
        self, result: SampleResult, entry_id: str, delivery_count: int, client: RolloutClient
    ) -> None:
        super().__init__(result, entry_id, delivery_count)
        self._client = client

    def done(self) -> bool:
        """Acknowledges the sample. False if it was no longer pending in the consumer group."""
        return self._client.ack(self) == 1


class RolloutClient:
    """Submits prompt groups to a scheduler and reads the run's finished groups.

    scheduler_address: ``host:port`` of the scheduler's gRPC server.
    redis_url: the Redis the scheduler writes to, e.g. ``redis://host:6379/0``.
    run_id: the run; its stream is ``rollserve:{run_id}:groups``.
    consumer_group: trainers that share the work of one run share a group; each
        entry goes to one consumer of the group.
    consumer_name: this reader within the group; None picks ``host-pid-random``.
        Pass a stable name to resume this consumer's unacknowledged entries after
        a restart right away, rather than after ``claim_idle_ms``.
    claim_idle_ms: entries another consumer has held unacknowledged this long are
        taken over (it is presumed dead). With ``heartbeat`` on, the entries this client
        holds are re-claimed every ``claim_idle_ms / 3``, so only a process that died or
        hung that long loses them; with it off, acknowledge faster than this.
    block_ms: longest single wait for new entries inside ``groups()``.
    rpc_timeout_s: deadline of each gRPC call.
    read_count: entries per Redis read.
    dedupe_capacity: acknowledged group ids remembered to drop duplicates.
    heartbeat: keep the groups handed out and not yet acknowledged claimed (XCLAIM ...
        JUSTID from a daemon thread, while any are held) as long as this process lives.
        False restores the old behaviour: a group held past ``claim_idle_ms`` is taken
        over by another consumer of the group, which trains on it too.
    reads: the stream this client reads: ``"groups"`` (``groups()``), or ``"samples"``
        (``samples()``: each sample of the groups submitted with ``stream_samples``, as it
        finished; the stream ``rollserve:{run_id}:samples``, with consumer groups of its
        own). To read both, use a client for each.
    credentials: what the scheduler asks of its callers: TLS, a bearer token, a client
        certificate (``SchedulerCredentials``); by default none, over plaintext.

    Not for concurrent iteration from several threads; ``ack``/``done`` may be
    called from another thread than the one iterating.
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
        self._lock = threading.Lock()  # guards _state and _beater
        self._redis = redis_client(redis.Redis.from_url, redis_url, block_ms)
        self._channel = credentials.channel(scheduler_address)
        self._metadata = credentials.metadata
        self._stub = pb_grpc.SchedulerStub(self._channel)
        self._heartbeat_script = self._redis.register_script(HEARTBEAT_SCRIPT)
        self._park_script = self._redis.register_script(PARK_SCRIPT)
        self._beater: threading.Thread | None = None  # runs while entries are held
        # What Redis answered to the last heartbeat it refused (not an outage): said by the
        # reader, since held groups are no longer kept claimed.
        self._heartbeat_refused: redis.ResponseError | None = None
        self._closing = threading.Event()

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

    def submit(self, groups: Sequence[PromptGroup]) -> int:
        """Queues the groups; all or none. Returns how many the scheduler accepted."""
        request = submit_request(self.run_id, groups)
        self._check_open("Submit")
        try:
            response = self._stub.Submit(
                request, timeout=self._rpc_timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, "Submit") from exc
        return response.accepted

    def cancel(self, group_ids: Sequence[str]) -> CancelResult:
        """Cancels queued or running groups; cancelled groups are never delivered."""
        request = cancel_request(self.run_id, group_ids)
        self._check_open("Cancel")
        try:
            response = self._stub.Cancel(
                request, timeout=self._rpc_timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, "Cancel") from exc
        return CancelResult.from_proto(response)

    def delete_run(self) -> DeleteRunResult:
        """Ends the run for good: the scheduler cancels its queued and running groups and
        deletes all it keeps of the run in Redis, the streams included (entries not yet read
        or acknowledged go too). The run id may then be used again, from nothing; the length
        history, kept by prompt_key across runs, stays."""
        check_run_id(self.run_id)
        request = pb.DeleteRunRequest(run_id=self.run_id)
        self._check_open("DeleteRun")
        try:
            response = self._stub.DeleteRun(
                request, timeout=self._rpc_timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, "DeleteRun") from exc
        return DeleteRunResult.from_proto(response)

    def publish_version(
        self, version: int, weights_path: str = "", *, timeout_s: float | None = None
    ) -> PublishResult:
        """Makes ``version`` the run's policy version, which labels tokens in each sample's
        ``versions``.

        weights_path: a checkpoint folder (Hugging Face layout, safetensors) every engine can
            read; the scheduler has every engine load it first (running samples go on under
            it), and engines that join later load it too. Each token is then labelled with
            the version of the weights that made it. Empty: the engines already run the new
            weights (the trainer updated them its own way), and the tokens the engines make
            from then on are labelled ``version`` (those made before keep the version before,
            whenever they reach the scheduler). Once the run has published weights, its
            tokens keep the version of the weights the engines serve: publish weights to
            move them on.
        timeout_s: deadline of the call (default: the client's, or ``WEIGHTS_TIMEOUT_S`` at
            least with ``weights_path``).

        Versions only go up (a lower one raises InvalidArgument); publishing the current one
        again is a no-op, or with the same ``weights_path`` a retry (engines that have those
        weights load nothing); a version published without weights may be published again
        with them (the engines then load them), a version published with weights not with
        other ones. When no engine could load the weights, nothing changes and the
        error's ``code`` is FAILED_PRECONDITION."""
        request = publish_version_request(self.run_id, version, weights_path)
        timeout = publish_timeout_s(self._rpc_timeout_s, weights_path, timeout_s)
        self._check_open("PublishVersion")
        try:
            response = self._stub.PublishVersion(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, "PublishVersion") from exc
        return PublishResult.from_proto(response)

    def status(self) -> SchedulerStatus:
        self._check_open("Status")
        try:
            response = self._stub.Status(
                pb.StatusRequest(), timeout=self._rpc_timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, "Status") from exc
        return SchedulerStatus.from_proto(response)

    # --------------------------------------------------------------- stream

    def groups(
        self, *, limit: int | None = None, timeout_s: float | None = None
    ) -> Iterator[ReceivedGroup]:
        """Finished groups of the run, each once, until ``limit`` groups or ``timeout_s``
        seconds (from the call) have passed; with neither, forever.

        Reads this consumer's own unacknowledged entries first, then takes over
        entries idle longer than ``claim_idle_ms`` and reads new ones. Raises
        :class:`UndecodableEntry` for an entry this SDK cannot read (it stays
        pending; see ``discard``), :class:`StreamUnavailable` if Redis is down
        (:class:`StreamReadOnly` if it is a read-only replica), :class:`StreamRefused` if
        Redis refuses the reads (the message says why) and :class:`ClientClosed` after
        ``close()``.
        """
        self.config.check_reads("groups")
        with contextlib.closing(self._deliveries(limit, timeout_s)) as deliveries:
            for item, count in deliveries:
                yield ReceivedGroup(cast(GroupResult, item.result), item.entry_id, count, self)

    def samples(
        self, *, limit: int | None = None, timeout_s: float | None = None
    ) -> Iterator[ReceivedSample]:
        """Finished samples of the run's groups submitted with ``stream_samples``, each once,
        about in the order they finished, as ``groups()`` reads groups (a client made with
        ``reads="samples"``). A sample is final training data only with its group: the
        group's entry carries it again, unless the group failed or was cancelled later."""
        self.config.check_reads("samples")
        with contextlib.closing(self._deliveries(limit, timeout_s)) as deliveries:
            for item, count in deliveries:
                yield ReceivedSample(cast(SampleResult, item.result), item.entry_id, count, self)

    def _deliveries(
        self, limit: int | None, timeout_s: float | None
    ) -> Generator[tuple[Deliver, int], None, None]:
        """The entries to hand out, each with its delivery count."""
        budget = Budget(limit, timeout_s, time.monotonic())
        with self._lock:
            iteration = self._state.restart()
        try:
            while not budget.exhausted(now := time.monotonic()):
                self._check_open("reading the stream")  # (a read would open a connection)
                with self._lock:  # (the heartbeat's thread sets it)
                    refused, self._heartbeat_refused = self._heartbeat_refused, None
                if refused is not None:  # (said once: a later refusal is said again)
                    raise heartbeat_error(refused, self.stream)
                with self._lock:
                    op = self._state.next_read(now, budget)
                batch = self._read(op)
                self._ensure_heartbeat()
                counts = self._delivery_counts(batch)
                for item in batch.items:
                    if not isinstance(item, Deliver):
                        raise item
                    with self._lock:
                        if not self._state.handed_out(item.entry_id, item.key):
                            continue
                    budget.took_one()
                    yield item, item.delivery_count(counts.get(item.entry_id, 1))
        finally:
            with self._lock:
                self._state.stop_reading(iteration)

    def ack(self, *received: ReceivedGroup | ReceivedSample) -> int:
        """Acknowledges groups (or samples) (one XACK); returns how many were still pending."""
        if not received:
            return 0
        ids = [r.entry_id for r in received]
        self._check_open("XACK")
        try:
            acked = int(self._redis.xack(self.stream, self.config.consumer_group, *ids))
        except redis.RedisError as exc:
            raise stream_error(exc, f"XACK {self.stream}") from exc
        with self._lock:
            for entry_id in ids:
                self._state.acked(entry_id)
        return acked

    def release(self, *received: ReceivedGroup | ReceivedSample) -> None:
        """Stops keeping these groups claimed, without acknowledging them: another
        consumer of the group takes them over after ``claim_idle_ms`` (this one does not
        hand them out again). For groups this trainer will not use, such as another
        trainer's in a shared consumer group. No I/O: the next read of ``groups()`` gives
        them up, at once claimable."""
        self._check_open("release")  # (closed, it reads no more: nothing would give them up)
        with self._lock:
            for r in received:
                self._state.release(r.entry_id)

    def discard(self, entry_id: str) -> bool:
        """Acknowledges an entry without reading it (an :class:`UndecodableEntry`).
        It stays readable in the stream with XRANGE for the scheduler's acked retention
        (``--acked-retention-s``, 300 s; always with ``--keep-acked-entries``); this group
        will not deliver it."""
        self._check_open("XACK")
        try:
            return int(self._redis.xack(self.stream, self.config.consumer_group, entry_id)) == 1
        except redis.RedisError as exc:
            raise stream_error(exc, f"XACK {self.stream}") from exc

    @property
    def in_hand(self) -> int:
        """Groups handed out by ``groups()`` and not yet acknowledged."""
        with self._lock:
            return self._state.in_hand

    def _check_open(self, doing: str) -> None:
        if self._closing.is_set():
            raise ClientClosed(f"{doing}: this client is closed; make a new one")

    def _read(self, op: NextRead) -> Batch:
        """Runs one read; returns what to do with its entries (duplicates acked already)."""
        config, cursor = self.config, CLAIM_START_CURSOR
        try:
            self._ensure_group()
            self._park()
            if isinstance(op, Claim):
                reply = self._redis.xautoclaim(
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
                    self._redis.xreadgroup(
                        config.consumer_group,
                        config.consumer_name,
                        {config.stream: op.start_id},
                        count=op.count,
                        block=op.block_ms if isinstance(op, ReadNew) else None,
                    )
                )
            with self._lock:
                batch = self._state.on_read(op, entries, time.monotonic(), next_cursor=cursor)
            if batch.drop:
                # Groups acknowledged before: redelivered, or a new run's under the same id
                # (deleted and submitted again while another reader made the group anew).
                deletes = deletes_count(self._redis.get(config.deletes))
                with self._lock:
                    deleted = self._state.deleted_since(deletes)
                if deleted:
                    raise RunDeleted(run_deleted(config))
                self._redis.xack(config.stream, config.consumer_group, *batch.drop_ids)
            self._park()
        except redis.RedisError as exc:
            if not is_nogroup(exc):
                raise stream_error(exc, f"reading {config.stream}") from exc
            with self._lock:
                self._state.group_lost()
            return Batch([], [])
        return batch

    def _park(self) -> None:
        """Moves the released entries still pending here to the parking consumer, idle for
        ``claim_idle_ms``: the next claim scan of another consumer takes them. One another
        consumer took over meanwhile (its idle time had run out) stays with it."""
        with self._lock:
            ids = self._state.to_park()
        if not ids:
            return
        try:
            self._park_script(keys=[self.config.stream], args=self._state.park_args(ids))
        except redis.RedisError as exc:
            if not refuses_scripting(exc):  # (an outage, a read-only replica: retried)
                with self._lock:
                    self._state.park_failed(ids)
                raise
            park_refused(self.config.stream, len(ids), exc)  # taken over once idle instead

    def _ensure_group(self) -> None:
        if self._state.group_ready:
            return
        # A stream that vanished under a reader: a deleted run's (its deletes counted one
        # more since), or one an operator removed. Only the latter is made again.
        before = deletes_count(self._redis.get(self.config.deletes))
        if self._state.deleted_since(before):  # (None seen yet: its first group)
            raise RunDeleted(run_deleted(self.config))
        try:
            self._redis.xgroup_create(
                self.stream, self.config.consumer_group, id="0", mkstream=True
            )
        except redis.ResponseError as exc:
            if not is_busygroup(exc):
                raise
        deletes = deletes_count(self._redis.get(self.config.deletes))
        if deletes != before:  # deleted meanwhile: the stream made may be the deleted run's
            raise RunDeleted(run_deleted(self.config))
        self._state.deletes_seen = deletes
        if self.config.heartbeat:  # refused, held groups would be taken over: say it now
            try:
                self._redis.script_load(HEARTBEAT_SCRIPT)
            except redis.ResponseError as exc:
                if not refuses_scripting(exc):
                    raise
                raise InvalidArgument(heartbeat_refused(exc)) from exc
        self._state.group_ready = True

    def _delivery_counts(self, batch: Batch) -> dict[str, int]:
        """Delivery counts of the redelivered entries of a batch (one round trip)."""
        ids = batch.redelivered_ids
        if not ids:
            return {}
        pipe = self._redis.pipeline(transaction=False)
        for entry_id in ids:
            pipe.xpending_range(self.stream, self.config.consumer_group, entry_id, entry_id, 1)
        try:
            replies = pipe.execute()
        except redis.RedisError as exc:
            raise stream_error(exc, f"XPENDING {self.stream}") from exc
        return {i: max(1, parse_delivery_count(r)) for i, r in zip(ids, replies, strict=True)}

    # ------------------------------------------------------------ heartbeat

    def _ensure_heartbeat(self) -> None:
        """Starts the heartbeat thread if entries are held and none runs."""
        with self._lock:
            if (self._beater is not None and self._beater.is_alive()) or self._closing.is_set():
                return
            if not self._state.needs_heartbeat:
                return
            self._beater = threading.Thread(
                target=self._beat_while_held,
                name=f"rollserve-heartbeat-{self.consumer_name}",
                daemon=True,
            )
            self._beater.start()

    def _beat_while_held(self) -> None:
        """The heartbeat thread: a beat every ``claim_idle_ms / 3`` until nothing is held
        or the client closes. Redis errors are logged and the next beat tries again."""
        while not self._closing.wait(self.config.heartbeat_interval_s):
            with self._lock:
                ids = self._state.beat_ids()
                if not ids:
                    self._beater = None  # under the lock: _ensure_heartbeat starts another
                    return
            try:
                self._beat(ids)
            except Exception:  # never the end of the heartbeat while groups are held
                log.exception("stream %s: heartbeat failed", self.config.stream)

    def _beat(self, ids: list[str]) -> None:
        config = self.config
        for chunk in heartbeat_chunks(ids):
            try:
                raw = self._heartbeat_script(
                    keys=[config.stream],
                    args=[config.consumer_group, config.consumer_name, *chunk],
                )
                reply = parse_heartbeat(raw)
            except redis.RedisError as exc:
                if isinstance(exc, redis.ResponseError) and not is_nogroup(exc):
                    with self._lock:  # the reader raises it at its next step
                        self._heartbeat_refused = exc
                log.warning(
                    "stream %s: heartbeat of %d held entries failed (%s); retrying in %.1f s",
                    config.stream,
                    len(ids),
                    exc,
                    config.heartbeat_interval_s,
                )
                return
            with self._lock:
                self._heartbeat_refused = None
                self._state.on_heartbeat(chunk, reply)

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Stops the heartbeat (groups still held become claimable by other consumers
        after ``claim_idle_ms``) and closes the connections."""
        self._closing.set()
        with self._lock:
            beater, self._beater = self._beater, None
        if beater is not None:
            beater.join(HEARTBEAT_JOIN_TIMEOUT_S)
        self._redis.close()
        self._channel.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
