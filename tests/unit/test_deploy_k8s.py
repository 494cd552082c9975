"""deploy/k8s, checked as files (no cluster here): every manifest is valid for Kubernetes
(its JSON schemas, unknown fields refused, from the oldest version the manifests are meant
for to the newest the validator knows), every container's arguments parse with the parser
of the service it runs, and the parts find each other: engines register at the scheduler's
Service, the scheduler dials the Redis Service, probes and Prometheus's annotations name the
ports the services serve, pods outlive their services' grace on SIGTERM.

Faked: the engines' model folder (a local one stands in: the engine's settings check that
it is one) and the values Kubernetes puts in ``$(VAR)`` (the pod's name and IP)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from rollserve.engine.server import parse_settings
from rollserve.engine.settings import EngineSettings
from rollserve.scheduler.server import build_parser, build_policy, settings_from_args
from rollserve.scheduler.settings import SchedulerSettings

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
# grpc probes are GA from 1.27; the validator knows up to its own version
VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
FIELD_VALUES = {"metadata.name": "rollserve-engine-0", "status.podIP": "10.1.2.3"}


def kustomization() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return loaded


def manifests() -> list[dict[str, Any]]:
    return [
        document
        for name in kustomization()["resources"]
        for document in yaml.safe_load_all((K8S / name).read_text())
        if document
    ]


def find(kind: str, name: str) -> dict[str, Any]:
    (found,) = (m for m in manifests() if m["kind"] == kind and m["metadata"]["name"] == name)
    return found


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    found: dict[str, Any] = only
    return found


def arguments(workload: dict[str, Any]) -> list[str]:
    """The container's arguments after its command (``scheduler``/``engine``), each
    ``$(VAR)`` replaced as Kubernetes would from the container's env."""
    spec = container(workload)
    env = {
        e["name"]: e.get("value") or FIELD_VALUES[e["valueFrom"]["fieldRef"]["fieldPath"]]
        for e in spec.get("env", [])
    }
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in spec["args"][1:]]


def port(workload: dict[str, Any], name: str) -> int:
    (number,) = (p["containerPort"] for p in container(workload)["ports"] if p["name"] == name)
    return int(number)


def service_port(service: dict[str, Any], target: str) -> int:
    (number,) = (p["port"] for p in service["spec"]["ports"] if p["targetPort"] == target)
    return int(number)


@pytest.fixture
def scheduler() -> SchedulerSettings:
    return settings_from_args(build_parser().parse_args(arguments(scheduler_workload())))


@pytest.fixture
def engine(tmp_path: Path) -> EngineSettings:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    args = arguments(engine_workload())
    args[args.index("--model") + 1] = str(tmp_path)
    return parse_settings(args)


def scheduler_workload() -> dict[str, Any]:
    return find("Deployment", "rollserve-scheduler")


def engine_workload() -> dict[str, Any]:
    return find("StatefulSet", "rollserve-engine")


def test_the_kustomization_applies_every_manifest_here() -> None:
    listed = set(kustomization()["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    # the image it renames is the one every rollserve container names
    (image,) = kustomization()["images"]
    images = {
        container(m)["image"] for m in manifests() if m["kind"] in ("Deployment", "StatefulSet")
    }
    assert images == {image["name"], "redis:7.2"}


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_valid_for_kubernetes(version: str) -> None:
    for manifest in manifests():
        kubernetes_validate.validate(manifest, version, strict=True)


def test_a_manifest_with_a_wrong_field_is_refused() -> None:
    """(The check above can fail.)"""
    broken = scheduler_workload()
    container(broken)["readinessProbe"]["grpc"]["prot"] = 50051
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[-1], strict=True)


def test_the_scheduler_runs_alone_and_serves_the_ports_its_service_names(
    scheduler: SchedulerSettings,
) -> None:
    """One scheduler per Redis database (its lease): one replica, the old pod stopped before
    the new one starts."""
    workload = scheduler_workload()
    assert workload["spec"]["replicas"] == 1
    assert workload["spec"]["strategy"]["type"] == "Recreate"
    assert (scheduler.port, scheduler.http_port) == (port(workload, "grpc"), port(workload, "http"))
    assert scheduler.host == "0.0.0.0"
    service = find("Service", "rollserve-scheduler")
    assert (
        service["spec"]["selector"].items()
        <= workload["spec"]["template"]["metadata"]["labels"].items()
    )
    build_policy(scheduler)  # (its policy and cost profile are ones it has)
    probes = container(workload)
    assert probes["readinessProbe"]["grpc"]["port"] == scheduler.port
    assert probes["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert probes["startupProbe"]["httpGet"] == probes["livenessProbe"]["httpGet"]
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(scheduler.http_port)


def test_the_scheduler_dials_the_redis_service(scheduler: SchedulerSettings) -> None:
    service = find("Service", "rollserve-redis")
    assert scheduler.redis_url == f"redis://rollserve-redis:{service_port(service, 'redis')}/0"
    redis = find("StatefulSet", "rollserve-redis")
    assert (
        service["spec"]["selector"].items()
        <= redis["spec"]["template"]["metadata"]["labels"].items()
    )
    assert "--appendonly" in container(redis)["args"]  # (delivered groups survive a restart)


def test_engines_register_at_the_schedulers_service_from_their_own_address(
    engine: EngineSettings, scheduler: SchedulerSettings
) -> None:
    service = find("Service", "rollserve-scheduler")
    assert engine.scheduler_address == f"rollserve-scheduler:{service_port(service, 'grpc')}"
    assert engine.engine_id == FIELD_VALUES["metadata.name"]  # stable across restarts
    assert engine.advertised_address(engine.port) == f"{FIELD_VALUES['status.podIP']}:7001"
    workload = engine_workload()
    assert (engine.port, engine.metrics_port) == (port(workload, "grpc"), port(workload, "metrics"))
    assert engine.host == "0.0.0.0"
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(engine.metrics_port)
    spec = container(workload)
    for probe in ("startupProbe", "readinessProbe"):
        assert spec[probe]["grpc"]["port"] == engine.port  # gRPC health: SERVING once warm
    assert engine.device == "cuda" and not engine.enforce_eager  # (CUDA graphs on GPUs)
    # each engine pod has a memory limit of its own, so dtype auto counts that, alone
    assert spec["resources"]["limits"]["memory"] and engine.engines_per_host == 1


def test_pods_outlive_their_services_grace_on_sigterm(
    engine: EngineSettings, scheduler: SchedulerSettings
) -> None:
    for workload, grace in (
        (engine_workload(), engine.shutdown_grace_s),
        (scheduler_workload(), scheduler.shutdown_grace_s),
    ):
        assert workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > grace + 5


def test_every_volume_claim_is_one_defined_here() -> None:
    claims = {m["metadata"]["name"] for m in manifests() if m["kind"] == "PersistentVolumeClaim"}
    for manifest in manifests():
        for volume in (
            manifest.get("spec", {}).get("template", {}).get("spec", {}).get("volumes", [])
        ):
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, volume


def test_only_the_scheduler_reaches_the_engines_grpc_port() -> None:
    """The engines' API asks for no credentials (docs/access.md): a NetworkPolicy keeps all
    but the scheduler's pods off it, and lets Prometheus scrape."""
    policy = find("NetworkPolicy", "rollserve-engines")
    engines, scheduler = engine_workload(), scheduler_workload()
    engine_labels = engines["spec"]["template"]["metadata"]["labels"]
    scheduler_labels = scheduler["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= engine_labels.items()
    assert not policy["spec"]["podSelector"]["matchLabels"].items() <= scheduler_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    grpc_rule, metrics_rule = policy["spec"]["ingress"]
    (source,) = grpc_rule["from"]
    assert source["podSelector"]["matchLabels"].items() <= scheduler_labels.items()
    named = {p["name"] for p in container(engines)["ports"]}
    assert [p["port"] for p in grpc_rule["ports"]] == ["grpc"] and "grpc" in named
    assert "from" not in metrics_rule
    assert [p["port"] for p in metrics_rule["ports"]] == ["metrics"] and "metrics" in named
