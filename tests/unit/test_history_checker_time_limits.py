"""tests/history.check_history's time-limit rule on synthetic histories: a lease with ``time_limit_s`` must be gone
once the wall times the history's records carry are past its end + the kill margin + the slack; a lease without
a limit, or one released in time, passes."""
from __future__ import annotations

from tests.support.history_builder import HOST, History, K, assert_one_violation, check
from tests.support.history_time_limits import KILL_MARGIN_S, SLACK_S

LIMIT = {"format": 4, "gang": [], "exclusive": False, "topology": "any", "min_runtime_s": 0.0,
         "time_limit_s": 3.0, "time_limit_warning_s": 1.0}
T0 = 1_700_000_001.0   # the builder's created_at of the first lease (token 1)
BOUND = T0 + 3.0 + KILL_MARGIN_S + SLACK_S


def usage(h: History, ts: float) -> None:
    h.put(K.usage(HOST), {"ts": ts, "interval_s": 1.0, "gpus": []})


def test_a_lease_gone_by_its_bound_and_a_lease_without_a_limit_pass() -> None:
    h = History()
    h.ledger()
    timed = h.lease("a", "r1", 1000, extra=LIMIT)
    h.lease("a", "r2", 1000)            # no limit: it may live for ever
    usage(h, BOUND - 0.5)
    h.release(timed)
    usage(h, BOUND + 100)
    assert check(h).violations == []


def test_a_lease_live_past_its_bound_is_flagged_once() -> None:
    h = History()
    h.ledger()
    timed = h.lease("a", "r1", 1000, extra=LIMIT)
    usage(h, BOUND + 0.5)
    usage(h, BOUND + 1.5)
    h.release(timed)
    assert_one_violation(check(h), "time limit", f"lease {timed}", "past its end")
