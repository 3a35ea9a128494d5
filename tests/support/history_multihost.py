"""The history checker's multi-host gang rule (G12, issue 30), fed by the replay of tests/history.check_history:

* **whole or absent**: at every revision, a lease whose records carry ``hosts`` (``[[host, [gpu uuids]], ...]``,
  every host's part in rank order) has either every ``(host, uuid)`` record its ``hosts`` lists, or none. The
  grant, release, eviction, reclaim and session expiry each take the whole gang in one transaction, so no
  revision shows a part of it;
* **one list**: every present record of such a lease carries the same ``hosts`` (a record of it without
  ``hosts`` counts as a different list);
* **reservations** (G2 across hosts): no lease of lower priority than a waiting multi-host gang is created on a
  GPU that one of the gang's ``queue/<host>/<rank>`` entries reserves (``reserve``), live before that revision,
  unless it is a backfill: it has a time limit and its record's ``created_at`` + ``time_limit_s`` is not after
  the entry's ``start_after`` (``policy/backfill.py``; the kill margin, which the checker does not know, is left
  out, so the rule is looser than the coordinator's). Same-priority leases are not checked (a lease record does
  not carry its request's arrival, so the checker cannot rank it against the gang).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

from coordinator.etcd.store import WatchEvent
from tests.support.history_docs import put_doc

HostsList = tuple[tuple[str, tuple[str, ...]], ...]


def hosts_of(doc: Any) -> HostsList:
    """A lease record's ``hosts`` as a hashable tuple; () when absent or not a list of [host, [uuids]] parts."""
    raw = doc.get("hosts") if isinstance(doc, dict) else None
    if not isinstance(raw, list):
        return ()
    try:
        return tuple((str(h), tuple(str(u) for u in uuids)) for h, uuids in raw)
    except (TypeError, ValueError):
        return ()


class MultiHostRules:
    def __init__(self) -> None:
        # lease id -> (host, uuid) -> the hosts its record there carries, for every live record of the id
        self.records: dict[str, dict[tuple[str, str], HostsList]] = defaultdict(dict)
        self.touched: set[str] = set()     # lease ids whose records this revision changes
        self.reserved: dict[bytes, tuple[str, dict[str, Any]]] = {}   # queue key -> (host, a live reservation)
        self.queue_changes: list[tuple[bytes, str, dict[str, Any] | None]] = []   # this revision's, applied after it
        self.created: list[tuple[str, str, dict[str, Any]]] = []   # (host, uuid, record) created this revision

    def event(self, kind: str, parts: list[str], ev: WatchEvent) -> None:
        if kind == "queue" and len(parts) == 2:
            doc = put_doc(kind, ev, ("queue",))
            self.queue_changes.append((ev.kv.key, parts[0], doc if isinstance(doc, dict) and doc.get("reserve") else None))
            return
        if kind != "leases" or len(parts) != 3:
            return
        if ev.kind == "PUT" and ev.kv.version == 1 and isinstance(doc := put_doc(kind, ev), dict):
            self.created.append((parts[0], parts[1], doc))
        host, gpu, lease_id = parts
        self.touched.add(lease_id)
        if ev.kind == "PUT":
            self.records[lease_id][(host, gpu)] = hosts_of(put_doc(kind, ev))
        else:
            self.records[lease_id].pop((host, gpu), None)
            if not self.records[lease_id]:
                del self.records[lease_id]

    def check(self, rev: int) -> list[str]:
        out = []
        for lease_id in sorted(self.touched):
            present = self.records.get(lease_id, {})
            lists = set(present.values())
            if not any(lists):          # absent, or a lease of one host
                continue
            if len(lists) > 1:
                out.append(f"rev {rev}: G12 multi-host gang {lease_id}: its records carry {len(lists)} different "
                           f"hosts lists: {sorted(lists)}")
            listed = {(h, u) for hosts in lists for h, uuids in hosts for u in uuids}
            missing, extra = sorted(listed - set(present)), sorted(set(present) - listed)
            if missing or extra:
                out.append(f"rev {rev}: G12 multi-host gang {lease_id} partly present: "
                           f"missing {missing}, not listed {extra}")
        self.touched = set()
        out += self._reservations(rev)
        return out

    def _reservations(self, rev: int) -> list[str]:
        out = []
        for host, uuid, lease in self.created:
            for on, e in self.reserved.values():
                if on != host or uuid not in e.get("reserve", ()) or lease.get("id") == e.get("lease_id"):
                    continue
                try:
                    lower = int(lease.get("priority", 0)) < int(e.get("priority", 0))
                    limit, start = float(lease.get("time_limit_s") or 0), float(e.get("start_after") or 0)
                    backfill = limit > 0 and start > 0 and float(lease.get("created_at", 0)) + limit <= start
                except (TypeError, ValueError):
                    continue
                if lower and not backfill:
                    out.append(f"rev {rev}: G12 lease {lease.get('id')} of priority {lease.get('priority')} created "
                               f"on {host}/{uuid}, which multi-host gang {e.get('lease_id')} of priority "
                               f"{e.get('priority')} reserves (not a backfill that ends by its start)")
        for key, host, doc in self.queue_changes:
            if doc is None:
                self.reserved.pop(key, None)
            else:
                self.reserved[key] = (host, doc)
        self.created, self.queue_changes = [], []
        return out
