"""tests/history.check_history on synthetic etcd histories: the events of one revision are applied together,
and a history read that missed events is told apart from etcd."""
from __future__ import annotations

import dataclasses

from tests.history import check_history, replay_differs
from tests.support.history_builder import (
    G0,
    HOST,
    History,
    K,
    assert_one_violation,
    check,
    clean_history,
)

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
