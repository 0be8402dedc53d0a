"""Backend state from stock vLLM's Prometheus ``/metrics`` (fallback when ``/stats`` is 404).

Pure: the poller calls `parse_vllm_metrics()` with the exposition text. Used series (vLLM
0.32, summed over data-parallel engines):

* ``vllm:num_requests_waiting``, ``vllm:num_requests_running`` (gauges);
* ``vllm:kv_cache_usage_perc`` (gauge, a fraction 0..1, per engine);
* ``vllm:cache_config_info`` (info gauge; labels ``num_gpu_blocks`` and ``block_size``;
  ``enable_prefix_caching`` and ``prefix_caching_hash_algo`` when present);
* ``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total`` (counters, tokens;
  optional) for the achieved prefix-cache hit rate;
* ``vllm:lora_requests_info`` (optional; only with ``--enable-lora``): one series per set of
  labels ever reported, its value the time vLLM set it, so the newest is now's; labels
  ``max_lora`` and ``running_lora_adapters`` (comma-separated adapter names) give the LoRA
  slots (`sal_core.lora_slots`).

Free KV tokens = sum over engines of ``(1 - usage) * num_gpu_blocks * block_size``. vLLM does
not expose queued prefill tokens or the per-step token budget; the result carries 0 queued
tokens (the state table substitutes the gateway's own in-flight counts) and
``max_num_batched_tokens=0`` (the state table substitutes the configured fallback).
"""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from sal_core.stats import ReplicaStats

_WAITING = "vllm:num_requests_waiting"
_RUNNING = "vllm:num_requests_running"
_KV_USAGE = "vllm:kv_cache_usage_perc"
_CACHE_INFO = "vllm:cache_config_info"
_QUERIES = "vllm:prefix_cache_queries_total"
_HITS = "vllm:prefix_cache_hits_total"
_LORA_INFO = "vllm:lora_requests_info"
_USED = frozenset((_WAITING, _RUNNING, _KV_USAGE, _CACHE_INFO, _QUERIES, _HITS, _LORA_INFO))
_MAX_LORA_NAMES = 256


class MetricsParseError(ValueError):
    """The text lacks a series the fallback needs (names it)."""


def _int_label(labels: dict[str, str], name: str) -> int | None:
    try:
        value = int(float(labels[name]))
    except (KeyError, ValueError):
        return None
    return value if value >= 0 else None


def parse_vllm_metrics(text: str, model: str, time_s: float) -> ReplicaStats:
    """Turn vLLM ``/metrics`` text into a `ReplicaStats` (schema ``sal-stats/1``).

    `time_s` is stamped as the snapshot time (the caller's clock). Raises `MetricsParseError`
    (also for a NaN, infinite or negative value of a series it uses).
    """
    waiting = running = 0.0
    found: set[str] = set()
    usage_by_engine: dict[str, float] = {}
    blocks_by_engine: dict[str, tuple[int, int]] = {}
    counters = {_QUERIES: 0.0, _HITS: 0.0}
    caching = False
    algo: str | None = None
    lora_set_s = -1.0
    max_loras = 0
    lora_running: tuple[str, ...] = ()
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise MetricsParseError(f"unparsable /metrics text: {exc}") from None
    for family in families:
        for sample in family.samples:
            name = sample.name
            if name in _USED and not (math.isfinite(sample.value) and sample.value >= 0):
                raise MetricsParseError(f"/metrics {name} is {sample.value!r}")
            engine = sample.labels.get("engine", "0")
            if name == _WAITING:
                waiting += sample.value
                found.add(name)
            elif name == _RUNNING:
                running += sample.value
                found.add(name)
            elif name == _KV_USAGE:
                usage_by_engine[engine] = min(1.0, max(0.0, sample.value))
                found.add(name)
            elif name == _CACHE_INFO:
                blocks = _int_label(sample.labels, "num_gpu_blocks")
                block_size = _int_label(sample.labels, "block_size")
                if blocks is not None and block_size is not None and block_size > 0:
                    blocks_by_engine[engine] = (blocks, block_size)
                    found.add(name)
                caching = sample.labels.get("enable_prefix_caching") == "True"
                algo = sample.labels.get("prefix_caching_hash_algo") if caching else None
            elif name in counters:
                counters[name] += sample.value
            elif name == _LORA_INFO and sample.value > lora_set_s:
                lora_set_s = sample.value
                max_loras = _int_label(sample.labels, "max_lora") or 0
                names = sample.labels.get("running_lora_adapters", "").split(",")
                lora_running = tuple(sorted({n for n in names if n}))[:_MAX_LORA_NAMES]
    for needed in (_WAITING, _RUNNING, _KV_USAGE, _CACHE_INFO):
        if needed not in found:
            raise MetricsParseError(f"/metrics lacks {needed}")
    free_tokens = 0
    free_blocks = 0
    total_blocks = 0
    block_size = next(iter(blocks_by_engine.values()))[1]
    mean_usage = sum(usage_by_engine.values()) / len(usage_by_engine)
    for engine, (blocks, size) in blocks_by_engine.items():
        usage = usage_by_engine.get(engine, mean_usage)
        engine_free_blocks = round(blocks * (1.0 - usage))
        free_blocks += engine_free_blocks
        total_blocks += blocks
        free_tokens += engine_free_blocks * size
    return ReplicaStats(
        time=time_s,
        step=0,
        model=model,
        scheduler="unknown",
        alpha=None,
        block_size=block_size,
        kv_blocks_total=total_blocks,
        kv_blocks_free=free_blocks,
        free_kv_tokens=free_tokens,
        queued_prefill_tokens=0,
        num_waiting=int(waiting),
        num_running=int(running),
        max_num_batched_tokens=0,
        max_num_seqs=0,
        prefix_caching=caching,
        prefix_hash_algo=algo[:32] if algo else None,
        prefix_cache_query_tokens=int(counters[_QUERIES]),
        prefix_cache_hit_tokens=int(counters[_HITS]),
        max_loras=max_loras,
        lora_running=lora_running,
    )
