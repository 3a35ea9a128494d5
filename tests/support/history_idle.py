"""The history checker's idle rule (issue 31, docs/policies.md "Idle GPUs"), fed by the replay of tests/history.check_history:

* **no idle notice without the reports showing the lease idle for the window**: an eviction notice with the reason
  ``idle`` is put only for a lease granted at least ``MIN_WINDOW_S`` before it (its record's ``created_at`` against
  the notice's), and only while, for every GPU of the lease, the host's usage report standing at that revision and
  every report of the host written in the ``MIN_WINDOW_S`` before the notice (by their ``ts``, less ``SLACK_S``)
  show a known utilization below ``BELOW_PCT``.

The history does not hold the policy: the rule is sound for every test policy with a window >= ``MIN_WINDOW_S``
and a threshold <= ``BELOW_PCT`` (the tests' policies are; a test with a longer window is checked less tightly,
never wrongly). It assumes the writers' wall clocks agree within ``SLACK_S`` (they run on one machine); a test that
skews clocks must not turn idle reclaim on.
"""
from __future__ import annotations

from typing import Any

from coordinator.etcd.store import WatchEvent
from tests.support.history_docs import MALFORMED, put_doc

MIN_WINDOW_S = 2.0
BELOW_PCT = 5
SLACK_S = 0.5
KEEP_S = 120.0   # reports kept per host (by ts), far more than any test's window


class IdleRules:
    def __init__(self) -> None:
        self.leases: dict[str, tuple[str, set[str], float]] = {}     # lease id -> (host, its GPUs, created_at)
        self.reports: dict[str, list[tuple[float, dict[str, Any]]]] = {}   # host -> (ts, uuid -> pct), oldest first
        self.found: list[str] = []

    def event(self, kind: str, parts: list[str], ev: WatchEvent) -> None:
        doc = put_doc(kind, ev)
        if doc is MALFORMED:
            return   # (the G1 and INVALID rules report malformed values)
        if kind == "leases" and len(parts) == 3:
            host, gpu, lease_id = parts
            if ev.kind == "PUT":
                created = doc.get("created_at", 0.0)
                held = self.leases.get(lease_id, (host, set(), float(created) if isinstance(created, (int, float)) else 0.0))
                held[1].add(gpu)
                self.leases[lease_id] = held
            elif lease_id in self.leases:
                self.leases[lease_id][1].discard(gpu)
                if not self.leases[lease_id][1]:
                    del self.leases[lease_id]
        elif kind == "usage" and parts and ev.kind == "PUT":
            ts = doc.get("ts", 0.0)
            ts = float(ts) if isinstance(ts, (int, float)) else 0.0
            pcts = {str(g.get("uuid")): g.get("utilization_pct", -1) for g in doc.get("gpus", ()) if isinstance(g, dict)}
            kept = [r for r in self.reports.get(parts[0], []) if r[0] >= ts - KEEP_S]
            self.reports[parts[0]] = [*kept, (ts, pcts)]
        elif kind == "usage" and parts:
            self.reports.pop(parts[0], None)
        elif kind == "evictions" and parts and ev.kind == "PUT" and doc.get("reason") == "idle":
            self._check_notice(parts[0], doc)

    def _check_notice(self, lease_id: str, notice: dict[str, Any]) -> None:
        at = float(notice.get("created_at", 0.0) or 0.0)
        lease = self.leases.get(lease_id)
        if lease is None:
            return   # (the notice rules report a notice for no live lease)
        host, gpus, created = lease
        if at - created < MIN_WINDOW_S - SLACK_S:
            self.found.append(f"idle: lease {lease_id} got an idle notice {at - created:.2f} s after its grant, "
                              f"before the window ({MIN_WINDOW_S:g} s)")
            return
        reports = self.reports.get(host, [])
        window = [r for r in reports if r[0] > at - MIN_WINDOW_S + SLACK_S]
        if reports:
            window.append(reports[-1])   # the report standing at the notice's revision
        if not window:
            self.found.append(f"idle: lease {lease_id} got an idle notice with no usage report of host {host}")
            return
        for ts, pcts in window:
            for gpu in sorted(gpus):
                pct = pcts.get(gpu, -1)
                if not isinstance(pct, int) or isinstance(pct, bool) or not 0 <= pct < BELOW_PCT:
                    self.found.append(f"idle: lease {lease_id} got an idle notice while host {host}'s report at "
                                      f"{ts:.3f} shows GPU {gpu} at {pct!r} (unknown or not below {BELOW_PCT} %)")
                    return

    def check(self, rev: int) -> list[str]:
        out = [f"rev {rev}: {x}" for x in self.found]
        self.found = []
        return out
