"""Session fixtures of the integration tests: a tiny model and one real engine shared by all.

Engine start-up takes 10-50 s on these machines, so one engine serves the whole session; a
test that needs its own engine starts one with `engine_proc.start_engine_process`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from rollserve.engine.tiny_model import make_tiny_model
from rollserve.v1 import rollserve_pb2_grpc as pb_grpc

from tests.integration.engine_proc import EngineProcess, free_port, start_engine_process


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with its tokenizer (see rollserve.engine.tiny_model)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def engine_metrics_port() -> int:
    """The port the session's engine serves its Prometheus metrics on."""
    return free_port()


@pytest.fixture(scope="session")
def engine_process(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, engine_metrics_port: int
) -> Iterator[EngineProcess]:
    """One engine for the session; stopped with SIGTERM, its process group reaped.

    It sends new tokens every 100 ms (the default is 500): tests that act on a running
    sample's progress must see it before the tiny model's short samples end."""
    engine = start_engine_process(
        tiny_model_dir,
        "engine-it",
        ["--flush-interval-ms", "100", "--metrics-port", str(engine_metrics_port)],
        log_dir=tmp_path_factory.mktemp("engine-logs"),
    )
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="session")
def engine_address(engine_process: EngineProcess) -> str:
    """host:port of the session's engine, serving."""
    return engine_process.address


@pytest.fixture
async def plain_stub(engine_address: str) -> AsyncIterator[pb_grpc.EngineAsyncStub]:
    """A client of the session's engine (no speculation: the reference of the spec tests)."""
    async with grpc.aio.insecure_channel(engine_address) as channel:
        yield pb_grpc.EngineStub(channel)
