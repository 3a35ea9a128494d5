"""tests/history.check_history on synthetic etcd histories: a clean one passes; every G1 capacity violation
(GPU, headroom, agent caps, partitions changed under live leases) is caught."""
from __future__ import annotations

import random

import pytest

from coordinator.etcd.store import WatchEvent
from coordinator.keys import Keys
from tests.history import check_history
from tests.support.history_builder import (
    CAP,
    G0,
    G1,
    HOST,
    SESSION,
    History,
    K,
    assert_one_violation,
    check,
    clean_history,
)

# -- clean ----------------------------------------------------------------------------------------

def test_clean_history_passes() -> None:
    h = clean_history()
    rep = check(h)
    rep.assert_ok()
    assert rep.violations == []
    assert rep.events == len(h.events)
    assert rep.revisions == h.rev - 1
    assert rep.leases_created == 6
    assert rep.max_used[f"{HOST}/{G0}"] == 15800
    assert rep.max_used[f"{HOST}/{G1}"] == 8000


def test_empty_history() -> None:
    rep = check_history([], K)
    assert rep.violations == [] and rep.revisions == 0
    with pytest.raises(AssertionError):
        rep.assert_ok()          # nothing read is not a pass


def test_order_of_events_across_revisions_does_not_matter() -> None:
    h = clean_history()
    # Within a revision the order is etcd's; keep it, shuffle only the revisions.
    by_rev: dict[int, list[WatchEvent]] = {}
    for ev in h.events:
        by_rev.setdefault(ev.kv.mod_revision, []).append(ev)
    revs = list(by_rev)
    random.Random(7).shuffle(revs)
    rep = check_history([ev for r in revs for ev in by_rev[r]], K)
    assert rep.violations == []


def test_unrelated_keys_are_ignored() -> None:
    h = History()
    h.ledger(G0)
    h.put(K.host(HOST), {"address": "127.0.0.1:7071", "inventory": {}})
    h.put(K.session("a", "1f"), {"agent": "a"}, etcd_lease=SESSION)
    h.put(K.queue_entry(HOST, Keys.queue_rank(0, 1, "x")), {"vram_mb": 99999})
    h.put(K.coordinator("r1"), {})
    h.lease("a", "r1", 100)
    assert check(h).violations == []


# -- G1 capacity --------------------------------------------------------------------------------

def test_over_capacity_detected() -> None:
    h = History()
    h.ledger(G0)
    h.lease("a", "r1", 10000)
    h.lease("b", "r1", 7000)                # 17000 > 16384
    rep = check(h)
    assert_one_violation(rep, "G1", f"{HOST}/{G0}", "17000")
    assert rep.max_used[f"{HOST}/{G0}"] == 17000


def test_exactly_at_capacity_is_fine() -> None:
    h = History()
    h.ledger(G0)
    h.lease("a", "r1", 10000)
    h.lease("b", "r1", CAP - 10000)
    assert check(h).violations == []


def test_over_capacity_minus_headroom_detected() -> None:
    h = History()
    h.ledger(G0)
    h.partition({}, headroom_mb=1024, mode="shared")
    h.lease("a", "r1", CAP - 1024)          # exactly usable: fine
    assert check(h).violations == []
    h.lease("b", "r1", 1)
    assert_one_violation(check(h), "G1", str(CAP - 1024))


def test_headroom_raised_under_live_leases_detected() -> None:
    h = History()
    h.ledger(G0)
    h.lease("a", "r1", 16000)
    h.partition({}, headroom_mb=1024, mode="shared")   # the partition change itself breaks G1
    assert_one_violation(check(h), "G1")


def test_capacity_shrunk_under_live_leases_detected() -> None:
    h = History()
    h.ledger(G0)
    h.lease("a", "r1", 12000)
    h.ledger(G0, capacity_mb=8192)
    assert_one_violation(check(h), "G1", "8192")


def test_agent_above_its_cap_detected() -> None:
    h = History()
    h.ledger(G0)
    h.partition({"a": [(G0, 4000)], "b": [(G0, 12000)]})
    h.lease("a", "r1", 3000)
    assert check(h).violations == []
    h.lease("a", "r2", 1001)                # 4001 > 4000, GPU far from full
    assert_one_violation(check(h), "G1", "agent a", "4001", "4000")


def test_agent_without_cap_on_that_gpu_detected() -> None:
    h = History()
    h.ledger(G0)
    h.ledger(G1)
    h.partition({"a": [(G0, 4000)], "b": [(G1, 4000)]})
    h.lease("a", "r1", 100, G1)             # a has no cap on G1
    assert_one_violation(check(h), "G1", "agent a", f"{HOST}/{G1}")


def test_cap_lowered_under_live_leases_detected() -> None:
    h = History()
    h.ledger(G0)
    h.partition({"a": [(G0, 8000)]})
    h.lease("a", "r1", 6000)
    h.partition({"a": [(G0, 4000)]})
    assert_one_violation(check(h), "G1", "agent a")


def test_shared_mode_has_no_agent_caps() -> None:
    h = History()
    h.ledger(G0)
    h.partition({"a": [(G0, 10)]}, mode="shared")
    h.lease("a", "r1", 8000)
    assert check(h).violations == []


def test_partition_deleted_lifts_caps_and_headroom() -> None:
    h = History()
    h.ledger(G0)
    h.partition({"a": [(G0, 8000)]}, headroom_mb=8000)
    h.delete(K.partition(HOST))
    h.lease("a", "r1", 16000)
    assert check(h).violations == []
