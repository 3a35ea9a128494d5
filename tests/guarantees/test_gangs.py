"""Gang leases end to end (issue 21), against a real etcd, a real coordinator and node daemons with simulated
GPUs: a gang is one lease over several GPUs, granted whole in one transaction and released, revoked and
evicted whole; placed within the topology asked for; refused naming ``topology`` when the host's topology
cannot ever hold it. Every test ends with the history checker (gangs wholly present or absent at every
revision, exclusive GPUs never shared, G1/G3/G5/G6)."""
from __future__ import annotations

import json
import subprocess
import sys
import threading

import grpc
import pytest

from agent_client import Client, errors
from agent_client.api import coordinator_pb2 as pb
from tests.support import REPO
from tests.support.cluster import Cluster
from tests.support.processes import child_env
from tests.support.rpcs import coordinator_stub, expect_refused
from tests.support.waiting import LIVENESS_S, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]
QUADS = ({0, 1, 2, 3}, {4, 5, 6, 7})


def gang_request(c: Client, **kw: object) -> pb.AcquireRequest:
    base: dict[str, object] = {"session": pb.SessionRef(agent="agent-a", session_id=c.session_id), "request_id": "g"}
    base.update(kw)
    return pb.AcquireRequest(**base)  # type: ignore[arg-type]


def lease_keys(cluster: Cluster) -> list[str]:
    return sorted(kv.key.decode()[len(cluster.prefix):] for kv in cluster.get_prefix(cluster.keys.leases()))


def test_an_nvlink_gang_of_four_gets_one_whole_quad_and_a_gang_of_five_is_refused_naming_topology(
        cluster: Cluster) -> None:
    cluster.start_node("h1", "8x80GiB:nvlink=0-3,4-7")
    addr = cluster.start_coordinator()
    stub = coordinator_stub(addr)
    with Client(addr, agent="agent-a", host="h1") as c:
        first = c.acquire(vram_mb=50_000, gpu_count=4, topology="nvlink")
        second = c.acquire(vram_mb=50_000, gpu_count=4, topology="nvlink")   # no room left on the first quad
        got = [{g.index for g in lease.gpus} for lease in (first, second)]
        assert sorted(got, key=min) == list(QUADS), got
        assert first.topology == "nvlink" and len({g.uuid for g in first.gpus}) == 4
        # Each GPU's token comes from that GPU's own ledger: the first lease on each.
        assert [g.token for g in first.gpus] == [1, 1, 1, 1]
        expect_refused(cluster, lambda: stub.Acquire(gang_request(c, vram_mb=1000, gpu_count=5, topology="nvlink")),
                       grpc.StatusCode.FAILED_PRECONDITION, "topology")
        with pytest.raises(errors.FailedPrecondition, match="topology"):
            c.acquire(vram_mb=1000, gpu_count=5, topology="nvlink")
        first.release()
        second.release()
    assert lease_keys(cluster) == []


def test_numa_or_nvlink_on_a_host_of_unknown_topology_is_refused_naming_topology(cluster: Cluster) -> None:
    cluster.start_node("h1", "2x16GiB")
    addr = cluster.start_coordinator()
    stub = coordinator_stub(addr)
    with Client(addr, agent="agent-a", host="h1") as c:
        for topology in ("numa", "nvlink"):
            expect_refused(cluster, lambda t=topology: stub.Acquire(  # type: ignore[misc]
                gang_request(c, vram_mb=1000, gpu_count=2, topology=t)), grpc.StatusCode.FAILED_PRECONDITION,
                "topology")
        lease = c.acquire(vram_mb=1000, gpu_count=2)          # "any" needs no topology
        assert sorted(g.index for g in lease.gpus) == [0, 1]


@pytest.mark.parametrize("fields,field", [
    ({"vram_mb": 1000, "gpu_count": 3}, "gpu_count"),                    # more than the host's GPUs
    ({"vram_mb": 1000, "gpu_count": 2, "topology": "ring"}, "topology"),
    ({"vram_mb": 1000, "exclusive": True}, "vram_mb"),
    ({"vram_mb": 1000, "gpu_count": 2, "gpus": ["0"]}, "gpus"),
    ({"vram_mb": 1000, "gpu_count": 2, "gpus": ["0", "7"]}, "gpus"),     # no GPU 7
    ({"vram_mb": 20_000, "gpu_count": 2}, "vram_mb"),                    # more than a GPU holds
])
def test_a_bad_gang_request_is_refused_naming_the_field_and_writes_nothing(
        cluster: Cluster, fields: dict[str, object], field: str) -> None:
    cluster.start_node("h1", "2x16GiB")
    addr = cluster.start_coordinator()
    stub = coordinator_stub(addr)
    with Client(addr, agent="agent-a", host="h1") as c:
        reply = None
        try:
            reply = stub.Acquire(gang_request(c, **fields))
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                                grpc.StatusCode.FAILED_PRECONDITION), e.details()
            assert field in e.details(), e.details()
        assert reply is None, "a bad gang request was granted"
        assert lease_keys(cluster) == []


def test_an_exclusive_gang_takes_whole_gpus_and_goes_whole_on_release(cluster: Cluster) -> None:
    cluster.start_node("h1", "4x16GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="agent-a", host="h1") as a, Client(addr, agent="agent-b", host="h1") as b:
        shared = b.acquire(vram_mb=1000, gpu=0)
        whole = a.acquire(exclusive=True, gpu_count=2)
        assert 0 not in {g.index for g in whole.gpus}, "an exclusive gang took a GPU that holds a lease"
        assert whole.exclusive and all(g.vram_mb == 16384 for g in whole.gpus)
        with pytest.raises(errors.ResourceExhausted):        # the exclusive GPUs take nothing else
            b.acquire(vram_mb=1000, gpus=[str(g.index) for g in whole.gpus[:1]])
        assert len(lease_keys(cluster)) == 3
        assert a.release(whole.id) is True
        assert lease_keys(cluster) == [f"leases/h1/{shared.gpu_uuid}/{shared.id}"]
        doc = [json.loads(kv.value) for kv in cluster.get_prefix(cluster.keys.leases())]
        assert [d.get("format") for d in doc] == [None]       # a plain lease stays in the previous format


def test_a_two_gpu_gang_is_evicted_whole_for_a_higher_priority_two_gpu_request(cluster: Cluster) -> None:
    cluster.start_node("h1", "2x16GiB")
    addr = cluster.start_coordinator(eviction_grace_s=30.0)
    with Client(addr, agent="agent-a", host="h1") as a, Client(addr, agent="agent-b", host="h1") as b:
        low = a.acquire(vram_mb=12_000, gpu_count=2, priority=0)
        result: dict[str, object] = {}

        def high() -> None:
            try:
                result["lease"] = b.acquire(vram_mb=12_000, gpu_count=2, priority=5, wait=20)
            except Exception as e:  # noqa: BLE001 - the test reads it below
                result["error"] = e
        t = threading.Thread(target=high, daemon=True)
        t.start()
        assert low.evicting.wait(LIVENESS_S), "the gang got no eviction notice"
        assert "lease" not in result, "granted before its victim was gone"
        assert len(lease_keys(cluster)) == 2            # both GPUs still held by the victim
        low.release()
        t.join(LIVENESS_S)
        got = result.get("lease")
        assert got is not None, result
        assert sorted(g.index for g in got.gpus) == [0, 1]  # type: ignore[attr-defined]
        assert [g.token for g in got.gpus] == [2, 2]        # type: ignore[attr-defined]


def test_a_gang_revoked_by_the_leader_at_its_deadline_goes_whole(cluster: Cluster) -> None:
    cluster.start_node("h1", "2x16GiB")
    addr = cluster.start_coordinator(eviction_grace_s=0.5)
    with Client(addr, agent="agent-a", host="h1") as a, Client(addr, agent="agent-b", host="h1") as b:
        a.acquire(vram_mb=12_000, gpu_count=2, priority=0)
        got = b.acquire(vram_mb=12_000, gpu_count=2, priority=5, wait=20)   # the holder ignores its notice
        assert sorted(g.index for g in got.gpus) == [0, 1]
        wait_for(lambda: len(lease_keys(cluster)) == 2, LIVENESS_S, "only the new gang's records")


def test_status_shows_a_gang_as_one_lease_over_its_gpus(cluster: Cluster) -> None:
    cluster.start_node("h1", "4x16GiB:nvlink=0-1,2-3")
    addr = cluster.start_coordinator()
    with Client(addr, agent="agent-a", host="h1") as c:
        lease = c.acquire(vram_mb=4000, gpu_count=2, topology="nvlink")
        doc = json.loads(subprocess.run([sys.executable, "-m", "coordinator.cli", "status", "--json", "--coordinator",
                                         addr], capture_output=True, text=True, env=child_env(), cwd=REPO,
                                        timeout=60, check=True).stdout)
        (shown,) = doc["hosts"][0]["leases"]
        assert shown["id"] == lease.id and [g["index"] for g in shown["gpus"]] == [0, 1]
        assert shown["topology"] == "nvlink"
        table = subprocess.run([sys.executable, "-m", "coordinator.cli", "status", "--coordinator", addr],
                               capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=60,
                               check=True).stdout
        rows = [line for line in table.splitlines() if lease.id in line]
        assert len(rows) == 1 and " 0,1 " in rows[0], table


def test_an_operators_lease_revoke_takes_the_whole_gang(cluster: Cluster) -> None:
    cluster.start_node("h1", "4x16GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="agent-a", host="h1") as c:
        lease = c.acquire(vram_mb=4000, gpu_count=3)
        assert len(lease_keys(cluster)) == 3
        out = subprocess.run([sys.executable, "-m", "coordinator.cli", "lease", "revoke", lease.id, "--coordinator",
                              addr], capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=60)
        assert out.returncode == 0, out.stderr
        assert lease_keys(cluster) == []


def test_a_gang_answered_by_a_replica_that_ignores_gangs_is_given_back_and_refused(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica of the release before gangs ignores their fields (proto3 unknown fields) and answers a plain
    lease without ``gpus``: the client gives it back and raises rather than hand out one GPU for a gang."""
    import coordinator.rpc.coordinator_server as server
    plain = server.lease_pb

    def old_release_answer(lease: object, ttl_remaining: int = 0, parts: object = ()) -> pb.Lease:
        msg = plain(lease)  # type: ignore[arg-type]
        del msg.gpus[:]
        return msg
    monkeypatch.setattr(server, "lease_pb", old_release_answer)
    cluster.start_node("h1", "2x16GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="agent-a", host="h1") as c:
        with pytest.raises(errors.FailedPrecondition, match="gpu_count") as e:
            c.acquire(vram_mb=1000, gpu_count=2)
        assert e.value.field == "gpu_count"
        assert lease_keys(cluster) == []
