"""vLLM's real V1 scheduler on CPU, no model and no server: the one builder the scheduler tests
share (tests/unit/test_larry_scheduler.py, tests/unit/test_engine_vllm_parity.py).

The scheduler is built the way vLLM's own ``tests/v1/core`` build it (configs plus a fake
KV-cache layout) and driven with requests and fabricated model outputs: one sampled token per
request that finished its prefill. The clock the LARRY classes read (``sal_clock``) is replaced
by a `Clock` the test advances, so waiting times are exact.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# torch and vLLM emit DeprecationWarnings of their own at import time (torch.jit.script_method
# and friends); `filterwarnings=error` would turn them into collection errors.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

BLOCK_SIZE = 16


class Clock:
    """The scheduler's wall clock, advanced by the test."""

    def __init__(self, now_s: float = 1000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def make_scheduler(
    cls: type[Any],
    model_dir: Path,
    *,
    num_blocks: int = 256,
    max_num_batched_tokens: int = 1024,
    max_model_len: int = 1024,
    max_num_seqs: int = 16,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = False,
    alpha: float | None = None,
    async_scheduling: bool = False,
    clock: Clock | None = None,
    additional_config: dict[str, Any] | None = None,
) -> Any:
    """A scheduler of class `cls` (vLLM's own or a LARRY class) over `num_blocks` KV blocks of
    `BLOCK_SIZE` tokens (block 0 is vLLM's null block), reading `clock` (default: a `Clock` at
    1000 s). `alpha` goes to ``additional_config["larry"]`` when given; `additional_config`
    (e.g. a ``larry_tail`` section) is merged over it."""
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        async_scheduling=async_scheduling,
        is_encoder_decoder=False,
    )
    model_config = ModelConfig(
        model=str(model_dir), dtype="float32", seed=0, skip_tokenizer_init=True
    )
    cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching)
    additional: dict[str, Any] = {} if alpha is None else {"larry": {"alpha": alpha}}
    additional.update(additional_config or {})
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        additional_config=additional,
    )
    # The CPU platform turns async scheduling off while validating the config; the async
    # variant is tested here as the GPU runs it.
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            )
        ],
    )
    cache_config.num_gpu_blocks = num_blocks
    scheduler = cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )
    scheduler.sal_clock = clock or Clock()
    return scheduler


_next_token = [100]


def make_request(
    request_id: str,
    prompt_tokens: int,
    arrival_s: float,
    *,
    max_tokens: int = 4,
    prompt: Sequence[int] | None = None,
    lora_request: LoRARequest | None = None,
) -> Request:
    """A request of `prompt_tokens` tokens; without `prompt`, a token of its own repeated (no
    accidental prefix-cache sharing between requests). `lora_request` names its adapter."""
    init_none_hash(sha256)
    if prompt is None:
        _next_token[0] += 1
        prompt = [_next_token[0] % 1900 + 20] * prompt_tokens
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        arrival_time=arrival_s,
        lora_request=lora_request,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


def engine_step(scheduler: Any) -> tuple[Any, Any]:
    """One engine step: schedule, fabricate the model output (one token per request whose
    prefill is complete), feed it back. Returns (`SchedulerOutput`, the engine outputs of
    ``update_from_output``)."""
    output = scheduler.schedule()
    ids = list(output.num_scheduled_tokens)
    sampled = [[] if scheduler.requests[r].is_prefill_chunk else [7] for r in ids]
    runner_output = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=sampled,
    )
    return output, scheduler.update_from_output(output, runner_output)


def run_step(scheduler: Any) -> Any:
    """`engine_step`, returning only the `SchedulerOutput`."""
    return engine_step(scheduler)[0]
