"""Idle GPU-seconds of a usage record (issue 33, docs/teams.md "Usage accounting"): ``policy.idle.idle_seconds``
measures how long within a lease a GPU's sampled utilization was known and below the threshold. Examples and
Hypothesis properties: never more than the window, unknown counts as busy, additive over a split window, and
monotone in the threshold."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.policy.idle import UNKNOWN, Points, UtilizationHistory, idle_seconds


def test_only_known_values_below_the_threshold_count_each_until_the_next_change() -> None:
    points: Points = ((0.0, UNKNOWN), (10.0, 2), (20.0, 50), (30.0, 0))
    assert idle_seconds(points, 0.0, 40.0, 5.0) == 20.0       # [10, 20) at 2 %, [30, 40) at 0 %
    assert idle_seconds(points, 15.0, 35.0, 5.0) == 10.0      # [15, 20) and [30, 35)
    assert idle_seconds(points, 0.0, 40.0, 60.0) == 30.0      # 50 % is below 60
    assert idle_seconds((), 0.0, 40.0, 5.0) == 0.0            # nothing seen: busy
    assert idle_seconds(points, 40.0, 40.0, 5.0) == 0.0


POINTS = st.lists(st.tuples(st.floats(0, 100), st.one_of(st.just(UNKNOWN), st.integers(0, 100))), max_size=12).map(
    lambda xs: tuple(sorted(xs, key=lambda p: p[0])))


@settings(max_examples=300, deadline=None)
@given(POINTS, st.floats(0, 100), st.floats(0, 100), st.floats(0, 100), st.floats(1, 100))
def test_idle_time_is_bounded_additive_and_monotone_in_the_threshold(points: Points, a: float, b: float, m: float,
                                                                    below: float) -> None:
    start, end = min(a, b), max(a, b)
    mid = min(max(m, start), end)
    whole = idle_seconds(points, start, end, below)
    assert 0.0 <= whole <= end - start + 1e-9
    assert abs(whole - idle_seconds(points, start, mid, below) - idle_seconds(points, mid, end, below)) <= 1e-6
    assert idle_seconds(points, start, end, below + 10) >= whole - 1e-9


def test_with_thresholds_the_history_keeps_only_moves_across_them_so_it_spans_a_long_lease() -> None:
    """A GPU whose load wanders above the threshold, or idles at 0-3 %, adds no point: 10,000 samples of a
    12-hour lease that went idle once are 2 points, and its idle time is measured whole."""
    history = UtilizationHistory(max_points=8)
    for i in range(10_000):
        pct = 40 + i % 50 if i < 5_000 else i % 4
        history.observe("g", i * 4.32, pct, thresholds={5.0})
    assert len(history.points("g")) == 2 and history.current("g") == 9_999 % 4
    assert idle_seconds(history.points("g"), 0.0, 10_000 * 4.32, 5.0) == pytest.approx(5_000 * 4.32)
    plain = UtilizationHistory(max_points=8)       # without thresholds: every change, the last 8 kept
    for i in range(100):
        plain.observe("g", float(i), i % 4)
    assert len(plain.points("g")) == 8
