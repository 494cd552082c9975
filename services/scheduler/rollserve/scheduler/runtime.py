"""The scheduler's runtime: carries out the policy's plans at the edges.

It owns the in-memory state (groups, queue, engines, the length predictor) and every
background task: the dispatch loop (snapshot -> ``policy.plan`` -> start calls), one task
per Generate call (consume the engine's stream; the call that finishes a group's last
sample delivers the group), and the health loop (probe engines; an engine that fails has
the unfinished samples of its calls re-queued).

A plan's ``Assign(group, engine, samples)`` starts one Generate call on that engine for
those sample indices (all the group's queued samples when empty) that have not started,
and one call of its own for each that resumes after a preemption (its prompt differs: the
group's prompt + its kept tokens). A group may run in several calls at once, on several
engines, started over several dispatch rounds.

A plan's ``Preempt(group, index, engine, to_engine)`` (for a policy that
``moves_running``) is carried out after its assignments: a sample holds its slot on its
engine until the engine confirms the abort, so a preempt frees nothing for assignments
of the same plan. It sends an Abort for that one sample of its call; the sample runs on
until the call's stream brings its Complete. Reason abort: the sample leaves the call with
its tokens and logprobs kept (``RUNNING -> PREEMPTED -> QUEUED``) and starts at once on
``to_engine`` if that is still healthy with room, else waits in the queue for a later
Assign; a sample whose kept tokens already reach max_tokens finishes (length) instead.
Any other reason: it finished before the abort landed, and simply finishes. If the engine
fails first, the call fails as any call does and the sample is re-queued from scratch.
Preemption is not persisted: like every running sample, a preempted one is re-run from
its first token after a scheduler restart (only pending groups are in Redis).

Invariants:
- a group is in Redis ``pending`` from before Submit returns until it ends;
- each sample of a group that has not ended is queued, running in exactly one call (a
  preempted sample leaves its call), or finished; the group is in the queue iff it has a
  queued sample;
- a group is ended (delivered, failed or cancelled) by exactly one task: ``_retire`` takes
  it out of memory and cancels its other calls before anything is awaited, and delivery
  goes through the idempotent ``Store.deliver``, so an engine failure or a scheduler restart
  re-runs samples but never delivers a group twice;
- when an engine or a call fails, only the unfinished samples of its calls go back to the
  queue; finished samples are kept.

One scheduler per Redis database: ``start`` takes the scheduler lease (see lease.py) before
it reads any state, and a background task renews it. If the lease is lost, the renewing task
at once, before anything else runs, cancels every other task of the runtime (the dispatch
and health loops and every call), and Submit and Cancel are refused from then on; then
``failed`` is set and the process exits. So no group is dispatched, and no delivery, failure
or history save is sent to Redis, after the loss is known. Not guaranteed: a Redis command
already sent when the loss is noticed (a delivery, a Submit's write) may still land; that is
harmless to delivery, which is idempotent per group, and the lease is given up a third of
its ttl before it can end in Redis, so another scheduler cannot hold it yet unless this
process was stalled that long.

The length predictor learns every delivered group's sample lengths (under its prompt_key
and epoch) and predicts, for the policy, the length of queued samples and the work left on
each engine. Its history is saved to Redis after each delivery and loaded at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import time
import uuid
from array import array
from collections import deque
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Coroutine,
    Iterator,
    Sequence,
)
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import redis.exceptions
from rollserve.client.types import PublishResult
from rollserve.client.wire import (
    MAX_EARLIER_OUTPUT_TOKENS,
    MAX_EARLIER_OUTPUTS,
    FinishReason,
    GroupResult,
    GroupStatus,
    SampleResult,
    first_non_finite,
    quoted,
)
from rollserve.scheduler.core.fairshare import EngineTags, FairShare, Waiting
from rollserve.scheduler.core.policy import Policy
from rollserve.scheduler.core.predictor import (
    LengthFit,
    LengthPredictor,
    mean_absolute_error,
    tail_auc,
)
from rollserve.scheduler.core.snapshot import (
    Assign,
    Preempt,
    QueuedGroup,
    RunningSample,
    Snapshot,
)
from rollserve.scheduler.engines import EngineHandle, EngineLoad, Metadata
from rollserve.scheduler.histogram import (
    GROUP_LATENCY_BOUNDS_S,
    OUTPUT_TOKENS_BOUNDS,
    PLAN_BOUNDS_S,
    STALENESS_BOUNDS,
    Histogram,
)
from rollserve.scheduler.lease import LeaseLost, SchedulerLease
from rollserve.scheduler.outputs import EarlierOutputs
from rollserve.scheduler.settings import SchedulerSettings
from rollserve.scheduler.state import GroupRecord, GroupSpec, MadeBefore, SampleState, group_key
from rollserve.scheduler.store import DuplicateGroup, FleetWeights, Store, may_pass_later
from rollserve.scheduler.trim import TrimSchedule
from rollserve.scheduler.validation import Limits, ValidationError
from rollserve.v1 import rollserve_pb2 as pb

_FIRST_TURN = (0, 0)  # every queued group's while one run waits (core.fairshare)
log = logging.getLogger(__name__)

# Deadline of an Abort to an engine. One that times out changes nothing: the sample then
# runs on, and its call's stream still says how it ends.
_ABORT_TIMEOUT_S = 5.0

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
# Codes of a call or push that the engine refused, or never got, whole: what it carried
# did not reach the engine's drafter.
_UNDELIVERED = _REJECTIONS | {grpc.StatusCode.UNAVAILABLE}
_REDIS_RETRY_S = (0.05, 0.2, 1.0, 2.0)
# How long a Submit that met a Redis error looks for the groups its write may have left
_ADOPT_WITHIN_S = 60.0
# Calls of an engine failed with a retryable error (``_CallFailed``) that take it out of
# service, within this many seconds: one alone requeues its own samples only (it took
# every running sample of the engine with it, all their tokens made again).
_CALL_FAILURES = 3
_CALL_FAILURES_WINDOW_S = 60.0
# Publishes without weights of one run whose counts may be awaited at once; the next waits.
_MAX_COUNTS_AWAITED = 4
# The latest delivered samples the predictor's accuracy is reported over (Status).
PREDICTOR_SCORE_WINDOW = 4096
MAX_PLAN_PACE_S = 0.25  # the longest wait after a plan (settings.plan_pace_from_s)
_T = TypeVar("_T")
_REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


def _log_crash(task: asyncio.Task[None]) -> None:
    exc = None if task.cancelled() else task.exception()
    if exc is not None and not isinstance(exc, LeaseLost):  # (said once, as the runtime halts)
        log.error("%s crashed: %r", task.get_name(), exc, exc_info=exc)


def _log_unheard(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.warning("%s, whose caller had gone, ended with: %s", task.get_name(), exc)


class QueueFull(Exception):
    pass


_STARTS_PER_TURN = 64  # calls a plan starts in one turn of the event loop (about 0.1 s)


def plan_pace(spent_s: float, settings: SchedulerSettings) -> float:
    """How long the dispatch loop waits after a plan that took ``spent_s``.

    A plan goes over the whole queue. Deep (tens of thousands of groups), it takes tens of
    ms, and every finished sample asks for one: back to back, the plans would take all of
    the process's time, and calls, streams and Submits would wait behind them (a Submit of
    a thousand groups ran past its 30 s deadline). After a plan that took over
    ``plan_pace_from_s`` the loop waits as long (``MAX_PLAN_PACE_S`` at most), so plans take
    half the time; the slots freed meanwhile are filled by the next plan, and the engines'
    own queues (``capacity_factor``) keep them busy until then."""
    if spent_s <= settings.plan_pace_from_s:
        return 0.0
    return min(spent_s, MAX_PLAN_PACE_S)


class FleetFull(Exception):
    """RegisterEngine of a new engine when the fleet has ``max_engines``."""


class WeightsNotLoaded(Exception):
    """No engine could load the weights a PublishVersion gave (nothing changed)."""

    def __init__(self, path: str, failed: Sequence[str]) -> None:
        listed = "; ".join(failed) if failed else "no engine is healthy"
        super().__init__(f"weights_path {path!r} was loaded by no engine: {listed}")


class VersionBehind(ValueError):
    """A published policy version is lower than the run's current one."""

    def __init__(self, run_id: str, version: int, current: int) -> None:
        super().__init__(
            f"version ({version}{', or not given' if version == 0 else ''}) is below the "
            f"policy version of run {run_id!r} ({current}): "
            "versions only go up"
        )
        self.current = current


class _EngineFault(Exception):
    """The engine could not finish the call; another engine may."""


class _CallFailed(Exception):
    """The engine failed the call with an error another engine may not meet: the call's
    samples go back to the queue (an attempt each); the engine is taken out of service
    once ``_CALL_FAILURES`` of its calls did so within ``_CALL_FAILURES_WINDOW_S`` (one
    whose core died also says so through its health, at once)."""


class _Rejected(Exception):
    """The engine refused the call for a reason no other engine would fix."""


class _BadOutput(Exception):
    """The engine sent output no trainer can use (a logprob that is not a finite number)."""


@dataclass(slots=True)
class Counters:
    groups_delivered: int = 0
    samples_delivered: int = 0
    tokens_generated: int = 0
    groups_failed: int = 0
    groups_cancelled: int = 0
    engine_failures: int = 0
    samples_preempted: int = 0
    earlier_outputs_sent: int = 0
    earlier_outputs_pushed: int = 0
    stream_entries_trimmed: int = 0  # acknowledged by every reader, removed (trim_acked)
    samples_streamed: int = 0  # written to the samples streams as they finished


@dataclass(eq=False, slots=True)
class _Call:
    """One Generate call: samples ``indices`` of ``record``'s group on ``engine``; a call
    that resumes a preempted sample has that one sample and sends the tokens it kept,
    ``resumed``, after the prompt."""

    request_id: str
    record: GroupRecord
    engine: EngineHandle
    indices: tuple[int, ...]
    resumed: tuple[int, ...] = ()
    tag: int = 0  # its place in the engine's queue (``EngineTags``), sent as its priority
    task: asyncio.Task[None] | None = None
    # Samples an Abort was sent for and whose Complete has not come yet -> the engine to
    # resume each on ("": the queue).
    stopping: dict[int, str] = field(default_factory=dict)
    # Samples that left the call preempted -> the tokens each had then: the engine sends
    # nothing more of them (a resumed call makes the rest).
    preempted: dict[int, int] = field(default_factory=dict)
    # Samples whose Abort got no answer (a timeout, a broken connection): the engine may
    # still have carried it out, and an aborted Complete of one is a preemption to the queue.
    abort_unanswered: set[int] = field(default_factory=set)

    def running(self) -> list[int]:
        """Its samples that have not finished yet (nor left it)."""
        samples = self.record.samples
        return [
            i
            for i in self.indices
            if i not in self.preempted and samples[i].state == SampleState.RUNNING
        ]


@dataclass(eq=False, slots=True)
class _Work:
    count: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(frozen=True, slots=True)
class _Ending:
    record: GroupRecord
    error: str  # "" when every sample finished


class SchedulerRuntime:
    def __init__(
        self,
        settings: SchedulerSettings,
        store: Store,
        policy: Policy,
        tokenize: Callable[[str], list[int]] | None = None,
    ) -> None:
        self.settings = settings
        self.tokenize = tokenize
        self._store = store
        self._policy = policy
        self._groups: dict[str, GroupRecord] = {}  # every group that has not ended
        self._delivered_to: set[str] = set()  # runs whose streams got entries lately (trim)
        self._held_prompt_tokens = 0  # of the groups in _groups
        # Groups and prompt tokens of the Submits that Redis is writing, not queued yet.
        self._admitting = (0, 0)
        self._queue: dict[str, None] = {}  # keys of groups with queued samples, in order
        self._calls: dict[str, dict[str, _Call]] = {}  # group key -> request id -> call
        # every call's task (and Abort's, and a registered engine's first probe), until it ends
        self._tasks: set[asyncio.Task[Any]] = set()
        self._probing: dict[EngineHandle, asyncio.Task[None]] = {}  # the health loop's
        self._stopping = False  # stop() or _halt() cancels the loops: no failure then
        self._engines: dict[str, EngineHandle] = {}
        self._watches: dict[str, asyncio.Task[None]] = {}  # engine id -> its health watch
        self._engines_added = 0
        self._registered = 0  # engines that came through RegisterEngine (heartbeat budget)
        self._probe_round = 0
        self._wake = asyncio.Event()
        self._seq = 0
        self._calls_started = 0
        self._boot = uuid.uuid4().hex[:8]  # keeps request ids unique across restarts
        self._background: list[asyncio.Task[None]] = []
        # Run -> its questions of what samples had made at a publish (``_ask_made``) not
        # answered yet, in the order of the publishes
        self._asking: dict[str, list[asyncio.Task[None]]] = {}
        # Group key -> writes of its samples to the samples stream not yet done; the group's
        # entry waits for them, so that its samples' entries come first.
        self._sample_writes: dict[str, set[asyncio.Task[None]]] = {}
        # Run id -> its lock and how many hold or wait for it (``_run_lock``).
        self._run_locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}
        # Run id -> its deliveries and samples' writes, and its publishes, in progress
        # (DeleteRun waits for them).
        self._writing: dict[str, _Work] = {}
        self._publishing: dict[str, _Work] = {}
        # Keys of the groups retired and not yet written (still pending in Redis)
        self._ending: set[str] = set()
        self._failed = asyncio.Event()
        self._lease: SchedulerLease | None = None  # held from start until stop
        self._lost: LeaseLost | None = None  # why the lease was lost; nothing acts after
        self.counters = Counters()
        # What was delivered since start, as distributions (the metrics endpoint's)
        self.group_latency = Histogram(
            "group_latency_seconds",
            "Seconds from a group's Submit to its stream entry, of the groups delivered.",
            GROUP_LATENCY_BOUNDS_S,
        )
        self.output_tokens = Histogram(
            "sample_output_tokens",
            "Tokens each sample of the groups delivered made.",
            OUTPUT_TOKENS_BOUNDS,
        )
        self.token_staleness = Histogram(
            "token_staleness_versions",
            "Output tokens of the groups delivered, by how many policy versions the run's "
            "version at delivery is ahead of the one they were made under (0: on-policy).",
            STALENESS_BOUNDS,
        )
        self.plan_seconds = Histogram(
            "plan_seconds",
            "Seconds each plan took (the policy's, with the view of the queue and engines it "
            "was shown); a plan over plan_pace_from_s is followed by a wait as long.",
            PLAN_BOUNDS_S,
        )
        # Finished outputs by prompt, for engines that draft from those they did not make.
        self._outputs = (
            EarlierOutputs(
                per_prompt=settings.earlier_outputs_per_prompt,
                max_tokens=settings.earlier_outputs_tokens,
            )
            if settings.earlier_outputs_per_prompt
            else None
        )
        self._outputs_taken = False  # some engine has said it drafts from earlier outputs
        # Engine id -> groups it runs whose outputs that finished elsewhere it lacks, the
        # task that sends them, and when it last sent (time.monotonic()).
        self._push_due: dict[str, set[str]] = {}
        self._pushers: dict[str, asyncio.Task[None]] = {}
        self._pushed_at: dict[str, float] = {}
        self._predictor = LengthPredictor(settings.predictor)
        # (predicted before learning, true length) of the latest delivered samples.
        self._scores: deque[tuple[float, int]] = deque(maxlen=PREDICTOR_SCORE_WINDOW)
        # Predictions kept while the predictor's stamp of their prompt holds (its reuse):
        # queued group key -> ((stamp, finished siblings, furthest progress), prediction);
        # running group key -> ((stamp, its revision), its length fit).
        self._predicted: dict[str, tuple[tuple[int, int, int, int, int], float]] = {}
        self._fits: dict[str, tuple[tuple[int, int, int, int], LengthFit]] = {}
        # The predictor's generations at the last snapshot, and the prompt keys learnt from
        # since: an untouched queued group of another prompt is predicted as it was then.
        self._seen_generations = (-1, -1)
        self._seen_buckets: dict[int, int] = {}
        self._relearnt: set[str] = set()
        # Per prompt-length bucket: (the predictor's generation and the bucket's, the prior's
        # mean there), what a group with nothing of its own is predicted.
        self._prior_means: dict[int, tuple[tuple[int, ...], float]] = {}
        # Queued group key -> (record, its revision, prediction, the view built from them):
        # a plan runs at every finished sample, and most queued groups have not changed.
        self._views: dict[str, tuple[GroupRecord, int, float | None, QueuedGroup]] = {}
        # Queued group key -> (record, its revision, what fair share sees of it).
        self._waiting: dict[str, tuple[GroupRecord, int, Waiting]] = {}
        self._share = FairShare()  # the runs' fair share of the engines (settings.fair_share)
        self._engine_tls = settings.engine_tls()  # (its files read again when they change)
        engine_token = settings.engine_token()  # (the engines' calls show it, where given)
        self._engine_metadata: Callable[[], Metadata] = (
            (lambda: ()) if engine_token is None else engine_token.metadata
        )
        # The order of the engines' own queues (settings.fair_share; without it, arrival).
        self._tags = EngineTags()
        self._oldest_tag: int | None = None  # the least tag in flight, as a plan begins
        self._tag_window = 0  # the fleet's sample slots then
        # Prompt keys learnt from and not saved yet, least recently learnt first.
        self._unsaved: dict[str, None] = {}
        self._globals_unsaved = False
        self._save_lock = asyncio.Lock()
        # Run id -> its policy version (PublishVersion; Redis has it), for every run with
        # groups here or that published since the start.
        self._versions: dict[str, int] = {}
        self._runs_deleted = 0  # DeleteRuns done (a version read across one is read again)
        # The fleet's weights from the last PublishVersion with a path: an engine serves
        # only with them loaded. None: engines keep the weights they have.
        self._weights: FleetWeights | None = None
        # (run id, since, upto): engines label tokens with their weights' version, and for
        # this run those of versions since to upto are its own (set as soon as a load
        # starts, upto the version it loads): weights of a version past it are another
        # run's, which the engines served before this run's first load ended.
        self._stamping: tuple[str, int, int] | None = None
        self._weights_lock = asyncio.Lock()  # one fleet update at a time

    # ------------------------------------------------------------ lifecycle

    async def _load_fleet_weights(self) -> None:
        """The fleet's weights from Redis (an engine serves only with them), or none when the
        settings say to forget them."""
        weights = await self._store.load_weights()
        if weights is not None and self.settings.forget_fleet_weights:
            await self._store.forget_weights()
            log.warning(
                "forgot the fleet's weights %s (version %d of run %r): engines serve their own",
                weights.path,
                weights.version,
                weights.run_id,
            )
            weights = None
        elif weights is not None:
            log.warning(
                "the fleet's weights are %s (version %d of run %r): every engine loads them "
                "before it gets work (--forget-fleet-weights for engines to serve their own)",
                weights.path,
                weights.version,
                weights.run_id,
            )
            self._stamping = (weights.run_id, weights.since, weights.version)
        self._weights = weights

    async def start(self) -> None:
        """Takes the scheduler lease (LeaseHeld if another scheduler keeps it for
        ``lease_wait_s``), then recovers the state and starts work. If it raises, it has
        stopped the runtime (and touched no state when the lease was not taken)."""
        try:
            lease = self._store.lease(
                self.settings.lease_ttl_s, self.settings.lease_wait_s, self._fenced_out
            )
            await lease.take()
            self._lease = lease
            self._own(self._keep_lease(lease), "lease")  # renewed while loading, too
            await self._load_history()
            await self._load_fleet_weights()
            recovered = await self._store.load_pending()
            self._versions.update(
                await self._store.load_versions(sorted({spec.run_id for spec in recovered}))
            )
            for spec in recovered:
                self._enqueue(spec)
            await self._restore_streamed([spec for spec in recovered if spec.stream_samples])
            if recovered:
                log.info("recovered %d pending groups from Redis", len(recovered))
            for endpoint in self.settings.engines:
                self._add_engine(endpoint.engine_id, endpoint.address)
            await self._probe_all()
            if self._lost is not None:
                raise self._lost
        except BaseException:
            await self.stop()
            raise
        self._own(self._dispatch_loop(), "dispatch")
        self._own(self._health_loop(), "health")
        if self.settings.trim_acked:
            self._own(self._trim_loop(), "trim")
        self._wake.set()

    def _own(self, coro: Coroutine[None, None, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._loop_ended)
        self._background.append(task)

    @property
    def failed(self) -> asyncio.Event:
        """Set when a background loop died or the lease was lost: the process must stop
        (state is in Redis)."""
        return self._failed

    @property
    def lost(self) -> LeaseLost | None:
        """Why the scheduler lease was lost, if it was."""
        return self._lost

    async def _keep_lease(self, lease: SchedulerLease) -> None:
        try:
            await lease.keep()
        except LeaseLost as exc:
            self._halt(exc)
            raise

    def _halt(self, lost: LeaseLost) -> None:
        """Stops acting, in this step: every other task of the runtime is cancelled, so it
        runs again only to unwind."""
        self._lost = lost
        self._stopping = True
        current = asyncio.current_task()
        for task in (
            *self._background,
            *self._tasks,
            *self._watches.values(),
            *self._questions(),
            *self._pushers.values(),
            *(task for writes in self._sample_writes.values() for task in writes),
        ):
            if task is not current:
                task.cancel()

    def _fenced_out(self, lost: LeaseLost) -> None:
        """Redis refused a write: another scheduler holds the lease (this one stalled past
        its ttl, before its renewal could find it gone). Stops all work, as a lost lease
        does."""
        if self._lost is not None:
            return
        log.critical("stopped all work: another scheduler runs the pending groups now (%s)", lost)
        self._halt(lost)
        self._failed.set()

    def _check_lease(self) -> None:
        if self._lost is not None:
            raise LeaseLost(f"this scheduler lost its lease and is stopping: {self._lost}")

    async def _lease_sure(self) -> None:
        """Waits while a late renewal of the lease is under way (the process stalled past
        the part of the ttl it counts on): until Redis says the lease is still this
        scheduler's, no new work starts on the engines, which another scheduler may be
        driving by now. (Redis's writes are fenced by the lease; the engines' calls are not.)"""
        if self._lease is not None and self._lease.in_doubt:
            await self._lease.sure()

    @property
    def predictor(self) -> LengthPredictor:
        """The length predictor (read it; only the runtime teaches it)."""
        return self._predictor

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            if not self._stopping:  # nothing here cancels a loop but stop() and _halt()
                log.critical("the %s loop was cancelled", task.get_name())
                self._failed.set()
            return
        exc = task.exception()
        if isinstance(exc, LeaseLost):
            log.critical(
                "lost the scheduler lease, stopped all work (another scheduler may run the "
                "pending groups now): %s",
                exc,
            )
        else:
            log.critical("the %s loop died: %r", task.get_name(), exc)
        self._failed.set()

    async def stop(self) -> None:
        """Stops all work. Running groups stay pending in Redis for the next start; length
        history not saved yet is saved now (if Redis answers and the lease was not lost);
        then the lease is released."""
        self._stopping = True
        tasks = [
            *self._background,
            *self._tasks,
            *self._watches.values(),
            *self._questions(),
            *self._pushers.values(),
            *(task for writes in self._sample_writes.values() for task in writes),
        ]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._background.clear()
        self._asking.clear()
        self._sample_writes.clear()
        self._tasks.clear()
        self._probing.clear()
        self._watches.clear()
        self._pushers.clear()
        self._push_due.clear()
        self._calls.clear()
        if self._lost is None:
            with contextlib.suppress(LeaseLost):  # (said as the runtime halted)
                await self._save_history()
        await asyncio.gather(*(e.close() for e in self._engines.values()))
        if self._lease is not None:
            await self._lease.release()  # only while still its own
            self._lease = None
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
            max_submit_prompt_tokens=self.settings.max_submit_prompt_tokens,
            max_prompt_tokens=self.settings.max_prompt_tokens,
            max_model_len=self.settings.max_model_len or (min(contexts) if contexts else None),
            vocab_size=min(vocabs) if vocabs else None,
        )

    async def submit(self, run_id: str, specs: Sequence[GroupSpec]) -> None:
        """Persists then queues the groups. Raises ValidationError (a batch no queue takes,
        however empty), QueueFull, store.DuplicateGroup or LeaseLost (this scheduler is
        stopping)."""
        self._check_lease()
        tokens = sum(len(spec.prompt_token_ids) for spec in specs)
        most, limit = self.settings.max_queued_groups, self.settings.max_held_prompt_tokens
        # A batch no queue takes, however empty, is refused as such: a retry never passes.
        if len(specs) > most:
            raise ValidationError(
                f"groups has {len(specs)} groups; the queue holds at most {most} "
                "(max_queued_groups): submit fewer at a time"
            )
        if tokens > limit:
            raise ValidationError(
                f"these {len(specs)} groups hold {tokens} prompt tokens; the groups not yet "
                f"delivered hold at most {limit} (max_held_prompt_tokens): submit fewer at a time"
            )
        queued = len(self._queue) + self._admitting[0]
        room = most - queued
        if len(specs) > room:
            raise QueueFull(
                f"the queue holds {queued} groups of at most {most} (max_queued_groups); "
                f"{len(specs)} more do not fit (room for {max(0, room)}): retry later"
            )
        held = self._held_prompt_tokens + self._admitting[1]
        if held + tokens > limit:
            raise QueueFull(
                f"the groups not yet delivered hold {held} prompt tokens of at most {limit} "
                f"(max_held_prompt_tokens); these {len(specs)} groups' {tokens} do not fit: "
                "retry once some are delivered"
            )
        # Counted against the limits until queued: Submits at once that each fit alone
        # would overfill the queue together.
        self._admitting = (self._admitting[0] + len(specs), self._admitting[1] + tokens)
        # Written and queued together even if the caller goes (its deadline, a cancel) while
        # Redis answers: written and not queued, the groups would wait for a restart, and a
        # retry would be refused as a duplicate.
        await self._carried_through(self._add(run_id, specs, tokens), f"submit {run_id}")

    async def _add(self, run_id: str, specs: Sequence[GroupSpec], tokens: int) -> None:
        try:
            specs = [self._with_epoch(spec) for spec in specs]
            if run_id not in self._versions:
                await self._load_version(run_id)
            # A DeleteRun between the write and the queue would leave the groups running
            # to a delivery refused.
            async with self._run_lock(run_id):
                try:
                    await self._store.add_pending(run_id, specs)
                except DuplicateGroup:
                    await self._adopt(run_id, specs)
                    raise
                except redis.exceptions.RedisError:
                    # The write may have landed with its answer lost: the groups Redis
                    # holds are queued once it answers, retried by the caller or not.
                    task = asyncio.create_task(
                        self._adopt_later(run_id, specs), name=f"adopt {run_id}"
                    )
                    self._tasks.add(task)
                    task.add_done_callback(self._call_ended)
                    raise
                for spec in specs:
                    # Redis took it as new: a group of the id still here is one of a
                    # DeleteRun whose answer was lost (done in Redis, not here).
                    stale = self._groups.get(spec.key)
                    if stale is not None and self._retire(stale):
                        stale.cancel()
                    self._enqueue(spec)
            self._wake.set()
        finally:
            self._admitting = (self._admitting[0] - len(specs), self._admitting[1] - tokens)

    async def _adopt(self, run_id: str, specs: Sequence[GroupSpec]) -> None:
        """A Submit that met a Redis error may have written its groups (the answer lost):
        they are pending in Redis and were never queued here (nothing else leaves a group
        so but a restart, which recovers them). Those are queued now, as Redis holds them:
        looked for once Redis answers again (``_adopt_later``), and by a retry, which is
        refused as a duplicate (ALREADY_EXISTS: the SDK counts them as submitted). The
        caller holds the run's lock."""
        pending = await self._store.pending_groups(run_id, [spec.group_id for spec in specs])
        # (A group retired since is still pending in Redis until its ending is written.)
        adopted = [s for s in pending if s.key not in self._groups and s.key not in self._ending]
        if not adopted:
            return
        log.warning(
            "%d groups of run %s were pending in Redis and not queued (a Submit whose answer "
            "was lost): queued now",
            len(adopted),
            run_id,
        )
        for spec in adopted:
            self._enqueue(spec)
        await self._restore_streamed([spec for spec in adopted if spec.stream_samples])
        self._wake.set()

    async def _adopt_later(self, run_id: str, specs: Sequence[GroupSpec]) -> None:
        """``_adopt`` once Redis answers, for up to ``_ADOPT_WITHIN_S`` (a retry of the
        Submit or a restart of the scheduler queues them after that)."""
        deadline = time.monotonic() + _ADOPT_WITHIN_S
        for attempt in itertools.count():
            try:
                async with self._run_lock(run_id):
                    await self._adopt(run_id, specs)
                return
            except redis.exceptions.RedisError as exc:
                delay = _REDIS_RETRY_S[min(attempt, len(_REDIS_RETRY_S) - 1)]
                if time.monotonic() + delay > deadline:
                    log.warning(
                        "whether Redis took %d groups of run %s is not known (%s): a retry "
                        "of the Submit, or a restart, queues them",
                        len(specs),
                        run_id,
                        exc,
                    )
                    return
                await asyncio.sleep(delay)

    @contextlib.asynccontextmanager
    async def _run_lock(self, run_id: str) -> AsyncIterator[None]:
        """One at a time per run: a Submit's write and queueing, or a DeleteRun."""
        entry = self._run_locks.setdefault(run_id, (asyncio.Lock(), [0]))
        lock, users = entry
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if not users[0] and self._run_locks.get(run_id) is entry:
                del self._run_locks[run_id]

    async def cancel(self, run_id: str, group_ids: Sequence[str]) -> tuple[list[str], list[str]]:
        """Ends the groups that have not ended; LeaseLost if this scheduler is stopping."""
        self._check_lease()
        # Cut off once Redis ended them, the groups would run on to a delivery refused.
        return await self._carried_through(self._cancel(run_id, group_ids), f"cancel {run_id}")

    async def _cancel(self, run_id: str, group_ids: Sequence[str]) -> tuple[list[str], list[str]]:
        ended_now = set(await self._store.cancel(run_id, group_ids))
        for gid in ended_now:
            self.counters.groups_cancelled += 1
            record = self._groups.get(group_key(run_id, gid))
            # None: it was being delivered or failed, and Redis ended it as cancelled first.
            if record is not None and self._retire(record):
                record.cancel()  # its calls were cancelled: the engines abort the work
        cancelled = [g for g in group_ids if g in ended_now]
        unknown = [g for g in group_ids if g not in ended_now]
        if cancelled:
            self._wake.set()
        return cancelled, unknown

    async def delete_run(self, run_id: str) -> tuple[int, bool]:
        """Ends the run for good: cancels its groups and deletes its state in Redis; how many
        groups it cancelled, and whether the run had state. LeaseLost if this scheduler is
        stopping."""
        self._check_lease()
        return await self._carried_through(self._delete_run(run_id), f"delete {run_id}")

    async def _delete_run(self, run_id: str) -> tuple[int, bool]:
        # Under the run's lock no Submit or PublishVersion of the run begins.
        async with self._run_lock(run_id):
            # A publish in progress would write the run's version back after the delete.
            await self._work_done(self._publishing, run_id)
            existed = await self._store.delete_run(run_id)
            # From here no write of the run takes: its groups are not pending. Out of memory
            # only now, in this step: had Redis refused the delete, they would run on.
            cancelled = 0
            for record in [r for r in self._groups.values() if r.spec.run_id == run_id]:
                if self._retire(record):  # its calls were cancelled: the engines abort
                    record.cancel()
                    cancelled += 1
            self._versions.pop(run_id, None)
            self._runs_deleted += 1
            self._tags.forget(run_id)
            if self._stamping is not None and self._stamping[0] == run_id:
                self._stamping = ("", 0, 0)  # (the fleet's weights, in Redis too, name no run)
            self.counters.groups_cancelled += cancelled
            if cancelled:
                self._wake.set()
            # Deliveries and samples' writes begun before (each writes nothing now, or its
            # entry went with the delete) end before the id can be used again: one landing
            # after a new Submit of the same group id would deliver the old group.
            await self._work_done(self._writing, run_id)
        log.info("run %s deleted (%d groups cancelled)", run_id, cancelled)
        return cancelled, existed

    @contextlib.contextmanager
    def _work(self, work: dict[str, _Work], run_id: str) -> Iterator[None]:
        """Counts a write (or publish) of the run in progress in ``work``."""
        entry = work.get(run_id)
        if entry is None:
            entry = work[run_id] = _Work()
        entry.count += 1
        try:
            yield
        finally:
            entry.count -= 1
            if not entry.count:
                entry.done.set()
                if work.get(run_id) is entry:
                    del work[run_id]

    @staticmethod
    async def _work_done(work: dict[str, _Work], run_id: str) -> None:
        """Waits until the run has no work of ``work`` in progress."""
        while (entry := work.get(run_id)) is not None:
            await entry.done.wait()

    async def publish_version(
        self, run_id: str, version: int, weights_path: str = ""
    ) -> PublishResult:
        """Makes ``version`` the run's policy version (stored first), which labels tokens as
        ``_token_version`` says. With ``weights_path``, every healthy engine loads those
        weights first (``_publish_weights``), and the publish is carried through even if its
        caller goes. Without, the tokens its running samples made before count as the
        version before (``_ask_made``, which does not wait for the engines unless the run
        has ``_MAX_COUNTS_AWAITED`` such counts due). Raises VersionBehind if the run's
        version is higher, and LeaseLost if this scheduler is stopping."""
        self._check_lease()
        with contextlib.ExitStack() as publishing:
            async with self._run_lock(run_id):  # (not while the run is being deleted)
                publishing.enter_context(self._work(self._publishing, run_id))
            return await self._publish_version(run_id, version, weights_path, publishing)

    async def _publish_version(
        self, run_id: str, version: int, weights_path: str, publishing: contextlib.ExitStack
    ) -> PublishResult:
        """``publishing`` holds the publish as one in progress of the run (DeleteRun waits
        for it); a part carried through takes it over, to hold until that part ends."""
        if run_id not in self._versions:
            await self._load_version(run_id)
        self._check_behind(run_id, version)
        if weights_path:
            # Cut off part way (the trainer's deadline), it would leave the engines that had
            # loaded serving weights the fleet's do not name, and the run's tokens labelled
            # by weights that were never made the fleet's.
            return await self._carried_through(
                self._publish_weights(run_id, version, weights_path),
                f"publish {run_id}",
                publishing.pop_all(),
            )
        if version > self._versions[run_id]:
            # Engines that answer slower than the trainer publishes hold it back here.
            while len(asking := self._asking.get(run_id, [])) >= _MAX_COUNTS_AWAITED:
                await asyncio.wait({asking[0]})
        # Cut off once stored, the tokens made before would count as the new version.
        return await self._carried_through(
            self._publish(run_id, version), f"publish {run_id}", publishing.pop_all()
        )

    async def _publish(self, run_id: str, version: int) -> PublishResult:
        # The version it replaced is Redis's word: two publishes at once both read the one
        # before them here (tokens between them were capped one version too low).
        current, before = await self._store_version(run_id, version)
        if current > before and not self._stamps(run_id) and not self.settings.label_on_arrival:
            self._ask_made(run_id, before)
        return PublishResult(current, 0, ())

    def _check_behind(self, run_id: str, version: int) -> None:
        if version < self._versions[run_id]:
            raise VersionBehind(run_id, version, self._versions[run_id])

    async def _store_version(self, run_id: str, version: int) -> tuple[int, int]:
        """Stores the version (VersionBehind if Redis has a higher one); returns the run's
        version and the one it replaced."""
        ok, current, before = await self._store.publish_version(run_id, version)
        self._versions[run_id] = max(current, self._versions[run_id])
        if not ok:
            raise VersionBehind(run_id, version, current)
        return current, before

    async def _publish_weights(self, run_id: str, version: int, path: str) -> PublishResult:
        """Has every healthy engine load the weights, then stores the version: engines that
        fail are taken out of service until they load them, and if none could, nothing
        changes (WeightsNotLoaded). One at a time: a publish that waited for another checks
        its version again (a v5 loaded after a v6 made the fleet serve v5)."""
        async with self._weights_lock:
            self._check_behind(run_id, version)
            fleet = self._weights
            if (
                fleet is not None
                and (fleet.run_id, fleet.version) == (run_id, version)
                and fleet.path != path  # (the same path again is a retry: it is loaded again)
            ):
                raise ValidationError(
                    f"version {version} of run {run_id!r} is the weights at "
                    f"{quoted(fleet.path)}; weights_path {quoted(path)} needs a version of "
                    f"its own (publish {version + 1}): tokens of one version come from one "
                    "checkpoint"
                )
            if fleet is not None and fleet.run_id not in ("", run_id):
                log.warning(
                    "run %s publishes weights (%s, version %d) in place of run %s's (%s, "
                    "version %d): every engine serves them, for every run",
                    run_id,
                    path,
                    version,
                    fleet.run_id,
                    fleet.path,
                    fleet.version,
                )
            # The labels of the tokens made before these weights are settled first.
            while asking := self._asking.get(run_id):
                await asyncio.wait({asking[-1]})
            updated, failed = await self._update_fleet(run_id, path, version)
            current, _ = await self._store_version(run_id, version)
            return PublishResult(current, updated, failed)

    async def _carried_through(
        self,
        work: Coroutine[None, None, _T],
        name: str,
        holding: contextlib.ExitStack | None = None,
    ) -> _T:
        """Runs ``work`` in a task of the runtime's: the caller's going (its deadline, a
        cancel) does not cut it off, stop() and a lost lease do (the caller then gets
        LeaseLost if the lease was lost). What it raises after the caller went is logged.
        ``holding`` (what counts the work as in progress) is closed when the task ends."""
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if holding is not None:
            task.add_done_callback(lambda _: holding.close())
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():  # the runtime stops, not the caller
                self._check_lease()
            elif not task.done():
                task.add_done_callback(_log_unheard)
            raise

    async def _update_fleet(
        self, run_id: str, path: str, version: int
    ) -> tuple[int, tuple[str, ...]]:
        """Loads the weights into every healthy engine and makes them the fleet's; returns
        how many engines loaded them and why the others did not. The caller holds
        ``_weights_lock``."""
        await self._lease_sure()
        before = self._stamping
        since = before[1] if before is not None and before[0] == run_id else version
        # An engine that has loaded them makes tokens of this version while the others
        # still load: they count as it from now on.
        self._stamping = (run_id, since, version)
        # An engine a probe has load the fleet's weights (it joined or restarted) is left
        # to that probe, which loads these too once they are the fleet's.
        healthy = [e for e in self._engines.values() if e.healthy]
        engines = [e for e in healthy if not e.loading_weights]
        for engine in engines:
            engine.loading_weights = True  # a probe meanwhile leaves it to this load
        try:
            # An engine removed meanwhile (it registered elsewhere) had its channel closed,
            # which cancels its load: that is its failure, not the publish's.
            results = await asyncio.gather(
                *(self._load_missing_weights(e, path, version) for e in engines),
                return_exceptions=True,
            )
        finally:
            for engine in engines:
                engine.loading_weights = False
        failed = [
            (e, why if isinstance(why, str) else f"its load broke off: {why!r}")
            for e, why in zip(engines, results, strict=True)
            if why
        ]
        reasons = tuple(f"{e.engine_id}: {why}" for e, why in failed)
        if len(failed) == len(healthy):  # (one a probe looks at is not counted as failed)
            self._stamping = before
            raise WeightsNotLoaded(path, reasons)
        weights = FleetWeights(path, version, run_id, since)
        try:
            await self._store.save_weights(weights)
        except BaseException:
            self._stamping = before
            raise
        self._weights = weights
        for engine, why in failed:
            await self._engine_down(engine, f"weights not loaded: {why}")
        # Engines that came into service while the others loaded had the old weights.
        joined = [e for e in self._engines.values() if e.healthy and e not in engines]
        await asyncio.gather(*(self._has_fleet_weights(e) for e in joined), return_exceptions=True)
        return len(engines) - len(failed), reasons

    async def _load_missing_weights(self, engine: EngineHandle, path: str, version: int) -> str:
        """Has the engine load the weights unless it serves them already (a retried publish
        loads nothing again); returns why it could not ("" when it has them)."""
        try:
            stats = await engine.stats(self.settings.health_timeout_s)
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
        engine.weights = (stats.weights_path, stats.weights_version)
        if engine.weights == (path, version):
            return ""
        return await self._load_weights(engine, path, version)

    async def _load_weights(self, engine: EngineHandle, path: str, version: int) -> str:
        """Has the engine load the weights; returns why it could not ("" when it did)."""
        try:
            await engine.update_weights(path, version, self.settings.weights_timeout_s)
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
        engine.weights = (path, version)
        log.info("engine %s loaded weights %s (version %d)", engine.engine_id, path, version)
        return ""

    async def _has_fleet_weights(self, engine: EngineHandle) -> bool:
        """Whether the engine serves the fleet's weights, loading them into it if not (an
        engine that joins, comes back or restarted starts with those it was launched with);
        one that served with other weights is taken out of service first."""
        if engine.loading_weights:
            return False  # a load is under way (a probe round is shorter than a load)
        engine.loading_weights = True
        try:
            while (target := self._weights) is not None:
                path, version = target.path, target.version
                downs = engine.downs
                stats = await engine.stats(self.settings.health_timeout_s)
                engine.weights = (stats.weights_path, stats.weights_version)
                if engine.downs != downs:
                    return False  # taken out while Stats was out (as in _probe)
                if self._weights is not target:
                    continue  # the fleet's weights changed meanwhile: compare with those
                if engine.weights == (path, version):
                    return True
                if engine.healthy:  # it restarted: no work for it until it has them
                    await self._engine_down(engine, "restarted without the fleet's weights")
                why = await self._load_weights(engine, path, version)
                if why:
                    engine.stays_down(
                        f"weights not loaded: {why} (the fleet's weights are {path}, version "
                        f"{version} of run {target.run_id!r}: publish weights every "
                        "engine can read, or start the scheduler with --forget-fleet-weights)"
                    )
                    return False
                # Loaded; the fleet's may have moved on meanwhile: look again.
            return True
        except grpc.aio.AioRpcError as exc:
            reason = f"its weights are unknown: Stats failed: {exc.details()}"
            if engine.healthy:
                await self._engine_down(engine, reason)
            engine.stays_down(reason)
            return False
        finally:
            engine.loading_weights = False

    async def _load_version(self, run_id: str) -> None:
        """The run's policy version from Redis, unless a publish set a newer one while it was
        read (a Submit and a PublishVersion of a run this process has not seen, at once).
        Read again when a DeleteRun ended meanwhile: the version read before it went with
        the run, and kept it would refuse the versions of the run used again below it."""
        while True:
            deletes = self._runs_deleted
            loaded = (await self._store.load_versions([run_id]))[run_id]
            if deletes == self._runs_deleted:
                break
        self._versions[run_id] = max(loaded, self._versions.get(run_id, loaded))

    def policy_version(self, run_id: str) -> int:
        return self._versions.get(run_id, 0)

    async def register_engine(self, engine_id: str, address: str) -> None:
        """Adds the engine to the fleet (or notes it is back) and probes it; FleetFull if the
        fleet is full, LeaseLost if this scheduler is stopping (the engine registers with
        the one that runs next)."""
        self._check_lease()
        engine = self._engines.get(engine_id)
        while engine is not None and engine.address != address:
            # (Cut off by the engine's deadline, the endings of the groups that ran out of
            # attempts there were not written: pending in Redis, out of memory.)
            await self._carried_through(
                self._remove_engine(engine, f"re-registered at {address}"), f"remove {engine_id}"
            )
            self._check_lease()
            engine = self._engines.get(engine_id)  # (another registration may have added it)
        if engine is None:
            if len(self._engines) >= self.settings.max_engines:
                raise FleetFull(
                    f"the fleet has {len(self._engines)} engines of at most "
                    f"{self.settings.max_engines} (max_engines); engine_id {engine_id!r} is not "
                    "added (engines that are down and silent leave after "
                    f"forget_engine_after_s, {self.settings.forget_engine_after_s:g} s)"
                )
            engine = self._add_engine(engine_id, address)
        if not engine.registered:
            engine.registered = True
            self._registered += 1
        engine.heartbeat()
        engine.may_have_restarted = True  # since it was seen
        # Probed in a task of its own, which the reply waits for a probe deadline at most: a
        # load of the fleet's weights outlasts the engine's RegisterEngine deadline, and a
        # cancelled load leaves the engine's model half written.
        probe = asyncio.create_task(self._probe(engine), name=f"probe {engine_id}")
        self._tasks.add(probe)
        probe.add_done_callback(self._probe_ended(engine))
        await asyncio.wait({probe}, timeout=self.settings.health_timeout_s)

    def _probe_ended(self, engine: EngineHandle) -> Callable[[asyncio.Task[None]], None]:
        task_ended = self._engine_task_ended(engine)

        def ended(task: asyncio.Task[None]) -> None:
            self._tasks.discard(task)
            if self._probing.get(engine) is task:
                del self._probing[engine]
            task_ended(task)

        return ended

    def _engine_task_ended(self, engine: EngineHandle) -> Callable[[asyncio.Task[None]], None]:
        """For a task that probes or watches ``engine``: one that raised fails the scheduler
        (as when a loop dies), unless the engine was removed meanwhile (it registered at
        another address: closing its channel cancelled or refused the task's calls)."""

        def ended(task: asyncio.Task[None]) -> None:
            exc = None if task.cancelled() else task.exception()
            current = self._engines.get(engine.engine_id) is engine
            if current and exc is not None and not isinstance(exc, LeaseLost):
                log.critical("%s crashed: %r", task.get_name(), exc, exc_info=exc)
                self._failed.set()

        return ended

    def heartbeat_interval_ms(self) -> int:
        """The period engines are told to heartbeat at: the setting, or longer on a fleet
        whose heartbeats would pass ``max_heartbeats_per_s`` together (each is a call the
        scheduler serves; 512 engines every 2 s were a tenth of its CPU)."""
        s = self.settings
        spread = math.ceil(1000 * self._registered / s.max_heartbeats_per_s)
        return min(600_000, max(s.heartbeat_interval_ms, spread))

    def heartbeat(self, engine_id: str) -> bool:
        engine = self._engines.get(engine_id)
        if engine is None:
            return False
        engine.heartbeat()
        return True

    @property
    def histograms(self) -> tuple[Histogram, ...]:
        """The distributions of what was delivered since start, and of the plans' durations
        (not in Status)."""
        return (self.group_latency, self.output_tokens, self.token_staleness, self.plan_seconds)

    def status(self) -> pb.StatusResponse:
        loads = self._loads()
        c = self.counters
        scored, mae, auc = self._predictor_score()
        return pb.StatusResponse(
            queue_depth=len(self._queue),
            inflight_groups=len(self._calls),
            inflight_samples=sum(load.samples for load in loads.values()),
            groups_delivered=c.groups_delivered,
            samples_delivered=c.samples_delivered,
            samples_streamed=c.samples_streamed,
            tokens_generated=c.tokens_generated,
            groups_failed=c.groups_failed,
            groups_cancelled=c.groups_cancelled,
            engine_failures=c.engine_failures,
            samples_preempted=c.samples_preempted,
            predictor_keys=len(self._predictor),
            predictor_epoch=self._predictor.epoch,
            predictor_scored_samples=scored,
            predictor_mae_tokens=mae,
            predictor_tail_auc=auc,
            engines=[
                pb.EngineStatus(
                    engine_id=e.engine_id,
                    address=e.address,
                    healthy=e.healthy,
                    inflight_groups=loads[e.engine_id].groups,
                    inflight_samples=loads[e.engine_id].samples,
                    outstanding_tokens=loads[e.engine_id].outstanding_tokens,
                    capacity_samples=e.capacity_samples,
                    last_error=e.last_error,
                    predicted_outstanding_tokens=loads[e.engine_id].predicted_outstanding,
                    weights_path=e.weights[0],
                    weights_version=e.weights[1],
                    loading_weights=e.loading_weights,
                    restarts=e.restarts,
                    model="" if e.info is None else e.info.model,
                    dtype="" if e.info is None else e.info.dtype,
                )
                for e in self._engines.values()
            ],
            fleet_weights_path="" if self._weights is None else self._weights.path,
            fleet_weights_version=0 if self._weights is None else self._weights.version,
            publishes_awaiting_counts=len(self._questions()),
            earlier_outputs_sent=c.earlier_outputs_sent,
            earlier_outputs_pushed=c.earlier_outputs_pushed,
            stream_entries_trimmed=c.stream_entries_trimmed,
            runs=self._run_statuses(),
        )

    def _run_statuses(self) -> list[pb.RunStatus]:
        """Each run with groups queued or running, by run id."""
        runs: dict[str, pb.RunStatus] = {}

        def of(run_id: str) -> pb.RunStatus:
            found = runs.get(run_id)
            if found is None:
                found = runs[run_id] = pb.RunStatus(run_id=run_id)
            return found

        for key in self._queue:
            record = self._groups[key]
            run = of(record.spec.run_id)
            run.queued_groups += 1
            run.queued_samples += record.pending_count
        for calls in self._calls.values():
            samples = sum(len(call.running()) for call in calls.values())
            if samples:
                run = of(next(iter(calls.values())).record.spec.run_id)
                run.running_groups += 1
                run.running_samples += samples
        return [runs[run_id] for run_id in sorted(runs)]

    # ------------------------------------------------------------ queue and dispatch

    def _with_epoch(self, spec: GroupSpec) -> GroupSpec:
        """The spec with its epoch: the given one, else one more than the last epoch its
        prompt_key was learnt in, else the predictor's newest epoch (a key never seen)."""
        if spec.epoch is not None:
            return spec
        last = self._predictor.last_epoch(spec.prompt_key) if spec.prompt_key else None
        epoch = self._predictor.epoch if last is None else last + 1
        return dataclasses.replace(spec, epoch=epoch)

    def _enqueue(self, spec: GroupSpec) -> None:
        spec = self._with_epoch(spec)
        self._seq += 1
        self._groups[spec.key] = GroupRecord.new(spec, self._seq)
        self._held_prompt_tokens += len(spec.prompt_token_ids)
        self._queue[spec.key] = None

    def _priority_bases(self) -> tuple[dict[str, int], int]:
        """Per run, what its priorities count from: the lowest of its queued groups', or
        with none queued, the highest of its running groups' (its newest work: what runs
        of earlier steps stays more urgent). Priorities order a run's own groups; counted
        so, runs share the engines on equal terms (a trainer whose step numbers are its
        priorities, as ``StepBatcher`` submits, does not go before one further on). With
        them, how many runs have groups queued (the first that many of the bases)."""
        bases: dict[str, int] = {}
        for key in self._queue:
            spec = self._groups[key].spec
            base = bases.get(spec.run_id)
            if base is None or spec.priority < base:
                bases[spec.run_id] = spec.priority
        running: dict[str, int] = {}
        for calls in self._calls.values():
            for call in calls.values():
                spec = call.record.spec
                if spec.run_id not in bases:
                    base = running.get(spec.run_id)
                    if base is None or spec.priority > base:
                        running[spec.run_id] = spec.priority
        return bases | running, len(bases)

    def _loads(
        self, predict: bool = True, bases: dict[str, int] | None = None
    ) -> dict[str, EngineLoad]:
        """Per engine, what its running samples hold and (with ``predict``) are predicted
        still to generate; without it the predicted fields stay 0 (unknown). With
        ``bases``, priorities are counted from their runs' (``_priority_bases``)."""
        loads = {engine_id: EngineLoad() for engine_id in self._engines}
        groups: dict[str, set[str]] = {engine_id: set() for engine_id in self._engines}
        for key, calls in self._calls.items():
            for call in calls.values():
                load = loads.get(call.engine.engine_id)
                running = call.running()
                if load is None or not running:
                    continue
                groups[call.engine.engine_id].add(key)
                spec = call.record.spec
                priority = spec.priority - (bases or {}).get(spec.run_id, 0)
                if load.urgent_priority is None or priority < load.urgent_priority:
                    load.urgent_priority = priority
                for index in running:
                    progress = len(call.record.samples[index].token_ids)
                    load.samples += 1
                    load.outstanding_tokens += max(0, spec.sampling.max_tokens - progress)
                    load.kv_used_tokens += len(spec.prompt_token_ids) + progress
                    if predict:
                        predicted = self._predict_running(call.record, progress)
                        left = max(0.0, predicted - progress)
                        load.predicted_outstanding += left
                        load.predicted_longest = max(load.predicted_longest, left)
        for engine_id, keys in groups.items():
            loads[engine_id].groups = len(keys)
        return loads

    def _predict_running(self, record: GroupRecord, progress: int) -> float:
        """Predicted length of a running sample that has generated ``progress`` tokens.

        Every plan predicts every running sample, whose progress moves between plans; the
        group's fit (its prompt's history and finished siblings) is kept until the group
        or the predictor's stamp of its prompt changes, and only the cheap conditioning on
        progress is redone."""
        spec = record.spec
        stamp = (
            *self._predictor.stamp(spec.prompt_key, len(spec.prompt_token_ids)),
            record.revision,
        )
        cached = self._fits.get(spec.key)
        if cached is None or cached[0] != stamp:
            fit = self._predictor.fit(
                spec.prompt_key, len(spec.prompt_token_ids), record.finished_lengths()
            )
            cached = self._fits[spec.key] = (stamp, fit)
        return min(cached[1].mean_above(progress), float(spec.sampling.max_tokens))

    def _predict_queued(self, record: GroupRecord) -> float:
        """Predicted length of a queued sample of the group, from its prompt's history, its
        finished siblings and its running siblings' furthest progress (a lower bound)."""
        spec = record.spec
        if record.untouched:
            finished: tuple[int, ...] = ()
            furthest = 0
        else:
            finished = record.finished_lengths()
            furthest = max(record.running_progress(), default=0)
        prompt_len = len(spec.prompt_token_ids)
        stamp = (*self._predictor.stamp(spec.prompt_key, prompt_len), len(finished), furthest)
        cached = self._predicted.get(spec.key)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        if stamp[2:] == (-1, 0, 0):
            # Nothing of its own (a prompt not seen yet, in a first epoch most of the
            # queue): the prior of its prompt length's bucket, alike for all such groups.
            bucket = prompt_len.bit_length()
            prior = self._prior_means.get(bucket)
            if prior is None or prior[0] != stamp[:2]:
                mean = self._predictor.predict(spec.prompt_key, prompt_len).mean
                prior = self._prior_means[bucket] = (stamp[:2], mean)
            mean = prior[1]
        else:
            mean = self._predictor.predict(
                spec.prompt_key, prompt_len, finished, (furthest,) if furthest else ()
            ).mean
        value = min(mean, float(spec.sampling.max_tokens))
        self._predicted[spec.key] = (stamp, value)
        return value

    def snapshot(self) -> Snapshot:
        """What the policy would be shown if it planned now."""
        # Predictions cost a predictor call per queued group and running sample at every
        # plan: only for a policy that reads them.
        predict = self._policy.uses_predictions
        bases, queued_runs = self._priority_bases()
        turns = self._turns(list(bases)[:queued_runs])
        # A deep queue is mostly untouched groups, whose prediction can only have changed
        # with their prompt's history, the prior's generation or their prompt length's
        # bucket's: the others keep theirs.
        moved, stale = self._prior_moved()
        relearnt, self._relearnt = self._relearnt, set()
        queue = []
        for key in self._queue:
            record = self._groups[key]
            cached = self._views.get(key)
            if not predict:
                predicted = None
            elif (
                cached is not None
                and not moved
                and (not stale or len(record.spec.prompt_token_ids).bit_length() not in stale)
                and cached[0] is record
                and cached[1] == record.revision
                and record.untouched
                and record.spec.prompt_key not in relearnt
            ):
                predicted = cached[2]
            else:
                predicted = self._predict_queued(record)
            priority = record.spec.priority - bases[record.spec.run_id]
            turn = turns.get(key, _FIRST_TURN)
            if cached is not None and cached[0] is record and cached[1] == record.revision:
                view = cached[3]  # its samples as they were: only what is told apart may move
                if view.priority != priority or view.turn != turn or cached[2] != predicted:
                    view = view.relabelled(priority, turn, predicted)
                    self._views[key] = (record, record.revision, predicted, view)
                queue.append(view)
                continue
            view = self._queued_view(record, predicted, priority, turn)
            self._views[key] = (record, record.revision, predicted, view)
            queue.append(view)
        loads = self._loads(predict, bases)
        engines = tuple(e.view(loads[engine_id]) for engine_id, e in self._engines.items())
        running = self._running_samples(predict, bases) if self._policy.moves_running else ()
        return Snapshot(tuple(queue), engines, now=time.monotonic(), running=running)

    def _prior_moved(self) -> tuple[bool, set[int]]:
        """Since the last snapshot: whether the predictor's prior began a new generation
        (every prediction may have moved), else the prompt-length buckets that did."""
        generations = self._predictor.generations
        seen, self._seen_generations = self._seen_generations, generations
        if generations == seen:
            return False, set()
        buckets = self._predictor.bucket_generations()
        before, self._seen_buckets = self._seen_buckets, buckets
        if generations[0] != seen[0]:
            return True, set()
        return False, {b for b, g in buckets.items() if before.get(b) != g}

    def _turns(self, runs: Collection[str]) -> dict[str, tuple[int, int]]:
        """Each queued group's fair-share turn (``core.fairshare``), ``runs`` being those
        with groups queued; empty (all (0, 0)) with fair share off, or while fewer than
        two runs have groups queued."""
        if not self.settings.fair_share:
            return {}
        if len(runs) < 2:
            self._share.active(runs)
            return {}
        slots = sum(e.capacity_samples for e in self._engines.values() if e.healthy)
        waiting = []
        kept = self._waiting
        for key in self._queue:
            record = self._groups[key]
            known = kept.get(key)
            if known is None or known[0] is not record or known[1] != record.revision:
                spec = record.spec
                pending = record.pending_count
                entry = Waiting(key, spec.run_id, spec.priority, record.seq, pending)
                known = kept[key] = (record, record.revision, entry)
            waiting.append(known[2])
        running: dict[str, int] = {}
        for calls in self._calls.values():
            for call in calls.values():
                run_id = call.record.spec.run_id
                running[run_id] = running.get(run_id, 0) + len(call.running())
        return self._share.turns(waiting, slots, running)

    @staticmethod
    def _queued_view(
        record: GroupRecord, predicted: float | None, priority: int, turn: tuple[int, int]
    ) -> QueuedGroup:
        spec = record.spec
        if record.untouched:  # all queued, none with tokens: its samples go unread
            pending: tuple[int, ...] = ()
            progress: tuple[int, ...] = ()
        else:
            pending = record.pending
            progress = record.progress(pending)
        return QueuedGroup(
            key=spec.key,
            n=spec.n,
            prompt_len=len(spec.prompt_token_ids),
            max_tokens=spec.sampling.max_tokens,
            priority=priority,
            seq=record.seq,
            turn=turn,
            run_id=spec.run_id,
            prompt_key=spec.prompt_key,
            samples=pending if len(pending) < spec.n else (),
            prompt_token_ids=spec.prompt_token_ids,
            predicted_len=predicted,
            progress=progress if any(progress) else (),
        )

    def _running_samples(self, predict: bool, bases: dict[str, int]) -> tuple[RunningSample, ...]:
        """Every running sample a policy may preempt (not those being preempted already);
        with ``predict``, with its predicted tokens left."""
        out: list[RunningSample] = []
        for key, calls in self._calls.items():
            for call in calls.values():
                record, spec = call.record, call.record.spec
                for index in call.running():
                    if index in call.stopping:
                        continue
                    sample = record.samples[index]
                    progress = len(sample.token_ids)
                    predicted = self._predict_running(record, progress) if predict else 0.0
                    out.append(
                        RunningSample(
                            group_key=key,
                            index=index,
                            engine_id=call.engine.engine_id,
                            prompt_len=len(spec.prompt_token_ids),
                            max_tokens=spec.sampling.max_tokens,
                            progress=progress,
                            predicted_left=max(0.0, predicted - progress),
                            preemptions=sample.preemptions,
                            priority=spec.priority - bases.get(spec.run_id, 0),
                            prompt_key=spec.prompt_key,
                        )
                    )
        return tuple(out)

    async def _dispatch_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._lease_sure()
            if not self._queue:
                self._share.active(())  # (no run waits: those that come start level)
            # A policy that moves running work plans whenever something runs: a finished
            # sample may leave a slot that a running one should move to.
            if not self._queue and not (self._policy.moves_running and self._calls):
                continue
            # A policy places only where a slot is free: with none anywhere (and nothing
            # it may move), a plan could start nothing.
            if not self._policy.moves_running and not any(
                room > 0 and self._engines[engine_id].healthy
                for engine_id, room in self._room().items()
            ):
                continue
            began = time.perf_counter()
            plan = self._policy.plan(self.snapshot())
            if plan.assignments:
                self._look_at_tags()
            spent = 0.0
            for first in range(0, len(plan.assignments), _STARTS_PER_TURN):
                if first:
                    # The calls started so far build and send their requests in the loop's
                    # next turn, and a plan can start thousands (a fleet's slots at a step's
                    # start): at once they held the loop for seconds, while the lease's
                    # renewal and the API's answers waited. So a turn at a time; what changed
                    # meanwhile (a group cancelled, an engine down) is not started.
                    spent += time.perf_counter() - began
                    await asyncio.sleep(0)
                    await self._lease_sure()
                    began = time.perf_counter()
                for assign in plan.assignments[first : first + _STARTS_PER_TURN]:
                    self._carry_out(assign, planned_now=not first)
            if plan.preempts:
                room = self._room()
                for preempt in plan.preempts:
                    self._preempt(preempt, room)
            spent += time.perf_counter() - began
            self.plan_seconds.observe(spent)
            pace = plan_pace(spent, self.settings)
            if pace:
                await asyncio.sleep(pace)

    def _carry_out(self, assign: Assign, planned_now: bool = True) -> None:
        """Starts the call ``assign`` asks for, or logs why it cannot be: an error when it
        was planned in this turn of the loop, a note when turns have passed since (its
        group may have ended, its engine gone out of service)."""
        record = self._groups.get(assign.group_key)
        engine = self._engines.get(assign.engine_id)
        pending = record.pending if record is not None else ()
        indices = assign.samples or pending
        if (
            record is None
            or engine is None
            or not engine.healthy
            or not indices
            or len(set(indices)) != len(indices)
            or not set(indices) <= set(pending)
        ):
            log.log(
                logging.ERROR if planned_now else logging.DEBUG,
                "policy %s planned an impossible %s (queued samples: %s)",
                self._policy.name,
                assign,
                list(pending),
            )
            return
        fresh = tuple(i for i in indices if not record.samples[i].token_ids)
        if fresh:
            self._start(record, engine, fresh)
        for index in indices:
            if record.samples[index].token_ids:  # resumes: a prompt of its own, a call of its own
                self._start(record, engine, (index,))

    def _start(self, record: GroupRecord, engine: EngineHandle, indices: Sequence[int]) -> None:
        """Starts one call of queued samples ``indices``: samples with no tokens yet, or one
        sample that resumes with the tokens it kept."""
        key = record.spec.key
        resumed = tuple(record.samples[indices[0]].token_ids) if len(indices) == 1 else ()
        assert len(indices) == 1 or not any(record.progress(indices)), "resumes run alone"
        record.start(indices, engine.engine_id)
        self._share.started(record.spec.run_id, len(indices))
        if not record.pending:
            del self._queue[key]
        self._calls_started += 1
        call = _Call(
            f"{key}#{self._boot}.{self._calls_started}",
            record,
            engine,
            tuple(indices),
            resumed,
            tag=self._engine_tag(record, len(indices)),
        )
        task = asyncio.create_task(self._run_call(call), name=f"call {call.request_id}")
        call.task = task
        self._calls.setdefault(key, {})[call.request_id] = call
        self._tasks.add(task)
        task.add_done_callback(self._call_ended)

    def _look_at_tags(self) -> None:
        """Notes, before calls start, what their tags count from (``EngineTags``): the least
        tag of the calls in flight (None when none is), and the fleet's slots. Nothing to
        note without fair share (every tag 0)."""
        if not self.settings.fair_share:
            return
        self._oldest_tag = min(
            (call.tag for calls in self._calls.values() for call in calls.values()),
            default=None,
        )
        self._tag_window = sum(e.capacity_samples for e in self._engines.values() if e.healthy)

    def _engine_tag(self, record: GroupRecord, samples: int) -> int:
        """The place in the engines' queues of a call of ``samples`` samples of ``record``
        (``EngineTags``): its group's first call's; 0 (arrival order) without fair share."""
        if not self.settings.fair_share:
            return 0
        tag = self._tags.tag(record.spec.run_id, samples, self._oldest_tag, self._tag_window)
        # (the least: the group's first tag, unless the counters started again since)
        sent = tag if record.engine_tag is None else min(record.engine_tag, tag)
        record.engine_tag = sent
        if self._oldest_tag is None:
            self._oldest_tag = sent  # (in flight from now on)
        return sent

    def _room(self) -> dict[str, int]:
        """Per engine, the samples it can take before it is at capacity."""
        room = {engine_id: e.capacity_samples for engine_id, e in self._engines.items()}
        for calls in self._calls.values():
            for call in calls.values():
                if call.engine.engine_id in room:
                    room[call.engine.engine_id] -= len(call.running())
        return room

    def _preempt(self, preempt: Preempt, room: dict[str, int]) -> None:
        """Sends the Abort ``preempt`` asks for, or logs why it cannot be. A sample moving to
        another engine takes its room there (in ``room``) for the rest of the plan."""
        call = self._running_call(preempt)
        problem = next(self._preempt_problems(preempt, call, room), "")
        if call is None or problem:
            log.error(
                "policy %s planned an impossible %s: %s",
                self._policy.name,
                preempt,
                problem,
            )
            return
        if preempt.to_engine:
            room[preempt.to_engine] -= 1
        call.stopping[preempt.index] = preempt.to_engine
        task = asyncio.create_task(
            self._abort(call, preempt.index), name=f"abort {call.request_id}/{preempt.index}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._call_ended)

    def _running_call(self, preempt: Preempt) -> _Call | None:
        """The call in which the sample ``preempt`` names runs on the engine it names."""
        for call in self._calls.get(preempt.group_key, {}).values():
            if call.engine.engine_id == preempt.engine_id and preempt.index in call.running():
                return call
        return None

    def _preempt_problems(
        self, preempt: Preempt, call: _Call | None, room: dict[str, int]
    ) -> Iterator[str]:
        """Why ``preempt`` cannot be carried out, most basic first; nothing when it can."""
        if call is None:
            yield f"no sample {preempt.index} of that group runs on {preempt.engine_id}"
        elif preempt.index in call.stopping:
            yield "that sample is being preempted already"
        target = preempt.to_engine
        if target and target not in self._engines:
            yield f"engine {target} is unknown"
        elif target and not self._engines[target].healthy:
            yield f"engine {target} is unhealthy"
        elif target and room[target] < 1:
            yield f"engine {target} has no room"

    async def _abort(self, call: _Call, index: int) -> None:
        """Asks the engine to stop sample ``index`` of ``call``; its Complete comes on the
        call's stream. Best effort: if the Abort fails, the sample runs on and ends there
        (or, if the engine carried it out after all, waits in the queue)."""
        try:
            found = await call.engine.abort(call.request_id, (index,), _ABORT_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "aborting sample %d of call %s on %s: %s: %s; it runs on",
                index,
                call.request_id,
                call.engine.engine_id,
                exc.code().name,
                exc.details(),
            )
            # (Taken as not done, its aborted Complete ended the sample short, as if the
            # engine had stopped it for good: a truncated sample delivered.)
            call.abort_unanswered.add(index)
            found = False
        if not found:  # it runs on (or the call ended): it may be preempted again later
            call.stopping.pop(index, None)

    def _call_ended(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        _log_crash(task)

    def _forget(self, call: _Call) -> None:
        key = call.record.spec.key
        calls = self._calls.get(key)
        if calls is not None and calls.get(call.request_id) is call:
            del calls[call.request_id]
            if not calls:
                del self._calls[key]

    async def _run_call(self, call: _Call) -> None:
        try:
            await self._attempt(call)
        except (asyncio.CancelledError, LeaseLost):
            raise
        except Exception as exc:  # a bug: the group fails with the reason, it does not hang
            log.exception("call %s failed in the scheduler", call.request_id)
            await self._end(call.record, f"the scheduler failed its call: {exc!r}")
        finally:
            # Leave _calls in the same step as the call's last state change (no await in
            # between), so no other task ever sees it running after it has ended.
            self._forget(call)
            self._wake.set()  # room on an engine

    async def _attempt(self, call: _Call) -> None:
        record, engine = call.record, call.engine
        resumption = record.samples[call.indices[0]].preemptions if call.resumed else 0
        earlier = self._earlier_outputs(call)
        stream = engine.generate(
            record.spec,
            call.request_id,
            call.indices,
            call.resumed,
            resumption,
            priority=call.tag,
            earlier_outputs=earlier,
        )
        try:
            await self._consume(call, stream)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _REJECTIONS:
                if self._outputs is not None:  # refused before the engine took them
                    self._outputs.release(record.spec.prompt_token_ids, engine.engine_id, earlier)
                await self._end(record, f"engine {engine.engine_id} rejected it: {exc.details()}")
                return
            await self._engine_down(engine, f"{exc.code().name}: {exc.details()}")
        except _Rejected as exc:
            await self._end(record, f"engine {engine.engine_id} rejected it: {exc}")
            return
        except _BadOutput as exc:
            await self._end(record, f"engine {engine.engine_id} sent unusable output: {exc}")
            return
        except _EngineFault as exc:
            await self._engine_down(engine, str(exc))
        except _CallFailed as exc:
            failed = engine.call_failed(time.monotonic(), _CALL_FAILURES_WINDOW_S)
            if failed < _CALL_FAILURES:
                await self._requeue_call(call, f"engine {engine.engine_id}: {exc}")
                return
            await self._engine_down(
                engine, f"{exc} ({failed} calls failed so within {_CALL_FAILURES_WINDOW_S:g} s)"
            )
        finally:
            if not stream.done():
                stream.cancel()
        if record.all_finished:  # this call finished the group's last sample
            await self._end(record)

    async def _requeue_call(self, call: _Call, reason: str) -> None:
        """The call's unfinished samples go back to the queue, its engine left in service;
        the group ends if one of them ran out of attempts."""
        self._forget(call)
        ending = self._requeue(call, reason)
        self._wake.set()
        if ending is not None:
            await self._end(ending.record, ending.error)

    def _earlier_outputs(self, call: _Call) -> list[array[int]]:
        """The outputs of the call's prompt its engine lacks, where it drafts from them (a
        resumed sample's prompt holds its partial response: it drafts from its own tokens)."""
        info = call.engine.info
        if self._outputs is None or call.resumed or info is None or not info.takes_earlier_outputs:
            return []
        outputs = self._outputs.missing(
            call.record.spec.prompt_token_ids, call.engine.engine_id, MAX_EARLIER_OUTPUT_TOKENS
        )
        self.counters.earlier_outputs_sent += len(outputs)
        return outputs

    def _keep_output(self, call: _Call, index: int, reason: FinishReason) -> None:
        """A sample finished: its output is kept for engines that draft from it, as held by
        the call's engine where it made the output whole, and pushed to the engines that run
        the group's other samples."""
        if self._outputs is None or not self._outputs_taken or reason is FinishReason.ABORT:
            return  # (none kept while no engine drafts from them)
        record = call.record
        self._outputs.finished(
            record.spec.prompt_token_ids,
            record.samples[index].token_ids,
            None if call.resumed else call.engine.engine_id,
        )
        if self.settings.earlier_outputs_push:
            self._push_outputs(record.spec.key, call.engine)

    def _push_outputs(self, key: str, source: EngineHandle) -> None:
        """Marks the group's outputs due to each other engine that drafts from them and runs
        samples of the group started from its prompt (a resumed one drafts from its own
        tokens), and starts that engine's pusher unless it runs."""
        for call in self._calls.get(key, {}).values():
            engine = call.engine
            info = engine.info
            if (
                engine is source
                or call.resumed
                or not engine.healthy
                or info is None
                or not info.takes_earlier_outputs
                or not call.running()
            ):
                continue
            self._push_due.setdefault(engine.engine_id, set()).add(key)
            running = self._pushers.get(engine.engine_id)
            if running is None or running.done():  # (one that has just returned is done)
                task = asyncio.create_task(self._pusher(engine), name=f"push {engine.engine_id}")
                self._pushers[engine.engine_id] = task
                task.add_done_callback(functools.partial(self._pusher_ended, engine.engine_id))

    async def _pusher(self, engine: EngineHandle) -> None:
        """Sends the engine the outputs it lacks of the groups it runs whose samples finished
        elsewhere, all in one AddOutputs call, at most once every
        ``earlier_outputs_push_interval_s`` (each such call pauses a vLLM engine for about a
        step: ``rollserve bench push-cost``). Drafts are an optimisation: a failed send is
        logged (the engine's calls and probes tell whether it is down)."""
        assert self._outputs is not None
        interval = self.settings.earlier_outputs_push_interval_s
        engine_id = engine.engine_id
        while self._push_due.get(engine_id):
            wait = self._pushed_at.get(engine_id, -math.inf) + interval - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            due = self._push_due.pop(engine_id, set())
            prompts: list[tuple[Sequence[int], list[array[int]]]] = []
            room, count = MAX_EARLIER_OUTPUT_TOKENS, MAX_EARLIER_OUTPUTS
            for key in due:
                calls = self._calls.get(key, {}).values()
                if not any(c.engine is engine and not c.resumed and c.running() for c in calls):
                    continue  # its samples there have ended meanwhile
                if room <= 0 or count <= 0:  # the next call's
                    self._push_due.setdefault(engine_id, set()).add(key)
                    continue
                prompt = next(iter(calls)).record.spec.prompt_token_ids
                outputs = self._outputs.missing(prompt, engine_id, room, max_outputs=count)
                if outputs:
                    prompts.append((prompt, outputs))
                    room -= sum(len(o) for o in outputs)
                    count -= len(outputs)
            if not prompts:
                continue
            sent = MAX_EARLIER_OUTPUTS - count
            self.counters.earlier_outputs_pushed += sent
            self._pushed_at[engine_id] = time.monotonic()
            try:
                await engine.add_outputs(prompts, self.settings.health_timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _UNDELIVERED:  # a later push or call sends them again
                    for refused, outputs in prompts:
                        self._outputs.release(refused, engine_id, outputs)
                log.info(
                    "engine %s did not take %d outputs of %d groups: %s: %s",
                    engine_id,
                    sent,
                    len(prompts),
                    exc.code().name,
                    exc.details(),
                )

    def _pusher_ended(self, engine_id: str, task: asyncio.Task[None]) -> None:
        if self._pushers.get(engine_id) is task:
            del self._pushers[engine_id]
        _log_crash(task)

    def _stamps(self, run_id: str) -> bool:
        """Whether the run's tokens are labelled by the engines' weights (it publishes the
        fleet's weights)."""
        return self._stamping is not None and self._stamping[0] == run_id

    def _token_version(self, run_id: str, weights_version: int) -> int:
        """The policy version of tokens an engine made with weights of ``weights_version``:
        that version where the run publishes the fleet's weights and the engine serves some
        it published, else the run's version when the tokens arrive (the trainer updates the
        engines itself, or they serve weights from before the run published any: its own, or
        another run's, of any version), which the sample's ``made_before`` may lower when it
        is delivered."""
        stamping = self._stamping
        if stamping is not None and stamping[0] == run_id:
            _, since, upto = stamping
            if since <= weights_version <= upto:
                return weights_version
        return self._versions.get(run_id, 0)

    async def _consume(self, call: _Call, stream: AsyncIterable[pb.GenerateResponse]) -> None:
        record = call.record
        run_id = record.spec.run_id
        async for message in stream:
            kind = message.WhichOneof("kind")
            if kind == "chunk":
                for delta in message.chunk.deltas:
                    self._check_tokens(call, delta.index, delta.token_ids, delta.logprobs)
                    version = self._token_version(run_id, delta.weights_version)
                    record.add_tokens(
                        delta.index, list(delta.token_ids), list(delta.logprobs), version
                    )
            elif kind == "complete":
                done = message.complete
                self._check_tokens(call, done.index, done.token_ids, done.logprobs)
                self._check_prompt_counts(call, done)
                version = self._token_version(run_id, done.weights_version)
                record.add_tokens(done.index, list(done.token_ids), list(done.logprobs), version)
                record.add_spec(
                    done.index, done.spec_draft_tokens, done.spec_accepted_tokens, done.spec_drafts
                )
                reason = _FINISH_REASONS.get(done.finish_reason, FinishReason.ABORT)
                # A finished or preempted sample frees its slot on the engine even while its
                # siblings run: plan again now, or the batch thins out behind long samples.
                self._wake.set()
                to_engine = call.stopping.pop(done.index, None)
                if to_engine is None and done.index in call.abort_unanswered:
                    to_engine = ""  # the engine did carry out an Abort it did not answer
                if to_engine is not None and reason is FinishReason.ABORT:
                    sample = record.samples[done.index]
                    if len(sample.token_ids) < record.spec.sampling.max_tokens:
                        self._preempted(call, done.index, to_engine)
                        continue
                    reason = FinishReason.LENGTH  # stopped with nothing left to generate
                record.finish_sample(
                    done.index, reason, done.num_prompt_tokens, done.num_cached_tokens
                )
                self._keep_output(call, done.index, reason)
                if record.spec.stream_samples:
                    self._stream_sample(record, done.index)
            elif kind == "error":
                if message.error.retryable:
                    raise _CallFailed(f"engine error: {message.error.message}")
                raise _Rejected(message.error.message)
        if call.running():
            raise _EngineFault("the stream ended before every sample finished")

    def _ask_made(self, run_id: str, version: int) -> None:
        """A publish without weights has moved the run on from ``version``: every token of
        its running samples counts as ``version`` until their engines say how many each had
        made (an engine sends tokens in batches, and vLLM holds some back); those made
        after count as they arrived. The question runs in the background, after the run's
        earlier ones, so the trainer does not wait for busy engines to answer."""
        asked: dict[str, list[tuple[_Call, int, MadeBefore]]] = {}
        for group in self._calls.values():
            for call in group.values():
                if call.record.spec.run_id != run_id:
                    continue
                for index in call.running():
                    sample = call.record.samples[index]
                    made = MadeBefore(version, start=len(sample.token_ids))
                    sample.made_before.append(made)
                    asked.setdefault(call.engine.engine_id, []).append((call, index, made))
        if not asked:
            return
        asking = self._asking.setdefault(run_id, [])
        previous = asking[-1] if asking else None
        task = asyncio.create_task(
            self._hear_made(run_id, version, asked, previous), name=f"made under {version}"
        )
        asking.append(task)
        task.add_done_callback(functools.partial(self._question_ended, run_id))

    def _questions(self) -> list[asyncio.Task[None]]:
        return [task for tasks in self._asking.values() for task in tasks]

    def _question_ended(self, run_id: str, task: asyncio.Task[None]) -> None:
        asking = self._asking.get(run_id, [])
        if task in asking:
            asking.remove(task)
        if not asking:
            self._asking.pop(run_id, None)
        _log_crash(task)

    async def _hear_made(
        self,
        run_id: str,
        version: int,
        asked: dict[str, list[tuple[_Call, int, MadeBefore]]],
        previous: asyncio.Task[None] | None,
    ) -> None:
        try:
            if previous is not None:  # counts must come in the order of the publishes
                await asyncio.wait({previous})
            await self._count_made(run_id, version, asked)
        finally:  # whatever stopped it, no sample's tokens stay the old version for good
            for entries in asked.values():
                for _, _, made in entries:
                    if made.end is None:
                        made.end = made.start

    async def _count_made(
        self, run_id: str, version: int, asked: dict[str, list[tuple[_Call, int, MadeBefore]]]
    ) -> None:
        engines = [entries[0][0].engine for entries in asked.values()]
        replies = await asyncio.gather(
            *(e.stats(self.settings.health_timeout_s, with_progress=True) for e in engines),
            return_exceptions=True,
        )
        for engine, reply in zip(engines, replies, strict=True):
            counts: dict[tuple[str, int], int] = {}
            if isinstance(reply, BaseException):
                log.warning(
                    "engine %s did not say what the samples of run %r made under version %d "
                    "(%s): their tokens since that publish are labelled as they came",
                    engine.engine_id,
                    run_id,
                    version,
                    reply,
                )
            else:
                counts = {(p.request_id, p.index): p.tokens for p in reply.progress}
            for call, index, made in asked[engine.engine_id]:
                self._settle(call, index, made, counts.get((call.request_id, index)))

    def _settle(self, call: _Call, index: int, made: MadeBefore, tokens: int | None) -> None:
        """Sets where ``made`` ends: at the engine's count ``tokens`` of sample ``index``;
        without one, at the publish if the sample still runs in ``call`` (the engine keeps
        no count or did not answer), else at what the sample has (it ended first: as for a
        sample delivered before the answer, every token since the publish is old)."""
        sample = call.record.samples[index]
        if not any(m is made for m in sample.made_before):
            return  # it restarted from scratch
        key = call.record.spec.key
        if tokens is not None:
            made.end = max(made.start, len(call.resumed) + tokens)
        elif self._calls.get(key, {}).get(call.request_id) is call and index in call.running():
            made.end = made.start  # its engine keeps no count: labelled as they came
        else:  # it ended before its engine counted: every token it made in the call is old
            # (one that left preempted may have more since, from the call that resumed it)
            made.end = call.preempted.get(index, len(sample.token_ids))

    def _preempted(self, call: _Call, index: int, to_engine: str) -> None:
        """Sample ``index`` of ``call`` stopped with its tokens kept: it leaves the call and
        resumes on ``to_engine`` if that is still healthy with room, else waits queued."""
        record = call.record
        call.preempted[index] = len(record.samples[index].token_ids)
        record.preempt(index)
        self.counters.samples_preempted += 1
        self._queue[record.spec.key] = None
        if not to_engine:
            return
        target = self._engines.get(to_engine)
        if target is not None and target.healthy and self._room()[to_engine] > 0:
            self._look_at_tags()
            self._start(record, target, (index,))
            return
        log.warning(
            "preempted sample %d of %s waits in the queue: engine %s is gone, unhealthy or full",
            index,
            record.spec.key,
            to_engine,
        )

    @staticmethod
    def _check_logprobs(call: _Call, index: int, logprobs: Sequence[float]) -> None:
        """A NaN or infinite logprob would poison a trainer's update and cannot be written to
        the stream's JSON: the group fails with the reason instead of reaching the trainer."""
        offset = first_non_finite(logprobs)
        if offset is not None:
            first = len(call.record.samples[index].token_ids)
            raise _BadOutput(
                f"a logprob of {logprobs[offset]} for token {first + offset} of sample "
                f"{index}; logprobs must be finite numbers"
            )

    def _check_tokens(
        self, call: _Call, index: int, token_ids: Sequence[int], logprobs: Sequence[float]
    ) -> None:
        """What an engine sent of a sample keeps the Engine API's contract, or the call ends
        as the engine's fault (the engine goes out of service; the group runs elsewhere):
        a running sample of the call, one logprob a token, ids in the engine's vocabulary,
        no more tokens than the group's max_tokens. A logprob that is no finite number
        fails the group (``_check_logprobs``)."""
        self._check_running(call, index)
        sample = call.record.samples[index]
        if len(logprobs) != len(token_ids):
            raise _EngineFault(
                f"{len(token_ids)} tokens with {len(logprobs)} logprobs for sample {index} of "
                f"call {call.request_id}; the Engine API sends one logprob a token"
            )
        most = call.record.spec.sampling.max_tokens
        if len(sample.token_ids) + len(token_ids) > most:
            raise _EngineFault(
                f"{len(sample.token_ids) + len(token_ids)} tokens for sample {index} of call "
                f"{call.request_id}, past its max_tokens ({most})"
            )
        info = call.engine.info
        vocab = info.vocab_size if info is not None else 0
        if token_ids and (min(token_ids) < 0 or (vocab > 0 and max(token_ids) >= vocab)):
            wrong = next(t for t in token_ids if t < 0 or 0 < vocab <= t)
            raise _EngineFault(
                f"token id {wrong} for sample {index} of call {call.request_id}, outside the "
                f"engine's vocabulary ({vocab or 'of unknown size'})"
            )
        self._check_logprobs(call, index, logprobs)

    @staticmethod
    def _check_prompt_counts(call: _Call, done: pb.Complete) -> None:
        prompt, cached = done.num_prompt_tokens, done.num_cached_tokens
        longest = len(call.record.spec.prompt_token_ids) + call.record.spec.sampling.max_tokens
        if not (0 <= cached <= prompt <= longest):
            raise _EngineFault(
                f"sample {done.index} of call {call.request_id} says its prompt had {prompt} "
                f"tokens, {cached} of them cached: the prompt (a resumed sample's with its "
                f"tokens) is at most {longest}, and no more are cached than it has"
            )

    @staticmethod
    def _check_running(call: _Call, index: int) -> None:
        if (
            index not in call.indices
            or index in call.preempted
            or call.record.samples[index].state != SampleState.RUNNING
        ):
            raise _EngineFault(
                f"sample index {index} is not a running sample of call {call.request_id} "
                f"(its samples: {list(call.indices)})"
            )

    # ------------------------------------------------------------ endings

    def _retire(self, record: GroupRecord) -> bool:
        """Takes the group out of memory (queue, calls, cached prediction) and cancels its
        calls but the current task's; False if it was already out. Never awaits, so the
        group has exactly one ending."""
        key = record.spec.key
        if self._groups.get(key) is not record:
            return False
        del self._groups[key]
        self._held_prompt_tokens -= len(record.spec.prompt_token_ids)
        self._queue.pop(key, None)
        self._predicted.pop(key, None)
        self._fits.pop(key, None)
        self._views.pop(key, None)
        self._waiting.pop(key, None)
        current = asyncio.current_task()
        for call in self._calls.pop(key, {}).values():
            if call.task is not None and call.task is not current:
                call.task.cancel()  # the engine aborts the work
        return True

    async def _end(self, record: GroupRecord, error: str = "") -> None:
        """Ends the group unless another task did: delivers it, or its failure."""
        if self._retire(record):
            with self._holding_writes(record.spec):
                await self._write_ending(_Ending(record, error))

    def _holding_writes(self, spec: GroupSpec) -> contextlib.ExitStack:
        """Counts a retired group's ending as a write of its run in progress, from its
        retirement (no await between) to its write: a DeleteRun waits for it, where it would
        have landed after a new Submit of the same group id and ended the new group."""
        holding = contextlib.ExitStack()
        holding.enter_context(self._work(self._writing, spec.run_id))
        self._ending.add(spec.key)
        holding.callback(self._ending.discard, spec.key)
        return holding

    async def _write_ending(self, ending: _Ending) -> None:
        """Writes a retired group's entry to its run's stream, exactly once; the caller holds
        it as a write in progress (``_holding_writes``)."""
        record, error = ending.record, ending.error
        spec = record.spec
        if error:
            record.fail()
        result = GroupResult(
            run_id=spec.run_id,
            group_id=spec.group_id,
            status=GroupStatus.FAILED if error else GroupStatus.DELIVERED,
            prompt_key=spec.prompt_key,
            prompt_token_ids=list(spec.prompt_token_ids),
            samples=[] if error else record.to_samples(),
            metadata=dict(spec.metadata),
            error=error,
            attempts=record.attempts,
            submitted_at=spec.submitted_at,
            finished_at=time.time(),
        )
        writes = self._sample_writes.pop(spec.key, None)
        if writes:  # its samples' entries first (a write that failed has said why)
            await asyncio.gather(*writes, return_exceptions=True)
        entry = await self._retrying(f"group {spec.key}", lambda: self._store.deliver(result))
        if entry is None:
            log.info(
                "group %s was no longer pending in Redis (cancelled, its run deleted, or "
                "delivered by an earlier scheduler): not written",
                spec.key,
            )
            return
        self._delivered(spec.run_id)
        if error:
            self.counters.groups_failed += 1
            log.warning("group %s failed: %s", spec.key, error)
            return
        self.counters.groups_delivered += 1
        self.counters.samples_delivered += spec.n
        self.counters.tokens_generated += result.num_output_tokens
        self.group_latency.observe(max(0.0, result.latency_s))
        version = self.policy_version(spec.run_id)
        for sample in result.samples:
            self.output_tokens.observe(len(sample.token_ids))
            for segment in sample.versions:
                self.token_staleness.observe(max(0, version - segment.version), segment.length)
        self._learn(record)
        await self._save_history()

    async def _retrying(self, what: str, write: Callable[[], Awaitable[str | None]]) -> str | None:
        """Retries ``write`` until Redis takes it: a finished group (or sample) is never
        dropped. An outage is waited out, and so is an error Redis answers (out of memory
        under ``noeviction``, a replica that became read-only, a busy script): the group is
        out of memory already, and given up it stayed pending in Redis, never delivered,
        until a restart. Only LeaseLost (another scheduler took over) and an answer no retry
        changes end it."""
        attempt = 0
        while True:
            try:
                return await write()
            except redis.exceptions.RedisError as exc:
                if not may_pass_later(exc):  # (WRONGTYPE, a script's bug: no retry passes)
                    log.error(
                        "writing %s to Redis: %s; not retried: the group stays pending in "
                        "Redis, run again by the next scheduler to start",
                        what,
                        exc,
                    )
                    raise
                delay = _REDIS_RETRY_S[min(attempt, len(_REDIS_RETRY_S) - 1)]
                level = logging.WARNING if isinstance(exc, _REDIS_ERRORS) else logging.ERROR
                log.log(level, "writing %s to Redis: %s; retry in %.2fs", what, exc, delay)
                attempt += 1
                await asyncio.sleep(delay)

    # ------------------------------------------------------------ samples as they finish

    def _stream_sample(self, record: GroupRecord, index: int) -> None:
        """Writes finished sample ``index`` of a ``stream_samples`` group to its run's samples
        stream, in a task of its own (the call's stream is read on meanwhile)."""
        spec = record.spec
        result = SampleResult(
            run_id=spec.run_id,
            group_id=spec.group_id,
            n=spec.n,
            prompt_key=spec.prompt_key,
            metadata=dict(spec.metadata),
            submitted_at=spec.submitted_at,
            sample=record.stream(index),
        )
        what = f"sample {spec.key}/{index}"
        task = asyncio.create_task(self._write_sample(what, result), name=f"write {what}")
        writes = self._sample_writes.setdefault(spec.key, set())
        writes.add(task)

        def written(task: asyncio.Task[None]) -> None:
            writes.discard(task)
            if not writes and self._sample_writes.get(spec.key) is writes:
                del self._sample_writes[spec.key]
            _log_crash(task)

        task.add_done_callback(written)

    async def _write_sample(self, what: str, result: SampleResult) -> None:
        with self._work(self._writing, result.run_id):
            entry = await self._retrying(what, lambda: self._store.deliver_sample(result))
        if entry is not None:
            self.counters.samples_streamed += 1
            self._delivered(result.run_id)  # (its samples stream is trimmed too)

    def _delivered(self, run_id: str) -> None:
        """The run's stream got an entry: the trim looks at it (nothing is kept without)."""
        if self.settings.trim_acked:
            self._delivered_to.add(run_id)

    async def _restore_streamed(self, specs: Sequence[GroupSpec]) -> None:
        """Recovered ``stream_samples`` groups keep the samples an earlier process wrote to
        the samples stream; one with all of them there is delivered at once."""
        streamed = await self._store.load_streamed([(s.run_id, s.group_id) for s in specs])
        for spec in specs:
            self._restore_group(spec, streamed[spec.run_id, spec.group_id])

    def _restore_group(self, spec: GroupSpec, streamed: Sequence[SampleResult]) -> None:
        record = self._groups[spec.key]
        for result in streamed:
            if 0 <= result.sample.index < spec.n:
                record.restore(result.sample)
        if record.all_finished:
            self._queue.pop(spec.key, None)
            task = asyncio.create_task(self._end(record), name=f"deliver {spec.key}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            task.add_done_callback(_log_crash)
        elif record.streamed:
            log.info(
                "group %s resumes with %d of its %d samples kept from the samples stream",
                spec.key,
                len(record.streamed),
                spec.n,
            )

    # ------------------------------------------------------------ length history

    def _learn(self, record: GroupRecord) -> None:
        """Teaches the predictor the delivered group's lengths (not of aborted samples),
        and scores what it predicted for them from the prompt's history before."""
        spec = record.spec
        if not spec.prompt_key:
            return
        lengths = record.finished_lengths()
        if lengths:
            before = self._predictor.predict(spec.prompt_key, len(spec.prompt_token_ids)).mean
            guess = min(before, float(spec.sampling.max_tokens))
            self._scores.extend((guess, length) for length in lengths)
        epoch = self._predictor.epoch if spec.epoch is None else spec.epoch
        for length in lengths:
            self._predictor.observe(spec.prompt_key, length, epoch, len(spec.prompt_token_ids))
        if self._queue:  # (with none queued no view is kept to be stale: the set stays small)
            self._relearnt.add(spec.prompt_key)
        self._unsaved.pop(spec.prompt_key, None)
        self._unsaved[spec.prompt_key] = None
        self._globals_unsaved = True

    def _predictor_score(self) -> tuple[int, float | None, float | None]:
        """The predictor's error over the latest delivered samples: how many, their mean
        absolute error and tail AUC (None while undefined)."""
        if not self._scores:
            return 0, None, None
        predicted, actual = zip(*self._scores, strict=True)
        auc = None
        with contextlib.suppress(ValueError):  # every length alike: no tail to rank
            auc = tail_auc(predicted, actual)
        return len(actual), mean_absolute_error(predicted, actual), auc

    async def _load_history(self) -> None:
        history = await self._store.load_history()
        broken: list[str] = []
        for prompt_key, record in history.records:
            try:
                self._predictor.load_key(prompt_key, record)
            except ValueError as exc:
                log.warning("dropping the saved length history of a prompt key: %s", exc)
                broken.append(prompt_key)
        if history.globals is not None:
            try:
                self._predictor.load_globals(history.globals)
            except ValueError as exc:
                log.warning("ignoring the saved length prior: %s", exc)
        await self._store.drop_history_keys(broken)
        if history.records:
            log.info(
                "length history: %d prompt keys, epoch %d",
                len(self._predictor),
                self._predictor.epoch,
            )

    async def _save_history(self) -> None:
        """Saves what the predictor learnt since the last save. Best effort: history is a
        hint, so a Redis outage or refusal (out of memory) keeps it for the next save instead
        of holding anything up."""
        async with self._save_lock:
            if not self._globals_unsaved:
                return
            keys, self._unsaved = self._unsaved, {}
            self._globals_unsaved = False
            records = {k: self._predictor.dump_key(k) for k in keys if k in self._predictor}
            try:
                await self._store.save_history(
                    records, self._predictor.dump_globals(), self.settings.predictor.max_keys
                )
            except BaseException as exc:
                for key in self._unsaved:  # learnt again meanwhile: newer than the rest
                    keys.pop(key, None)
                    keys[key] = None
                self._unsaved = keys
                self._globals_unsaved = True
                if not isinstance(exc, redis.exceptions.RedisError):
                    raise
                log.warning("saving length history to Redis: %s; it is kept for later", exc)

    # ------------------------------------------------------------ engines

    def _add_engine(self, engine_id: str, address: str) -> EngineHandle:
        engine = EngineHandle(
            engine_id,
            address,
            self.settings.capacity_factor,
            self._engine_metadata,
            self._engine_tls,
        )
        engine.probe_slot = self._engines_added  # spreads the watched engines' probes
        self._engines_added += 1
        self._engines[engine_id] = engine
        watch = asyncio.create_task(self._watch(engine), name=f"watch-{engine_id}")
        watch.add_done_callback(self._engine_task_ended(engine))
        self._watches[engine_id] = watch
        return engine

    async def _remove_engine(self, engine: EngineHandle, reason: str) -> None:
        await self._engine_down(engine, reason)
        if self._engines.get(engine.engine_id) is engine:  # else removed by another task
            del self._engines[engine.engine_id]
            if self._outputs is not None:
                self._outputs.forget_engine(engine.engine_id)
            self._push_due.pop(engine.engine_id, None)
            self._pushed_at.pop(engine.engine_id, None)
            # (its pusher would take the pushes due to an engine of the id that registers
            # again at another address, and drop them as not its own)
            pusher = self._pushers.pop(engine.engine_id, None)
            if pusher is not None:
                pusher.cancel()
            if engine.registered:
                self._registered -= 1
            watch = self._watches.pop(engine.engine_id, None)
            if watch is not None:
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)
        await engine.close()

    async def _engine_down(self, engine: EngineHandle, reason: str) -> None:
        """Marks the engine unhealthy and sends the unfinished samples of its calls back to
        the queue (groups whose samples ran out of attempts fail)."""
        current = asyncio.current_task()
        victims = [
            c for calls in self._calls.values() for c in calls.values() if c.engine is engine
        ]
        # A failure: the engine was taken for healthy, or work on it is lost (an engine its
        # health watch already showed NOT_SERVING, whose calls then broke).
        if engine.mark(False, reason) or victims:
            self.counters.engine_failures += 1
        endings: list[_Ending] = []
        for call in victims:
            self._forget(call)
            if call.task is not None and call.task is not current:
                call.task.cancel()
            ending = self._requeue(call, f"engine {engine.engine_id}: {reason}")
            if ending is not None and self._retire(ending.record):
                endings.append(ending)
        self._wake.set()
        if endings:
            holds = [self._holding_writes(ending.record.spec) for ending in endings]
            # In a task of its own: cut off with its caller (a registration's deadline), the
            # retired groups stayed pending in Redis; awaited, a Redis that refuses for a
            # while held up the caller (a publish, under the weights lock).
            task = asyncio.create_task(
                self._write_endings(endings, holds), name=f"endings on {engine.engine_id}"
            )
            self._tasks.add(task)
            task.add_done_callback(self._call_ended)

            def release(_: asyncio.Task[None]) -> None:  # (also if cancelled before it began)
                for hold in holds:
                    hold.close()

            task.add_done_callback(release)

    async def _write_endings(
        self, endings: Sequence[_Ending], holds: Sequence[contextlib.ExitStack]
    ) -> None:
        for ending, hold in zip(endings, holds, strict=True):
            # One Redis refuses for good (logged by _write) stays pending for a restart; the
            # rest, of other runs maybe, are still written.
            with hold, contextlib.suppress(redis.exceptions.RedisError):
                await self._write_ending(ending)

    def _requeue(self, call: _Call, reason: str) -> _Ending | None:
        """Queues the call's unfinished samples again; says how the group ends instead when
        one of them ran out of attempts, or when the group has nothing left to run."""
        record = call.record
        key = record.spec.key
        if self._groups.get(key) is not record:
            return None  # it ended meanwhile
        running = call.running()
        spent = [i for i in running if record.samples[i].attempts >= self.settings.max_attempts]
        if spent:
            attempts = record.samples[spent[0]].attempts
            return _Ending(record, f"{attempts} attempts failed; last: {reason}")
        record.requeue(running, reason)
        if running:
            self._queue[key] = None
        if record.all_finished:  # the call broke after its last sample finished
            return _Ending(record, "")
        return None

    async def _trim_loop(self) -> None:
        """Every ``trim_interval_s``, removes from the runs' streams the entries every reader
        has acknowledged, once ``acked_retention_s`` old (``Store.trim_acked``): a long run's
        stream holds what its readers have still to read, not every group it delivered. The
        runs in Redis are looked at first (what earlier processes delivered), then the runs
        this one delivers to, as ``TrimSchedule`` says: a run where nothing happens is looked
        at less and less often, and one whose stream is empty with nothing pending here not
        at all. A Redis outage is waited out; a Redis that cannot trim (before 6.2) is said
        once, and its streams keep every entry."""
        schedule: TrimSchedule | None = None
        refused = ""  # what Redis last answered to a trim it refused (said once)
        while True:
            await asyncio.sleep(self.settings.trim_interval_s)
            try:
                if schedule is None:
                    known = await self._store.runs()
                    schedule = TrimSchedule()
                    schedule.touch(known)
                schedule.touch(self._delivered_to)
                self._delivered_to.clear()
                active = {record.spec.run_id for record in self._groups.values()}
                for run in schedule.due(active):
                    retention_s = self.settings.acked_retention_s
                    removed, left = await self._store.trim_acked(run, retention_s)
                    # The samples stream on the same schedule: a run is looked at while
                    # either stream holds entries.
                    samples_removed, samples_left = await self._store.trim_acked(
                        run, retention_s, samples=True
                    )
                    removed += samples_removed
                    self.counters.stream_entries_trimmed += removed
                    schedule.looked(run, removed, left + samples_left, run in active)
                schedule.next_round()
                refused = ""
            except redis.exceptions.ResponseError as exc:
                # Permanent (before Redis 6.2, or an ACL without the commands) or not (a busy
                # script, a failover): tried again each round, said when it changes.
                if str(exc) != refused:
                    log.error(
                        "Redis refused to trim the streams (%s; XTRIM MINID needs Redis 6.2): "
                        "they keep every entry until it can (--keep-acked-entries: no trim)",
                        exc,
                    )
                refused = str(exc)
            except _REDIS_ERRORS as exc:
                log.warning(
                    "trimming the streams: %s; again in %g s", exc, self.settings.trim_interval_s
                )

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            await self._probe_all()
            await self._forget_silent_engines()

    async def _forget_silent_engines(self) -> None:
        """Takes out of the fleet the registered engines that are down and have sent no
        heartbeat for ``forget_engine_after_s`` (and five heartbeat periods): engines of a
        fleet that changes (new ids as machines come and go) would otherwise be watched and
        probed for as long as the scheduler runs. Engines of the settings stay."""
        silent_s = max(self.settings.forget_engine_after_s, 5 * self.heartbeat_interval_ms() / 1000)
        configured = {e.engine_id for e in self.settings.engines}
        now = time.monotonic()
        for engine in list(self._engines.values()):
            if self._engines.get(engine.engine_id) is not engine:
                continue  # replaced or removed while an earlier one was removed
            if (
                engine.registered
                and not engine.healthy
                and engine.engine_id not in configured
                and now - engine.last_heartbeat > silent_s
            ):
                log.warning(
                    "engine %s at %s left the fleet: down, and no heartbeat for %.0f s",
                    engine.engine_id,
                    engine.address,
                    now - engine.last_heartbeat,
                )
                await self._remove_engine(engine, f"no heartbeat for {silent_s:g} s")

    async def _probe_all(self) -> None:
        """Probes the engines that are unhealthy or not followed by a health watch every
        round, and the others every ``health_watched_every`` rounds, a share of them each
        round. A watched engine's change of status arrives at once, and one that exits
        breaks its watch (and streams) at once; what is left to the probe is an engine that
        hangs. A probe costs the scheduler a few hundred µs of CPU: on a big fleet the
        probes were most of its work, idle or busy."""
        every = self.settings.health_watched_every
        due = self._probe_round
        self._probe_round += 1
        engines = [
            e
            for e in list(self._engines.values())
            if not (e.healthy and e.watching) or (due + e.probe_slot) % every == 0
        ]
        probes = [self._probe_soon(e) for e in engines]
        if probes:
            # A probe that has the engine load the fleet's weights takes up to
            # weights_timeout_s: it goes on after the round (and the scheduler's start).
            await asyncio.wait(probes, timeout=self.settings.health_timeout_s)

    def _probe_soon(self, engine: EngineHandle) -> asyncio.Task[None]:
        """A task that probes the engine: the one still under way from an earlier round,
        else a new one."""
        task = self._probing.get(engine)
        if task is None:
            task = asyncio.create_task(self._probe(engine), name=f"probe {engine.engine_id}")
            self._probing[engine] = task
            self._tasks.add(task)
            task.add_done_callback(self._probe_ended(engine))
        return task

    async def _watch(self, engine: EngineHandle) -> None:
        """Follows the engine's health as it changes (gRPC health Watch), for as long as the
        engine is known; when the watch breaks, probes the engine at once and reopens the
        watch a probe interval later. NOT_SERVING (the engine drains or its core died) stops
        new work at once; the calls it runs go on until they finish or their streams break
        (then they are requeued, as when a probe finds the engine gone). SERVING again is
        checked by a probe, which also learns the engine's limits. A watch that broke leaves
        the engine suspect of a restart until a probe reaches it: the first SERVING of the
        watch opened next is probed too, so that an engine back before a probe failed loads
        the fleet's weights as well."""
        while True:
            try:
                async with contextlib.aclosing(engine.watch()) as statuses:
                    async for serving in statuses:
                        engine.watching = True
                        if not serving:
                            if engine.mark(False, "health is NOT_SERVING"):
                                self._wake.set()
                            # A draining engine waits for every open call before it exits,
                            # this watch too: close it (it is opened again later).
                            break
                        if not engine.healthy or engine.may_have_restarted:
                            await self._probe(engine)
            except grpc.aio.AioRpcError:
                pass
            finally:
                engine.watching = False
            # The watch ended: closed above on NOT_SERVING, or broken (the engine exited, or
            # the connection did). Probe it now, so that an engine that is gone counts a
            # failed probe at once (and one that restarted loads the fleet's weights).
            engine.may_have_restarted = True
            await self._probe(engine)
            await asyncio.sleep(self.settings.health_interval_s)

    async def _probe(self, engine: EngineHandle) -> None:
        """Checks the engine's health. Before an engine serves (again), or when it may have
        restarted, its Stats are read: a new process holds none of the outputs handed to the
        old one, and it must serve the fleet's weights: it loads them or stays out."""
        look = engine.may_have_restarted or not engine.healthy
        downs = engine.downs
        engine.probes_sent += 1
        sent = engine.probes_sent
        try:
            anew = await engine.probe(self.settings.health_timeout_s, look)
            if engine.info is not None and engine.info.takes_earlier_outputs:
                self._outputs_taken = True
        except (grpc.aio.AioRpcError, RuntimeError) as exc:
            if engine.reached_by > sent:
                # A probe sent after this one reached the engine (this one went to a process
                # that has since exited, and the engine is back): it took a serving engine
                # out, and its calls were requeued.
                return
            engine.failed_probes += 1
            detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            reason = f"health probe failed: {detail}"
            if not engine.healthy:
                engine.stays_down(reason)
            elif engine.failed_probes >= self.settings.health_failures:
                await self._engine_down(engine, reason)
            return
        engine.reached_by = max(engine.reached_by, sent)
        if engine.downs != downs:
            # It was taken out while the probe was out (a call to it broke): the probe's
            # SERVING is older than that, and the next probe decides. (Taken at its word, it
            # put a dead engine back in service, which was handed the group it had just lost.)
            return
        if look:
            if engine.loading_weights:
                return  # a load is under way: the probe after it looks (may_have_restarted)
            engine.may_have_restarted = False
            if anew and self._outputs is not None:  # its drafter holds none of them
                self._outputs.forget_engine(engine.engine_id)
            if not await self._has_fleet_weights(engine):
                return  # out of service until it serves the fleet's weights
        if engine.mark(True):
            self._wake.set()
