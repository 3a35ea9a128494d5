"""The node daemon against a real etcd: publishing, the Node service, usage, fencing checks, death."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from agent_client import Client
from agent_client.api import node_pb2 as npb
from agent_client.api import node_pb2_grpc as npb_grpc
from coordinator.records import GpuProcess
from tests.harness import REPO, Cluster, child_env, wait_for

pytestmark = pytest.mark.integration


def test_node_publishes_inventory_and_usage_under_its_etcd_lease(cluster: Cluster) -> None:
    daemon = cluster.start_node("h1", "2x24GiB,1x80GiB")
    (host_kv,) = cluster.get_prefix(cluster.keys.host("h1"))
    doc = json.loads(host_kv.value)
    gpus = doc["inventory"]["gpus"]
    assert [g["vram_total_mb"] for g in gpus] == [24576, 24576, 81920]
    assert doc["inventory"]["cpu_count"] > 0 and doc["inventory"]["mem_bytes"] > 0
    assert host_kv.etcd_lease == daemon.etcd_lease != 0
    (usage_kv,) = cluster.get_prefix(cluster.keys.usage("h1"))
    assert usage_kv.etcd_lease == daemon.etcd_lease
    assert [g["vram_used_mb"] for g in json.loads(usage_kv.value)["gpus"]] == [0, 0, 0]


def test_usage_is_written_when_it_changes_and_untracked_vram_is_subtracted(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    _, _, source = cluster.nodes["h1"]
    addr = cluster.start_coordinator()
    source.set_used(0, 10000, (GpuProcess(pid=4242, used_mb=10000),))

    def used() -> int:
        (kv,) = cluster.get_prefix(cluster.keys.usage("h1"))
        return int(json.loads(kv.value)["gpus"][0]["vram_used_mb"])
    wait_for(lambda: used() == 10000, 5, "the node to publish the new usage")
    with Client(addr, agent="agent-a", host="h1") as c:
        # 16384 - 10000 untracked leaves 6384.
        from agent_client import errors
        with pytest.raises(errors.ResourceExhausted):
            c.acquire(7000)
        lease = c.acquire(6000)
        # NVML now sees the lease's own 6000 as well: it is not counted twice.
        source.set_used(0, 16000)
        wait_for(lambda: used() == 16000, 5, "usage 16000")
        status = c.status("h1")
        g = status.hosts[0].gpus[0]
        assert (g.leased_mb, g.used_mb, g.untracked_mb, g.free_mb) == (6000, 16000, 10000, 384)
        lease.release()


def test_untracked_vram_can_be_turned_off(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    cluster.nodes["h1"][2].set_used(0, 16000)
    addr = cluster.start_coordinator(untracked_vram=False)
    wait_for(lambda: '"vram_used_mb":16000' in cluster.get_prefix(cluster.keys.usage("h1"))[0].value.decode(), 5,
             "usage 16000")
    with Client(addr, agent="agent-a", host="h1") as c:
        assert c.acquire(16000).vram_mb == 16000


def test_get_inventory_and_check_token(cluster: Cluster) -> None:
    daemon = cluster.start_node("h1", "2x16GiB")
    addr = cluster.start_coordinator()
    stub = npb_grpc.NodeStub(grpc.insecure_channel(daemon.address))
    inv = stub.GetInventory(npb.GetInventoryRequest(), timeout=5)
    assert inv.host == "h1" and inv.simulated and [g.vram_total_mb for g in inv.gpus] == [16384, 16384]
    with Client(addr, agent="agent-a", host="h1") as c:
        lease = c.acquire(1000, gpu=0)
        check = lambda t: stub.CheckToken(npb.CheckTokenRequest(gpu_uuid=lease.gpu_uuid, token=t), timeout=5)  # noqa: E731
        wait_for(lambda: check(lease.token).live, 5, "the node to see the lease")
        assert check(lease.token).lease_id == lease.id
        assert not check(lease.token + 1).live
        lease.release()
        wait_for(lambda: not check(lease.token).live, 5, "the node to see the release")
        assert check(lease.token).highest_token == lease.token
        with pytest.raises(grpc.RpcError) as e:
            stub.CheckToken(npb.CheckTokenRequest(gpu_uuid="GPU-nope", token=1), timeout=5)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "gpu_uuid" in e.value.details()


def test_dead_node_daemon_takes_its_host_away(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB", ttl=2)
    cluster.stop_node("h1", revoke=False)  # as if killed: its etcd_lease must expire by itself
    wait_for(lambda: cluster.get_prefix(cluster.keys.host("h1")) == [], 4, "hosts/h1 to expire")
    assert cluster.get_prefix(cluster.keys.usage("h1")) == []


def test_node_without_nvml_exits_with_a_clear_message(etcd: object) -> None:
    proc = subprocess.run([sys.executable, "-m", "coordinator.cli", "node", "--etcd", "127.0.0.1:1", "--host", "h1"],
                          capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=60)
    assert proc.returncode == 3
    assert "NVML" in proc.stderr and "--fake-gpus" in proc.stderr


def test_node_rejects_a_bad_fake_gpu_spec(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "coordinator.cli", "node", "--fake-gpus", "lots", "--host", "h1"],
                          capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=60)
    assert proc.returncode == 2 and "--fake-gpus" in proc.stderr
