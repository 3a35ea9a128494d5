"""The history checker's multi-host gang rule (G12, issue 30), fed by the replay of tests/history.check_history:

* **whole or absent**: at every revision, a lease whose records carry ``hosts`` (``[[host, [gpu uuids]], ...]``,
  every host's part in rank order) has either every ``(host, uuid)`` record its ``hosts`` lists, or none. The
  grant, release, eviction, reclaim and session expiry each take the whole gang in one transaction, so no
  revision shows a part of it;
* **one list**: every present record of such a lease carries the same ``hosts`` (a record of it without
  ``hosts`` counts as a different list).
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

    def event(self, kind: str, parts: list[str], ev: WatchEvent) -> None:
        if kind != "leases" or len(parts) != 3:
            return
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
        return out
