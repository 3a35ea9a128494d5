"""GPU-seconds per team per UTC day from the hourly rollups (``accounting.gpu_seconds_by_day``, status's
``usage_days`` and the console's usage chart): each day is the sum of its 24 hours' rollups, as ``gpucoord usage
--by team`` sums them for that day's window."""
from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.etcd.types import KV
from coordinator.keys import Keys
from coordinator.policy.accounting import totals_from_rollups
from coordinator.policy.usage_days import gpu_seconds_by_day, last_days

K = Keys("/t/")
NOON = 1_796_558_400.0   # 2026-12-06T12:00:00Z


def _kv(hour: str, team: str, gpu_s: object) -> KV:
    return KV(K.usage_rollup(hour, team), json.dumps({"gpu_s": gpu_s, "vram_mib_s": 0, "evictions": 0, "leases": 1,
                                                     "agents": {}}).encode(), 1, 1, 1, 0)


def test_the_last_days_end_with_today_oldest_first() -> None:
    assert last_days(NOON) == ["2026-11-30", "2026-12-01", "2026-12-02", "2026-12-03", "2026-12-04", "2026-12-05",
                               "2026-12-06"]
    assert last_days(NOON - 12 * 3600, 2) == ["2026-12-05", "2026-12-06"]   # midnight is today's


def test_a_day_sums_its_hours_and_leaves_out_other_days_and_bad_values() -> None:
    kvs = [_kv("2026-12-06T00", "a", 10.5), _kv("2026-12-06T23", "a", 1.25), _kv("2026-12-06T05", "b", 7),
           _kv("2026-12-05T23", "a", 100), _kv("2026-11-29T12", "a", 999), _kv("2026-12-06T01", "a", "x"),
           _kv("2026-12-06T02", "a", True)]
    got = gpu_seconds_by_day(K, kvs, ["2026-12-05", "2026-12-06"])
    assert got == {"2026-12-05": {"a": 100.0}, "2026-12-06": {"a": 11.75, "b": 7.0}}
    assert gpu_seconds_by_day(K, [], ["2026-12-06"]) == {"2026-12-06": {}}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 47), st.sampled_from(["a", "b", "c"]), st.integers(0, 36000)),
                unique_by=lambda x: (x[0], x[1])))
def test_each_day_equals_the_usage_totals_of_its_window(rows: list[tuple[int, str, int]]) -> None:
    hours = [(f"2026-12-0{5 + h // 24}T{h % 24:02d}", team, secs) for h, team, secs in rows]
    got = gpu_seconds_by_day(K, [_kv(h, t, s) for h, t, s in hours], ["2026-12-05", "2026-12-06"])
    for day in ("2026-12-05", "2026-12-06"):
        window = [(h, t, {"gpu_s": s, "vram_mib_s": 0, "evictions": 0, "leases": 1, "agents": {}})
                  for h, t, s in hours if h.startswith(day)]
        totals = totals_from_rollups(window, "team")
        assert {t: round(v.gpu_s, 3) for t, v in totals.items()} == got[day]
