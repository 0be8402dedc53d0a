"""The one percentile definition every latency number in this repository uses.

``percentile(values, q)`` with ``q`` in percent, **0..100** (p99 is ``q=99``), by linear
interpolation between the closest ranks: numpy's default (``method="linear"``), so a reader
can check any table with ``numpy.percentile``. Pure, standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float:
    """The `q`-th percentile of `values`, `q` in 0..100, linearly interpolated; NaN if empty.

    With the values sorted as ``v[0] <= ... <= v[n-1]``, the position ``(n - 1) * q / 100``
    falls between ranks ``lo`` and ``lo + 1``; the result interpolates between them (so
    ``q=0`` is the minimum, ``q=100`` the maximum, ``q=50`` the usual median). Raises
    `ValueError` for `q` outside 0..100.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile: q must be in 0..100 (percent), got {q!r}")
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
