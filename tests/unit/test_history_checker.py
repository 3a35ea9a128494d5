"""Tests of tests/history.check_history on synthetic etcd histories: a clean one passes, each violation is caught."""
from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

import pytest

from coordinator.etcd.store import KV, WatchEvent
from coordinator.keys import Keys, lease_id_for
from tests.history import HistoryReport, check_history, replay_differs

K = Keys("/t/")
HOST = "h1"
G0 = "GPU-0"
G1 = "GPU-1"
CAP = 16384
SESSION = 0x1F


def dumps(d: Any) -> bytes:
    return json.dumps(d, separators=(",", ":"), sort_keys=True).encode()


class History:
    """Builds watch events the way the coordinator's transactions would produce them.

    Every ``txn()`` is one etcd revision; the events inside it share that mod_revision.
    """

    def __init__(self) -> None:
        self.rev = 1
        self.events: list[WatchEvent] = []
        self.kvs: dict[bytes, KV] = {}
        self.seq: dict[str, int] = {}
        self._pending: list[tuple[str, bytes, bytes, int]] | None = None

    # -- low level ---------------------------------------------------------------------------
    def txn(self) -> History:
        assert self._pending is None
        self._pending = []
        return self

    def __enter__(self) -> History:
        return self

    def __exit__(self, *exc: object) -> None:
        self.commit()

    def commit(self) -> None:
        ops, self._pending = self._pending or [], None
        self.rev += 1
        for kind, key, value, etcd_lease in ops:
            prev = self.kvs.get(key)
            if kind == "PUT":
                kv = KV(key, value, prev.create_revision if prev else self.rev, self.rev,
                        prev.version + 1 if prev else 1, etcd_lease)
                self.kvs[key] = kv
            else:
                assert prev is not None, key
                kv = KV(key, b"", 0, self.rev, 0, 0)
                del self.kvs[key]
            self.events.append(WatchEvent(kind, kv, prev))

    def put(self, key: bytes, value: Any, etcd_lease: int = 0) -> None:
        op = ("PUT", key, dumps(value), etcd_lease)
        if self._pending is None:
            self._pending = [op]
            self.commit()
        else:
            self._pending.append(op)

    def delete(self, key: bytes) -> None:
        op = ("DELETE", key, b"", 0)
        if self._pending is None:
            self._pending = [op]
            self.commit()
        else:
            self._pending.append(op)

    # -- coordinator-shaped writes -------------------------------------------------------------
    def ledger(self, gpu: str = G0, seq: int | None = None, capacity_mb: int = CAP, host: str = HOST) -> None:
        if seq is None:
            seq = self.seq.get(gpu, 0)
        self.seq[gpu] = seq
        self.put(K.gpu(host, gpu), {"capacity_mb": capacity_mb, "seq": seq})

    def lease(self, agent: str, request_id: str, vram_mb: int, gpu: str = G0, *, token: int | None = None,
              lease_id: str | None = None, priority: int = 0, host: str = HOST, bump: bool = True) -> str:
        """Put a new lease and, like an admission, bump the GPU's ledger in the same revision (own txn if none open)."""
        if token is None:
            token = self.seq.get(gpu, 0) + 1
        lease_id = lease_id or lease_id_for(agent, request_id, host)
        own_txn = self._pending is None
        if own_txn:
            self.txn()
        self.put(K.lease(host, gpu, lease_id), {
            "id": lease_id, "host": host, "gpu_uuid": gpu, "gpu_index": int(gpu.rsplit("-", 1)[1]),
            "agent": agent, "session_id": format(SESSION, "x"), "vram_mb": vram_mb, "priority": priority,
            "preemptible": True, "request_id": request_id, "token": token, "created_at": 1_700_000_000.0 + token,
        }, etcd_lease=SESSION)
        if bump:
            self.ledger(gpu, max(token, self.seq.get(gpu, 0)), host=host)
        if own_txn:
            self.commit()
        return lease_id

    def release(self, lease_id: str, gpu: str = G0, host: str = HOST) -> None:
        self.delete(K.lease(host, gpu, lease_id))

    def partition(self, caps: dict[str, list[tuple[str, int]]], headroom_mb: int = 0, mode: str = "manual",
                  host: str = HOST) -> None:
        self.put(K.partition(host), {"partition": {
            "host": host, "mode": mode, "agents": list(caps), "headroom_mb": headroom_mb,
            "allocations": [{"agent": a, "cores": [], "mem_bytes": 0, "disk_bytes": 0, "whole_gpus": [],
                             "vram_caps_mb": [[u, mb] for u, mb in c]} for a, c in caps.items()],
            "spec": None}})


def check(h: History) -> HistoryReport:
    return check_history(h.events, K)


def assert_one_violation(rep: HistoryReport, *needles: str) -> None:
    assert rep.violations, "the violation was not detected"
    assert all(any(n in v for v in rep.violations) for n in needles), rep.violations


def clean_history() -> History:
    """Two GPUs, two agents, a partition, admissions, a group commit, releases and an eviction."""
    h = History()
    h.ledger(G0)
    h.ledger(G1)
    h.partition({"a": [(G0, 12000), (G1, 16384)], "b": [(G0, 8000), (G1, 8000)]}, headroom_mb=512)
    a1 = h.lease("a", "r1", 8000)
    b1 = h.lease("b", "r1", 7000)           # same request_id, other agent: fine
    with h.txn():                            # group commit: two admissions on G1, one ledger bump
        h.lease("a", "r2", 4000, G1, token=1, bump=False)
        h.lease("b", "r2", 4000, G1, token=2, bump=False)
        h.ledger(G1, seq=2)
    h.release(a1)
    a3 = h.lease("a", "r3", 8800)           # G0: 7000 + 8800 = 15800 <= 16384 - 512
    h.release(b1)
    with h.txn():                            # victim gone and the waiter admitted in one revision
        h.release(a3)
        h.lease("b", "r4", 8000)
    return h


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


# -- G5 fencing ---------------------------------------------------------------------------------

def test_token_not_above_previous_max_detected() -> None:
    h = History()
    h.ledger(G0)
    a = h.lease("a", "r1", 100)             # token 1
    h.lease("a", "r2", 100)                 # token 2
    h.release(a)
    h.lease("b", "r1", 100, token=2)        # token 2 is still live on the r2 lease
    assert_one_violation(check(h), "G5", "token 2")


def test_token_reused_after_release_detected() -> None:
    h = History()
    h.ledger(G0)
    a = h.lease("a", "r1", 100)             # token 1
    h.release(a)
    h.lease("b", "r1", 100, token=1)        # the earlier token is gone from the live set, not from history
    assert_one_violation(check(h), "G5", "token 1")


def test_token_lower_than_previous_detected() -> None:
    h = History()
    h.ledger(G0)
    h.lease("a", "r1", 100, token=5)
    h.lease("b", "r1", 100, token=3)
    assert_one_violation(check(h), "G5", "token 3", "5")


def test_equal_tokens_in_one_group_commit_detected() -> None:
    h = History()
    h.ledger(G0)
    with h.txn():
        h.lease("a", "r1", 100, token=1, bump=False)
        h.lease("b", "r1", 100, token=1, bump=False)
        h.ledger(G0, seq=1)
    assert_one_violation(check(h), "G5", "token 1", "not above 1")


def test_tokens_are_per_gpu() -> None:
    h = History()
    h.ledger(G0)
    h.ledger(G1)
    h.lease("a", "r1", 100, G0, token=1)
    h.lease("a", "r2", 100, G1, token=1)
    assert check(h).violations == []


def test_token_zero_detected() -> None:
    h = History()
    h.ledger(G0)
    h.lease("a", "r1", 100, token=0)
    assert_one_violation(check(h), "G5")


def test_live_token_above_ledger_seq_detected() -> None:
    h = History()
    h.ledger(G0)
    h.lease("a", "r1", 100, token=1, bump=False)     # admitted without bumping the ledger
    assert_one_violation(check(h), "G5", "ledger")


def test_ledger_seq_going_back_below_a_live_token_detected() -> None:
    h = History()
    h.ledger(G0)
    h.lease("a", "r1", 100)                 # token 1, seq 1
    h.lease("a", "r2", 100)                 # token 2, seq 2
    h.ledger(G0, seq=1)
    assert_one_violation(check(h), "G5", "ledger")


def test_update_of_a_live_lease_is_not_a_new_token() -> None:
    h = History()
    h.ledger(G0)
    lid = h.lease("a", "r1", 100)
    # Rewriting the same lease (version 2) keeps its token: not a re-issue.
    h.put(K.lease(HOST, G0, lid), json.loads(h.kvs[K.lease(HOST, G0, lid)].value), etcd_lease=SESSION)
    assert h.kvs[K.lease(HOST, G0, lid)].version == 2
    assert check(h).violations == []


# -- G6 idempotency -----------------------------------------------------------------------------

def test_two_live_leases_same_request_detected() -> None:
    h = History()
    h.ledger(G0)
    h.lease("a", "r1", 100, lease_id="one")
    h.lease("a", "r1", 100, lease_id="two")
    assert_one_violation(check(h), "G6", "'a', 'r1'")


def test_same_request_after_release_is_fine() -> None:
    h = History()
    h.ledger(G0)
    lid = h.lease("a", "r1", 100)
    h.release(lid)
    h.lease("a", "r1", 100)
    assert check(h).violations == []


def test_same_request_on_two_gpus_detected() -> None:
    h = History()
    h.ledger(G0)
    h.ledger(G1)
    h.lease("a", "r1", 100, G0)
    h.lease("a", "r1", 100, G1)             # the very G6 break the key design guards against
    assert_one_violation(check(h), "G6")


def test_same_request_id_on_two_hosts_is_two_requests() -> None:
    h = History()
    h.ledger(G0)
    h.ledger(G1, host="h2")
    h.lease("a", "r1", 100, G0)
    h.lease("a", "r1", 100, G1, host="h2")  # a session is of one host: another host, another request
    assert check(h).violations == []


# -- one revision, applied together -------------------------------------------------------------

def test_delete_and_put_in_one_revision_are_applied_together() -> None:
    h = History()
    h.ledger(G0)
    victim = h.lease("a", "r1", 12000)
    with h.txn():
        # The put comes first in the revision: applied one at a time, 12000 + 10000 would exceed.
        h.lease("b", "r1", 10000, bump=False)
        h.release(victim)
        h.ledger(G0, seq=2)
    assert check(h).violations == []


def test_same_events_one_revision_each_would_be_flagged() -> None:
    """The control for the test above: split into separate revisions, the same events do break G1."""
    h = History()
    h.ledger(G0)
    victim = h.lease("a", "r1", 12000)
    with h.txn():
        h.lease("b", "r1", 10000, bump=False)
        h.release(victim)
        h.ledger(G0, seq=2)
    split = [dataclasses.replace(ev, kv=dataclasses.replace(ev.kv, mod_revision=i + 1))
             for i, ev in enumerate(h.events)]
    assert_one_violation(check_history(split, K), "G1", "22000")


def test_put_before_ledger_bump_in_one_revision() -> None:
    h = History()
    h.ledger(G0)
    with h.txn():
        # Applied one at a time, the lease's token would be above the not yet bumped seq.
        h.lease("a", "r1", 100, token=1, bump=False)
        h.ledger(G0, seq=1)
    assert check(h).violations == []


def test_partition_and_admission_in_one_revision() -> None:
    h = History()
    h.ledger(G0)
    h.partition({"a": [(G0, 1000)]})
    h.lease("a", "r1", 1000)
    with h.txn():
        h.partition({"a": [(G0, 3000)]})    # raise the cap and use it in the same revision
        h.lease("a", "r2", 2000, bump=False)
        h.ledger(G0, seq=2)
    assert check(h).violations == []


def test_violation_inside_a_revision_is_still_caught() -> None:
    h = History()
    h.ledger(G0)
    victim = h.lease("a", "r1", 12000)
    with h.txn():
        h.release(victim)
        h.lease("b", "r1", 10000, bump=False)
        h.lease("c", "r1", 10000, token=3, bump=False)
        h.ledger(G0, seq=3)
    assert_one_violation(check(h), "G1", "20000")


def test_every_event_carries_its_revision() -> None:
    # Sanity of the builder: one revision per txn, shared by its events, deletes included.
    h = clean_history()
    revs = [ev.kv.mod_revision for ev in h.events]
    assert revs == sorted(revs)
    last = h.events[-3:]
    assert {ev.kv.mod_revision for ev in last} == {h.rev}
    assert [ev.kind for ev in last] == ["DELETE", "PUT", "PUT"]
    assert dataclasses.asdict(last[0].kv)["version"] == 0 and last[0].prev_kv is not None


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


# -- a history read that missed events ----------------------------------------------------------

def test_a_lease_deleted_but_never_put_is_a_missed_event() -> None:
    h = History()
    h.ledger(G0)
    lease = h.lease("a", "r1", 100)
    h.release(lease)
    lost_put = [ev for ev in h.events if not (ev.kind == "PUT" and ev.kv.key == K.lease(HOST, G0, lease))]
    assert_one_violation(check_history(lost_put, K), "missed events", lease)


def test_a_phantom_lease_left_by_a_lost_delete_differs_from_etcd() -> None:
    """A lost DELETE leaves the lease live in the replay (it can add up to a G1 over-commit etcd never had);
    etcd's own leases at the last revision tell."""
    h = History()
    h.ledger(G0)
    kept = h.lease("a", "r1", 100)
    gone = h.lease("b", "r1", 100)
    h.release(gone)
    etcd_has = {K.lease(HOST, G0, kept)}
    assert replay_differs(check(h), etcd_has, h.rev) == []
    lost_delete = [ev for ev in h.events if ev.kind == "PUT"]
    (msg,) = replay_differs(check_history(lost_delete, K), etcd_has, h.rev)
    assert "missed events" in msg and "holds 1 leases etcd does not" in msg and gone in msg, msg


# -- gangs (issue 21): a gang lease is wholly present or absent at every revision; an exclusive GPU is not shared
GANG = [G0, G1]


def gang_part(h: History, gpu: str, request_id: str = "g", *, gang: list[str] | None = None,
              exclusive: bool = False, vram_mb: int = 4000, agent: str = "a") -> str:
    lease_id = lease_id_for(agent, request_id, HOST)
    token = h.seq.get(gpu, 0) + 1
    h.put(K.lease(HOST, gpu, lease_id), {
        "id": lease_id, "host": HOST, "gpu_uuid": gpu, "gpu_index": int(gpu.rsplit("-", 1)[1]), "agent": agent,
        "session_id": format(SESSION, "x"), "vram_mb": vram_mb, "priority": 0, "preemptible": True,
        "request_id": request_id, "token": token, "created_at": 1.0, "format": 2, "gang": gang or GANG,
        "exclusive": exclusive, "topology": "any"}, etcd_lease=SESSION)
    h.ledger(gpu, token)
    return lease_id


def test_a_gang_granted_and_released_whole_passes() -> None:
    h = History()
    with h.txn():
        gang_part(h, G0)
        lid = gang_part(h, G1)
    with h.txn():
        h.release(lid, G0)
        h.release(lid, G1)
    rep = check_history(h.events, K)
    assert not rep.violations, rep.violations


def test_a_gang_granted_in_two_revisions_is_caught() -> None:
    h = History()
    gang_part(h, G0)
    gang_part(h, G1)
    rep = check_history(h.events, K)
    assert any("partly held" in v for v in rep.violations), rep.violations


def test_a_gang_released_one_gpu_at_a_time_is_caught() -> None:
    h = History()
    with h.txn():
        gang_part(h, G0)
        lid = gang_part(h, G1)
    h.release(lid, G0)
    rep = check_history(h.events, K)
    assert any("partly held" in v for v in rep.violations), rep.violations


def test_the_same_lease_id_on_two_gpus_without_a_gang_is_caught() -> None:
    h = History()
    with h.txn():
        h.lease("a", "r1", 1000, G0)
        h.lease("a", "r1", 1000, G1)
    rep = check_history(h.events, K)
    assert any("G6" in v or "partly held" in v for v in rep.violations), rep.violations


def test_an_exclusive_gpu_shared_is_caught() -> None:
    h = History()
    with h.txn():
        gang_part(h, G0, exclusive=True, vram_mb=8000)
        gang_part(h, G1, exclusive=True, vram_mb=8000)
    h.lease("b", "r1", 1000, G0)
    rep = check_history(h.events, K)
    assert any("exclusive GPU" in v for v in rep.violations), rep.violations
