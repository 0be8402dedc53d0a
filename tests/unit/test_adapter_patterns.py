"""Which model may serve a LoRA adapter no replica lists yet (`models[].resolvable_adapters`)."""

from __future__ import annotations

import pytest

from sal_gateway.adapter_patterns import resolvable_owner, safe_adapter_name
from sal_gateway.config import ConfigError, GatewayConfig, build_config

PATTERNS = [("llama", ("team-*", "org/*")), ("qwen", ("*",)), ("off", ())]


def test_the_first_model_whose_pattern_matches_owns_the_name() -> None:
    assert resolvable_owner(PATTERNS, "team-sql") == "llama"
    assert resolvable_owner(PATTERNS, "org/adapter-7") == "llama"
    assert resolvable_owner(PATTERNS, "Team-sql") == "qwen"  # case-sensitive: only "*"
    assert resolvable_owner(PATTERNS[:1], "other") is None
    assert resolvable_owner([], "team-sql") is None


@pytest.mark.parametrize(
    "name",
    [
        "../x",
        "org/../../etc",
        "/etc/passwd",
        "a\\b",
        "with space",
        "tab\tname",
        "nl\n",
        "",
        "x" * 257,
    ],
)
def test_names_a_resolver_could_turn_into_another_path_never_match(name: str) -> None:
    # The filesystem resolver joins the name to its directory: none of these may reach it.
    assert not safe_adapter_name(name)
    assert resolvable_owner(PATTERNS, name) is None


@pytest.mark.parametrize("name", ["team-sql", "org/adapter", "a.b_c-d", "x" * 256, "ünï"])
def test_ordinary_adapter_names_and_hub_ids_are_safe(name: str) -> None:
    assert safe_adapter_name(name)


def _config(patterns: object) -> GatewayConfig:
    model = {"name": "m", "backends": ["http://127.0.0.1:8001"], "resolvable_adapters": patterns}
    return build_config({"models": [model]})


def test_config_reads_the_patterns_and_rejects_bad_ones() -> None:
    assert _config(["team-*"]).models[0].resolvable_adapters == ("team-*",)
    for bad, says in [
        ("team-*", "expected a list of strings"),
        ([""], "expected a non-empty string"),
        (["*" * 300], "a pattern of 1 to 256 characters"),
        ([f"p{i}" for i in range(65)], "at most 64 patterns"),
        ([3], "models[0].resolvable_adapters[0]"),
    ]:
        with pytest.raises(ConfigError, match=says.replace("[", r"\[").replace("]", r"\]")):
            _config(bad)
