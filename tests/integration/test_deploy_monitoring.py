"""The Grafana dashboard and the alert rules, checked against a live gateway's ``/metrics``.

The gateway is started the way the compose CPU profile starts it: the ``sal-gateway`` console
script with the image's baked config (deploy/gateway/config.yaml) and the environment compose
gives the container (from deploy/cpu.env), except that DNS discovery resolves ``127.0.0.1``
instead of the compose alias and points at a fake replica's port. Traffic (plain, streaming,
chat, an unknown model, a stream cut mid-way, a replica that dies) makes the labelled series
appear; then every metric and label the dashboard and the alert rules query must be there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_sim.fake_vllm import FakeBackend, ServedBackend
from tests.deploy_support import (
    ALERTS,
    DASHBOARD,
    DEPLOY,
    PROMETHEUS_SYNTHETIC,
    SCRAPE_LABELS,
    compose_project,
    exposition_families,
    load_yaml,
    promql_refs,
)

PORT_RANGE = range(21000, 21500)
"""This test module's ports (the deployment tests' share of the project's port plan)."""
READY_TIMEOUT_S = 60.0
HTTP_TIMEOUT_S = 10.0

# --- static checks of the dashboard and the rules -----------------------------------------


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    result: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return result


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def _dashboard_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, expr) for every query: panel targets and template variables."""
    queries = [
        (f"panel {p['title']!r} {t['refId']}", t["expr"])
        for p in _panels(dashboard)
        for t in p["targets"]
    ]
    for variable in dashboard["templating"]["list"]:
        # label_values(METRIC, LABEL) is Grafana's, not PromQL: check METRIC and LABEL.
        match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variable["query"]["query"])
        assert match, f"unexpected variable query {variable['query']}"
        queries.append((f"variable {variable['name']}", f"count by ({match[2]}) ({match[1]})"))
    return queries


def _alert_rules() -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = [r for g in load_yaml(ALERTS)["groups"] for r in g["rules"]]
    return rules


def test_every_panel_has_a_query_on_the_provisioned_datasource(
    dashboard: dict[str, Any],
) -> None:
    provisioned = load_yaml(DEPLOY / "grafana/provisioning/datasources/prometheus.yaml")
    (datasource,) = provisioned["datasources"]
    uid = datasource["uid"]
    panels = _panels(dashboard)
    assert len(panels) >= 10
    for panel in panels:
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        assert panel["datasource"] == {"type": "prometheus", "uid": uid}
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(set(ref_ids)) == len(ref_ids)
        for target in panel["targets"]:
            assert target["expr"].strip()
            assert target["datasource"]["uid"] == uid
    for variable in dashboard["templating"]["list"]:
        assert variable["datasource"]["uid"] == uid


def test_panels_do_not_overlap_and_have_unique_ids(dashboard: dict[str, Any]) -> None:
    cells: dict[tuple[int, int], str] = {}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(set(ids)) == len(ids)
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


def test_dashboard_covers_what_operators_watch(dashboard: dict[str, Any]) -> None:
    used: set[str] = set()
    for _, expr in _dashboard_queries(dashboard):
        used |= promql_refs(expr).metrics
    assert {
        "sal_ttft_seconds_bucket",  # TTFT percentiles
        "sal_generation_seconds_bucket",  # total generation time percentiles
        "sal_backend_queued_prefill_tokens",  # per replica
        "sal_backend_free_kv_tokens",  # per replica
        "sal_routing_decisions_total",  # routing share
        "sal_retries_total",
        "sal_backend_ejections_total",
        "sal_stream_errors_total",
        "sal_requests_total",  # errors by status
        "sal_beta",
        "sal_adapter_requests_total",  # per LoRA adapter
        "sal_adapter_ttft_seconds_bucket",
        "sal_lora_slot_decisions_total",
        "sal_backend_lora_slots_used",
        "sal_prefix_engine_hit_tokens_total",  # achieved prefix-cache hit rate
        "sal_prefix_predicted_hit_tokens_total",
        "sal_prefix_fleet_reuse_hit_tokens_total",  # what the fleet's KV could keep
    } <= used
    queries = " ".join(expr for _, expr in _dashboard_queries(dashboard))
    for quantile in ("0.5", "0.95", "0.99"):
        assert f"histogram_quantile({quantile}, sum by (le) (rate(sal_ttft_seconds" in queries


def test_alert_rules_are_well_formed() -> None:
    rules = _alert_rules()
    names = [r["alert"] for r in rules]
    assert len(set(names)) == len(names)
    for rule in rules:
        promql_refs(rule["expr"])  # parses, or raises
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        assert rule["annotations"]["summary"]


def test_promql_check_rejects_a_broken_query() -> None:
    # Guards the checks above: a syntax error must not pass as "no metrics referenced".
    with pytest.raises(ValueError, match=r"."):
        promql_refs("sum by (backend (rate(sal_requests_total[5m]))")


# --- the live gateway -----------------------------------------------------------------------


def _free_port() -> int:
    for port in PORT_RANGE:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORT_RANGE}")


def _gateway_env(discovered_port: int, static_url: str) -> dict[str, str]:
    """The container environment compose gives the gateway (CPU profile), adapted to here."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAL_GATEWAY__")}
    compose_env = compose_project(DEPLOY / "cpu.env")["services"]["gateway"]["environment"]
    env.update({key: str(value) for key, value in compose_env.items()})
    model = "SAL_GATEWAY__MODELS__0__"
    env.update(
        {
            # The compose alias `vllm` does not exist here; an address literal resolves to
            # itself through the same getaddrinfo path.
            f"{model}DISCOVERY__DNS_NAME": "127.0.0.1",
            f"{model}DISCOVERY__PORT": str(discovered_port),
            f"{model}DISCOVERY__INTERVAL_S": "0.5",
            f"{model}BACKENDS": json.dumps([static_url]),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
    )
    return env


def _wait(predicate: Any, what: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"gateway exited ({process.returncode}):\n{log.read_text()}")
        try:
            if predicate():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}:\n{log.read_text()}")


def _drive_traffic(client: httpx.Client, model: str) -> None:
    body = {"model": model, "prompt": "hello deployment", "max_tokens": 4}
    for _ in range(4):
        assert client.post("/v1/completions", json=body).status_code == 200
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        assert "[DONE]" in "".join(response.iter_text())
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert client.post("/v1/chat/completions", json={**chat, "stream": True}).status_code == 200
    missing = client.post("/v1/completions", json={**body, "model": "no-such-model"})
    assert missing.status_code == 404


def _popen(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as log_file:
        return subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT)


def _terminate(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=5)


def _emulator_command(port: int) -> list[str]:
    """The CPU profile's emulator service command, bound to 127.0.0.1:`port` instead."""
    service = compose_project(DEPLOY / "cpu.env")["services"]["emulator"]
    entrypoint, args = list(service["entrypoint"]), list(service["command"])
    assert entrypoint[0] == "python"
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--base-port") + 1] = str(port)
    return [sys.executable, *entrypoint[1:], *args]


@pytest.fixture(scope="module")
def live_metrics(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Start the CPU profile (emulated replica + gateway) plus a fake replica for faults,
    drive traffic, and yield the final ``/metrics``."""
    logs = tmp_path_factory.mktemp("deploy-live")
    model = compose_project(DEPLOY / "cpu.env")["services"]["gateway"]["environment"][
        "SAL_GATEWAY__MODELS__0__NAME"
    ]
    emulator_port = _free_port()
    emulator_url = f"http://127.0.0.1:{emulator_port}"
    # The fake replica also serves two LoRA adapters of its own (the emulator serves others),
    # with one slot, held by other-lora.
    static = FakeBackend(name="static", model=model, adapters=("static-lora", "other-lora"))
    static.stats = dataclasses.replace(static.stats, max_loras=1, lora_running=("other-lora",))
    static_server = ServedBackend(static)
    with contextlib.ExitStack() as stack:
        emulator = _popen(_emulator_command(emulator_port), dict(os.environ), logs / "emulator.log")
        stack.callback(_terminate, emulator)
        with httpx.Client(base_url=emulator_url, timeout=HTTP_TIMEOUT_S) as client:
            _wait(
                lambda: client.get("/health").status_code == 200,
                "the emulator",
                emulator,
                logs / "emulator.log",
            )
        static_url = static_server.start()
        stack.callback(static_server.stop)
        port = _free_port()
        executable = Path(sys.executable).with_name("sal-gateway")
        config = DEPLOY / "gateway" / "config.yaml"
        log = logs / "gateway.log"
        command = [str(executable), "serve", "--config", str(config)]
        command += ["--host", "127.0.0.1", "--port", str(port)]
        gateway = _popen(command, _gateway_env(emulator_port, static_url), log)
        stack.callback(_terminate, gateway)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=HTTP_TIMEOUT_S) as client:

            def both_eligible() -> bool:
                ready = client.get("/ready")
                return bool(
                    ready.status_code == 200 and ready.json()["eligible_backends"][model] == 2
                )

            _wait(both_eligible, "/ready with both backends", gateway, log)
            _drive_traffic(client, model)
            # static-lora: only the fake replica lists it, and its one slot is other-lora's.
            lora = {"model": "static-lora", "prompt": "hello adapter", "max_tokens": 4}
            for _ in range(2):
                assert client.post("/v1/completions", json=lora).status_code == 200
            # The fake replica cuts streams after the first chunk: a stream error once the
            # gateway routes a stream there (SAL alternates between idle replicas).
            static.behaviour.close_after_chunks = 1
            body = {"model": model, "prompt": "x", "max_tokens": 8, "stream": True}
            for _ in range(10):
                with client.stream("POST", "/v1/completions", json=body) as response:
                    "".join(response.iter_text())
                if "sal_stream_errors_total{" in client.get("/metrics").text:
                    break
            static.behaviour.close_after_chunks = None
            # A replica that dies is ejected after eject_after_failures failed polls.
            static_server.stop()
            _wait(
                lambda: "sal_backend_ejections_total{" in client.get("/metrics").text,
                "the stopped replica's ejection",
                gateway,
                log,
            )
            # A loaded CI machine can starve the emulator past stale_after_s (1 s) at any one
            # scrape: take the snapshot once it is healthy (bounded; if it never is, the
            # snapshot shows it and the DNS test fails).
            emulator_healthy = (
                f'sal_backend_healthy{{backend="{emulator_url}",model="{model}"}} 1.0'
            )
            deadline = time.monotonic() + READY_TIMEOUT_S
            text = client.get("/metrics").text
            while emulator_healthy not in text and time.monotonic() < deadline:
                time.sleep(0.1)
                text = client.get("/metrics").text
        yield {
            "text": text,
            "families": exposition_families(text),
            "discovered_url": emulator_url,
            "static_url": static_url,
        }


def _queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    rules = [(f"alert {r['alert']}", r["expr"]) for r in _alert_rules()]
    return _dashboard_queries(dashboard) + rules


def _legend_labels() -> list[tuple[str, str, set[str]]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (p["title"], t["expr"], set(re.findall(r"\{\{\s*(\w+)\s*\}\}", t["legendFormat"])))
        for p in _panels(dashboard)
        for t in p["targets"]
    ]


def test_gateway_found_the_replica_through_dns(live_metrics: dict[str, Any]) -> None:
    text = live_metrics["text"]
    healthy = f'sal_backend_healthy{{backend="{live_metrics["discovered_url"]}",model="tiny"}} 1.0'
    assert healthy in text
    assert 'sal_backend_stats_source{backend="' in text


def test_every_queried_metric_is_exported_by_the_gateway(live_metrics: dict[str, Any]) -> None:
    exported = set(live_metrics["families"])
    missing = {
        where: sorted(promql_refs(expr).metrics - exported - PROMETHEUS_SYNTHETIC)
        for where, expr in _queries()
    }
    assert {where: names for where, names in missing.items() if names} == {}


def test_every_queried_label_exists_on_the_live_series(live_metrics: dict[str, Any]) -> None:
    families: dict[str, set[str]] = live_metrics["families"]
    unchecked: set[str] = set()
    problems: dict[str, list[str]] = {}
    legends = {expr: labels for _, expr, labels in _legend_labels()}
    for where, expr in _queries():
        refs = promql_refs(expr)
        metrics = refs.metrics - PROMETHEUS_SYNTHETIC
        available = set().union(*(families.get(m, set()) for m in metrics)) | SCRAPE_LABELS
        if metrics and not any(families.get(m) for m in metrics):
            unchecked |= metrics  # no sample yet, so no labels to compare with
            continue
        wanted = refs.labels | legends.get(expr, set())
        if wanted - available:
            problems[where] = sorted(wanted - available)
    assert problems == {}
    # Only the retry counter may lack samples: a connect failure after a good poll is a race
    # this test does not stage. Everything else was exercised above.
    assert unchecked <= {"sal_retries_total"}


def test_faults_show_up_where_the_dashboard_looks(live_metrics: dict[str, Any]) -> None:
    text = live_metrics["text"]
    static = re.escape(live_metrics["static_url"])
    assert re.search(
        rf'sal_backend_ejections_total\{{backend="{static}",model="tiny"\}} [1-9]', text
    )
    assert re.search(r'sal_backend_healthy\{backend="' + static + r'",model="tiny"\} 0', text)
    assert re.search(r'sal_stream_errors_total\{backend="[^"]+",model="tiny"\} [1-9]', text)
    # The request for an unknown model reached no backend and is counted as such.
    assert re.search(r'sal_requests_total\{backend="none",model="[^"]+",status="404"\} 1', text)
    # The adapter's requests waited for the fake replica's only LoRA slot (other-lora's).
    assert re.search(
        r'sal_lora_slot_decisions_total\{model="tiny",outcome="no_free_slot"\} 2', text
    )
    assert re.search(
        r'sal_adapter_requests_total\{adapter="static-lora",model="tiny",status="200"\} 2', text
    )
