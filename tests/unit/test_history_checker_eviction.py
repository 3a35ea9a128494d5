"""tests/history.check_history on synthetic etcd histories: G3 eviction order, for leases and for leases bound
to processes (against the node's usage reports)."""
from __future__ import annotations

import json
from typing import Any

from coordinator.keys import Keys, lease_id_for
from tests.support.history_builder import (
    G0,
    HOST,
    SESSION,
    History,
    K,
    assert_one_violation,
    check,
)

# -- G3 eviction ----------------------------------------------------------------------------------

def _evict(h: History, lease_id: str, requester_priority: int | None, gpu: str = G0) -> None:
    h.put(K.eviction(lease_id), {"lease_id": lease_id, "host": HOST, "gpu_uuid": gpu, "agent": "a",
                                 "session_id": "1f", "victim_priority": 0, "requested_by": "b/r9",
                                 "requester_priority": requester_priority, "reason": "test",
                                 "deadline_unix": 1.0, "created_at": 0.0}, etcd_lease=SESSION)


def test_eviction_of_a_lower_priority_lease_passes() -> None:
    h = History()
    h.ledger(G0)
    victim = h.lease("a", "r1", 8000, priority=1)
    _evict(h, victim, requester_priority=10)
    _evict(h, h.lease("a", "r2", 100, priority=50), requester_priority=None)   # an operator's: any priority
    rep = check(h)
    assert rep.violations == [] and rep.evictions == 2


def test_eviction_of_an_equal_priority_lease_is_detected() -> None:
    h = History()
    h.ledger(G0)
    victim = h.lease("a", "r1", 8000, priority=10)
    _evict(h, victim, requester_priority=10)
    assert_one_violation(check(h), "G3", "priority 10")


def test_grant_while_victims_live_is_detected() -> None:
    h = History()
    h.ledger(G0)
    victim = h.lease("a", "r1", 4000, priority=1)
    rank = Keys.queue_rank(10, 1, "x")
    waiter = lease_id_for("b", "r9", HOST)
    h.put(K.queue_entry(HOST, rank), {"lease_id": waiter, "victims": [victim]})
    _evict(h, victim, requester_priority=10)
    with h.txn():
        h.delete(K.queue_entry(HOST, rank))
        h.lease("b", "r9", 4000, priority=10, bump=False)
        h.ledger(G0, seq=2)
    assert_one_violation(check(h), "G3", "admitted while its victims")
    # And the right order passes: victim gone first.
    h2 = History()
    h2.ledger(G0)
    victim = h2.lease("a", "r1", 4000, priority=1)
    h2.put(K.queue_entry(HOST, rank), {"lease_id": waiter, "victims": [victim]})
    _evict(h2, victim, requester_priority=10)
    h2.release(victim)
    with h2.txn():
        h2.delete(K.queue_entry(HOST, rank))
        h2.lease("b", "r9", 4000, priority=10, bump=False)
        h2.ledger(G0, seq=2)
    assert check(h2).violations == []


# -- G3 for leases bound to processes: against the node's usage reports ----------------------------

PID = 4242


def _bound_victim(h: History, vram_mb: int = 12000) -> str:
    """A lease of agent a with process PID attached, which the node lists on G0; then b/r9 evicts it."""
    victim = h.lease("a", "r1", vram_mb, priority=1)
    kv = h.kvs[K.lease(HOST, G0, victim)]
    h.put(kv.key, json.loads(kv.value) | {"pids": [PID], "pgid": PID}, etcd_lease=SESSION)
    _usage(h, [PID], victim)
    _evict(h, victim, requester_priority=10)
    return victim


def _usage(h: History, pids: list[int], lease_id: str, state: str = "leased") -> None:
    h.put(K.usage(HOST), {"ts": 1.0, "interval_s": 5.0, "gpus": [
        {"uuid": G0, "index": 0, "vram_used_mb": 0, "processes_visible": True,
         "processes": [{"pid": p, "used_mb": 0, "state": state, "lease_id": lease_id} for p in pids]}]})


def _end(h: History, victim: str, departing: dict[str, Any] | None = None) -> None:
    """The victim's release (or revoke): its lease and notice go, maybe leaving a departing record."""
    with h.txn():
        h.release(victim)
        h.delete(K.eviction(victim))
        if departing is not None:
            h.put(K.departing(HOST, G0, victim), {"lease_id": victim, "forced": False} | departing)


def _grant_requester(h: History, vram_mb: int = 12000) -> None:
    h.lease("b", "r9", vram_mb, priority=10)


def test_a_requester_granted_while_its_victims_processes_are_reported_is_detected() -> None:
    h = History()
    h.ledger(G0)
    victim = _bound_victim(h)
    _end(h, victim, departing={})
    _usage(h, [PID], victim, state="orphaned")     # the node still lists it after the lease ended
    _grant_requester(h)
    assert_one_violation(check(h), "G3", f"victim {victim}'s processes [{PID}] are still reported")


def test_a_requester_granted_once_the_node_no_longer_lists_the_victims_processes_passes() -> None:
    h = History()
    h.ledger(G0)
    victim = _bound_victim(h)
    _end(h, victim, departing={})
    _usage(h, [], victim)
    h.delete(K.departing(HOST, G0, victim))
    _grant_requester(h)
    assert check(h).violations == []


def test_a_forced_departing_record_lets_the_grant_in_though_the_process_is_listed() -> None:
    h = History()
    h.ledger(G0)
    victim = _bound_victim(h)
    _end(h, victim, departing={})
    h.put(K.departing(HOST, G0, victim), {"lease_id": victim, "forced": True})   # the kill margin passed
    _grant_requester(h)
    assert check(h).violations == []


def test_a_victim_that_went_with_its_session_is_not_held_to_the_order() -> None:
    h = History()
    h.ledger(G0)
    h.put(K.session("a", format(SESSION, "x")), {"agent": "a"}, etcd_lease=SESSION)
    victim = _bound_victim(h)
    with h.txn():     # the session expired: etcd deletes everything on it at one revision
        h.delete(K.session("a", format(SESSION, "x")))
        h.release(victim)
        h.delete(K.eviction(victim))
    _grant_requester(h)
    assert check(h).violations == []


def test_another_grant_that_fits_only_without_the_departing_vram_is_detected() -> None:
    h = History()
    h.ledger(G0)
    victim = _bound_victim(h, vram_mb=12000)
    _end(h, victim, departing={})
    h.lease("c", "r1", 4000)                       # 12000 still held + 4000 <= 16384: fine
    assert check(h).violations == []
    h.lease("c", "r2", 4000)                       # 12000 + 8000 > 16384
    assert_one_violation(check(h), "G3", "counting ended leases")
