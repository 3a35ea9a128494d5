"""tests/history.check_history on synthetic etcd histories: every G5 fencing-token and G6 idempotency
violation is caught."""
from __future__ import annotations

import json

from tests.support.history_builder import (
    G0,
    G1,
    HOST,
    SESSION,
    History,
    K,
    assert_one_violation,
    check,
)

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
