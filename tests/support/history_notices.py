"""The rule of the history checker that notices serve their requester (G3, G11; ``policy/notices.py``), fed by
the replay of tests/history.check_history:

* **a request's notice stands only while its requester lists it**: after every revision, each live eviction
  notice made for a request (``requester_priority`` set: by priority or by reclaim; an operator's notice
  aside), and each that ended in that revision together with its lease (the lease revoked by the leader, or
  released by its holder under the notice), names a lease that the requester's queue entry on that host
  (``agent/request_id`` = the notice's ``requested_by``), where that entry exists after the revision, lists
  among its ``victims``. A round that no longer needs a victim (the request fits on room it finds free, its team's
  limit holds it back, a reclaim victim went back into quota, a victim can be spared) rewrites the entry
  without it and withdraws the notice in one transaction, and the leader's revoke compares the entry it read:
  so no lease is revoked for a request that no longer lists it. A requester that has left the queue (its wait
  ended, its caller or session left, it was granted) is not held to it: its notices are withdrawn after its
  entry goes (at the latest by the leader at the deadline), and a holder may always release its lease.

What the checker cannot decide from the history alone, and so does not check: whether the requester could
have been placed without the victim at the revoke's revision (that needs the partition caps, the untracked
VRAM and the queue's blocking rules as the round applied them); the round's choice is covered by the planner's
unit tests and the scenes of tests/guarantees/test_notices_serve.py.
"""
from __future__ import annotations

import json
from typing import Any

from coordinator.etcd.store import WatchEvent


class NoticeRules:
    def __init__(self) -> None:
        self.entries: dict[tuple[str, str], tuple[str, ...]] = {}   # (host, agent/request_id) -> victims
        self.notices: dict[str, dict[str, Any]] = {}               # lease id -> a live request's notice
        self._touched: set[str] = set()                             # notices created or rewritten this revision
        self._gone: dict[str, dict[str, Any]] = {}                 # notices deleted this revision
        self._leases_gone: set[str] = set()                         # lease ids whose records went this revision
        self._entries_touched: set[tuple[str, str]] = set()

    def event(self, kind: str, parts: list[str], ev: WatchEvent) -> None:
        if kind == "queue" and len(parts) == 2:
            kv = ev.kv if ev.kind == "PUT" else ev.prev_kv
            e = json.loads(kv.value) if kv is not None else {}
            if "agent" not in e or "request_id" not in e:
                return     # (a test's partial entry: not a request this rule can name)
            who = (parts[0], f"{e['agent']}/{e['request_id']}")
            if ev.kind == "PUT":
                self.entries[who] = tuple(e.get("victims") or ())
            else:
                self.entries.pop(who, None)
            self._entries_touched.add(who)
        elif kind == "evictions" and parts:
            if ev.kind == "PUT":
                rec = json.loads(ev.kv.value)
                if rec.get("requester_priority") is not None and "requested_by" in rec and "host" in rec:
                    self.notices[parts[0]] = rec
                    self._touched.add(parts[0])
                else:
                    self.notices.pop(parts[0], None)
            else:
                gone = self.notices.pop(parts[0], None)
                if gone is not None:
                    self._gone[parts[0]] = gone
        elif kind == "leases" and len(parts) == 3 and ev.kind == "DELETE":
            self._leases_gone.add(parts[2])

    def withdrawn_now(self) -> set[str]:
        """The leases whose request notice was deleted in this revision (withdrawn, or gone with the lease)."""
        return set(self._gone)

    def check(self, rev: int) -> list[str]:
        ended = [rec for lease_id, rec in self._gone.items() if lease_id in self._leases_gone]
        touched, entries_touched = self._touched, self._entries_touched
        self._gone, self._leases_gone, self._touched, self._entries_touched = {}, set(), set(), set()
        out = []
        looked = [self.notices[i] for i in sorted(touched) if i in self.notices]
        looked += [rec for rec in self.notices.values() if (rec["host"], rec["requested_by"]) in entries_touched
                   and rec["lease_id"] not in touched]
        for rec in looked:
            victims = self.entries.get((rec["host"], rec["requested_by"]))
            if victims is not None and rec["lease_id"] not in victims:
                out.append(f"rev {rev}: G3 notice to lease {rec['lease_id']} stands for {rec['requested_by']}, whose "
                           f"queue entry no longer lists it (victims {list(victims)})")
        for rec in ended:
            victims = self.entries.get((rec["host"], rec["requested_by"]))
            if victims is not None and rec["lease_id"] not in victims:
                out.append(f"rev {rev}: G3 lease {rec['lease_id']} ended under a notice for {rec['requested_by']}, "
                           f"whose queue entry no longer lists it (victims {list(victims)})")
        return out
