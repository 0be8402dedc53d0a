"""Median with spread and tie detection (`bench.spread`), used by every multi-seed report."""

from __future__ import annotations

import math

import pytest

from bench.spread import Spread, compare, overlaps, ratios, spread, verdict


def test_spread_is_the_median_with_min_and_max() -> None:
    s = spread([3.0, 1.0, 2.0])
    assert (s.median, s.low, s.high, s.n) == (2.0, 1.0, 3.0, 3)
    assert spread([1.0, 2.0, 3.0, 10.0]).median == pytest.approx(2.5)


def test_nan_seeds_are_left_out_and_an_empty_spread_says_so() -> None:
    assert spread([1.0, math.nan, 3.0]).n == 2
    empty = spread([math.nan])
    assert empty.n == 0
    assert empty.format() == "n/a"


def test_format_reads_median_then_range() -> None:
    assert spread([1.1, 1.31, 1.234]).format() == "1.23 [1.1–1.31]"
    assert spread([2.0, 2.0, 2.0]).format() == "2"
    assert spread([0.5, 0.25, 1.0]).format(2, " s") == "0.5 s [0.25–1 s]"


def test_paired_ratios_keep_a_zero_denominator_visible() -> None:
    assert ratios([2.0, 3.0], [1.0, 0.0]) == [2.0, math.inf]
    with pytest.raises(ValueError, match="equal lengths"):
        ratios([1.0], [1.0, 2.0])


def test_a_spread_straddling_one_is_a_tie() -> None:
    assert verdict(spread([0.9, 1.2, 1.3])) == "tie"
    assert verdict(spread([1.05, 1.2, 1.3])) == "win"
    assert verdict(spread([0.7, 0.8, 0.95])) == "loss"


def test_a_consistent_difference_of_one_percent_is_still_a_tie() -> None:
    assert verdict(spread([1.005, 1.01, 1.015])) == "tie"
    assert verdict(spread([1.005, 1.01, 1.015]), tolerance=0.0) == "win"


def test_compare_orients_ratios_so_above_one_means_ours_is_better() -> None:
    latency = compare([2.0, 2.2, 2.4], [1.0, 1.1, 1.2])
    assert latency.ratio.median == pytest.approx(2.0)
    assert latency.verdict == "win"
    capacity = compare([1.0, 1.0, 1.0], [1.5, 1.4, 1.3], higher_is_better=True)
    assert capacity.ratio.median == pytest.approx(1.4)
    assert capacity.verdict == "win"
    assert capacity.format() == "1.4x [1.3–1.5] win"
    worse = compare([1.0, 1.0, 1.0], [0.5, 0.6, 0.7], higher_is_better=True)
    assert worse.verdict == "loss"


def test_overlapping_unpaired_spreads_are_a_tie() -> None:
    a = Spread(1.0, 0.9, 1.1, 3)
    assert overlaps(a, Spread(1.2, 1.05, 1.3, 3))
    assert not overlaps(a, Spread(1.3, 1.2, 1.4, 3))
