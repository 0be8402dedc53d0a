"""Tracing settings: the ``tracing`` config section, its precedence against ``OTEL_*``
variables, the exporters it builds, and a gateway without the ``otel`` extra."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sal_gateway.config import ConfigError, TracingConfig, build_config, load_config
from sal_gateway.tracing import (
    NO_SPAN,
    NO_TRACE,
    ExportSettings,
    TracingError,
    _span_exporter,
    resolve_settings,
)

MODELS = [{"name": "m", "backends": ["http://127.0.0.1:9"]}]
ON = TracingConfig(enabled=True)


def test_tracing_is_off_by_default() -> None:
    config = build_config({"models": MODELS})
    assert config.tracing == TracingConfig()
    assert config.tracing.enabled is False
    assert resolve_settings(config.tracing, {}) is None


def test_tracing_section_is_read() -> None:
    data = {
        "enabled": True,
        "exporter": "otlp_grpc",
        "endpoint": "http://collector:4317",
        "service_name": "gw-eu",
        "sample_ratio": 0.25,
    }
    config = build_config({"models": MODELS, "tracing": data})
    assert config.tracing == TracingConfig(
        True, "otlp_grpc", "http://collector:4317", "gw-eu", 0.25
    )


@pytest.mark.parametrize(
    ("tracing", "message"),
    [
        ({"exporter": "jaeger"}, "tracing.exporter: expected one of otlp_http, otlp_grpc, console"),
        ({"sample_ratio": 1.5}, "tracing.sample_ratio: must be within 0..1"),
        ({"sample_ratio": "all"}, "tracing.sample_ratio: expected a number"),
        ({"endpoint": "collector:4318"}, "tracing.endpoint: expected an http(s)://host:port URL"),
        ({"enabled": "yes"}, "tracing.enabled: expected true or false"),
        ({"service_name": ""}, "tracing.service_name: expected a non-empty string"),
        ({"exporters": "console"}, "tracing.exporters: unknown key"),
    ],
)
def test_bad_tracing_config_names_the_key(tracing: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_config({"models": MODELS, "tracing": tracing})


def test_gateway_environment_override_turns_tracing_on(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("models: [{name: m, backends: ['http://127.0.0.1:9']}]\n")
    config = load_config(path, {"SAL_GATEWAY__TRACING__ENABLED": "true"})
    assert config.tracing.enabled is True


@pytest.mark.parametrize(
    ("config", "environ", "expected"),
    [
        # config alone
        (ON, {}, ExportSettings("otlp_http", None, "sal-gateway", 1.0)),
        (
            TracingConfig(True, "otlp_http", "http://c:4318", "gw", 0.5),
            {},
            ExportSettings("otlp_http", "http://c:4318/v1/traces", "gw", 0.5),
        ),
        (
            TracingConfig(True, "otlp_http", "http://c:4318/custom"),
            {},
            ExportSettings("otlp_http", "http://c:4318/custom", "sal-gateway", 1.0),
        ),
        (
            TracingConfig(True, "otlp_grpc", "http://c:4317"),
            {},
            ExportSettings("otlp_grpc", "http://c:4317", "sal-gateway", 1.0),
        ),
        (TracingConfig(True, "console"), {}, ExportSettings("console", None, "sal-gateway", 1.0)),
        # OTEL_* variables win over the config (None: left to the SDK, which reads them)
        (
            TracingConfig(True, "otlp_http", "http://c:4318"),
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://other:4318"},
            ExportSettings("otlp_http", None, "sal-gateway", 1.0),
        ),
        (
            TracingConfig(True, "otlp_http", "http://c:4318"),
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://other:4318/v1/traces"},
            ExportSettings("otlp_http", None, "sal-gateway", 1.0),
        ),
        (ON, {"OTEL_SERVICE_NAME": "x"}, ExportSettings("otlp_http", None, None, 1.0)),
        (
            ON,
            {"OTEL_RESOURCE_ATTRIBUTES": "service.name=x,team=y"},
            ExportSettings("otlp_http", None, None, 1.0),
        ),
        (
            ON,
            {"OTEL_RESOURCE_ATTRIBUTES": "team=y"},
            ExportSettings("otlp_http", None, "sal-gateway", 1.0),
        ),
        (
            ON,
            {"OTEL_TRACES_SAMPLER": "always_off"},
            ExportSettings("otlp_http", None, "sal-gateway", None),
        ),
        (
            ON,
            {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            ExportSettings("otlp_grpc", None, "sal-gateway", 1.0),
        ),
        (
            TracingConfig(True, "otlp_grpc"),
            {
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            },
            ExportSettings("otlp_http", None, "sal-gateway", 1.0),
        ),
        (
            ON,
            {"OTEL_TRACES_EXPORTER": "console"},
            ExportSettings("console", None, "sal-gateway", 1.0),
        ),
        (
            TracingConfig(True, "console"),
            {"OTEL_TRACES_EXPORTER": "otlp"},
            ExportSettings("otlp_http", None, "sal-gateway", 1.0),
        ),
        # off switches
        (ON, {"OTEL_SDK_DISABLED": "true"}, None),
        (ON, {"OTEL_SDK_DISABLED": "TRUE"}, None),
        (ON, {"OTEL_TRACES_EXPORTER": "none"}, None),
        (TracingConfig(enabled=False), {"OTEL_SERVICE_NAME": "x"}, None),  # never turns it on
        (ON, {"OTEL_SDK_DISABLED": "false"}, ExportSettings("otlp_http", None, "sal-gateway", 1.0)),
    ],
)
def test_settings_precedence(
    config: TracingConfig, environ: dict[str, str], expected: ExportSettings | None
) -> None:
    assert resolve_settings(config, environ) == expected


@pytest.mark.parametrize(
    "environ",
    [
        {"OTEL_TRACES_EXPORTER": "zipkin"},
        {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
    ],
)
def test_unsupported_otel_values_are_refused(environ: dict[str, str]) -> None:
    with pytest.raises(TracingError, match=next(iter(environ.values()))):
        resolve_settings(ON, environ)


def test_exporters_get_the_endpoint() -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
        OTLPSpanExporter as GrpcExporter,
    )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    http = _span_exporter(ExportSettings("otlp_http", "http://c:4318/v1/traces", None, None))
    assert isinstance(http, OTLPSpanExporter)
    assert http._endpoint == "http://c:4318/v1/traces"
    grpc = _span_exporter(ExportSettings("otlp_grpc", "http://c:4317", None, None))
    assert isinstance(grpc, GrpcExporter)
    grpc.shutdown()
    assert isinstance(
        _span_exporter(ExportSettings("console", None, None, None)), ConsoleSpanExporter
    )


def test_no_op_hooks_change_nothing() -> None:
    headers = {"traceparent": "00-1-2-01", "x": "y"}
    assert NO_SPAN.inject(headers) is headers
    assert NO_TRACE.upstream("http://a:1", "/v1/completions") is NO_SPAN
    with NO_TRACE.tokenize() as span:
        span.counted(None)  # type: ignore[arg-type]  # never looked at


_WITHOUT_OTEL = textwrap.dedent(
    """
    import sys
    sys.modules["opentelemetry"] = None  # as if the `otel` extra were not installed
    from sal_gateway.app import create_app
    from sal_gateway.cli import main
    from sal_gateway.config import build_config
    from sal_gateway.tracing import TracingError

    models = [{"name": "m", "backends": ["http://127.0.0.1:9"]}]
    create_app(build_config({"models": models}))
    assert not [m for m in sys.modules if m.startswith("opentelemetry.")]
    try:
        create_app(build_config({"models": models, "tracing": {"enabled": True}}))
    except TracingError as exc:
        print("refused:", exc)
    with open(sys.argv[1], "w") as f:
        f.write("models: [{name: m, backends: ['http://127.0.0.1:9']}]\\n")
        f.write("tracing: {enabled: true}\\n")
    print("exit status", main(["serve", "--config", sys.argv[1]]))
    """
)


def test_gateway_without_the_otel_extra(tmp_path: Path) -> None:
    """Tracing off: nothing imports OpenTelemetry. On: a start-up error naming the extra
    (``sal-gateway serve`` exits 2 before binding)."""
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_OTEL, str(tmp_path / "config.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "refused: tracing.enabled is true but OpenTelemetry is not installed" in result.stdout
    assert "pip install 'sal-gateway[otel]'" in result.stdout
    assert "exit status 2" in result.stdout
    assert "sal-gateway: bad config: tracing.enabled is true" in result.stderr
