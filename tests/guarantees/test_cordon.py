"""Cordon and drain (issue 31, docs/policies.md "Cordon and drain"): a cordoned host gets no new grant at any revision (the
history checker's cordon rule runs after every test here); a call that asked for no wait is refused
FAILED_PRECONDITION naming ``host`` and the reason; waiters stay queued until the uncordon; bad input is refused
with the field named and changes nothing. The operator's role is checked by tests/security/test_matrix.py."""
from __future__ import annotations

import json
import threading
import time
from typing import Any

import grpc
import pytest

from agent_client import Client, errors
from agent_client.api import coordinator_pb2 as pb
from coordinator.host_records import CordonRecord
from coordinator.limits import MAX_REASON_BYTES
from coordinator.records import dumps
from tests.support.cluster import Cluster
from tests.support.rpcs import expect_refused
from tests.support.waiting import LIVENESS_S, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]
C = grpc.StatusCode


def _status(stub: Any, host: str = "h1") -> Any:
    (hs,) = stub.GetStatus(pb.GetStatusRequest(host=host), timeout=10).hosts
    return hs


def test_bad_cordon_requests_are_refused_naming_the_field_and_change_nothing(
        env: tuple[Cluster, Any, Client]) -> None:
    cluster, stub, c = env
    c.acquire(1000)

    def cordon(**kw: Any) -> Any:
        return lambda: stub.CordonHost(pb.CordonHostRequest(**{"host": "h1", **kw}), timeout=10)

    expect_refused(cluster, cordon(host="nowhere"), C.NOT_FOUND, "host")
    expect_refused(cluster, cordon(host=""), C.INVALID_ARGUMENT, "host")
    expect_refused(cluster, cordon(host="a/b"), C.INVALID_ARGUMENT, "host")
    expect_refused(cluster, cordon(drain=True, grace_seconds=-1), C.INVALID_ARGUMENT, "grace_seconds")
    expect_refused(cluster, cordon(drain=True, grace_seconds=float("nan")), C.INVALID_ARGUMENT, "grace_seconds")
    expect_refused(cluster, cordon(drain=True, grace_seconds=1e9), C.INVALID_ARGUMENT, "grace_seconds")
    expect_refused(cluster, cordon(reason="x" * (MAX_REASON_BYTES + 1)), C.INVALID_ARGUMENT, "reason")
    expect_refused(cluster, lambda: stub.UncordonHost(pb.UncordonHostRequest(host="nowhere"), timeout=10),
                   C.NOT_FOUND, "host")
    # Uncordoning a host that is not cordoned writes nothing either.
    before = cluster.state()
    assert not stub.UncordonHost(pb.UncordonHostRequest(host="h1"), timeout=10).uncordoned
    assert cluster.state() == before
    assert not _status(stub).cordoned


def test_a_cordoned_host_refuses_no_wait_keeps_its_waiters_queued_and_grants_them_after_the_uncordon(
        env: tuple[Cluster, Any, Client]) -> None:
    cluster, stub, c = env
    held = c.acquire(4000)
    resp = stub.CordonHost(pb.CordonHostRequest(host="h1", reason="driver upgrade"), timeout=10)
    assert resp.created and resp.leases == 1 and resp.notices == 0 and resp.cordon.reason == "driver upgrade"
    hs = _status(stub)
    assert hs.cordoned and not hs.draining and hs.cordon.reason == "driver upgrade" and len(hs.leases) == 1
    # Room is free, but nothing is granted: no wait is refused at once, naming host and the reason.
    with pytest.raises(errors.FailedPrecondition) as info:
        c.acquire(1000)
    assert "host: host 'h1' is cordoned: 'driver upgrade'" in str(info.value), info.value
    # A wait that ends while the host is still cordoned says so too.
    with pytest.raises(errors.FailedPrecondition) as info:
        c.acquire(1000, wait=0.5)
    assert "cordoned" in str(info.value) and "waited" in str(info.value), info.value
    # A waiter stays queued, and is granted once the host is uncordoned.
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(c.acquire(1000, wait=60)))
    waiter.start()
    wait_for(lambda: len(_status(stub).queue) == 1, 20, "the waiter's queue entry")
    assert not got and not [x for x in cluster.leases() if x.id != held.id]
    # A second cordon only replaces the reason.
    again = stub.CordonHost(pb.CordonHostRequest(host="h1", reason="longer upgrade"), timeout=10)
    assert not again.created and _status(stub).cordon.reason == "longer upgrade"
    assert stub.UncordonHost(pb.UncordonHostRequest(host="h1"), timeout=10).uncordoned
    waiter.join(30)
    assert got and got[0].vram_mb == 1000
    assert not _status(stub).cordoned and not cluster.get_prefix(cluster.keys.cordons())
    c.acquire(500).release()   # and a call that asks for no wait is granted again


def test_a_drain_sends_each_lease_a_drain_notice_and_no_grant_follows(env: tuple[Cluster, Any, Client]) -> None:
    cluster, stub, c = env
    leases = [c.acquire(1000) for _ in range(3)]
    resp = stub.CordonHost(pb.CordonHostRequest(host="h1", reason="reboot", drain=True, grace_seconds=30),
                           timeout=10)
    assert resp.created and resp.leases == 3 and resp.notices == 3 and resp.cordon.drain
    assert all(x.evicting.wait(LIVENESS_S) for x in leases)
    assert {x.notice.reason for x in leases if x.notice} == {"drain"}
    hs = _status(stub)
    assert hs.cordoned and hs.draining and {x.eviction.reason for x in hs.leases} == {"drain"}
    for x in leases:
        x.release()
    wait_for(lambda: not _status(stub).draining, 20, "the host to be empty")
    assert _status(stub).cordoned
    with pytest.raises(errors.FailedPrecondition):
        c.acquire(1000)
    stub.UncordonHost(pb.UncordonHostRequest(host="h1"), timeout=10)


def test_a_drain_cut_short_after_its_cordon_is_finished_by_the_leader(env: tuple[Cluster, Any, Client]) -> None:
    """The replica that served a drain died between the cordon's commit and its notices: etcd holds the drain's
    cordon and no notice. The leader sends the missing notices (reason ``drain``, the drain's grace)."""
    cluster, stub, c = env
    leases = [c.acquire(1000) for _ in range(2)]
    record = CordonRecord(host="h1", reason="reboot", drain=True, grace_s=30.0, asked_by="ops", created_at=time.time())
    cluster.lt.run(cluster.store.put(cluster.keys.cordon("h1"), dumps(record.to_json())))
    assert all(x.evicting.wait(LIVENESS_S) for x in leases), "the leader sent no notice to the drain's leases"
    assert {x.notice.reason for x in leases if x.notice} == {"drain"}
    notices = [json.loads(kv.value) for kv in cluster.get_prefix(cluster.keys.evictions())]
    assert sorted(n["lease_id"] for n in notices) == sorted(x.id for x in leases)
    assert all(n["requested_by"] == "operator" and 29 <= n["deadline_unix"] - n["created_at"] <= 30.01 for n in notices)
    for x in leases:
        x.release()
    wait_for(lambda: not _status(stub).draining, 20, "the host to be empty")
    stub.UncordonHost(pb.UncordonHostRequest(host="h1"), timeout=10)


def test_a_cordon_that_commits_between_a_rounds_snapshot_and_its_commit_fails_the_grant(cluster: Cluster) -> None:
    """Two replicas: the owner of h1 has decided a grant from its snapshot; just before its transaction goes to
    etcd, the other replica cordons h1. The grant's compare of the cordon key fails it, the round is decided
    again and sees the cordon: the caller is refused naming the host, and no lease exists."""
    from coordinator.replica.cordons import Cordons
    from tests.support.patching import is_put, patch_commit

    cluster.start_node("h1", "1x16GiB")
    addrs = [cluster.start_coordinator(), cluster.start_coordinator()]
    owner = cluster.owner("h1", 2)
    other = cluster.service(next(a for a in addrs if a != owner))
    raced: list[bool] = []

    async def hook(compares: Any, ops: Any, commit: Any) -> Any:
        if not raced and any(is_put(op, cluster.keys.leases("h1")) for op in ops):
            raced.append(True)
            await Cordons(other.ctx, other.leases).cordon("h1", "raced", False, 0.0, "test")
        return await commit()

    undo = patch_commit(cluster, cluster.service(owner), hook)
    try:
        with Client(owner, agent="racer", host="h1") as c:
            with pytest.raises(errors.FailedPrecondition) as info:
                c.acquire(1000)
    finally:
        undo()
    assert raced and "host: host 'h1' is cordoned: 'raced'" in str(info.value), info.value
    assert cluster.leases() == []


def test_cordons_drains_and_uncordons_racing_a_load_over_two_replicas_never_grant_on_a_cordoned_host(
        cluster: Cluster) -> None:
    """The nemesis's operator (tests/support/cordon_load.py) without faults: 8 agents over two replicas and two
    hosts acquire and release while hosts are cordoned, drained and uncordoned through either replica. The
    history checker's cordon rule (this module's ``history_checked``) replays it all; every call ends with a
    documented status, and both hosts granted."""
    import asyncio

    from tests.support.cordon_load import run_cordons
    from tests.support.load import run_load

    for host in ("h1", "h2"):
        cluster.start_node(host, "2x16GiB")
    a, b = cluster.start_coordinator(), cluster.start_coordinator()

    async def race() -> Any:
        return await asyncio.gather(run_load([[a, b], [b, a]] * 4, ["h1", "h2"], 10.0, seed=31),
                                    run_cordons([a, b], ["h1", "h2"], 10.0, seed=31))

    load, ops = asyncio.run(race())
    assert not load.undocumented(), load.undocumented()[:5]
    assert not ops.undocumented(), ops.undocumented()[:5]
    assert ops.done("cordon") + ops.done("drain") >= 1 and load.granted > 0
    assert not cluster.get_prefix(cluster.keys.cordons())
