"""The flags the dev stack (``rollserve up``, the demo, the benchmarks) gives its engines and
its scheduler, parsed by the services' own parsers. Nothing is started."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError
from rollserve.cli.stack import StackConfig, engine_flags
from rollserve.engine.server import parse_settings


@pytest.fixture
def model(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return tmp_path


def test_each_engine_is_told_how_many_engines_share_its_machine(model: Path) -> None:
    assert parse_settings([f"--model={model}"]).engines_per_host == 1
    settings = parse_settings(
        [f"--model={model}", *engine_flags(StackConfig(model=model, engines=3), 2)]
    )
    assert settings.engines_per_host == 3
    # a stack beside other engines (bench peer's interleaved sides) counts them too
    beside = StackConfig(model=model, engines=2, engines_per_host=6)
    assert parse_settings([f"--model={model}", *engine_flags(beside, 0)]).engines_per_host == 6
    with pytest.raises(ValidationError, match="engines_per_host"):
        parse_settings([f"--model={model}", "--engines-per-host=0"])


def test_what_a_user_gives_the_engines_wins_over_the_stacks_own(model: Path) -> None:
    config = StackConfig(model=model, engines=3, engine_args=("--engines-per-host=5", "--seed=7"))
    settings = parse_settings([f"--model={model}", *engine_flags(config, 0)])
    assert (settings.engines_per_host, settings.seed) == (5, 7)


def test_engines_serve_metrics_on_the_ports_after_the_schedulers(model: Path) -> None:
    config = StackConfig(model=model, engines=3, http_port=9464)
    ports = [
        parse_settings([f"--model={model}", *engine_flags(config, i)]).metrics_port
        for i in range(3)
    ]
    assert ports == [9465, 9466, 9467]
    plain = StackConfig(model=model, engines=2)
    assert parse_settings([f"--model={model}", *engine_flags(plain, 1)]).metrics_port is None


def test_metrics_ports_past_the_last_port_or_over_the_schedulers_are_refused(
    model: Path,
) -> None:
    with pytest.raises(ValueError, match="would take ports up to 65537, past 65535"):
        StackConfig(model=model, engines=2, http_port=65535)
    with pytest.raises(ValueError, match="hold the scheduler's gRPC port 50051"):
        StackConfig(model=model, engines=2, scheduler_port=50051, http_port=50050)
    StackConfig(model=model, engines=2, scheduler_port=50051, http_port=9464)
    with pytest.raises(ValidationError, match=r"metrics_port \(7001\) is the gRPC port"):
        parse_settings([f"--model={model}", "--port=7001", "--metrics-port=7001"])
