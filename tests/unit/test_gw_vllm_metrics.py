"""Stock vLLM /metrics fallback parsing."""

from __future__ import annotations

import pytest

from engine_sim.fake_vllm import FakeBackend
from sal_gateway.vllm_metrics import MetricsParseError, parse_vllm_metrics

# Shaped like vLLM 0.32 with two data-parallel engines (counters and histograms included, which
# the parser must skip).
TWO_ENGINES = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 5.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.5
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 12.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="1000"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="1",num_gpu_blocks="200"} 1.0
"""


def test_sums_engines_and_derives_free_kv_tokens() -> None:
    stats = parse_vllm_metrics(TWO_ENGINES, "tiny", 123.0)
    assert stats.num_running == 4
    assert stats.num_waiting == 5
    assert stats.kv_blocks_total == 1200
    assert stats.kv_blocks_free == 750 + 100
    assert stats.free_kv_tokens == (750 + 100) * 16
    assert stats.queued_prefill_tokens == 0  # not exposed by vLLM; the state table fills it
    assert stats.time == 123.0


def test_fake_backend_metrics_round_trip() -> None:
    fake = FakeBackend(
        metrics_waiting=2,
        metrics_running=7,
        metrics_kv_usage=0.9,
        metrics_num_gpu_blocks=100,
        metrics_block_size=32,
    )
    stats = parse_vllm_metrics(fake.metrics_text(), "tiny", 0.0)
    assert (stats.num_waiting, stats.num_running) == (2, 7)
    assert stats.free_kv_tokens == 10 * 32


@pytest.mark.parametrize(
    "missing", ["vllm:kv_cache_usage_perc", "vllm:cache_config_info", "vllm:num_requests_waiting"]
)
def test_missing_series_is_an_error_naming_it(missing: str) -> None:
    text = "\n".join(line for line in TWO_ENGINES.splitlines() if missing not in line) + "\n"
    with pytest.raises(MetricsParseError, match=missing):
        parse_vllm_metrics(text, "tiny", 0.0)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
@pytest.mark.parametrize("field", ["metrics_waiting", "metrics_running", "metrics_kv_usage"])
def test_nan_infinite_or_negative_values_are_errors_not_crashes(field: str, value: float) -> None:
    fake = FakeBackend(model="tiny")
    setattr(fake, field, value)
    with pytest.raises(MetricsParseError, match="vllm:"):
        parse_vllm_metrics(fake.metrics_text(), "tiny", 0.0)


def test_prefix_caching_and_its_hit_counters_are_read_when_present() -> None:
    text = TWO_ENGINES.replace(
        'cache_dtype="auto",engine="1"',
        'cache_dtype="auto",enable_prefix_caching="True",engine="1",'
        'prefix_caching_hash_algo="sha256"',
    ) + (
        "# TYPE vllm:prefix_cache_queries counter\n"
        'vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 300.0\n'
        'vllm:prefix_cache_queries_total{engine="1",model_name="tiny"} 100.0\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 64.0\n'
    )
    stats = parse_vllm_metrics(text, "tiny", 1.0)
    assert (stats.prefix_caching, stats.prefix_hash_algo) == (True, "sha256")
    assert (stats.prefix_cache_query_tokens, stats.prefix_cache_hit_tokens) == (400, 64)
    plain = parse_vllm_metrics(TWO_ENGINES, "tiny", 1.0)
    assert (plain.prefix_caching, plain.prefix_cache_query_tokens) == (False, 0)
