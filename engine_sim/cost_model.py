"""Roofline-style iteration time and KV capacity of one vLLM replica (pure, no I/O).

One engine iteration runs every scheduled token through the model once. Its time is

    t = max(t_compute, t_memory) + t_tp_comm + step_overhead_s + per_seq_overhead_s * seqs

* ``t_compute`` = (2 * matmul_params * tokens + 4 * layers * q_dim * attention_pairs)
  / (peak_flops * compute_efficiency) — prefill tokens make an iteration compute-bound;
* ``t_memory`` = (weight_read_bytes + kv_bytes_per_token * context_tokens)
  / (hbm_bytes_s * bandwidth_efficiency) — a decode-only iteration reads every weight once
  and each sequence's KV cache once, so it is memory-bound;
* ``t_tp_comm`` = tensor-parallel all-reduces (two per layer): a fixed latency per step plus
  the activation bytes over NVLink;
* fixed per-step CPU/launch overhead plus a small per-sequence cost (sampling, bookkeeping).

Every constant carries its source; `docs/engine_model.md` lists them with the published
anchor points the tests check (`tests/unit/test_cost_model.py`). Callers: the engine model
once per step (`iteration_time_s`), and once per replica at start-up (`num_kv_blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GIB = 1024**3


@dataclass(frozen=True, slots=True)
class CostProfile:
    """A model on a GPU deployment: what the roofline needs, with sources in `PROFILES`."""

    name: str
    description: str
    matmul_params: float
    """Parameters that take part in the per-token matmuls (2 FLOPs each per token)."""
    num_layers: int
    q_dim: int
    """Query width (heads * head_dim); attention costs 4 * layers * q_dim FLOPs per (q, k) pair."""
    weight_read_bytes: float
    """Bytes of weights read from HBM once per iteration (all GPUs together)."""
    weight_footprint_bytes: float
    """Bytes of weights resident in GPU memory (all GPUs together)."""
    kv_bytes_per_token: int
    """KV-cache bytes per token: 2 (K, V) * layers * kv_heads * head_dim * dtype bytes."""
    peak_flops: float
    """Dense tensor-core FLOP/s of the whole deployment for the weight dtype."""
    hbm_bytes_s: float
    """HBM bandwidth of the whole deployment, bytes/s."""
    gpu_memory_bytes: float
    """Total GPU memory of the deployment, bytes."""
    compute_efficiency: float
    """Achieved fraction of `peak_flops` in prefill (model FLOPs utilisation)."""
    bandwidth_efficiency: float
    """Achieved fraction of `hbm_bytes_s` in decode."""
    step_overhead_s: float
    """Fixed time per iteration: scheduling, input preparation, kernel launches, sampling."""
    per_seq_overhead_s: float
    """Extra time per scheduled sequence (sampling, detokenisation, bookkeeping)."""
    tp_size: int = 1
    tp_step_latency_s: float = 0.0
    """All-reduce latency per iteration (2 per layer), tensor parallel only."""
    tp_comm_s_per_token: float = 0.0
    """All-reduce transfer time per scheduled token (activations over NVLink)."""
    gpu_memory_utilization: float = 0.9
    """vLLM's ``--gpu-memory-utilization`` default."""
    non_kv_reserve_bytes: float = 0.0
    """Activation peak, CUDA graphs and runtime buffers vLLM keeps out of the KV cache."""
    max_model_len: int = 8192
    """The model's context window in tokens (what workloads are clipped to)."""

    def kv_cache_bytes(self) -> float:
        """Bytes left for the KV cache after weights and runtime reserve."""
        return (
            self.gpu_memory_bytes * self.gpu_memory_utilization
            - self.weight_footprint_bytes
            - self.non_kv_reserve_bytes
        )

    def num_kv_blocks(self, block_size: int = 16) -> int:
        """KV blocks of `block_size` tokens this deployment holds (vLLM's ``num_gpu_blocks``)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        return max(0, int(self.kv_cache_bytes() // (self.kv_bytes_per_token * block_size)))


def iteration_time_s(
    profile: CostProfile,
    prefill_tokens: int,
    decode_seqs: int,
    context_tokens: int,
    *,
    attention_pairs: int | None = None,
) -> float:
    """Seconds one engine iteration takes.

    `prefill_tokens`: prompt (or recompute) tokens processed this step; `decode_seqs`:
    sequences decoding one token; `context_tokens`: KV tokens the batch's attention reads
    (sum over scheduled sequences of their context including the new tokens);
    `attention_pairs`: (query, key) pairs attention computes — defaults to
    `context_tokens` (exact for decode; the engine passes the exact number for prefill).
    An empty iteration takes 0 s.
    """
    tokens = prefill_tokens + decode_seqs
    if tokens <= 0:
        return 0.0
    pairs = context_tokens if attention_pairs is None else attention_pairs
    flops = 2.0 * profile.matmul_params * tokens + 4.0 * profile.num_layers * profile.q_dim * pairs
    t_compute = flops / (profile.peak_flops * profile.compute_efficiency)
    read_bytes = profile.weight_read_bytes + profile.kv_bytes_per_token * context_tokens
    t_memory = read_bytes / (profile.hbm_bytes_s * profile.bandwidth_efficiency)
    t_comm = 0.0
    if profile.tp_size > 1:
        t_comm = profile.tp_step_latency_s + profile.tp_comm_s_per_token * tokens
    seqs = decode_seqs + (1 if prefill_tokens else 0)
    return (
        max(t_compute, t_memory)
        + t_comm
        + profile.step_overhead_s
        + profile.per_seq_overhead_s * seqs
    )


def prefill_time_s(profile: CostProfile, prompt_tokens: int) -> float:
    """Time of one iteration prefilling a single `prompt_tokens` prompt from scratch."""
    pairs = prompt_tokens * (prompt_tokens + 1) // 2
    return iteration_time_s(profile, prompt_tokens, 0, prompt_tokens, attention_pairs=pairs)


def decode_time_s(profile: CostProfile, batch: int, context_per_seq: int) -> float:
    """Time of one decode-only iteration of `batch` sequences of `context_per_seq` tokens."""
    return iteration_time_s(profile, 0, batch, batch * context_per_seq)


# --- Llama-3-8B (bf16) on one A100-SXM4-40GB ---------------------------------------------
# Model shape: meta-llama/Meta-Llama-3-8B config.json — 32 layers, hidden 4096, 32 query
# heads and 8 KV heads of dim 128, vocab 128256; 8.03e9 parameters (model card).
_L3_8B_PARAMS = 8.03e9
_L3_8B_EMBED = 128_256 * 4096  # input embedding: a lookup, not a matmul, and not read whole
LLAMA3_8B_A100 = CostProfile(
    name="llama3-8b-a100",
    description="Llama-3-8B bf16 on one NVIDIA A100-SXM4-40GB (vLLM defaults)",
    matmul_params=_L3_8B_PARAMS - _L3_8B_EMBED,
    num_layers=32,
    q_dim=32 * 128,
    weight_read_bytes=(_L3_8B_PARAMS - _L3_8B_EMBED) * 2,
    weight_footprint_bytes=_L3_8B_PARAMS * 2,  # bf16; vLLM logs ~14.96 GiB for this model
    kv_bytes_per_token=2 * 32 * 8 * 128 * 2,  # 128 KiB (bf16 KV cache)
    peak_flops=312e12,  # A100 datasheet: 312 TFLOPS dense bf16 tensor core
    hbm_bytes_s=1.555e12,  # A100-40GB datasheet: 1,555 GB/s HBM2
    gpu_memory_bytes=40 * GIB,  # A100-40GB: 40,960 MiB (nvidia-smi)
    compute_efficiency=0.60,  # calibrated to the prefill anchors (docs/engine_model.md)
    bandwidth_efficiency=0.80,  # typical achieved HBM fraction of decode GEMVs (calibrated)
    step_overhead_s=1.0e-3,  # vLLM V1 CPU scheduling + launch with CUDA graphs (calibrated)
    per_seq_overhead_s=2.0e-5,  # sampling/bookkeeping per sequence (estimate)
    non_kv_reserve_bytes=2.0 * GIB,  # profile-run activation peak + CUDA graphs (estimate)
)

# --- Llama-3-70B FP8 on two H100-SXM5-80GB, tensor parallel 2 --------------------------
# Model shape: meta-llama/Meta-Llama-3-70B config.json — 80 layers, hidden 8192, 64 query
# heads and 8 KV heads of dim 128, vocab 128256; 70.6e9 parameters (model card). FP8
# checkpoints (e.g. neuralmagic/Meta-Llama-3-70B-Instruct-FP8) quantise the linear layers to
# 1 byte and keep embeddings and lm_head in bf16; the KV cache stays bf16 (vLLM default).
_L3_70B_PARAMS = 70.6e9
_L3_70B_EMBED = 128_256 * 8192
_L3_70B_LINEAR = _L3_70B_PARAMS - 2 * _L3_70B_EMBED
LLAMA3_70B_FP8_H100X2 = CostProfile(
    name="llama3-70b-fp8-h100x2",
    description="Llama-3-70B FP8 on two NVIDIA H100-SXM5-80GB, tensor parallel 2",
    matmul_params=_L3_70B_PARAMS - _L3_70B_EMBED,
    num_layers=80,
    q_dim=64 * 128,
    weight_read_bytes=_L3_70B_LINEAR * 1 + _L3_70B_EMBED * 2,  # fp8 linears + bf16 lm_head
    weight_footprint_bytes=_L3_70B_LINEAR * 1 + 2 * _L3_70B_EMBED * 2,
    kv_bytes_per_token=2 * 80 * 8 * 128 * 2,  # 320 KiB (bf16 KV cache)
    peak_flops=2 * 1979e12,  # H100 SXM datasheet: 1,979 TFLOPS dense FP8, per GPU
    hbm_bytes_s=2 * 3.35e12,  # H100 SXM datasheet: 3.35 TB/s HBM3, per GPU
    gpu_memory_bytes=2 * 80 * GIB,  # H100 80GB: 81,559 MiB (nvidia-smi), rounded down
    compute_efficiency=0.40,  # FP8 GEMMs reach a lower share of peak than bf16 (calibrated)
    bandwidth_efficiency=0.80,
    step_overhead_s=2.5e-3,
    per_seq_overhead_s=2.0e-5,
    tp_size=2,
    # 2 all-reduces per layer x 80 layers at ~8 us each for decode-size messages (NCCL over
    # NVLink, small-message latency).
    tp_step_latency_s=160 * 8e-6,
    # per token: 2 all-reduces x 80 layers x 8192 x 2 bytes = 2.6 MB; a 2-GPU ring sends
    # half of it each way at ~450 GB/s effective NVLink4 bandwidth (900 GB/s bidirectional).
    tp_comm_s_per_token=(2 * 80 * 8192 * 2) / 2 / 450e9,
    non_kv_reserve_bytes=2 * 2.0 * GIB,
)

# --- Llama-3.1-8B (bf16), 128k context, on one A100-SXM4-40GB / -80GB -------------------
# Model shape: meta-llama/Llama-3.1-8B config.json — the same 32 layers, hidden 4096, 32 query
# and 8 KV heads of dim 128 and vocab 128256 as Llama-3-8B (same parameters), with
# max_position_embeddings 131072 (rope_scaling "llama3"). Same GPU constants as above, so it
# differs from `llama3-8b-a100` only in the context window the workloads may use; on 40 GB its
# KV cache (~156k tokens, `num_kv_blocks`) holds one 128k prompt. Prefill attention grows with
# the square of the context: a 128k-token prompt takes ~33 s here (roofline, no overheads).
LLAMA31_8B_A100 = replace(
    LLAMA3_8B_A100,
    name="llama31-8b-a100",
    description="Llama-3.1-8B bf16 (128k context) on one NVIDIA A100-SXM4-40GB",
    max_model_len=131_072,
)
# The same model on an A100-SXM4-80GB: datasheet 80 GB HBM2e at 2,039 GB/s, the same
# 312 TFLOPS dense bf16. 80 GiB x 0.9 - weights - reserve leaves ~55 GiB of KV (~451k tokens),
# 2.9x the 40 GB card's ~19 GiB: the "about 3x the KV per replica" regime. FP8 KV
# (``--kv-cache-dtype fp8``, 64 KiB per token) on the 40 GB card gives 1.9x; on 80 GB, 5.8x.
LLAMA31_8B_A100_80GB = replace(
    LLAMA31_8B_A100,
    name="llama31-8b-a100-80gb",
    description="Llama-3.1-8B bf16 (128k context) on one NVIDIA A100-SXM4-80GB (2.9x the KV)",
    hbm_bytes_s=2.039e12,  # A100-80GB SXM datasheet: 2,039 GB/s HBM2e
    gpu_memory_bytes=80 * GIB,  # A100-80GB: 81,920 MiB (nvidia-smi)
)

# --- tiny-cpu: a synthetic, fast profile for tests and the laptop demo ------------------
# Not a real deployment: sized so one emulated replica steps every few milliseconds, a
# 1,000-token prompt prefills in ~25 ms and a modest KV cache (16k tokens with
# block_size 16) creates memory pressure with a handful of long requests.
TINY_CPU = CostProfile(
    name="tiny-cpu",
    description="synthetic fast profile (tests, demo): ~25 us/prefill token, ~3 ms/step",
    matmul_params=1.0e9,
    num_layers=4,
    q_dim=256,
    weight_read_bytes=2.0e9,
    weight_footprint_bytes=2.0e9,
    kv_bytes_per_token=2 * 4 * 2 * 64 * 2,  # 2 KiB
    peak_flops=100e12,
    hbm_bytes_s=1.0e12,
    gpu_memory_bytes=2.0e9 + 1024 * 16 * 2048,  # weights + exactly 1,024 blocks of 16
    compute_efficiency=0.8,
    bandwidth_efficiency=1.0,
    step_overhead_s=1.0e-3,
    per_seq_overhead_s=1.0e-5,
    gpu_memory_utilization=1.0,
    non_kv_reserve_bytes=0.0,
)

# Llama-3.1-70B has Llama-3-70B's shape with a 128k context: the same deployment otherwise.
LLAMA31_70B_FP8_H100X2 = replace(
    LLAMA3_70B_FP8_H100X2,
    name="llama31-70b-fp8-h100x2",
    description="Llama-3.1-70B FP8 (128k context) on two NVIDIA H100-SXM5-80GB, TP 2",
    max_model_len=131_072,
)

PROFILES: dict[str, CostProfile] = {
    p.name: p
    for p in (
        LLAMA3_8B_A100,
        LLAMA3_70B_FP8_H100X2,
        LLAMA31_8B_A100,
        LLAMA31_8B_A100_80GB,
        LLAMA31_70B_FP8_H100X2,
        TINY_CPU,
    )
}


def get_profile(name: str) -> CostProfile:
    """The profile called `name`; `KeyError` names the known ones."""
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise KeyError(f"unknown cost profile {name!r} (known: {known})") from None
