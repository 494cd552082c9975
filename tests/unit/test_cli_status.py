"""``rollserve status`` against a scheduler served as ``rollserve scheduler`` serves it (see
``test_fuzz_api.scheduler``), Redis real. Faked: the engines (FakeEngine; one that cannot
load weights, to be shown out of service with the reason)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from typing import Any

import pytest
from rollserve.cli.main import build_parser, main
from rollserve.cli.stack import free_port
from rollserve.v1 import rollserve_pb2 as pb

from tests.unit.fakes import FakeEngine
from tests.unit.test_fuzz_api import scheduler, valid_group
from tests.unit.test_runtime import eventually, read_stream


def command(*argv: str) -> int:
    """``rollserve status ARGV`` as ``main`` runs it, but callable off the main thread (main
    sets a signal handler)."""
    args = build_parser().parse_args(["status", *argv])
    code: int = args.func(args)
    return code


async def test_status_shows_the_queue_deliveries_and_each_engine(
    other_redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = await FakeEngine("e0").start()
    try:
        async with scheduler(other_redis_url, engine) as running:
            run = f"status-{uuid.uuid4().hex[:8]}"
            await running.stub.Submit(pb.SubmitRequest(run_id=run, groups=[valid_group("g0")]))
            await read_stream(other_redis_url, run, 1)

            async def counted() -> bool:
                status = await running.stub.Status(pb.StatusRequest())
                return bool(status.groups_delivered == 1)

            await eventually(counted, "the scheduler to count the group")
            capsys.readouterr()  # what the scheduler printed
            # (the command blocks on gRPC: off this loop, which serves the scheduler)
            as_json = await asyncio.to_thread(command, "--scheduler", running.address, "--json")
            printed = json.loads(capsys.readouterr().out)
            as_tables = await asyncio.to_thread(command, "--scheduler", running.address)
            shown = capsys.readouterr().out
    finally:
        await engine.stop()
    assert as_json == as_tables == 0
    assert printed["groups_delivered"] == 1 and printed["queue_depth"] == 0
    assert printed["samples_delivered"] == valid_group("g0").n
    [e0] = printed["engines"]
    assert e0["engine_id"] == "e0" and e0["healthy"] and e0["address"] == engine.address
    assert e0["predicted_outstanding_tokens"] == 0.0  # nothing runs
    assert e0["model"] == "fake" and e0["dtype"] == engine.dtype  # as its Stats say
    assert "1 groups, 2 samples" in shown  # delivered
    assert "1 of 1 in service" in shown
    assert "e0" in shown and "in service" in shown and engine.dtype in shown
    assert "none published" in shown


async def test_status_says_why_an_engine_is_out_of_service(
    other_redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = await FakeEngine("bad", refuse_weights=True).start()
    try:
        async with scheduler(other_redis_url, engine) as running:
            # Weights no engine loads change nothing; a restart of the engine with the
            # fleet's weights unloadable is what leaves it out. Here: taken out by a probe
            # that finds it gone.
            await engine.stop()

            async def out() -> bool:
                status = await running.stub.Status(pb.StatusRequest())
                return not status.engines[0].healthy

            await eventually(out, "the scheduler to take the engine out")
            capsys.readouterr()  # what the scheduler printed
            code = await asyncio.to_thread(command, "--scheduler", running.address)
            shown = capsys.readouterr().out
    finally:
        await engine.stop()
    assert code == 0
    assert "0 of 1 in service" in shown
    assert "bad is out of service: health probe failed" in shown


def test_status_of_no_scheduler_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    code = main(["status", "--scheduler", address, "--timeout-s", "2"])
    assert code == 1
    out = capsys.readouterr().out
    assert f"the scheduler at {address} did not answer" in out


@pytest.mark.parametrize("address", ["localhost", "localhost:0", "localhost:70000", ":50051"])
def test_status_refuses_an_address_that_is_not_host_port(
    address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["status", "--scheduler", address])
    assert exit_info.value.code == 2
    assert "HOST:PORT" in capsys.readouterr().err


@pytest.mark.parametrize("width", [50, 80, 200])
def test_no_number_or_address_is_broken_across_lines_at_any_width(width: int) -> None:
    """A narrow terminal used to fold each cell of the engines' table, ``365/1,270`` into
    ``365/1,27`` and ``0``: the engines are then a line each, broken between words."""
    from rich.console import Console
    from rollserve.cli.status import render
    from rollserve.client.types import EngineStatus, RunStatus, SchedulerStatus

    engines = tuple(
        EngineStatus(
            engine_id=f"sim-{i}",
            address=f"127.0.0.1:4183{i}",
            healthy=True,
            inflight_groups=365,
            inflight_samples=1270,
            outstanding_tokens=1_234_567,
            capacity_samples=1280,
            last_error="",
            weights_path="/ckpt/step-3",
            weights_version=5,
            predicted_outstanding_tokens=987_654.0,
            dtype="bfloat16",
        )
        for i in range(2)
    )
    runs = (RunStatus("grpo-7", 1500, 6000, 365, 1270),)
    counts: dict[str, Any] = {
        f.name: 0
        for f in dataclasses.fields(SchedulerStatus)
        if f.name not in ("engines", "runs") and f.default is dataclasses.MISSING
    }
    status = SchedulerStatus(**counts, engines=engines, runs=runs)
    console = Console(width=width, record=True, force_terminal=False)
    render(status, console)
    words = console.export_text().split()
    for whole in ("365/1,270", "1,280", "987,654/1,234,567", "127.0.0.1:41831", "bfloat16"):
        assert whole in words, (whole, console.export_text())
