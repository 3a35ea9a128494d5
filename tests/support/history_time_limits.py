"""The history checker's time-limit rule (issue 31, docs/policies.md "Time limits"), fed by the replay of
tests/history.check_history:

* **no lease outlives its time limit**: a lease whose record carries ``time_limit_s`` ends (its key deleted) by
  ``created_at + time_limit_s + KILL_MARGIN_S + SLACK_S``. The history has revisions, not times, so "now" at a
  revision is bounded from below by the wall times the records written in it carry, each taken before its write
  committed: a lease's ``created_at``, a notice's ``created_at``, a usage report's ``ts``. A lease still live
  after a revision whose records say it is later than its bound is a violation.

It assumes the writers' wall clocks agree within ``SLACK_S`` (the tests run them on one machine); a test that
skews clocks (``GPUCOORD_CLOCK_OFFSET_S``) must not give leases time limits. ``SLACK_S`` also covers how late the
leader may see a lease (the end is measured from when it first saw it) and a revoke's round trip.
"""
from __future__ import annotations

from coordinator.etcd.store import WatchEvent
from tests.support.history_docs import MALFORMED, put_doc

KILL_MARGIN_S = 2.0   # the fleet's default eviction_kill_margin_s, what the tests run with
SLACK_S = 5.0


class TimeLimitRules:
    """``slack_s``: ``SLACK_S``, plus what the test's faults may add to a revoke's lateness (a leader stopped
    or cut off: until the next leader holds the election, up to the longest cut; the nemesis passes it)."""

    def __init__(self, slack_s: float = SLACK_S) -> None:
        self.slack_s = slack_s
        self.bounds: dict[str, tuple[float, float, float]] = {}   # lease id -> (created_at, limit, bound)
        self.parts: dict[str, set[bytes]] = {}                  # lease id -> its live keys (a gang's, one per GPU)
        self.now = 0.0                                           # the latest wall time written so far

    def event(self, kind: str, parts: list[str], ev: WatchEvent) -> None:
        doc = put_doc(kind, ev)
        if doc is MALFORMED:
            return   # (the G1 and INVALID rules report malformed values)
        for field in ("created_at", "ts"):
            if doc is not None and isinstance(doc.get(field), (int, float)):
                self.now = max(self.now, float(doc[field]))
        if kind != "leases" or len(parts) != 3:
            return
        lease_id = parts[2]
        if ev.kind == "PUT":
            limit = doc.get("time_limit_s", 0) if doc is not None else 0
            if isinstance(limit, (int, float)) and limit > 0 and isinstance(doc.get("created_at"), (int, float)):
                created = float(doc["created_at"])
                self.bounds[lease_id] = (created, float(limit), created + limit + KILL_MARGIN_S + self.slack_s)
                self.parts.setdefault(lease_id, set()).add(ev.kv.key)
        elif lease_id in self.parts:
            self.parts[lease_id].discard(ev.kv.key)
            if not self.parts[lease_id]:
                del self.parts[lease_id], self.bounds[lease_id]

    def check(self, rev: int) -> list[str]:
        out = [f"rev {rev}: time limit: lease {lease_id} (limit {limit:g} s, granted at {created:.3f}) still live at "
               f"{self.now:.3f}, {self.now - created - limit:.1f} s past its end"
               for lease_id, (created, limit, bound) in self.bounds.items() if self.now > bound]
        for lease_id in [x for x, (_, _, bound) in self.bounds.items() if self.now > bound]:
            del self.bounds[lease_id], self.parts[lease_id]   # (reported once)
        return out
