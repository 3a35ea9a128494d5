"""tests/history.check_history's idle rule on synthetic histories: an ``idle`` notice must name a lease granted a
window before it, while the host's usage reports over that window show each of its GPUs at a known utilization
below the threshold; a notice with another reason, or one that the reports bear out, passes."""
from __future__ import annotations

from typing import Any

from tests.support.history_builder import (
    G0,
    HOST,
    History,
    K,
    assert_one_violation,
    check,
)
from tests.support.history_idle import MIN_WINDOW_S

T0 = 1_700_000_001.0   # the builder's created_at of the first lease (token 1)


def usage(h: History, ts: float, pct: Any) -> None:
    h.put(K.usage(HOST), {"ts": ts, "interval_s": 1.0,
                          "gpus": [{"uuid": G0, "vram_used_mb": 0, "utilization_pct": pct}]})


def notice(h: History, lease_id: str, at: float, reason: str = "idle") -> None:
    h.put(K.eviction(lease_id), {"lease_id": lease_id, "host": HOST, "gpu_uuid": G0, "agent": "a",
                                 "session_id": "1f", "victim_priority": 0, "requested_by": "operator",
                                 "requester_priority": None, "reason": reason, "deadline_unix": at + 1.0,
                                 "created_at": at, "asked_by": "idle reclaim"})


def idle_history(pct_in_window: Any = 0, notice_at: float = T0 + MIN_WINDOW_S + 1.0, reason: str = "idle") -> History:
    h = History()
    h.ledger()
    usage(h, T0 - 10.0, 0)
    lease = h.lease("a", "r1", 1000)
    usage(h, T0 + 2.0, pct_in_window)
    usage(h, notice_at - 0.1, 0)
    notice(h, lease, notice_at, reason)
    h.release(lease)
    h.delete(K.eviction(lease))
    return h


def test_an_idle_notice_the_reports_bear_out_passes_and_other_reasons_are_not_judged() -> None:
    assert check(idle_history()).violations == []
    assert check(idle_history(pct_in_window=90, notice_at=T0 + 0.5, reason="drain")).violations == []


def test_an_idle_notice_while_a_report_in_the_window_shows_the_gpu_busy_or_unknown_is_flagged() -> None:
    assert_one_violation(check(idle_history(pct_in_window=50)), "idle", "at 50")
    assert_one_violation(check(idle_history(pct_in_window=-1)), "idle", "unknown")


def test_an_idle_notice_before_the_window_since_the_grant_is_flagged() -> None:
    assert_one_violation(check(idle_history(notice_at=T0 + 1.0)), "idle", "before the window")
