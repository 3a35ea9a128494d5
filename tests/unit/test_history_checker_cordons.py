"""tests/history.check_history's cordon rule on synthetic histories: no lease is created on a host while its
``cordons/<host>`` key exists; before the cordon, after the uncordon and on other hosts grants pass."""
from __future__ import annotations

from tests.support.history_builder import HOST, History, K, assert_one_violation, check

CORDON = {"host": HOST, "reason": "maintenance", "drain": True, "grace_s": 2.0, "asked_by": "ops", "created_at": 1.0}


def test_grants_before_the_cordon_after_the_uncordon_and_on_another_host_pass() -> None:
    h = History()
    h.ledger()
    h.ledger(host="h2")
    before = h.lease("a", "r1", 1000)
    h.put(K.cordon(HOST), CORDON)
    h.lease("a", "r2", 1000, host="h2")        # another host keeps granting
    h.release(before)                          # a lease ends on the cordoned host: fine
    h.put(K.cordon(HOST), CORDON | {"reason": "longer"})
    h.delete(K.cordon(HOST))
    h.lease("a", "r3", 1000)
    assert check(h).violations == []


def test_a_grant_on_a_cordoned_host_is_flagged() -> None:
    h = History()
    h.ledger()
    h.put(K.cordon(HOST), CORDON)
    lease_id = h.lease("a", "r1", 1000)
    assert_one_violation(check(h), "cordon", f"lease {lease_id} granted on host h1")


def test_a_grant_in_the_cordons_own_revision_is_flagged() -> None:
    h = History()
    h.ledger()
    with h.txn():
        h.put(K.cordon(HOST), CORDON)
        h.lease("a", "r1", 1000)
    assert_one_violation(check(h), "cordon")
