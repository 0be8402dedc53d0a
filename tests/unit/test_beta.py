"""SAL's beta estimate: seeded, then converging to (mean_in + mean_out) / mean_out."""

from __future__ import annotations

import pytest

from sal_core.beta import BetaEstimator


def test_seed_is_used_before_any_observation() -> None:
    assert BetaEstimator(seed=3.5).beta == pytest.approx(3.5)


def test_converges_to_the_workload_ratio() -> None:
    est = BetaEstimator(seed=2.0, seed_weight=10)
    for _ in range(10_000):
        est.observe(prompt_tokens=900, output_tokens=100)
    assert est.beta == pytest.approx(10.0, rel=0.01)
    assert est.observations == 10_000


def test_mean_output_tokens_counts_observed_requests_only() -> None:
    est = BetaEstimator(seed=4.0, seed_weight=10)
    assert est.mean_output_tokens == 0.0  # unknown, not the seed's pseudo-output of 1
    est.observe(prompt_tokens=900, output_tokens=100)
    est.observe(prompt_tokens=100, output_tokens=300)
    est.observe(prompt_tokens=100, output_tokens=0)  # no output: not a finished request
    assert est.mean_output_tokens == pytest.approx(200.0)


def test_requests_without_output_do_not_move_it() -> None:
    est = BetaEstimator(seed=2.0)
    est.observe(prompt_tokens=5_000, output_tokens=0)
    assert est.beta == pytest.approx(2.0)


def test_seed_below_one_is_rejected() -> None:
    with pytest.raises(ValueError, match="beta seed must be >= 1"):
        BetaEstimator(seed=0.5)
