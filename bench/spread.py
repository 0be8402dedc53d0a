"""Headline numbers from several seeds or trace windows: median with its spread, and ties.

Every benchmark that reports a number measured on >= 3 seeds (or windows) reports it as
``median [min-max]`` (`Spread`), and every comparison as a verdict that calls a difference
inside the spread a tie (`compare`). Pure, standard library only; the median is
`sal_core.percentile` at 50 (the project's one percentile definition).

Two ways to compare, both here so every benchmark means the same thing by "a tie":

* **paired** (`compare`, the default): the same seed/window was run by both sides, so the
  comparison is the spread of the per-seed ratios ``baseline / ours``. It is a win when every
  ratio is above 1 + `tolerance`, a loss when every ratio is below 1 - `tolerance`, and a tie
  otherwise (the ratios straddle 1, or all sit within the tolerance of it).
* **unpaired** (`overlaps`): two spreads whose ranges overlap are a tie.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from sal_core.percentile import percentile

TIE_TOLERANCE = 0.02
"""Ratios within 2 % of 1 are a tie even when all seeds agree on the sign: the engine model's
own run-to-run differences (a window boundary, one request) are of that size."""


@dataclass(frozen=True, slots=True)
class Spread:
    """The median of `n` values with their smallest and largest."""

    median: float
    low: float
    high: float
    n: int

    def format(self, digits: int = 3, unit: str = "") -> str:
        """``1.23 [1.10-1.31]`` (significant `digits`), or ``n/a`` when no value was finite."""
        if self.n == 0:
            return "n/a"

        def num(x: float) -> str:
            return _fmt(x, digits) + unit

        if self.n == 1 or self.low == self.high:
            return num(self.median)
        return f"{num(self.median)} [{_fmt(self.low, digits)}–{_fmt(self.high, digits)}{unit}]"

    def __str__(self) -> str:
        return self.format()

    def to_dict(self) -> dict[str, float | int]:
        return {"median": self.median, "min": self.low, "max": self.high, "n": self.n}


def _fmt(x: float, digits: int) -> str:
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.{digits}g}"


def spread(values: Sequence[float]) -> Spread:
    """Median, min and max of the finite `values` (NaNs are left out; none left: ``n == 0``)."""
    finite = [float(v) for v in values if not math.isnan(v)]
    if not finite:
        return Spread(math.nan, math.nan, math.nan, 0)
    return Spread(percentile(finite, 50), min(finite), max(finite), len(finite))


def ratios(baseline: Sequence[float], ours: Sequence[float]) -> list[float]:
    """Per-seed ``baseline[i] / ours[i]`` (paired: the same seed on both sides).

    A zero denominator gives ``inf`` (or NaN for 0 / 0), so a seed is never silently dropped.
    Raises `ValueError` when the sequences differ in length.
    """
    if len(baseline) != len(ours):
        raise ValueError(f"paired ratios need equal lengths, got {len(baseline)} and {len(ours)}")
    out = []
    for b, o in zip(baseline, ours, strict=True):
        if o == 0:
            out.append(math.nan if b == 0 else math.inf)
        else:
            out.append(b / o)
    return out


VERDICTS = ("win", "loss", "tie")


def verdict(ratio: Spread, tolerance: float = TIE_TOLERANCE) -> str:
    """``win`` / ``loss`` / ``tie`` for a spread of ratios where > 1 means "ours is better".

    A win needs every seed's ratio above ``1 + tolerance``; a loss every one below
    ``1 - tolerance``; anything else (the spread straddles 1, or hugs it) is a tie.
    """
    if ratio.n == 0:
        return "tie"
    if ratio.low > 1.0 + tolerance:
        return "win"
    if ratio.high < 1.0 - tolerance:
        return "loss"
    return "tie"


@dataclass(frozen=True, slots=True)
class Comparison:
    """A paired comparison of one metric over the same seeds."""

    ratio: Spread
    """Per-seed ``baseline / ours`` (for lower-is-better metrics; > 1: ours is better)."""
    verdict: str
    """``win``, ``loss`` or ``tie`` (`verdict`)."""

    def format(self, digits: int = 3) -> str:
        """``1.31x [1.20–1.45] win``."""
        text = self.ratio.format(digits)
        if self.ratio.n:
            head, sep, rest = text.partition(" ")
            text = f"{head}x{sep}{rest}"
        return f"{text} {self.verdict}"


def compare(
    baseline: Sequence[float],
    ours: Sequence[float],
    *,
    higher_is_better: bool = False,
    tolerance: float = TIE_TOLERANCE,
) -> Comparison:
    """Paired comparison of `ours` against `baseline` over the same seeds.

    For lower-is-better metrics (latencies; the default) the ratio is ``baseline / ours``;
    for higher-is-better ones (capacity) it is ``ours / baseline``; either way > 1 means ours
    is better.
    """
    per_seed = ratios(ours, baseline) if higher_is_better else ratios(baseline, ours)
    ratio = spread(per_seed)
    return Comparison(ratio, verdict(ratio, tolerance))


def overlaps(a: Spread, b: Spread) -> bool:
    """Whether two (unpaired) spreads' ranges overlap: a difference inside them is a tie."""
    if a.n == 0 or b.n == 0:
        return True
    return a.low <= b.high and b.low <= a.high
