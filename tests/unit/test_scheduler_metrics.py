"""The scheduler's Prometheus endpoint (``rollserve.scheduler.metrics``).

The Status figures as metric families, from built StatusResponses; the HTTP server over a
status function the test changes between scrapes; and a real scheduler (``serve``, on the
session's Redis, with no engine: what it is given stays queued) scraped as Prometheus
would, over HTTP. Nothing is faked but the status function of the server tests."""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import aiohttp
import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rollserve.cli.stack import free_port
from rollserve.common.http import HttpServer
from rollserve.scheduler.histogram import GROUP_LATENCY_BOUNDS_S, Histogram
from rollserve.scheduler.metrics import status_registry
from rollserve.scheduler.server import serve
from rollserve.scheduler.settings import SchedulerSettings
from rollserve.v1 import rollserve_pb2 as pb
from rollserve.v1 import rollserve_pb2_grpc as pb_grpc

from tests.served import served_scheduler

TIMEOUT_S = 30.0


def status(**fields: object) -> pb.StatusResponse:
    engines = [
        pb.EngineStatus(
            engine_id="engine-0",
            address="127.0.0.1:7001",
            healthy=True,
            inflight_groups=2,
            inflight_samples=16,
            outstanding_tokens=4096,
            predicted_outstanding_tokens=1500.5,
            capacity_samples=64,
            weights_version=3,
            restarts=1,
            model="/models/reasoner",
            dtype="float32",
        ),
        pb.EngineStatus(engine_id="engine-1", address="127.0.0.1:7002", healthy=False),
    ]
    return pb.StatusResponse(engines=engines, **fields)  # type: ignore[arg-type]


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Each sample of Prometheus's text format: (name, sorted labels) -> value; also checks
    that the text parses as Prometheus parses it."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def exposition(response: pb.StatusResponse, histograms: Sequence[Histogram] = ()) -> str:
    return generate_latest(status_registry(response, histograms)).decode()


def test_the_status_figures_are_gauges_and_counters_with_the_engine_as_a_label() -> None:
    samples = scrape(
        exposition(
            status(
                queue_depth=7,
                inflight_groups=2,
                groups_delivered=40,
                tokens_generated=123_456,
                samples_preempted=5,
                fleet_weights_version=3,
                stream_entries_trimmed=9,
            )
        )
    )
    assert samples[("rollserve_queue_depth", ())] == 7
    assert samples[("rollserve_inflight_groups", ())] == 2
    assert samples[("rollserve_groups_delivered_total", ())] == 40
    assert samples[("rollserve_tokens_generated_total", ())] == 123_456
    assert samples[("rollserve_samples_preempted_total", ())] == 5
    assert samples[("rollserve_fleet_weights_version", ())] == 3
    assert samples[("rollserve_stream_entries_trimmed_total", ())] == 9
    assert samples[("rollserve_groups_failed_total", ())] == 0
    zero, one = (("engine", "engine-0"),), (("engine", "engine-1"),)
    assert samples[("rollserve_engine_healthy", zero)] == 1
    assert samples[("rollserve_engine_healthy", one)] == 0
    assert samples[("rollserve_engine_inflight_samples", zero)] == 16
    assert samples[("rollserve_engine_outstanding_tokens", zero)] == 4096
    assert samples[("rollserve_engine_predicted_outstanding_tokens", zero)] == 1500.5
    assert samples[("rollserve_engine_capacity_samples", zero)] == 64
    assert samples[("rollserve_engine_weights_version", zero)] == 3
    assert samples[("rollserve_engine_restarts_total", zero)] == 1
    info = (
        ("address", "127.0.0.1:7001"),
        ("dtype", "float32"),
        ("engine", "engine-0"),
        ("model", "/models/reasoner"),
    )
    assert samples[("rollserve_engine_info", info)] == 1
    # the predictor's error is left out while Status leaves it unset
    assert not any(name.startswith("rollserve_predictor_mae") for name, _ in samples)
    assert not any(name.startswith("rollserve_predictor_tail_auc") for name, _ in samples)


def test_the_predictors_error_is_there_once_status_has_it() -> None:
    samples = scrape(
        exposition(
            status(predictor_scored_samples=500, predictor_mae_tokens=45.5, predictor_tail_auc=0.8)
        )
    )
    assert samples[("rollserve_predictor_scored_samples", ())] == 500
    assert samples[("rollserve_predictor_mae_tokens", ())] == 45.5
    assert samples[("rollserve_predictor_tail_auc", ())] == 0.8


def test_a_histogram_counts_each_value_in_the_first_bucket_it_fits_as_prometheus_does() -> None:
    h = Histogram("x", "x", (1, 10, 100))
    for value in (0.5, 1, 1.5, 10, 99, 100, 101, 5000):
        h.observe(value)
    assert h.cumulative() == [("1.0", 2), ("10.0", 4), ("100.0", 6), ("+Inf", 8)]
    assert (h.count, h.sum) == (8, 5313.0)
    with pytest.raises(ValueError, match="must be finite and rise strictly"):
        Histogram("x", "x", (1, 1, 2))
    with pytest.raises(ValueError, match="must be finite and rise strictly"):
        Histogram("x", "x", (1, math.inf))  # (+Inf is always the last bucket)
    with pytest.raises(ValueError, match="NaN"):
        h.observe(math.nan)
    assert (h.count, h.sum) == (8, 5313.0)


def test_a_histograms_copy_is_what_it_was_when_copied() -> None:
    """A scrape formats copies on another thread while the runtime goes on observing."""
    h = Histogram("x", "x", (1, 10))
    h.observe(5)
    copied = h.copy()
    h.observe(50)
    assert (copied.cumulative(), copied.sum) == ([("1.0", 0), ("10.0", 1), ("+Inf", 1)], 5)
    assert h.count == 2


def test_the_delivered_groups_histograms_are_prometheus_histograms() -> None:
    latency = Histogram("group_latency_seconds", "latency", GROUP_LATENCY_BOUNDS_S)
    for seconds in (0.4, 3.0, 3.5, 9000.0):
        latency.observe(seconds)
    samples = scrape(exposition(pb.StatusResponse(), (latency,)))
    name = "rollserve_group_latency_seconds"
    assert samples[(name + "_bucket", (("le", "0.5"),))] == 1
    assert samples[(name + "_bucket", (("le", "1.0"),))] == 1
    assert samples[(name + "_bucket", (("le", "5.0"),))] == 3
    assert samples[(name + "_bucket", (("le", "7200.0"),))] == 3
    assert samples[(name + "_bucket", (("le", "+Inf"),))] == 4
    assert samples[(name + "_count", ())] == 4
    assert samples[(name + "_sum", ())] == 9006.9


def test_a_fleet_without_engines_has_no_engine_series() -> None:
    samples = scrape(exposition(pb.StatusResponse(queue_depth=1)))
    assert samples[("rollserve_queue_depth", ())] == 1
    assert not any(dict(labels).get("engine") for _, labels in samples)


async def test_each_scrape_reads_the_status_anew_and_other_requests_are_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    current = [status(queue_depth=1)]
    server = HttpServer(lambda: status_registry(current[0]), "127.0.0.1", 0)
    port = await server.start()
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/metrics") as reply:
                assert reply.status == 200
                assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                assert scrape(await reply.text())[("rollserve_queue_depth", ())] == 1
            current[0] = status(queue_depth=5)
            async with http.get(f"{url}/metrics") as reply:
                assert scrape(await reply.text())[("rollserve_queue_depth", ())] == 5
            async with http.get(f"{url}/") as reply:
                assert reply.status == 404
            async with http.post(f"{url}/metrics", data=b"x") as reply:
                assert reply.status == 405
        # a request that is not good HTTP gets a 400, and the server goes on serving
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.1\r\nno colon in this header\r\n\r\n")
        await writer.drain()
        with caplog.at_level(logging.INFO):
            first_line = await asyncio.wait_for(reader.readline(), TIMEOUT_S)
        assert first_line.startswith(b"HTTP/1.") and b" 400 " in first_line
        writer.close()
        # the client's fault: not logged as the server's error (a scanner sends thousands)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as reply:
            assert reply.status == 200
    finally:
        await server.stop()


def settings(redis_url: str, http_port: int) -> SchedulerSettings:
    return SchedulerSettings(
        port=0,
        http_port=http_port,
        redis_url=redis_url,
        predictor_namespace=f"ns-{uuid.uuid4().hex[:10]}",
        shutdown_grace_s=0.0,
    )


@asynccontextmanager
async def serving(given: SchedulerSettings) -> AsyncIterator[int]:
    """A scheduler served as ``rollserve scheduler`` serves it; yields its gRPC port."""
    async with served_scheduler(given, TIMEOUT_S) as served:
        yield served.port


async def test_a_scheduler_serves_its_status_as_metrics(other_redis_url: str) -> None:
    metrics_port = free_port()
    async with serving(settings(other_redis_url, metrics_port)) as bound:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{bound}") as channel:
            stub = pb_grpc.SchedulerStub(channel)
            groups = [
                pb.PromptGroup(
                    group_id=f"g{i}",
                    prompt_token_ids=[5, 6, 7],
                    n=2,
                    sampling=pb.SamplingParams(max_tokens=8),
                )
                for i in range(3)
            ]
            request = pb.SubmitRequest(run_id="metrics", groups=groups)
            await stub.Submit(request, timeout=TIMEOUT_S)
            grpc_status = await stub.Status(pb.StatusRequest(), timeout=TIMEOUT_S)
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        async with aiohttp.ClientSession() as http, http.get(url) as reply:
            samples = scrape(await reply.text())
        assert grpc_status.queue_depth == 3  # no engine: they wait
        assert samples[("rollserve_queue_depth", ())] == grpc_status.queue_depth
        assert samples[("rollserve_groups_delivered_total", ())] == 0
        assert samples[("rollserve_group_latency_seconds_count", ())] == 0  # (none delivered)
        assert samples[("rollserve_sample_output_tokens_bucket", (("le", "+Inf"),))] == 0
        assert samples[("rollserve_plan_seconds_count", ())] == 0  # (no engine: no plan)
    with pytest.raises(aiohttp.ClientConnectionError):  # stopped with the scheduler
        async with aiohttp.ClientSession() as http, http.get(url) as reply:
            pass


async def test_an_http_port_taken_stops_the_scheduler_naming_it(other_redis_url: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # (awaited here: a SystemExit out of a task of its own would leave the event loop)
        with pytest.raises(SystemExit, match=f"http_port {port}: could not bind 127.0.0.1"):
            await serve(settings(other_redis_url, port))
    async with serving(settings(other_redis_url, 0)):  # it let go of its lease
        pass


async def test_a_grpc_port_taken_stops_the_scheduler_and_serves_no_metrics(
    other_redis_url: str,
) -> None:
    metrics_port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        given = settings(other_redis_url, metrics_port).model_copy(update={"port": port})
        with pytest.raises(SystemExit, match=f"port {port}: could not bind 127.0.0.1:{port}"):
            await serve(given)
    with pytest.raises(aiohttp.ClientConnectionError):  # never started
        async with aiohttp.ClientSession() as http:
            await http.get(f"http://127.0.0.1:{metrics_port}/metrics")
    async with serving(settings(other_redis_url, 0)):  # it let go of its lease
        pass


def test_the_http_port_may_not_be_the_grpc_port() -> None:
    with pytest.raises(ValueError, match=r"http_port \(9000\) is the gRPC port"):
        SchedulerSettings(redis_url="redis://x", port=9000, http_port=9000)
    SchedulerSettings(redis_url="redis://x", port=0, http_port=0)  # (both picked free)


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
@pytest.mark.parametrize("host", ["::1", "[::1]"])
async def test_an_ipv6_host_bracketed_or_not_serves(host: str) -> None:
    server = HttpServer(lambda: status_registry(status(queue_depth=2)), host, 0)
    port = await server.start()
    try:
        async with aiohttp.ClientSession() as http, http.get(f"http://[::1]:{port}/metrics") as r:
            assert scrape(await r.text())[("rollserve_queue_depth", ())] == 2
    finally:
        await server.stop()
