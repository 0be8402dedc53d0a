"""Config loading: the example config, validation naming the key path, env overrides, CLI."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sal_gateway import __version__, cli
from sal_gateway.config import ConfigError, ListenConfig, build_config, load_config

REPO = Path(__file__).resolve().parents[2]

MINIMAL = """
models:
  - name: tiny
    backends: ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
routing:
  policy: sal
  poll_interval_s: 0.1
listen: {host: 127.0.0.1, port: 8080}
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_example_config_in_repo_loads() -> None:
    config = load_config(REPO / "config.yaml", environ={})
    assert [m.name for m in config.models] == ["tiny"]
    assert config.models[0].backends == ("http://127.0.0.1:8001", "http://127.0.0.1:8002")
    assert config.routing.policy == "sal"
    assert config.routing.poll_interval_s == 0.1
    assert config.proxy.max_body_bytes == 10485760


def test_minimal_shape_from_issue_gets_defaults(tmp_path: Path) -> None:
    config = load_config(_write(tmp_path, MINIMAL), environ={})
    assert config.listen.port == 8080
    assert config.routing.stale_after_s == 1.0
    assert config.routing.eject_after_failures == 3
    assert config.routing.poll_backoff_max_s == 2.0
    assert config.routing.accounting_grace_s == 0.05
    assert config.models[0].tokenizer is None
    assert config.model("tiny") is config.models[0]
    assert config.model("other") is None


@pytest.mark.parametrize(
    ("patch", "path_in_message"),
    [
        ({"bogus": 1}, "bogus"),
        ({"routing": {"polcy": "sal"}}, "routing.polcy"),
        ({"proxy": {"timeout": 1}}, "proxy.timeout"),
        # Removed in issue 8: a non-streaming request is bounded by total_timeout_s only.
        ({"proxy": {"first_byte_timeout_s": 60}}, "proxy.first_byte_timeout_s"),
        ({"listen": {"hots": "x"}}, "listen.hots"),
        (
            {"models": [{"name": "m", "backends": ["http://a:1"], "tokeniser": "x"}]},
            "models[0].tokeniser",
        ),
        (
            {"models": [{"name": "m", "discovery": {"dns_name": "x", "ttl": 3}}]},
            "models[0].discovery.ttl",
        ),
    ],
)
def test_unknown_keys_are_rejected_naming_the_path(
    patch: dict[str, object], path_in_message: str
) -> None:
    data: dict[str, object] = {"models": [{"name": "m", "backends": ["http://a:1"]}]}
    data.update(patch)
    with pytest.raises(ConfigError, match=re.escape(path_in_message) + ": unknown key"):
        build_config(data)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"models": []}, "models: expected a non-empty list"),
        ({"models": [{"backends": ["http://a:1"]}]}, r"models\[0\].name: required"),
        ({"models": [{"name": "m"}]}, "needs `backends` or `discovery`"),
        ({"models": [{"name": "m", "backends": ["ftp://a"]}]}, r"backends\[0\]"),
        ({"models": [{"name": "m", "backends": "http://a:1"}]}, "expected a list"),
        ({"models": [{"name": "m", "backends": ["http://a:1", "http://a:1"]}]}, "duplicate"),
        ({"models": [{"name": "m", "backends": ["http://a:1"]}] * 2}, "configured twice"),
        (
            {"models": [{"name": "m", "backends": ["http://a:1"], "max_model_len": "4k"}]},
            "max_model_len: expected an integer",
        ),
        ({"routing": {"policy": "fastest"}}, "unknown policy 'fastest'"),
        ({"routing": {"poll_interval_s": 0}}, "poll_interval_s: must be a positive"),
        ({"routing": {"poll_timeout_s": "1s"}}, "poll_timeout_s: expected a number"),
        ({"routing": {"eject_after_failures": 0}}, "eject_after_failures: must be >= 1"),
        ({"routing": {"beta_seed": 0.5}}, "beta_seed: must be >= 1"),
        ({"routing": {"max_retries": True}}, "max_retries: expected an integer"),
        ({"proxy": {"stream_header_timeout_s": 0}}, "stream_header_timeout_s: must be a posit"),
        ({"proxy": {"stream_idle_timeout_s": "1m"}}, "stream_idle_timeout_s: expected a number"),
        ({"routing": {"poll_backoff_max_s": 0}}, "poll_backoff_max_s: must be a positive"),
        ({"routing": {"accounting_grace_s": -0.1}}, "accounting_grace_s: must be >= 0"),
        ({"routing": {"accounting_grace_s": "50ms"}}, "accounting_grace_s: expected a number"),
        ({"routing": {"lora_slots": "off"}}, "routing.lora_slots: expected true or false"),
        ({"listen": {"port": 70000}}, "listen.port"),
        ({"log_level": "loud"}, "log_level"),
    ],
)
def test_bad_values_are_rejected_with_a_clear_message(
    data: dict[str, object], message: str
) -> None:
    full: dict[str, object] = {"models": [{"name": "m", "backends": ["http://a:1"]}]}
    full.update(data)
    with pytest.raises(ConfigError, match=message):
        build_config(full)


def test_env_overrides_nested_and_indexed_values(tmp_path: Path) -> None:
    env = {
        "SAL_GATEWAY__ROUTING__POLICY": "p2c",
        "SAL_GATEWAY__ROUTING__SEED": "7",
        "SAL_GATEWAY__LISTEN__PORT": "9000",
        "SAL_GATEWAY__MODELS__0__MAX_MODEL_LEN": "2048",
        "SAL_GATEWAY__PROXY__TOTAL_TIMEOUT_S": "30.5",
        "UNRELATED": "x",
    }
    config = load_config(_write(tmp_path, MINIMAL), environ=env)
    assert config.routing.policy == "p2c"
    assert config.routing.seed == 7
    assert config.listen.port == 9000
    assert config.models[0].max_model_len == 2048
    assert config.proxy.total_timeout_s == 30.5


def test_env_override_with_unknown_key_or_bad_value_is_rejected(tmp_path: Path) -> None:
    path = _write(tmp_path, MINIMAL)
    with pytest.raises(ConfigError, match=r"routing.polcy: unknown key"):
        load_config(path, environ={"SAL_GATEWAY__ROUTING__POLCY": "p2c"})
    with pytest.raises(ConfigError, match="unknown policy"):
        load_config(path, environ={"SAL_GATEWAY__ROUTING__POLICY": "nope"})
    with pytest.raises(ConfigError, match="no list item"):
        load_config(path, environ={"SAL_GATEWAY__MODELS__3__NAME": "x"})


def test_unreadable_or_invalid_yaml_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml", environ={})
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(_write(tmp_path, "models: [\n"), environ={})


def test_cli_bad_config_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, MINIMAL + "extra_key: 1\n")
    assert cli.main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "extra_key: unknown key" in err


def test_cli_missing_tokenizer_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = MINIMAL.replace("- name: tiny", f"- name: tiny\n    tokenizer: {tmp_path / 'nope'}")
    assert cli.main(["serve", "--config", str(_write(tmp_path, text))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "cannot load tokenizer" in err


def test_cli_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert __version__ in capsys.readouterr().out


def test_keep_alive_outlasts_client_pools_by_default_and_is_configurable(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "models: [{name: m, backends: ['http://127.0.0.1:1']}]\nlisten: {keep_alive_s: 120}\n"
    )
    assert load_config(path).listen.keep_alive_s == 120.0
    # httpx and the OpenAI SDK expire idle pooled connections after 5 s.
    assert ListenConfig().keep_alive_s > 5.0
    path.write_text(
        "models: [{name: m, backends: ['http://127.0.0.1:1']}]\nlisten: {keep_alive_s: 0}\n"
    )
    with pytest.raises(ConfigError, match=r"listen\.keep_alive_s"):
        load_config(path)


def test_stream_timeouts_default_to_vllm_shaped_bounds() -> None:
    config = build_config({"models": [{"name": "m", "backends": ["http://a:1"]}]})
    assert config.proxy.stream_header_timeout_s == 10.0
    assert config.proxy.stream_idle_timeout_s == 60.0
    assert config.proxy.total_timeout_s == 600.0


def test_body_workers_are_configurable_and_at_least_one() -> None:
    base = {"models": [{"name": "m", "backends": ["http://a:1"]}]}
    assert build_config(base).limits.body_workers == 2
    config = build_config({**base, "limits": {"body_workers": 1, "body_max_waiting": 0}})
    assert config.limits.body_workers == 1
    assert config.limits.body_max_waiting == 0
    # Zero workers would put large bodies back on the event loop: refused, naming the key.
    with pytest.raises(ConfigError, match=r"limits\.body_workers: must be >= 1"):
        build_config({**base, "limits": {"body_workers": 0}})


_M = {"name": "m", "backends": ["http://a:1"]}


def test_prefix_cache_keys_default_and_validate() -> None:
    routing = build_config({"models": [_M]}).routing
    assert routing.prefix_cache == "approximate"
    assert (routing.session_header, routing.kv_events_port, routing.kv_events_topic) == (
        None,
        5557,
        "",
    )
    config = build_config(
        {
            "models": [{**_M, "kv_events_endpoints": {"http://a:1": "tcp://10.0.0.5:5600"}}],
            "routing": {"prefix_cache": "kv_events", "session_header": "X-Session-Id"},
        }
    )
    assert config.routing.prefix_cache == "kv_events"
    assert config.routing.session_header == "x-session-id"
    assert routing.prefix_min_match_tokens == 1024
    assert (
        build_config(
            {"models": [_M], "routing": {"prefix_min_match_tokens": 0}}
        ).routing.prefix_min_match_tokens
        == 0
    )
    assert config.models[0].kv_events_endpoints == (("http://a:1", "tcp://10.0.0.5:5600"),)
    # Replay is off unless a port or an endpoint names the replicas' replay sockets.
    assert routing.kv_events_replay_port is None
    assert config.models[0].kv_events_replay_endpoints == ()
    replay = build_config(
        {
            "models": [{**_M, "kv_events_replay_endpoints": {"http://a:1": "ipc:///r.sock"}}],
            "routing": {"prefix_cache": "kv_events", "kv_events_replay_port": 5558},
        }
    )
    assert replay.routing.kv_events_replay_port == 5558
    assert replay.models[0].kv_events_replay_endpoints == (("http://a:1", "ipc:///r.sock"),)


@pytest.mark.parametrize(
    ("routing", "model", "message"),
    [
        ({"prefix_cache": "precise"}, {}, "routing.prefix_cache: expected one of off"),
        ({"prefix_cache": True}, {}, "routing.prefix_cache: expected one of"),
        ({"session_header": "bad header"}, {}, "routing.session_header: not a valid"),
        ({"kv_events_port": 70000}, {}, "routing.kv_events_port: must be <= 65535"),
        ({"kv_events_topic": 3}, {}, "routing.kv_events_topic: expected a string"),
        ({"kv_events_replay_port": 0}, {}, "routing.kv_events_replay_port: must be >= 1"),
        ({"kv_events_replay_port": "x"}, {}, "routing.kv_events_replay_port: expected"),
        ({}, {"kv_events_replay_endpoints": {"http://a:1": "a:1"}}, "expected a ZMQ endpoint"),
        ({"prefix_min_match_tokens": -1}, {}, "routing.prefix_min_match_tokens: must be >= 0"),
        ({}, {"kv_events_endpoints": ["tcp://a:1"]}, r"kv_events_endpoints: expected a mapping"),
        ({}, {"kv_events_endpoints": {"http://a:1": "a:1"}}, "expected a ZMQ endpoint"),
        ({}, {"kv_events_endpoints": {"nope": "tcp://a:1"}}, r"kv_events_endpoints\['nope'\]"),
    ],
)
def test_bad_prefix_cache_keys_are_named(
    routing: dict[str, object], model: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config({"models": [{**_M, **model}], "routing": routing})


def test_shutdown_drain_settings_default_and_validate() -> None:
    base: dict[str, object] = {"models": [{"name": "m", "backends": ["http://a:1"]}]}
    listen = build_config(base).listen
    # A rolling update must not cut streams that finish within half a minute.
    assert (listen.shutdown_delay_s, listen.shutdown_grace_s) == (0.0, 30.0)
    custom = build_config({**base, "listen": {"shutdown_delay_s": 5, "shutdown_grace_s": 0}})
    assert (custom.listen.shutdown_delay_s, custom.listen.shutdown_grace_s) == (5.0, 0.0)
    for key, value in (("shutdown_delay_s", -1), ("shutdown_grace_s", "long")):
        with pytest.raises(ConfigError, match=rf"listen\.{key}"):
            build_config({**base, "listen": {key: value}})


def test_workers_share_their_accounting_unless_told_not_to() -> None:
    base: dict[str, object] = {"models": [{"name": "m", "backends": ["http://a:1"]}]}
    # Sharing is what makes several workers route as one gateway: on by default.
    assert build_config({**base, "listen": {"workers": 4}}).listen.share_accounting is True
    off = build_config({**base, "listen": {"workers": 4, "share_accounting": False}})
    assert off.listen.share_accounting is False
    with pytest.raises(ConfigError, match=r"listen\.share_accounting: expected true or false"):
        build_config({**base, "listen": {"share_accounting": "yes"}})


def test_workers_share_their_prefix_index_unless_told_not_to() -> None:
    base: dict[str, object] = {"models": [{"name": "m", "backends": ["http://a:1"]}]}
    assert build_config({**base, "listen": {"workers": 4}}).listen.share_prefix_index is True
    off = build_config({**base, "listen": {"workers": 4, "share_prefix_index": False}})
    assert off.listen.share_prefix_index is False
    with pytest.raises(ConfigError, match=r"listen\.share_prefix_index: expected true or false"):
        build_config({**base, "listen": {"share_prefix_index": 1}})
