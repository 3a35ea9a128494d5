"""G4 and G5 under partitions: a node daemon cut off from etcd (silently) past its TTL while agents on its host
hold leases, then healed.

* While cut, its usage goes stale within 3 heartbeats and admission fails closed: the untracked VRAM it last
  reported still counts, though the process that used it has exited meanwhile, and beside leases granted since.
* It stops answering CheckToken (UNAVAILABLE) once it knows it cannot reach etcd: its view of the leases may
  miss a revocation, as it does here (an operator revokes a lease during the cut).
* Past its TTL its registration expires: new acquires on the host are FAILED_PRECONDITION naming the host, a
  waiter there is answered FAILED_PRECONDITION (the leader sweeps its entry), and the leases held stay: they
  hang on their agents' sessions, not on the node, and those sessions live on.
* Healed, it registers again on its own, reports fresh usage, and the host is admitted on again; CheckToken
  answers from a current view.

In process: the node's etcd connection runs through a fault link (tests/faultlink.py). The history checker
ends the test. How soon each step came after the cut (3 heartbeats, the node's TTL, on a quiet machine) is
printed, not asserted: the test waits for each with a deadline no loaded machine misses.
"""
from __future__ import annotations

import json
import time

import grpc
import pytest

from agent_client import Client, errors
from agent_client.api import coordinator_pb2 as pb
from agent_client.api import node_pb2 as npb
from tests.history import check_store
from tests.support.cluster import Cluster, session_alive, wait_no_leaks
from tests.support.rpcs import coordinator_stub, node_stub
from tests.support.waiting import LIVENESS_S, Background, wait_for

NODE_TTL = 4
HEARTBEAT_S = 0.5


def usage_stale(addr: str, host: str) -> bool:
    status = coordinator_stub(addr).GetStatus(pb.GetStatusRequest(host=host), timeout=10)
    return any(h.host == host and h.usage_stale for h in status.hosts)


def check_token(address: str, gpu: str, token: int) -> str:
    try:
        answer = node_stub(address).CheckToken(npb.CheckTokenRequest(gpu_uuid=gpu, token=token), timeout=5)
    except grpc.RpcError as e:
        return str(e.code().name)
    return "live" if answer.live else "gone"


def test_a_node_cut_from_etcd_past_its_ttl_loses_its_host_keeps_the_leases_and_comes_back(cluster: Cluster) -> None:
    daemon = cluster.start_node("h1", "1x16GiB", ttl=NODE_TTL, heartbeat_s=HEARTBEAT_S, linked=True)
    source = cluster.nodes["h1"][2]
    addr = cluster.start_coordinator()
    link = cluster.etcd_links["h1"]
    with Client(addr, agent="holder", host="h1", ttl=30) as holder, \
            Client(addr, agent="other", host="h1", ttl=30) as other, \
            Client(addr, agent="waiter", host="h1", ttl=30) as waiter:
        kept = holder.acquire(4000)
        revoked = other.acquire(2000)
        source.set_used(0, 4000 + 2000 + 4000)    # the two leases' processes, and 4000 MiB of no lease's
        wait_for(lambda: not usage_stale(addr, "h1") and _untracked(cluster) == 4000, 10, "the untracked VRAM")
        with pytest.raises(errors.ResourceExhausted):
            holder.acquire(8000)                    # 16384 - 6000 leased - 4000 untracked

        link.cut()
        cut_at = time.monotonic()
        source.set_used(0, 4000 + 2000)             # the untracked process exits: the node cannot say so
        wait_for(lambda: usage_stale(addr, "h1"), LIVENESS_S, "the usage to go stale")
        stale_after = time.monotonic() - cut_at
        with pytest.raises(errors.ResourceExhausted):
            holder.acquire(8000)                    # fails closed: the 4000 untracked still count
        # A lease granted since the last report: the report's used VRAM does not cover it, and the 4000 MiB
        # of no lease still count beside it (never less), not the report's used VRAM less today's leases.
        extra = holder.acquire(4000)                # 16384 - 6000 leased - 4000 untracked
        with pytest.raises(errors.ResourceExhausted):
            holder.acquire(4000)                    # 16384 - 10000 leased - 4000 untracked
        extra.release()
        coordinator_stub(addr).RevokeLease(pb.RevokeLeaseRequest(lease_id=revoked.id), timeout=10)
        wait_for(lambda: check_token(daemon.address, kept.gpu_uuid, revoked.token) == "UNAVAILABLE", LIVENESS_S,
                 "the cut node to stop answering CheckToken")
        refused_after = time.monotonic() - cut_at
        waiting = Background(waiter.acquire, 12000, wait=3 * LIVENESS_S)
        wait_for(lambda: cluster.get_prefix(cluster.keys.queue("h1")), 10, "the waiter to be queued")

        wait_for(lambda: not cluster.get_prefix(cluster.keys.host("h1")), LIVENESS_S, "the registration to expire")
        gone_after = time.monotonic() - cut_at
        with pytest.raises(errors.FailedPrecondition, match="host"):
            holder.acquire(1000)
        with pytest.raises(errors.FailedPrecondition, match="host"):
            waiting.result(timeout=10)
        assert {x.id for x in cluster.leases()} == {kept.id}, "a lease went with the node's registration"
        assert session_alive(cluster, "holder", holder.session_id)

        link.heal()
        healed = time.monotonic()
        wait_for(lambda: cluster.get_prefix(cluster.keys.host("h1")), 10, "the node to register again")
        back_after = time.monotonic() - healed
        # Fresh usage: the revoked lease's process still runs (2000 MiB of no lease now), the other one exited.
        wait_for(lambda: not usage_stale(addr, "h1") and _untracked(cluster) == 2000, 10, "fresh usage")
        more = holder.acquire(8000)                 # fits now: 16384 - 4000 leased - 2000 untracked
        assert check_token(daemon.address, kept.gpu_uuid, kept.token) == "live"
        wait_for(lambda: check_token(daemon.address, kept.gpu_uuid, revoked.token) == "gone", 10,
                 "the node to see the revocation")
        print(f"after the cut: usage stale at {stale_after:.1f}s, CheckToken UNAVAILABLE at {refused_after:.1f}s, "
              f"registration gone at {gone_after:.1f}s; registered again {back_after:.1f}s after the heal")
        more.release()
        kept.release()
    wait_no_leaks(cluster, 10)
    cluster.lt.run(check_store(cluster.store, cluster.keys), timeout=120).assert_ok()


def _untracked(cluster: Cluster) -> int:
    """The untracked VRAM of h1's GPU in its last usage report (-1: none)."""
    kv = cluster.get_prefix(cluster.keys.usage("h1"))
    return int(json.loads(kv[0].value)["gpus"][0]["untracked_mb"]) if kv else -1
