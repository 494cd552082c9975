"""deploy/docker-compose.yml, checked as a file (no Docker engine runs here): every service's
command parses with the parser of the service it runs, the scheduler dials the engines the
file defines and publishes its ports, and engines sharing the host count each other's
memory.

Faked: the engines' model folder (the file mounts it at /models; a local checkpoint stands
in, since the engine's settings check that the folder is one)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from rollserve.engine.server import parse_settings
from rollserve.engine.settings import EngineSettings
from rollserve.scheduler.server import build_parser, settings_from_args

COMPOSE = Path(__file__).resolve().parents[2] / "deploy" / "docker-compose.yml"


def services() -> dict[str, dict[str, Any]]:
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    found: dict[str, dict[str, Any]] = loaded["services"]
    return found


def with_model(command: list[str], model: Path) -> list[str]:
    """The engine's arguments, its --model replaced by ``model``."""
    args = list(command[1:])
    args[args.index("--model") + 1] = str(model)
    return args


def memory_limit(service: dict[str, Any]) -> object:
    """The service's memory limit, in either way compose takes one; None without."""
    limits = service.get("deploy", {}).get("resources", {}).get("limits", {})
    return service.get("mem_limit") or limits.get("memory")


@pytest.fixture
def engines(tmp_path: Path) -> dict[str, EngineSettings]:
    """Each engine service's settings, as its command gives them."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return {
        name: parse_settings(with_model(service["command"], tmp_path))
        for name, service in services().items()
        if service.get("command", [""])[0] == "engine"
    }


def test_every_command_names_a_service_rollserve_runs() -> None:
    for name, service in services().items():
        if "build" in service:  # (the others are third-party images)
            assert service["command"][0] in ("engine", "scheduler"), name
            assert service["build"]["args"]["TARGET"] in ("cpu", "gpu"), name


def test_every_service_of_the_stack_is_started_again_when_it_exits() -> None:
    """An engine exits on a fault it cannot serve past and a scheduler that lost its lease
    exits, each for a supervisor to start it again: without a restart policy, compose left
    them down."""
    for name, service in services().items():
        if "profiles" not in service:  # (Prometheus, on demand, is not the stack's)
            assert service.get("restart") == "unless-stopped", name


def test_the_scheduler_dials_every_engine_at_the_address_it_advertises(
    engines: dict[str, EngineSettings],
) -> None:
    assert engines
    (scheduler,) = (s for s in services().values() if s.get("command", [""])[0] == "scheduler")
    settings = settings_from_args(build_parser().parse_args(scheduler["command"][1:]))
    dialled = {e.engine_id: e.address for e in settings.engines}
    assert dialled == {e.engine_id: e.advertised_address(e.port) for e in engines.values()}
    assert set(scheduler["depends_on"]) >= set(engines)
    # its ports are published: gRPC, and HTTP (its API and metrics) where it serves one
    published = {str(p).rsplit(":", 1)[-1] for p in scheduler["ports"]}
    assert str(settings.port) in published
    if settings.http_port is not None:
        assert str(settings.http_port) in published


def test_engines_without_a_memory_limit_count_each_other(
    engines: dict[str, EngineSettings],
) -> None:
    """Engines on one host with no memory limit of their own see the host's memory: each
    must know how many share it (dtype auto's upcast rule), or N of them could each take
    the half of it that the rule leaves for one."""
    compose = services()
    unlimited = [name for name in engines if not memory_limit(compose[name])]
    for name in unlimited:
        assert engines[name].engines_per_host == len(unlimited), name


def test_prometheus_scrapes_every_metrics_endpoint_the_services_serve(
    engines: dict[str, EngineSettings],
) -> None:
    """deploy/prometheus.yml's targets are the scheduler's --http-port and each engine's
    --metrics-port, by service name (the compose network's host names), and the file it
    mounts is there."""
    compose = services()
    (scheduler_name,) = (n for n, s in compose.items() if s.get("command", [""])[0] == "scheduler")
    scheduler = settings_from_args(
        build_parser().parse_args(compose[scheduler_name]["command"][1:])
    )
    served = {f"{scheduler_name}:{scheduler.http_port}"} | {
        f"{name}:{e.metrics_port}" for name, e in engines.items() if e.metrics_port is not None
    }
    mount = compose["prometheus"]["volumes"][0].split(":")[0]
    config = yaml.safe_load((COMPOSE.parent / mount).read_text())
    scraped = {
        target
        for job in config["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    }
    assert scraped == served
    assert len(served) == len(engines) + 1
