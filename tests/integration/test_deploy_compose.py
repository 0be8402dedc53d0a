"""deploy/compose*.yaml, .env, cpu.env, Prometheus config: what `docker compose up` would see.

No Docker engine runs here, so these tests do what compose does before it starts anything:
select the files from the env file, interpolate variables, validate against the compose-spec
JSON schema (vendored by check-jsonschema), and then check the wiring that the schema cannot
see: replica GPU pinning, the DNS alias shared by the gateway, Prometheus and the replicas,
the gateway's config with compose's environment overrides, and the engine command line.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from check_jsonschema.builtin_schemas import get_builtin_schema

from engine_patch.launcher import plan_launch
from sal_gateway.config import load_config
from tests.deploy_support import (
    DEPLOY,
    compose_project,
    compose_raw,
    interpolate,
    load_yaml,
    read_env,
    render_module,
    variables,
)

GPU_ENV = DEPLOY / ".env"
CPU_ENV = DEPLOY / "cpu.env"
ENGINE_PORT = 8000


def _services(project: dict[str, Any], profiles: set[str]) -> dict[str, Any]:
    """Services compose would start with these profiles active."""
    return {
        name: svc
        for name, svc in project["services"].items()
        if not svc.get("profiles") or profiles & set(svc["profiles"])
    }


def _profiles(env_file: Path) -> set[str]:
    raw = read_env(env_file).get("COMPOSE_PROFILES", "")
    return {p for p in raw.split(",") if p}


def _aliases(service: dict[str, Any]) -> set[str]:
    networks = service.get("networks") or {}
    return {a for net in networks.values() for a in (net or {}).get("aliases", [])}


@pytest.fixture(scope="module")
def compose_schema() -> dict[str, Any]:
    schema: dict[str, Any] = get_builtin_schema("vendor.compose-spec")
    return schema


@pytest.mark.parametrize("name", ["compose.yaml", "compose.replicas.yaml"])
def test_compose_files_match_the_compose_spec(name: str, compose_schema: dict[str, Any]) -> None:
    document = load_yaml(DEPLOY / name)
    validator = jsonschema.validators.validator_for(compose_schema)(compose_schema)
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(document)]
    assert errors == []


@pytest.mark.parametrize("env_file", [GPU_ENV, CPU_ENV], ids=["gpu", "cpu"])
def test_interpolated_project_is_valid(env_file: Path, compose_schema: dict[str, Any]) -> None:
    # Interpolation fails on any required variable the env file does not set.
    project = compose_project(env_file)
    validator = jsonschema.validators.validator_for(compose_schema)(compose_schema)
    assert [e.message for e in validator.iter_errors(project)] == []
    assert {"gateway", "prometheus", "grafana"} <= set(_services(project, _profiles(env_file)))


@pytest.mark.parametrize("env_file", [GPU_ENV, CPU_ENV], ids=["gpu", "cpu"])
def test_every_variable_is_listed_in_the_env_file(env_file: Path) -> None:
    # Every knob of a deployment lives in its env file, defaults included, so that one file is
    # the place to read and change them (the variables of inactive services do not count).
    raw = compose_raw(env_file)
    env = read_env(env_file)
    used = {"name": raw["name"], **_services(raw, _profiles(env_file))}
    missing = sorted(set(variables(used)) - set(env))
    assert missing == [], f"{env_file.name} does not list {missing}"


def test_committed_replicas_file_matches_env() -> None:
    render = render_module()
    env = read_env(GPU_ENV)
    replicas, gpus = int(env["REPLICAS"]), int(env["GPUS_PER_REPLICA"])
    expected = render.dump(render.render(replicas, gpus), replicas, gpus)
    assert (DEPLOY / "compose.replicas.yaml").read_text() == expected, (
        "deploy/compose.replicas.yaml is stale: run python3 deploy/render_replicas.py"
    )


@pytest.mark.parametrize(("replicas", "gpus"), [(1, 1), (3, 1), (2, 4)])
def test_each_replica_gets_its_own_gpus(replicas: int, gpus: int) -> None:
    services = render_module().render(replicas, gpus)["services"]
    engines = {name: svc for name, svc in services.items() if name.startswith("vllm-")}
    assert len(engines) == replicas
    pinned: list[str] = []
    for svc in engines.values():
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"]
        assert len(device["device_ids"]) == gpus
        assert svc["command"][svc["command"].index("--tensor-parallel-size") + 1] == str(gpus)
        pinned += device["device_ids"]
    assert sorted(pinned, key=int) == [str(i) for i in range(replicas * gpus)]
    # The gateway waits for the first replica only (its tokenizer comes from the model cache
    # that replica filled); the others join through discovery.
    assert services["gateway"]["depends_on"] == {"vllm-0": {"condition": "service_healthy"}}


def test_render_script_writes_file_from_env(tmp_path: Path) -> None:
    env_file = tmp_path / ".env"
    env_file.write_text("REPLICAS=3\nGPUS_PER_REPLICA=2\n")
    out = tmp_path / "compose.replicas.yaml"
    assert render_module().main(["--env-file", str(env_file), "--output", str(out)]) == 0
    services = load_yaml(out)["services"]
    assert sorted(s for s in services if s.startswith("vllm-")) == ["vllm-0", "vllm-1", "vllm-2"]
    devices = services["vllm-2"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert devices["device_ids"] == ["4", "5"]


def test_render_script_rejects_bad_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env_file = tmp_path / ".env"
    env_file.write_text("REPLICAS=zero\nGPUS_PER_REPLICA=1\n")
    assert render_module().main(["--env-file", str(env_file), "--output", str(tmp_path / "x")]) == 2
    assert "REPLICAS" in capsys.readouterr().err


@pytest.mark.parametrize("env_file", [GPU_ENV, CPU_ENV], ids=["gpu", "cpu"])
def test_replicas_share_the_discovery_alias(env_file: Path) -> None:
    project = compose_project(env_file)
    services = _services(project, _profiles(env_file))
    replicas = {n: s for n, s in services.items() if "vllm" in _aliases(s)}
    assert replicas, "no replica service carries the `vllm` alias"
    expected = int(read_env(env_file).get("REPLICAS", "0")) or int(
        read_env(env_file)["CPU_REPLICAS"]
    )
    copies = sum(int(s.get("deploy", {}).get("replicas", 1)) for s in replicas.values())
    assert copies == expected
    # Nothing but replicas may answer to the discovery name.
    assert not {"gateway", "prometheus", "grafana"} & set(replicas)


@pytest.mark.parametrize("env_file", [GPU_ENV, CPU_ENV], ids=["gpu", "cpu"])
def test_gateway_config_with_compose_overrides_discovers_the_replicas(
    env_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gateway = compose_project(env_file)["services"]["gateway"]
    for key, value in gateway["environment"].items():
        monkeypatch.setenv(key, str(value))
    # The image bakes deploy/gateway/config.yaml at /etc/sal/config.yaml.
    config = load_config(DEPLOY / "gateway" / "config.yaml")
    env = read_env(env_file)
    (model,) = config.models
    assert model.name == env["SERVED_MODEL_NAME"]
    assert model.discovery is not None
    assert (model.discovery.dns_name, model.discovery.port) == ("vllm", ENGINE_PORT)
    expected_tokenizer = None if env["GATEWAY_TOKENIZER"] == "null" else env["GATEWAY_TOKENIZER"]
    assert model.tokenizer == expected_tokenizer
    assert config.routing.policy == env["ROUTING_POLICY"]
    # The gateway refuses exactly the prompts the replicas would refuse.
    assert model.max_model_len == int(env["MAX_MODEL_LEN"])
    assert config.listen == dataclasses.replace(config.listen, host="0.0.0.0", port=8080)
    assert gateway["ports"] == [f"{env['GATEWAY_BIND']}:{env['GATEWAY_PORT']}:8080"]


def test_gpu_engine_command_is_accepted_by_the_launcher() -> None:
    project = compose_project(GPU_ENV)
    env = read_env(GPU_ENV)
    engines = [s for n, s in project["services"].items() if n.startswith("vllm-")]
    assert len(engines) == int(env["REPLICAS"])
    for svc in engines:
        args = svc["command"]
        assert args[0] == env["MODEL"]
        plan = plan_launch(args, async_default=True)
        vllm_args = plan.vllm_args
        assert vllm_args[vllm_args.index("--port") + 1] == str(ENGINE_PORT)
        assert vllm_args[vllm_args.index("--served-model-name") + 1] == env["SERVED_MODEL_NAME"]
        assert "--middleware" in vllm_args  # /stats is served
        scheduler = vllm_args[vllm_args.index("--scheduler-cls") + 1]
        assert scheduler.endswith("LarryTailAsyncScheduler")  # the default: LARRY + tail guard
        config = vllm_args[vllm_args.index("--additional-config") + 1]
        assert f'"alpha":{float(env["LARRY_ALPHA"])}' in config


def test_fcfs_switch_needs_no_other_change() -> None:
    # ENGINE_SCHEDULER=fcfs with the LARRY_ALPHA still in .env must still launch.
    env = {**read_env(GPU_ENV), "ENGINE_SCHEDULER": "fcfs"}
    args = interpolate(render_module().render(1, 1)["services"]["vllm-0"]["command"], env)
    plan = plan_launch(args, async_default=True)
    assert plan.vllm_args[plan.vllm_args.index("--scheduler-cls") + 1].endswith(
        "FcfsAsyncScheduler"
    )


def test_cpu_profile_runs_without_gpus() -> None:
    project = compose_project(CPU_ENV)
    active = _services(project, _profiles(CPU_ENV))
    for name, svc in active.items():
        devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {})
        assert "devices" not in devices, f"{name} reserves a device in the CPU profile"
        assert "gpus" not in svc
    emulator = active["emulator"]
    assert emulator["entrypoint"][:3] == ["python", "-m", "engine_sim.emulator"]
    args = emulator["command"]
    assert args[args.index("--base-port") + 1] == str(ENGINE_PORT)
    assert args[args.index("--host") + 1] == "0.0.0.0"
    assert args[args.index("--max-model-len") + 1] == read_env(CPU_ENV)["MAX_MODEL_LEN"]
    # The emulator runs from the gateway image: same image, built by the same build section.
    assert emulator["image"] == project["services"]["gateway"]["image"]


def test_gpu_env_does_not_start_the_emulator() -> None:
    active = _services(compose_project(GPU_ENV), _profiles(GPU_ENV))
    assert "emulator" not in active


def test_prometheus_scrapes_gateway_and_every_replica() -> None:
    config = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["sal-gateway"]["static_configs"][0]["targets"] == ["gateway:8080"]
    (dns,) = jobs["vllm"]["dns_sd_configs"]
    assert (dns["names"], dns["port"], dns["type"]) == (["vllm"], ENGINE_PORT, "A")
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    prometheus = compose_project(GPU_ENV)["services"]["prometheus"]
    assert "./prometheus:/etc/prometheus:ro" in prometheus["volumes"]
    assert (DEPLOY / "prometheus" / "alerts.yml").is_file()


def test_grafana_provisioning_points_at_the_dashboard_and_prometheus() -> None:
    grafana = compose_project(GPU_ENV)["services"]["grafana"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in grafana["volumes"] if ":ro" in v)
    dashboards = load_yaml(DEPLOY / "grafana/provisioning/dashboards/sal.yaml")
    path_in_container = dashboards["providers"][0]["options"]["path"]
    host_dir = next(h for h, c in mounts.items() if c == path_in_container)
    assert (DEPLOY / host_dir / "sal.json").is_file()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{path_in_container}/sal.json"
    (datasource,) = load_yaml(DEPLOY / "grafana/provisioning/datasources/prometheus.yaml")[
        "datasources"
    ]
    assert datasource["url"] == "http://prometheus:9090"
