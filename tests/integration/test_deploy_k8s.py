"""deploy/k8s: schema-valid manifests whose pieces fit together (no cluster needed).

Every resource is validated against the Kubernetes OpenAPI schema of a recent release
(`kubernetes-validate`, offline, strict: unknown fields fail), then the cross-references a
schema cannot see are checked: selectors, the headless Service the gateway discovers, the
gateway's embedded config.yaml, probes, scrape annotations, and the engine's arguments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from engine_patch.launcher import plan_launch
from sal_gateway.config import load_config
from tests.deploy_support import ALERTS, K8S, load_yaml, load_yaml_all

KUBERNETES_VERSION = "1.33"
"""A release still supported by the providers when this was written; schemas ship offline."""


def _kustomized(directory: Path) -> list[dict[str, Any]]:
    kustomization = load_yaml(directory / "kustomization.yaml")
    docs: list[dict[str, Any]] = []
    for resource in kustomization["resources"]:
        docs += load_yaml_all(directory / resource)
    return docs


@pytest.fixture(scope="module")
def resources() -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in _kustomized(K8S)}


def _pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = _pod_spec(workload)["containers"]
    result: dict[str, Any] = container
    return result


def test_kustomization_lists_every_manifest() -> None:
    listed = set(load_yaml(K8S / "kustomization.yaml")["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    monitoring = K8S / "monitoring"
    listed = set(load_yaml(monitoring / "kustomization.yaml")["resources"])
    assert listed == {p.name for p in monitoring.glob("*.yaml")} - {"kustomization.yaml"}


def test_core_manifests_match_the_kubernetes_schema() -> None:
    docs = _kustomized(K8S)
    assert {d["kind"] for d in docs} == {"ConfigMap", "Deployment", "Service", "StatefulSet"}
    for doc in docs:
        # Raises ValidationError naming the bad field (strict: unknown fields are errors).
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_schema_validation_catches_a_typo(resources: dict[tuple[str, str], Any]) -> None:
    # Guards the test above: a misspelt probe field must not pass silently.
    doc = resources[("Deployment", "sal-gateway")]
    broken = load_yaml(K8S / "gateway-deployment.yaml")
    _container(broken)["readinessProbe"]["httpGet"]["pth"] = "/ready"
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    with pytest.raises(kubernetes_validate.ValidationError, match="pth"):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize(
    ("kind", "name", "service"),
    [("Deployment", "sal-gateway", "sal-gateway"), ("StatefulSet", "vllm", "vllm-headless")],
)
def test_selectors_match_pod_labels(
    resources: dict[tuple[str, str], Any], kind: str, name: str, service: str
) -> None:
    workload = resources[(kind, name)]
    pod_labels = workload["spec"]["template"]["metadata"]["labels"]
    assert workload["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    svc = resources[("Service", service)]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    # Service targetPort names a port the container declares.
    ports = {p["name"] for p in _container(workload)["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports


def test_gateway_discovers_the_headless_service(
    resources: dict[tuple[str, str], Any], gateway_config: Any
) -> None:
    headless = resources[("Service", "vllm-headless")]
    assert headless["spec"]["clusterIP"] == "None"
    # Loading replicas must not be published (the gateway would route to them).
    assert headless["spec"]["publishNotReadyAddresses"] is False
    statefulset = resources[("StatefulSet", "vllm")]
    assert statefulset["spec"]["serviceName"] == "vllm-headless"
    engine_port = next(p for p in _container(statefulset)["ports"] if p["name"] == "http")
    (model,) = gateway_config.models
    assert model.discovery is not None
    assert model.discovery.dns_name == "vllm-headless"
    assert model.discovery.port == engine_port["containerPort"]
    assert model.backends == ()
    # The model the gateway serves is the one the replicas serve.
    args = _container(statefulset)["args"]
    assert args[args.index("--served-model-name") + 1] == model.name
    # The gateway refuses exactly the prompts the replicas would refuse.
    assert args[args.index("--max-model-len") + 1] == str(model.max_model_len)


@pytest.fixture
def gateway_config(resources: dict[tuple[str, str], Any], tmp_path: Path) -> Any:
    path = tmp_path / "config.yaml"
    path.write_text(resources[("ConfigMap", "sal-gateway-config")]["data"]["config.yaml"])
    return load_config(path)


def test_gateway_configmap_is_a_valid_gateway_config(
    gateway_config: Any, resources: dict[tuple[str, str], Any]
) -> None:
    deployment = resources[("Deployment", "sal-gateway")]
    container = _container(deployment)
    args = container["args"]
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    assert args[args.index("--port") + 1] == str(port)
    assert args[args.index("--host") + 1] == "0.0.0.0"
    config_path = Path(args[args.index("--config") + 1])
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert Path(mount["mountPath"]) / "config.yaml" == config_path
    volume = next(v for v in _pod_spec(deployment)["volumes"] if v["name"] == "config")
    assert volume["configMap"]["name"] == "sal-gateway-config"
    (model,) = gateway_config.models
    assert model.discovery is not None


def test_the_peers_recipe_fits_the_manifests(
    resources: dict[tuple[str, str], Any], tmp_path: Path
) -> None:
    """The ConfigMap's commented ``peers`` block, uncommented, is a valid config whose
    addresses name the peers Service (headless, UDP, every pod published), whose port the
    gateway container declares, and whose secret the Deployment passes in."""
    text = resources[("ConfigMap", "sal-gateway-config")]["data"]["config.yaml"]
    enabled = text.replace("# peers:", "peers:").replace("#   ", "  ")
    path = tmp_path / "config.yaml"
    path.write_text(enabled)
    peers = load_config(path).peers
    assert peers.enabled
    (address,) = peers.addresses
    host, port = address.rsplit(":", 1)
    service = resources[("Service", host)]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    (svc_port,) = service["spec"]["ports"]
    assert (svc_port["port"], svc_port["protocol"]) == (int(port), "UDP")
    container = _container(resources[("Deployment", "sal-gateway")])
    declared = next(p for p in container["ports"] if p["name"] == svc_port["targetPort"])
    assert declared["protocol"] == "UDP"
    assert str(declared["containerPort"]) == peers.listen.rsplit(":", 1)[1]  # type: ignore[union-attr]
    env = {e["name"]: e for e in container["env"]}
    assert env[peers.secret_env]["valueFrom"]["secretKeyRef"]["optional"] is True


def test_gateway_probes_and_hardening(resources: dict[tuple[str, str], Any]) -> None:
    deployment = resources[("Deployment", "sal-gateway")]
    container = _container(deployment)
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    pod_security = _pod_spec(deployment)["securityContext"]
    assert pod_security["runAsNonRoot"] is True
    assert pod_security["runAsUser"] != 0
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # With a read-only root, the paths the gateway writes to must be volumes.
    mounted = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/tmp", "/var/cache/sal"} <= mounted


def test_replicas_request_one_gpu_and_are_probed(resources: dict[tuple[str, str], Any]) -> None:
    container = _container(resources[("StatefulSet", "vllm")])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    args = container["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "1"


def test_engine_args_are_accepted_by_the_launcher(resources: dict[tuple[str, str], Any]) -> None:
    args = _container(resources[("StatefulSet", "vllm")])["args"]
    plan = plan_launch(args, async_default=True)
    assert "--middleware" in plan.vllm_args
    assert plan.vllm_args[plan.vllm_args.index("--scheduler-cls") + 1].endswith(
        "LarryTailAsyncScheduler"
    )


@pytest.mark.parametrize(
    ("kind", "name", "port"), [("Deployment", "sal-gateway", 8080), ("StatefulSet", "vllm", 8000)]
)
def test_pods_carry_scrape_annotations(
    resources: dict[tuple[str, str], Any], kind: str, name: str, port: int
) -> None:
    workload = resources[(kind, name)]
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(port),
        "prometheus.io/path": "/metrics",
    }
    assert port in {p["containerPort"] for p in _container(workload)["ports"]}


def test_service_monitors_select_the_services(resources: dict[tuple[str, str], Any]) -> None:
    monitors = [d for d in _kustomized(K8S / "monitoring") if d["kind"] == "ServiceMonitor"]
    services = [d for (kind, _), d in resources.items() if kind == "Service"]
    assert len(monitors) == 2
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        wanted = monitor["spec"]["selector"]["matchLabels"].items()
        (service,) = [s for s in services if wanted <= s["metadata"]["labels"].items()]
        port_names = {p["name"] for p in service["spec"]["ports"]}
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= port_names


def test_prometheus_rule_matches_the_compose_alert_rules() -> None:
    (rule,) = [d for d in _kustomized(K8S / "monitoring") if d["kind"] == "PrometheusRule"]
    assert rule["spec"]["groups"] == load_yaml(ALERTS)["groups"]
