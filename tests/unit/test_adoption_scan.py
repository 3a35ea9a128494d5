"""Adoption (``replica/liveness.Liveness.adopt``) over a replica's mirror: after each scan, every session whose
record names a replica that is not registered, and that rendezvous hashing gives this replica, is tracked here,
whatever the sequence of record changes and scans before (each record's tracker is parsed once per version and
remembered between scans: a remembered one must never outlive its version)."""
from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, cast

from hypothesis import given
from hypothesis import strategies as st

from coordinator.config import CoordinatorConfig
from coordinator.etcd.types import KV, WatchBatch, WatchEvent
from coordinator.keys import Keys
from coordinator.replica.liveness import Liveness
from coordinator.replica.mirror import Mirror
from coordinator.replica.session_table import adopter

KEYS = Keys()
ME, LIVE, DEAD = "r-me", "r-live", "r-dead"
SESSIONS = [f"{n:016x}" for n in range(1, 7)]

steps = st.lists(st.one_of(
    st.tuples(st.just("put"), st.sampled_from(SESSIONS), st.sampled_from([ME, LIVE, DEAD])),
    st.tuples(st.just("delete"), st.sampled_from(SESSIONS), st.just("")),
    st.tuples(st.just("scan"), st.just(""), st.just("")),
), max_size=30)


def _put(mirror: Mirror, revision: int, key: bytes, doc: dict[str, Any]) -> None:
    kv = KV(key, json.dumps(doc).encode(), revision, revision, 1, 7)
    mirror.apply(WatchBatch(revision, (WatchEvent("PUT", kv, None),)))


@given(steps)
def test_every_orphan_rendezvous_gives_this_replica_is_adopted_at_each_scan(plan: list[tuple[str, str, str]]) -> None:
    mirror = Mirror(KEYS)
    mirror.reset([], 1)
    revision = 1
    for replica in (ME, LIVE):
        revision += 1
        _put(mirror, revision, KEYS.coordinator(replica), {"replica": replica, "sessions": "memory"})
    ctx = SimpleNamespace(mirror=mirror, keys=KEYS, replica_id=ME, config=CoordinatorConfig())
    liveness = Liveness(cast(Any, ctx), lambda info: None)
    live = [ME, LIVE]
    expected: set[str] = set()      # adopted so far (a session once tracked stays so until dropped)
    for op, session_id, tracker in plan:
        revision += 1
        key = KEYS.session("agent", session_id)
        if op == "put":
            _put(mirror, revision, key, {"host": "h1", "ttl": 5, "coordinator": tracker})
        elif op == "delete":
            kv = KV(key, b"", 0, revision, 0, 0)
            mirror.apply(WatchBatch(revision, (WatchEvent("DELETE", kv, None),)))
        else:
            liveness._scanned = 0.0     # the periodic scan is due
            liveness.adopt()
            for kv in mirror.items("sessions"):
                sid = KEYS.parse(kv.key)[1][1]
                if json.loads(kv.value)["coordinator"] == DEAD and adopter(sid, live) == ME:
                    expected.add(sid)
            assert expected <= {sid for sid in SESSIONS if sid in liveness.table}
            assert all(adopter(sid, live) == ME for sid in SESSIONS if sid in liveness.table)
