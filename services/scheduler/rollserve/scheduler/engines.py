"""Connections to engines: one gRPC channel each, their health and capacity."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rollserve.common.access import ClientTls
from rollserve.scheduler.core.snapshot import EngineView
from rollserve.scheduler.state import GroupSpec
from rollserve.v1 import rollserve_pb2 as pb
from rollserve.v1 import rollserve_pb2_grpc as pb_grpc

Metadata = tuple[tuple[str, str], ...]

log = logging.getLogger(__name__)

_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
)


@dataclass(frozen=True)
class EngineTls:
    """How the scheduler reaches engines that serve TLS: the CA that signed their
    certificates and, for engines that ask for one (mutual TLS), the certificate the
    scheduler shows (``client``, its files read again when they change); the name to check
    in the engines' certificates (None: the address's host)."""

    client: ClientTls
    server_name: str | None = None

    def channel(self, address: str) -> tuple[int, grpc.aio.Channel]:
        """A channel to ``address`` with the latest credentials, and their generation."""
        options: list[tuple[str, str | int]] = list(CHANNEL_OPTIONS)
        if self.server_name is not None:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        generation, credentials = self.client.credentials()
        return generation, grpc.aio.secure_channel(address, credentials, options=options)


@dataclass(eq=False)
class _Link:
    """A channel to an engine, its stubs, and how many calls it has open (its health watch
    not counted)."""

    channel: grpc.aio.Channel
    generation: int  # of the credentials it was made with (0 in plaintext)
    calls: int = 0

    def __post_init__(self) -> None:
        self.stub = pb_grpc.EngineStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)


@dataclass(slots=True)
class EngineLoad:
    """What the scheduler has running on an engine, summed over its running samples."""

    samples: int = 0
    groups: int = 0  # groups with at least one call on it
    outstanding_tokens: int = 0  # max_tokens minus progress
    predicted_outstanding: float = 0.0  # predicted length minus progress, at least 0
    predicted_longest: float = 0.0  # the most of that for one sample
    kv_used_tokens: int = 0  # prompt plus progress (shared prefixes counted per sample)
    urgent_priority: int | None = None  # the lowest priority value of its running samples


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What an engine says of itself in Stats."""

    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    model: str
    kv_capacity_tokens: int = 0  # 0: the engine did not say
    takes_earlier_outputs: bool = False  # it drafts from a call's earlier_outputs
    dtype: str = ""  # its model computes in ("": the engine did not say)


_INT64 = 1 << 63


def _check_stats(stats: pb.StatsResponse) -> None:
    """Raises when an engine's Stats cannot be an engine's: Submit's limits come from them
    (a context of 0 would refuse every group), so such an engine stays out of service with
    this as its error."""
    wrong = [
        f"{name} ({value}) must be {bound}"
        for name, value, ok, bound in (
            ("max_model_len", stats.max_model_len, stats.max_model_len >= 2, ">= 2"),
            ("max_num_seqs", stats.max_num_seqs, stats.max_num_seqs >= 1, ">= 1"),
            ("vocab_size", stats.vocab_size, stats.vocab_size >= 0, ">= 0 (0: unknown)"),
            (
                "kv_capacity_tokens",
                stats.kv_capacity_tokens,
                stats.kv_capacity_tokens >= 0,
                ">= 0 (0: unknown)",
            ),
        )
        if not ok
    ]
    if wrong:
        raise RuntimeError(f"its Stats make no sense: {'; '.join(wrong)}")


class EngineHandle:
    """One engine: its channel, what the scheduler has seen of its health, its load."""

    def __init__(
        self,
        engine_id: str,
        address: str,
        capacity_factor: float,
        metadata: Callable[[], Metadata] = lambda: (),
        tls: EngineTls | None = None,
    ) -> None:
        """``metadata``: what each call of the Engine API carries (its token, where engines
        ask for one), asked for at each call; ``tls``: how to reach an engine that serves
        TLS (None: plaintext)."""
        self.engine_id = engine_id
        self.address = address
        self._capacity_factor = capacity_factor
        self._metadata = metadata
        self._tls = tls
        self._link = self._connect()
        # Links made with credentials since replaced, closed once their calls end (a
        # health watch on one breaks then, and is opened again on the latest).
        self._retired: set[_Link] = set()
        self._closing: set[asyncio.Task[None]] = set()
        self._closed = False  # (no new connection after close: nothing would close it)
        self.info: EngineInfo | None = None
        self.healthy = False
        self.failed_probes = 0
        # Times it was taken for down: a probe that answered from before the last of them
        # says nothing of now.
        self.downs = 0
        # Probes sent to it, numbered; the number of the latest sent of those that reached
        # it: a probe that fails after a later one reached the engine says nothing of now.
        self.probes_sent = 0
        self.reached_by = 0
        self.last_error = ""
        self.last_heartbeat = 0.0
        # When its latest calls failed with an error it said another engine may not meet
        self._call_errors: deque[float] = deque()
        self.registered = False  # came through RegisterEngine rather than settings
        # A health watch is open: a change of its status arrives without a probe.
        self.watching = False
        self.probe_slot = 0  # which rounds probe it while it is watched
        self.loading_weights = False  # the scheduler has it load the fleet's weights now
        # The weights it serves as last seen (Stats, or a load the scheduler had it do).
        self.weights: tuple[str, int] = ("", 0)
        # Its health watch broke, or it registered again: it may be another process now,
        # with its launch weights and none of the outputs handed to it. The next probe that
        # reaches it reads its Stats to know.
        self.may_have_restarted = False
        self.boot_id = ""  # its process's, as its Stats last said ("": not known or not said)
        self.restarts = 0  # times its Stats gave a boot id other than the one before

    def _connect(self) -> _Link:
        if self._tls is None:
            return _Link(grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS), 0)
        generation, channel = self._tls.channel(self.address)
        return _Link(channel, generation)

    def _latest(self) -> _Link:
        """The link with the latest credentials: a new one when they changed since the
        current was made (the current retires)."""
        if (
            self._tls is not None
            and not self._closed
            and self._tls.client.credentials()[0] != self._link.generation
        ):
            self._retired.add(self._link)
            self._close_if_idle(self._link)
            self._link = self._connect()
            log.info("engine %s: new connections with the new TLS credentials", self.engine_id)
        return self._link

    def _close_if_idle(self, link: _Link) -> None:
        if link in self._retired and link.calls == 0:
            self._retired.discard(link)
            task = asyncio.get_running_loop().create_task(link.channel.close(grace=None))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    @contextlib.contextmanager
    def _call(self) -> Iterator[_Link]:
        """The link a unary call goes on, its call counted while it runs."""
        link = self._latest()
        link.calls += 1
        try:
            yield link
        finally:
            link.calls -= 1
            self._close_if_idle(link)

    @property
    def capacity_samples(self) -> int:
        if self.info is None:
            return 0
        return max(1, math.ceil(self.info.max_num_seqs * self._capacity_factor))

    def view(self, load: EngineLoad) -> EngineView:
        return EngineView(
            engine_id=self.engine_id,
            healthy=self.healthy,
            capacity_samples=self.capacity_samples,
            inflight_samples=load.samples,
            outstanding_tokens=load.outstanding_tokens,
            predicted_outstanding=load.predicted_outstanding,
            predicted_longest=load.predicted_longest,
            kv_capacity_tokens=self.info.kv_capacity_tokens if self.info is not None else 0,
            kv_used_tokens=load.kv_used_tokens,
            urgent_priority=load.urgent_priority,
        )

    async def probe(self, timeout_s: float, look: bool = False) -> bool:
        """Raises when the engine is not SERVING. Reads its Stats the first time and when
        asked to ``look`` (it may have restarted), learning its limits again; returns whether
        it is another process than the one whose Stats were read before: a new boot id, or
        one it does not give (nothing tells then), or the first time."""
        with self._call() as link:
            reply = await link.health.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
            )
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            raise RuntimeError(
                f"health is {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
            )
        if self.info is not None and not look:
            return False
        stats = await self.stats(timeout_s)
        anew = self.info is None or not stats.boot_id or stats.boot_id != self.boot_id
        if self.boot_id and stats.boot_id and stats.boot_id != self.boot_id:
            self.restarts += 1
            log.warning("engine %s restarted (a new boot id)", self.engine_id)
        _check_stats(stats)
        self.boot_id = stats.boot_id
        self.info = EngineInfo(
            stats.max_model_len,
            stats.max_num_seqs,
            stats.vocab_size,
            stats.model,
            stats.kv_capacity_tokens,
            stats.takes_earlier_outputs,
            stats.dtype,
        )
        return anew

    async def watch(self) -> AsyncGenerator[bool, None]:
        """Its health as it changes (gRPC health Watch): True while SERVING. Ends or raises
        grpc.aio.AioRpcError when the stream breaks (it ends when its connection retires:
        open it again, on the latest)."""
        replies = self._latest().health.Watch(health_pb2.HealthCheckRequest(service=""))
        try:
            async for reply in replies:
                yield reply.status == health_pb2.HealthCheckResponse.SERVING
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            # Not this task's cancel: its connection was closed under it (it retired when
            # the TLS credentials changed), which cancels its calls. The stream ended.
        finally:
            replies.cancel()

    async def update_weights(self, path: str, version: int, timeout_s: float) -> None:
        """Has the engine load the checkpoint at ``path`` as weights ``version``."""
        request = pb.UpdateWeightsRequest(weights_path=path, version=version)
        with self._call() as link:
            await link.stub.UpdateWeights(request, timeout=timeout_s, metadata=self._metadata())

    async def add_outputs(
        self,
        prompts: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]],
        timeout_s: float,
    ) -> int:
        """Hands the engine's drafter earlier outputs of prompts; how many it took."""
        request = pb.AddOutputsRequest(
            prompts=[
                pb.PromptOutputs(
                    prompt_token_ids=prompt,
                    outputs=[pb.EarlierOutput(token_ids=o) for o in outputs],
                )
                for prompt, outputs in prompts
            ]
        )
        with self._call() as link:
            reply: pb.AddOutputsResponse = await link.stub.AddOutputs(
                request, timeout=timeout_s, metadata=self._metadata()
            )
        return reply.taken

    async def stats(self, timeout_s: float, *, with_progress: bool = False) -> pb.StatsResponse:
        request = pb.StatsRequest(with_progress=with_progress)
        with self._call() as link:
            reply: pb.StatsResponse = await link.stub.Stats(
                request, timeout=timeout_s, metadata=self._metadata()
            )
        return reply

    def generate(
        self,
        spec: GroupSpec,
        request_id: str,
        indices: Sequence[int],
        resumed: Sequence[int] = (),
        resumption: int = 0,
        *,
        priority: int = 0,
        earlier_outputs: Sequence[Sequence[int]] = (),
    ) -> grpc.aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse]:
        """Starts generating samples ``indices`` of the group (all n: no sample_indices).

        ``resumed``: the response tokens the one sample of ``indices`` kept from before its
        preemption; the engine gets prompt + ``resumed`` as the prompt and ``max_tokens``
        reduced by their count, and generates what comes after them. ``resumption``: how many
        times that sample was preempted; a seeded group's seed moves by ``n`` per resumption,
        so sample ``i`` resumes on seed ``seed + n * resumption + i``, a stream of its own
        (the same seed would replay the random draws its first tokens were sampled with).
        ``earlier_outputs``: outputs of the prompt for the engine's drafter (see
        :mod:`rollserve.scheduler.outputs`). Read the call to its end or cancel it: until it
        is done it holds its connection open (one retired by new credentials included)."""
        s = spec.sampling
        sampling = pb.SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_tokens=s.max_tokens - len(resumed),
            stop=s.stop,
            stop_token_ids=s.stop_token_ids,
        )
        if s.seed is not None:
            # Wrapped to stay in int64, the field's range, with its samples' seeds (seed + i
            # up to seed + n - 1): a seed near the top would overflow when resumed.
            span = 2 * _INT64 - (spec.n - 1)
            sampling.seed = (s.seed + spec.n * resumption + _INT64) % span - _INT64
        request = pb.GenerateRequest(
            request_id=request_id,
            prompt_token_ids=[*spec.prompt_token_ids, *resumed],
            n=spec.n,
            sampling=sampling,
            priority=priority,
            sample_indices=[] if len(set(indices)) == spec.n else indices,
            earlier_outputs=[pb.EarlierOutput(token_ids=o) for o in earlier_outputs],
        )
        link = self._latest()
        call = link.stub.Generate(request, metadata=self._metadata())
        link.calls += 1

        def ended(_: object) -> None:
            link.calls -= 1
            self._close_if_idle(link)

        call.add_done_callback(ended)
        return call

    async def abort(self, request_id: str, indices: Sequence[int], timeout_s: float) -> bool:
        """Asks the engine to stop samples ``indices`` of call ``request_id``: each ends with
        a Complete of reason abort on the call's stream. False when the call was not running
        there (it ended, or has not reached the engine yet)."""
        with self._call() as link:
            reply: pb.AbortResponse = await link.stub.Abort(
                pb.AbortRequest(request_id=request_id, sample_indices=indices),
                timeout=timeout_s,
                metadata=self._metadata(),
            )
        return reply.found

    def call_failed(self, now: float, window_s: float) -> int:
        """Notes a call of it that failed with an error another engine may not meet; how
        many did within the last ``window_s`` seconds, this one included."""
        errors = self._call_errors
        errors.append(now)
        while errors[0] <= now - window_s:
            errors.popleft()
        return len(errors)

    def mark(self, healthy: bool, error: str = "") -> bool:
        """Sets health; returns True when it changed."""
        changed = healthy != self.healthy
        self.healthy = healthy
        if not healthy:
            self.downs += 1
        if error:
            self.last_error = error
        if healthy:
            self.failed_probes = 0
        if changed:
            log.warning(
                "engine %s at %s is now %s%s",
                self.engine_id,
                self.address,
                "healthy" if healthy else "unhealthy",
                f": {error}" if error else "",
            )
        return changed

    def stays_down(self, why: str) -> None:
        """Why the engine, out of service, stays so (a probe or a load of the fleet's weights
        failed again): its ``last_error``, logged when it changes (a probe round repeats it)."""
        if not self.healthy and why != self.last_error:
            log.warning(
                "engine %s at %s stays out of service: %s", self.engine_id, self.address, why
            )
        self.last_error = why

    def heartbeat(self) -> None:
        self.last_heartbeat = time.monotonic()

    async def close(self) -> None:
        self._closed = True
        links = [self._link, *self._retired]
        self._retired.clear()
        await asyncio.gather(*(link.channel.close(grace=None) for link in links), *self._closing)
