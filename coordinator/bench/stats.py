"""The one percentile definition of the bench: every p50 and p99 it reports is ``percentile(values, q)``."""
from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float:
    """The q-quantile of ``values`` by nearest rank, taking the upper rank: the smallest of the values with
    more than ``q * len(values)`` of them at or below it, i.e. ``sorted(values)[floor(q * n)]`` (the largest
    value when ``q * n`` reaches ``n``). So p50 of an even count is the upper of the two middle values, and
    p99 of fewer than 100 values is the largest. NaN when there are no values.

    Not ``statistics.quantiles``: it interpolates between neighbours, so its p99 of 20 samples is not a
    latency that was observed, and the bench's figures (docs/performance.md's recorded run included) are ranks.
    """
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.floor(q * len(ordered)))]
