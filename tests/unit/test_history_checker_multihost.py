"""tests/history.check_history's multi-host gang rule (G12, issue 30) on synthetic histories: a lease whose
records carry ``hosts`` is whole or absent at every revision, and all its records carry the same ``hosts``."""
from __future__ import annotations

from typing import Any

from coordinator.keys import lease_id_for
from tests.support.history_builder import (
    G0,
    G1,
    HOST,
    History,
    assert_one_violation,
    check,
)

H2 = "h2"
G2, G3 = "GPU-2", "GPU-3"
PARTS: list[tuple[str, list[str]]] = [(HOST, [G0, G1]), (H2, [G2, G3])]
LEASE = lease_id_for("a", "mh", HOST)


def part(h: History, host: str, gpu: str, hosts: Any = None) -> None:
    """One record of the 2-host × 2-GPU gang (format 5), in the open transaction."""
    own = dict(PARTS)[host]
    h.lease("a", "mh", 4000, gpu, host=host, lease_id=LEASE, extra={
        "format": 5, "gang": own, "exclusive": False, "topology": "any",
        "hosts": [[x, list(u)] for x, u in (PARTS if hosts is None else hosts)]})


def grant_whole(h: History) -> None:
    for host, gpu in ((HOST, G0), (HOST, G1), (H2, G2), (H2, G3)):
        h.ledger(gpu, host=host)
    with h.txn():
        for host, gpus in PARTS:
            for gpu in gpus:
                part(h, host, gpu)


def test_a_gang_granted_and_released_whole_passes() -> None:
    h = History()
    grant_whole(h)
    with h.txn():
        for host, gpus in PARTS:
            for gpu in gpus:
                h.release(LEASE, gpu, host)
    assert check(h).violations == []


def test_a_part_deleted_in_its_own_revision_is_flagged_naming_the_lease() -> None:
    h = History()
    grant_whole(h)
    with h.txn():                       # the whole part of h2 goes first: h1's stays, alone
        h.release(LEASE, G2, H2)
        h.release(LEASE, G3, H2)
    with h.txn():
        h.release(LEASE, G0)
        h.release(LEASE, G1)
    rep = check(h)
    assert_one_violation(rep, "G12", f"multi-host gang {LEASE} partly present", "'h2', 'GPU-2'")
    assert len(rep.violations) == 1, rep.violations      # once absent, it is whole again


def test_a_gang_granted_one_host_at_a_time_is_flagged() -> None:
    h = History()
    for host, gpu in ((HOST, G0), (HOST, G1), (H2, G2), (H2, G3)):
        h.ledger(gpu, host=host)
    for host, gpus in PARTS:
        with h.txn():
            for gpu in gpus:
                part(h, host, gpu)
    assert_one_violation(check(h), f"multi-host gang {LEASE} partly present")


def test_records_with_different_hosts_lists_are_flagged() -> None:
    h = History()
    for host, gpu in ((HOST, G0), (HOST, G1), (H2, G2), (H2, G3)):
        h.ledger(gpu, host=host)
    with h.txn():
        for host, gpus in PARTS:
            for gpu in gpus:
                part(h, host, gpu, hosts=list(reversed(PARTS)) if gpu == G3 else None)
    assert_one_violation(check(h), f"multi-host gang {LEASE}", "different hosts lists")


def test_leases_of_one_host_are_not_held_to_the_rule() -> None:
    h = History()
    h.ledger(G0)
    lease_id = h.lease("a", "r1", 1000)
    h.release(lease_id)
    assert check(h).violations == []
