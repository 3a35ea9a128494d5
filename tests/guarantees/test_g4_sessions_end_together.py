"""G4 when many sessions expire at once (issue 32, P6 at 10,000): their keys are deleted in shared etcd
transactions, each session's keys in one revision (``replica/ended_together.py``), and their etcd leases are
revoked after, so that a key the replica did not know of goes too. The history checker ends each test."""
from __future__ import annotations

import pytest

from agent_client.api import coordinator_pb2 as pb
from tests.support.cluster import Cluster, events_since, revision
from tests.support.rpcs import coordinator_stub
from tests.support.waiting import LIVENESS_S, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]
TTL = 8   # long enough that no session expires while the 40 are opened and acquire, on a busy machine
SESSIONS = 40   # however the expiry ticks split them, at least one tick ends replica/ended_together's threshold


def _open(addr: str, agent: str) -> pb.SessionRef:
    resp = coordinator_stub(addr).OpenSession(pb.OpenSessionRequest(agent=agent, host="h1", ttl_seconds=TTL),
                                              timeout=30)
    return pb.SessionRef(agent=agent, session_id=resp.session_id)


def _gone(cluster: Cluster, keys: list[bytes]) -> bool:
    return not any(cluster.get_prefix(k) for k in keys)


def test_sessions_that_expire_together_end_in_shared_transactions_each_with_its_keys_at_once(
        cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    stub = coordinator_stub(addr)
    refs = [_open(addr, f"together-{i}") for i in range(SESSIONS)]
    for ref in refs:
        stub.Acquire(pb.AcquireRequest(session=ref, vram_mb=64, request_id="r"), timeout=30)
    sessions = [cluster.keys.session(r.agent, r.session_id) for r in refs]
    etcd_lease = int(cluster.get_prefix(sessions[0])[0].etcd_lease)
    # A key on the first session's etcd lease that the replica's mirror does not hold (it keeps no accounting/
    # key), as a write that raced the deletion would be: the revoke that follows the shared deletion takes it.
    stray = cluster.keys.root() + b"accounting/stray-on-a-session"
    cluster.lt.run(cluster.store.put(stray, b"{}", etcd_lease))
    # Each lease record's session, before they go.
    session_of = {kv.key: cluster.keys.session(kv.json()["agent"], kv.json()["session_id"])
                  for kv in cluster.get_prefix(cluster.keys.leases("h1"))}
    assert len(session_of) == SESSIONS
    before = revision(cluster)
    # One keepalive for them all, then nothing (the process died): their deadlines are one TTL from one moment.
    next(iter(stub.KeepAliveSessions(iter([pb.KeepAliveSessionsRequest(seq=1, sessions=refs)]), timeout=30)))
    wait_for(lambda: _gone(cluster, sessions) and not cluster.get_prefix(cluster.keys.leases("h1")), LIVENESS_S,
             "every session and lease of the dead process to go")
    deleted = {key: rev for kind, key, rev in events_since(cluster, before) if kind == "DELETE"}
    revisions = {deleted[k] for k in sessions}
    assert len(revisions) <= SESSIONS // 2, f"{SESSIONS} sessions expiring together ended in {len(revisions)} revisions"
    for lease_key, session_key in session_of.items():
        assert deleted[lease_key] == deleted[session_key], f"{lease_key!r} did not go with its session"
    wait_for(lambda: not cluster.get_prefix(stray), LIVENESS_S,
             "the key the replica did not know of to go with its session's etcd lease")
