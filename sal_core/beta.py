"""SAL's beta = (mean_in + mean_out) / mean_out, from running means of finished requests.

Pure: the gateway calls `BetaEstimator.observe()` once per finished request that reported
`usage`, and reads `BetaEstimator.beta` once per routing decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class BetaEstimator:
    """Running-mean estimate of beta, seeded with a configured value.

    The seed counts as `seed_weight` pseudo-observations with mean output 1 token and mean
    input `seed - 1` tokens, so early estimates move smoothly from the seed toward the data.
    """

    seed: float = 2.0
    """Configured beta used before any request finished (must be >= 1)."""
    seed_weight: int = 10
    """How many observations the seed is worth."""
    _n: int = field(default=0, init=False)
    _sum_in: float = field(default=0.0, init=False)
    _sum_out: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if self.seed < 1.0:
            raise ValueError(f"beta seed must be >= 1, got {self.seed}")
        if self.seed_weight < 0:
            raise ValueError(f"seed_weight must be >= 0, got {self.seed_weight}")

    def observe(self, prompt_tokens: int, output_tokens: int) -> None:
        """Record one finished request's token counts (ignored when output is 0)."""
        if prompt_tokens < 0 or output_tokens <= 0:
            return
        self._n += 1
        self._sum_in += prompt_tokens
        self._sum_out += output_tokens

    @property
    def observations(self) -> int:
        return self._n

    @property
    def mean_output_tokens(self) -> float:
        """Mean output tokens of the observed requests (the seed is not counted); 0.0 before
        the first."""
        return self._sum_out / self._n if self._n else 0.0

    @property
    def beta(self) -> float:
        """Current estimate; always >= 1."""
        w = float(self.seed_weight)
        total_in = self._sum_in + w * (self.seed - 1.0)
        total_out = self._sum_out + w * 1.0
        if total_out <= 0.0:
            return self.seed
        return (total_in + total_out) / total_out
