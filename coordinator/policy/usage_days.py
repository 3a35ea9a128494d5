"""The console's usage chart (issue 34): each team's GPU-seconds per UTC day over the last days, summed from the
hourly rollups of the leases that ended (``policy/accounting.py``). Pure: no I/O."""
from __future__ import annotations

import math
from typing import Iterable, Sequence

from coordinator.keys import Keys
from coordinator.records import InvalidRecord, StoredKV, load_record

USAGE_DAYS = 7   # the console's usage chart: today and the six UTC days before


def last_days(now: float, n: int = USAGE_DAYS) -> list[str]:
    """The ``n`` UTC days up to the one ``now`` falls in, oldest first, as ``2026-12-06``."""
    import time
    today = math.floor(now / 86400) * 86400
    return [time.strftime("%Y-%m-%d", time.gmtime(today - 86400 * k)) for k in range(n - 1, -1, -1)]


def gpu_seconds_by_day(keys: Keys, rollup_kvs: Iterable[StoredKV], days: Sequence[str]) -> dict[str, dict[str, float]]:
    """Each of ``days`` with each team's GPU-seconds in it (``day -> team -> seconds``), summed from the hourly
    rollups of its 24 hours (malformed ones left out): what ``gpucoord usage --by team`` gives for that day's
    window. A day without usage maps to {}."""
    out: dict[str, dict[str, float]] = {d: {} for d in days}
    for kv in rollup_kvs:
        parts = keys.parse(kv.key)[1]
        if len(parts) != 3 or parts[1][:10] not in out:
            continue
        try:
            value = load_record(kv.value).get("gpu_s")
        except InvalidRecord:
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            day = out[parts[1][:10]]
            day[parts[2]] = round(day.get(parts[2], 0.0) + float(value), 3)
    return out
