"""The scheduler's runtime: carries out the policy's plans at the edges.

It owns the in-memory state (groups, queue, engines) and every background task:
the dispatch loop (snapshot -> ``policy.plan`` -> start groups), one task per
running group (consume the engine's stream, then deliver to Redis), and the
health loop (probe engines; an engine that fails has its groups re-queued).

Invariants:
- a group is in Redis ``pending`` from before Submit returns until it ends;
- it is in exactly one of: the queue, ``_running`` (with its task), or ended;
- it is delivered only whole, through the idempotent ``Store.deliver``, so an
  engine failure or a scheduler restart re-runs it but never delivers it twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterable, Callable, Sequence
from dataclasses import dataclass

import grpc
import redis.exceptions
from rollserve.client.wire import FinishReason, GroupResult, GroupStatus
from rollserve.scheduler.core.policy import Policy
from rollserve.scheduler.core.snapshot import EngineView, QueuedGroup, Snapshot
from rollserve.scheduler.engines import EngineHandle
from rollserve.scheduler.settings import SchedulerSettings
from rollserve.scheduler.state import GroupRecord, GroupSpec, group_key
from rollserve.scheduler.store import Store
from rollserve.scheduler.validation import Limits
from rollserve.v1 import rollserve_pb2 as pb

log = logging.getLogger(__name__)

_FINISH_REASONS = {
    pb.FINISH_REASON_STOP: FinishReason.STOP,
    pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    pb.FINISH_REASON_ABORT: FinishReason.ABORT,
}
# Status codes with which an engine refuses the request itself: retrying elsewhere
# cannot help, so the group fails with the engine's message.
_REJECTIONS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.FAILED_PRECONDITION,
    }
)
_REDIS_RETRY_S = (0.05, 0.2, 1.0, 2.0)


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("%s crashed: %r", task.get_name(), task.exception())


class QueueFull(Exception):
    pass


class _EngineFault(Exception):
    """The engine could not finish the group; another engine may."""


@dataclass(slots=True)
class Counters:
    groups_delivered: int = 0
    samples_delivered: int = 0
    tokens_generated: int = 0
    groups_failed: int = 0
    groups_cancelled: int = 0
    engine_failures: int = 0


class SchedulerRuntime:
    def __init__(
        self,
        settings: SchedulerSettings,
        store: Store,
        policy: Policy,
        tokenize: Callable[[str], list[int]] | None = None,
    ) -> None:
        if not policy.whole_groups:
            # Sample-level dispatch (a group's samples on several engines) is not in the
            # runtime yet: such policies run in the discrete-event simulator only.
            raise ValueError(
                f"policy {policy.name!r} places samples one by one; this scheduler runs "
                "whole-group policies only (e.g. least_outstanding)"
            )
        self.settings = settings
        self.tokenize = tokenize
        self._store = store
        self._policy = policy
        self._groups: dict[str, GroupRecord] = {}  # every group that has not ended
        self._queue: dict[str, None] = {}  # keys of queued groups, in arrival order
        self._running: dict[str, asyncio.Task[None]] = {}
        self._engines: dict[str, EngineHandle] = {}
        self._wake = asyncio.Event()
        self._seq = 0
        self._background: list[asyncio.Task[None]] = []
        self._failed = asyncio.Event()
        self.counters = Counters()

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        recovered = await self._store.load_pending()
        for spec in recovered:
            self._enqueue(spec)
        if recovered:
            log.info("recovered %d pending groups from Redis", len(recovered))
        for endpoint in self.settings.engines:
            self._add_engine(endpoint.engine_id, endpoint.address)
        await self._probe_all()
        self._background = [
            asyncio.create_task(self._dispatch_loop(), name="dispatch"),
            asyncio.create_task(self._health_loop(), name="health"),
        ]
        for task in self._background:
            task.add_done_callback(self._loop_ended)
        self._wake.set()

    @property
    def failed(self) -> asyncio.Event:
        """Set when a background loop died: the process must stop (state is in Redis)."""
        return self._failed

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        log.critical("the %s loop died: %r", task.get_name(), task.exception())
        self._failed.set()

    async def stop(self) -> None:
        """Stops all work. Running groups stay pending in Redis for the next start."""
        tasks = [*self._background, *self._running.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._background.clear()
        self._running.clear()
        await asyncio.gather(*(e.close() for e in self._engines.values()))
        await self._store.close()

    # ------------------------------------------------------------ API

    def limits(self) -> Limits:
        """Submit limits: settings, and what the engines said of their model (the minimum)."""
        infos = [e.info for e in self._engines.values() if e.info is not None]
        contexts = [i.max_model_len for i in infos]
        vocabs = [i.vocab_size for i in infos if i.vocab_size > 0]
        return Limits(
            max_n=self.settings.max_n,
            max_groups_per_submit=self.settings.max_groups_per_submit,
            max_prompt_tokens=self.settings.max_prompt_tokens,
            max_model_len=self.settings.max_model_len or (min(contexts) if contexts else None),
            vocab_size=min(vocabs) if vocabs else None,
        )

    async def submit(self, run_id: str, specs: Sequence[GroupSpec]) -> None:
        """Persists then queues the groups. Raises QueueFull or store.DuplicateGroup."""
        room = self.settings.max_queued_groups - len(self._queue)
        if len(specs) > room:
            raise QueueFull(
                f"the queue holds {len(self._queue)} groups of at most "
                f"{self.settings.max_queued_groups}; {len(specs)} more do not fit "
                f"(room for {max(0, room)}): retry later"
            )
        await self._store.add_pending(run_id, specs)
        for spec in specs:
            self._enqueue(spec)
        self._wake.set()

    async def cancel(self, run_id: str, group_ids: Sequence[str]) -> tuple[list[str], list[str]]:
        ended_now = set(await self._store.cancel(run_id, group_ids))
        for gid in ended_now:
            key = group_key(run_id, gid)
            record = self._groups.pop(key, None)
            if record is None:
                continue
            record.cancel()
            self._queue.pop(key, None)
            task = self._running.pop(key, None)
            if task is not None:
                task.cancel()  # cancels the Generate call: the engine aborts the work
            self.counters.groups_cancelled += 1
        cancelled = [g for g in group_ids if g in ended_now]
        unknown = [g for g in group_ids if g not in ended_now]
        if cancelled:
            self._wake.set()
        return cancelled, unknown

    async def register_engine(self, engine_id: str, address: str) -> None:
        engine = self._engines.get(engine_id)
        if engine is not None and engine.address != address:
            await self._remove_engine(engine, f"re-registered at {address}")
            engine = None
        if engine is None:
            engine = self._add_engine(engine_id, address)
        engine.registered = True
        engine.heartbeat()
        await self._probe(engine)

    def heartbeat(self, engine_id: str) -> bool:
        engine = self._engines.get(engine_id)
        if engine is None:
            return False
        engine.heartbeat()
        return True

    def status(self) -> pb.StatusResponse:
        loads = self._loads()
        c = self.counters
        return pb.StatusResponse(
            queue_depth=len(self._queue),
            inflight_groups=len(self._running),
            inflight_samples=sum(v.inflight_samples for v in loads.values()),
            groups_delivered=c.groups_delivered,
            samples_delivered=c.samples_delivered,
            tokens_generated=c.tokens_generated,
            groups_failed=c.groups_failed,
            groups_cancelled=c.groups_cancelled,
            engine_failures=c.engine_failures,
            engines=[
                pb.EngineStatus(
                    engine_id=e.engine_id,
                    address=e.address,
                    healthy=e.healthy,
                    inflight_groups=sum(
                        1 for k in self._running if self._groups[k].engine_id == e.engine_id
                    ),
                    inflight_samples=loads[e.engine_id].inflight_samples,
                    outstanding_tokens=loads[e.engine_id].outstanding_tokens,
                    capacity_samples=e.capacity_samples,
                    last_error=e.last_error,
                )
                for e in self._engines.values()
            ],
        )

    # ------------------------------------------------------------ queue and dispatch

    def _enqueue(self, spec: GroupSpec) -> None:
        self._seq += 1
        self._groups[spec.key] = GroupRecord.new(spec, self._seq)
        self._queue[spec.key] = None

    def _loads(self) -> dict[str, EngineView]:
        inflight = dict.fromkeys(self._engines, 0)
        outstanding = dict.fromkeys(self._engines, 0)
        for key in self._running:
            record = self._groups[key]
            if record.engine_id in inflight:
                inflight[record.engine_id] += record.running_samples
                outstanding[record.engine_id] += record.outstanding_tokens
        return {eid: e.view(inflight[eid], outstanding[eid]) for eid, e in self._engines.items()}

    def _snapshot(self) -> Snapshot:
        queue = []
        for key in self._queue:
            spec = self._groups[key].spec
            queue.append(
                QueuedGroup(
                    key=key,
                    n=spec.n,
                    prompt_len=len(spec.prompt_token_ids),
                    max_tokens=spec.sampling.max_tokens,
                    priority=spec.priority,
                    seq=self._groups[key].seq,
                    prompt_key=spec.prompt_key,
                    prompt_token_ids=spec.prompt_token_ids,
                )
            )
        return Snapshot(tuple(queue), tuple(self._loads().values()), now=time.monotonic())

    async def _dispatch_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._queue:
                continue
            plan = self._policy.plan(self._snapshot())
            for assign in plan.assignments:
                engine = self._engines.get(assign.engine_id)
                if assign.group_key not in self._queue or engine is None or not engine.healthy:
                    log.error("policy %s planned an impossible %s", self._policy.name, assign)
                    continue
                self._start(self._groups[assign.group_key], engine)

    def _start(self, record: GroupRecord, engine: EngineHandle) -> None:
        key = record.spec.key
        del self._queue[key]
        record.start(engine.engine_id)
        task = asyncio.create_task(self._run_group(record, engine), name=f"group {key}")
        self._running[key] = task
        task.add_done_callback(_log_crash)

    async def _run_group(self, record: GroupRecord, engine: EngineHandle) -> None:
        try:
            await self._attempt(record, engine)
        finally:
            # Leave _running in the same step as the group's last state change (no await
            # in between), so no other task ever sees it running with its record gone.
            key = record.spec.key
            if self._running.get(key) is asyncio.current_task():
                del self._running[key]
            self._wake.set()  # room on an engine

    async def _attempt(self, record: GroupRecord, engine: EngineHandle) -> None:
        request_id = f"{record.spec.key}#{record.attempts}"
        call = engine.generate(record.spec, request_id)
        try:
            await self._consume(record, call)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _REJECTIONS:
                await self._end(record, f"engine {engine.engine_id} rejected it: {exc.details()}")
                return
            await self._engine_down(engine, f"{exc.code().name}: {exc.details()}", record)
            return
        except _EngineFault as exc:
            await self._engine_down(engine, str(exc), record)
            return
        finally:
            if not call.done():
                call.cancel()
        await self._end(record)

    async def _consume(self, record: GroupRecord, call: AsyncIterable[pb.GenerateResponse]) -> None:
        async for message in call:
            kind = message.WhichOneof("kind")
            if kind == "chunk":
                for delta in message.chunk.deltas:
                    self._check_index(record, delta.index)
                    record.add_tokens(delta.index, list(delta.token_ids), list(delta.logprobs))
            elif kind == "complete":
                done = message.complete
                self._check_index(record, done.index)
                record.add_tokens(done.index, list(done.token_ids), list(done.logprobs))
                record.finish_sample(
                    done.index,
                    _FINISH_REASONS.get(done.finish_reason, FinishReason.ABORT),
                    done.num_prompt_tokens,
                    done.num_cached_tokens,
                )
                # A finished sample frees its slot on the engine even while its siblings
                # run: plan again now, or the engine's batch thins out behind long samples.
                self._wake.set()
            elif kind == "error":
                raise _EngineFault(f"engine error: {message.error.message}")
        if not record.all_finished:
            raise _EngineFault("the stream ended before every sample finished")

    @staticmethod
    def _check_index(record: GroupRecord, index: int) -> None:
        if not 0 <= index < record.spec.n:
            raise _EngineFault(f"sample index {index} out of range for n={record.spec.n}")

    # ------------------------------------------------------------ endings

    async def _end(self, record: GroupRecord, error: str = "") -> None:
        """Delivers the group (or its failure) to the run's stream, exactly once."""
        spec = record.spec
        status = GroupStatus.FAILED if error else GroupStatus.DELIVERED
        result = GroupResult(
            run_id=spec.run_id,
            group_id=spec.group_id,
            status=status,
            prompt_key=spec.prompt_key,
            prompt_token_ids=list(spec.prompt_token_ids),
            samples=[] if error else record.to_samples(),
            metadata=dict(spec.metadata),
            error=error,
            attempts=record.attempts,
            submitted_at=spec.submitted_at,
            finished_at=time.time(),
        )
        entry = await self._write(result)
        self._groups.pop(spec.key, None)
        if entry is None:
            return  # ended before (cancelled, or delivered by an earlier process)
        if error:
            self.counters.groups_failed += 1
            log.warning("group %s failed: %s", spec.key, error)
        else:
            self.counters.groups_delivered += 1
            self.counters.samples_delivered += spec.n
            self.counters.tokens_generated += result.num_output_tokens

    async def _write(self, result: GroupResult) -> str | None:
        """Retries a Redis outage until it passes: a finished group is never dropped."""
        attempt = 0
        while True:
            try:
                return await self._store.deliver(result)
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                delay = _REDIS_RETRY_S[min(attempt, len(_REDIS_RETRY_S) - 1)]
                log.warning(
                    "writing group %s to Redis: %s; retry in %.2fs", result.group_id, exc, delay
                )
                attempt += 1
                await asyncio.sleep(delay)

    # ------------------------------------------------------------ engines

    def _add_engine(self, engine_id: str, address: str) -> EngineHandle:
        engine = EngineHandle(engine_id, address, self.settings.capacity_factor)
        self._engines[engine_id] = engine
        return engine

    async def _remove_engine(self, engine: EngineHandle, reason: str) -> None:
        await self._engine_down(engine, reason)
        del self._engines[engine.engine_id]
        await engine.close()

    async def _engine_down(
        self, engine: EngineHandle, reason: str, failed: GroupRecord | None = None
    ) -> None:
        """Marks the engine unhealthy and sends its groups back to the queue."""
        if engine.mark(False, reason):
            self.counters.engine_failures += 1
        victims = [
            self._groups[k]
            for k in list(self._running)
            if self._groups[k].engine_id == engine.engine_id and self._groups[k] is not failed
        ]
        for record in victims:
            task = self._running.pop(record.spec.key)
            task.cancel()
        for record in [*victims, *([failed] if failed is not None else [])]:
            await self._requeue(record, f"engine {engine.engine_id}: {reason}")
        self._wake.set()

    async def _requeue(self, record: GroupRecord, reason: str) -> None:
        if record.attempts >= self.settings.max_attempts:
            await self._end(record, f"{record.attempts} attempts failed; last: {reason}")
            return
        record.requeue(reason)
        self._queue[record.spec.key] = None

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            await self._probe_all()

    async def _probe_all(self) -> None:
        await asyncio.gather(*(self._probe(e) for e in list(self._engines.values())))

    async def _probe(self, engine: EngineHandle) -> None:
        try:
            await engine.probe(self.settings.health_timeout_s)
        except (grpc.aio.AioRpcError, RuntimeError) as exc:
            engine.failed_probes += 1
            detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            reason = f"health probe failed: {detail}"
            if not engine.healthy:
                engine.last_error = reason
            elif engine.failed_probes >= self.settings.health_failures:
                await self._engine_down(engine, reason)
            return
        if engine.mark(True):
            self._wake.set()
