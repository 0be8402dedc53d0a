"""The one percentile definition (`sal_core.percentile`): q in percent, linear interpolation."""

from __future__ import annotations

import math
import random

import numpy
import pytest

from sal_core.percentile import percentile


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)


def test_percentile_ends_are_min_and_max() -> None:
    values = [5.0, -1.0, 7.5, 3.0]
    assert percentile(values, 0) == -1.0
    assert percentile(values, 100) == 7.5


def test_percentile_of_nothing_is_nan() -> None:
    assert math.isnan(percentile([], 50))


def test_percentile_matches_numpy_linear() -> None:
    """The tables' numbers can be checked with numpy's default method."""
    rng = random.Random(7)
    for n in (1, 2, 3, 10, 101):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 1, 50, 95, 99, 99.9, 100):
            assert percentile(values, q) == pytest.approx(float(numpy.percentile(values, q)))


@pytest.mark.parametrize("q", [-1.0, 100.5, math.nan])
def test_percentile_rejects_q_outside_percent(q: float) -> None:
    with pytest.raises(ValueError, match=r"0\.\.100"):
        percentile([1.0], q)
