"""G6 and releases under one-way links: a client whose answers are dropped (its requests still arrive) retries
through the other replica with the same request_id and gets the one lease it was granted, never a second; a
release whose answer is dropped, or whose request is, is never lost.

In-process replicas; the client reaches replica A through a fault link (tests/faultlink.py), B directly. A owns
the host, so the client's acquires and releases go to A first (host ownership). The session lives on through B.
"""
from __future__ import annotations

import time

import pytest

from agent_client import Client
from coordinator.replica.service import owner_of
from tests.history import check_store
from tests.support.cluster import Cluster, session_alive, wait_no_leaks
from tests.support.waiting import wait_for

TTL = 6


def owned_host(cluster: Cluster, owner_addr: str, other_addr: str) -> str:
    ids = [cluster.service(owner_addr).replica_id, cluster.service(other_addr).replica_id]
    return next(h for h in (f"h{i}" for i in range(100)) if owner_of(h, ids) == ids[0])


@pytest.mark.parametrize("lost", ["answers", "requests"])
def test_a_client_whose_answers_are_lost_gets_one_lease_and_never_loses_a_release(cluster: Cluster,
                                                                                  lost: str) -> None:
    a = cluster.start_coordinator(linked=True)
    b = cluster.start_coordinator()
    wait_for(lambda: len(cluster.replicas()) == 2, 10, "both replicas to register")
    host = owned_host(cluster, a, b)
    cluster.start_node(host, "1x16GiB")
    link = cluster.client_links[a]
    with Client([a, b], agent="agent-a", host=host, ttl=TTL, attempt_timeout=1.0) as c:
        warm = c.acquire(1000, request_id="warm-up")        # through A: the client knows A owns the host
        if lost == "answers":
            link.cut_one_way("answers")    # A receives, commits, and its answers never come back
        else:
            link.cut_one_way("requests")   # nothing reaches A
        t0 = time.monotonic()
        lease = c.acquire(2000, request_id="lost-answer")
        took = time.monotonic() - t0
        held = [x for x in cluster.leases() if x.agent == "agent-a"]
        assert sorted(x.id for x in held) == sorted([warm.id, lease.id]), held
        again = c.acquire(2000, request_id="lost-answer")
        assert (again.id, again.token) == (lease.id, lease.token)
        # B's answer names A as the owner: the releases go to A first.
        t0 = time.monotonic()
        c.release(lease.id)
        c.release(warm.id)
        print(f"{lost} lost: the acquire took {took:.1f}s, the two releases {time.monotonic() - t0:.1f}s")
        assert [x for x in cluster.leases() if x.agent == "agent-a"] == []
        # Its session lived on: the keepalives moved to B when A's answers stopped.
        link.heal()
        assert not c.expired and session_alive(cluster, "agent-a", c.session_id)
    wait_no_leaks(cluster, 2 * TTL)
    cluster.lt.run(check_store(cluster.store, cluster.keys), timeout=120).assert_ok()
