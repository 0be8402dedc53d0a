"""LoRA adapter mixes for simulated workloads (pure).

A multi-tenant fleet serves many adapters of one base model, and their popularity is
skewed: a few adapters draw most requests, a long tail draws the rest. S-LoRA (Sheng et al.,
"S-LoRA: Serving Thousands of Concurrent LoRA Adapters", MLSys 2024) and Punica (Chen et
al., MLSys 2024) evaluate with power-law popularity for this reason. `with_adapters` gives
each request of a trace an adapter drawn from a Zipf distribution over `adapter_names`,
seeded, so every router of a comparison sees the same requests.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

from engine_sim.trace import TraceError, TraceRequest


def adapter_names(count: int) -> tuple[str, ...]:
    """``lora-00``, ``lora-01``, ...: `count` adapter names, most popular first."""
    return tuple(f"lora-{i:02d}" for i in range(count))


def with_adapters(
    requests: Sequence[TraceRequest],
    *,
    adapters: int,
    zipf_s: float = 1.0,
    base_share: float = 0.0,
    seed: int = 0,
) -> list[TraceRequest]:
    """`requests`, each naming an adapter: with probability `base_share` none (the base
    model), else adapter i of `adapter_names(adapters)` with probability proportional to
    ``1 / (i + 1) ** zipf_s``. `TraceError` for fewer than 1 adapter, a negative exponent
    or a share outside [0, 1]."""
    if adapters < 1:
        raise TraceError(f"adapters must be >= 1, got {adapters}")
    if not zipf_s >= 0:
        raise TraceError(f"zipf_s must be >= 0, got {zipf_s}")
    if not 0.0 <= base_share <= 1.0:
        raise TraceError(f"base_share must be in [0, 1], got {base_share}")
    names = adapter_names(adapters)
    weights = [1.0 / (i + 1) ** zipf_s for i in range(adapters)]
    rng = random.Random(seed)
    out = []
    for r in requests:
        base = rng.random() < base_share
        name = rng.choices(names, weights)[0]  # drawn either way: the same stream per seed
        out.append(replace(r, adapter=None if base else name))
    return out
