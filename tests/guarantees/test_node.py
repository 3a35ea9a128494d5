"""The node daemon against a real etcd: publishing, the Node service, usage, fencing checks, death; and it
keeps its host registered through etcd errors and slow NVML calls, so a live daemon's host takes admissions.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import grpc
import pytest

from agent_client import Client
from agent_client.api import node_pb2 as npb
from agent_client.api import node_pb2_grpc as npb_grpc
from coordinator import errors as cerrors
from coordinator.records import GpuProcess
from coordinator.txn import Put
from tests.support import REPO
from tests.support.cluster import Cluster
from tests.support.fake_nvml import FakeDevice, FakeNvml
from tests.support.patching import patch_commit
from tests.support.processes import child_env
from tests.support.rpcs import node_stub
from tests.support.waiting import LIVENESS_S, LoopThread, wait_for


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
    # A heartbeat far longer than the test: each new usage is the change's write, not the heartbeat's, at any speed.
    cluster.start_node("h1", "1x16GiB", heartbeat_s=600.0)
    _, _, source = cluster.nodes["h1"]
    addr = cluster.start_coordinator()
    source.set_used(0, 10000, (GpuProcess(pid=4242, used_mb=10000),))

    def used() -> int:
        (kv,) = cluster.get_prefix(cluster.keys.usage("h1"))
        return int(json.loads(kv.value)["gpus"][0]["vram_used_mb"])
    wait_for(lambda: used() == 10000, LIVENESS_S, "the node to publish the new usage")
    with Client(addr, agent="agent-a", host="h1") as c:
        # 16384 - 10000 untracked leaves 6384.
        from agent_client import errors
        with pytest.raises(errors.ResourceExhausted):
            c.acquire(7000)
        lease = c.acquire(6000)
        # NVML now sees the lease's own 6000 as well: it is not counted twice.
        source.set_used(0, 16000)
        wait_for(lambda: used() == 16000, LIVENESS_S, "usage 16000")
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
        check = lambda t: stub.CheckToken(npb.CheckTokenRequest(gpu_uuid=lease.gpu_uuid, token=t), timeout=5)
        wait_for(lambda: check(lease.token).live, LIVENESS_S, "the node to see the lease")
        assert check(lease.token).lease_id == lease.id
        assert not check(lease.token + 1).live
        lease.release()
        wait_for(lambda: not check(lease.token).live, LIVENESS_S, "the node to see the release")
        assert check(lease.token).highest_token == lease.token
        with pytest.raises(grpc.RpcError) as e:
            stub.CheckToken(npb.CheckTokenRequest(gpu_uuid="GPU-nope", token=1), timeout=5)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "gpu_uuid" in e.value.details()


def test_dead_node_daemon_takes_its_host_away(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB", ttl=2)
    cluster.stop_node("h1", revoke=False)  # as if killed: its etcd_lease must expire by itself
    wait_for(lambda: cluster.get_prefix(cluster.keys.host("h1")) == [], LIVENESS_S, "hosts/h1 to expire")
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


def test_the_node_registers_again_when_its_first_attempt_fails(cluster: Cluster) -> None:
    """When the node's etcd_lease has expired (etcd out of reach past the TTL), the daemon grants a new one
    and publishes hosts/<host> again, and keeps trying when a write fails (etcd still flapping): its host
    comes back. (Review finding R6: one failed write ended the registration loop; the daemon kept serving
    gRPC, but its host was gone for good.)"""
    daemon = cluster.start_node("h1", "1x8GiB", ttl=3)
    failed: list[int] = []

    async def hook(compares: Any, success: Any, commit: Callable[[], Awaitable[Any]]) -> Any:
        if not failed and any(isinstance(op, Put) and op.key == cluster.keys.host("h1") for op in success):
            failed.append(1)
            raise cerrors.Unavailable("etcd unavailable: injected")
        return await commit()

    undo = patch_commit(cluster, daemon, hook)   # the daemon's Store
    try:
        cluster.lt.run(cluster.store.revoke(daemon.etcd_lease))   # as if etcd was unreachable past the TTL
        wait_for(lambda: failed, 10, "the node to try to register again")
        wait_for(lambda: cluster.get_prefix(cluster.keys.host("h1")), 8, "hosts/h1 to be published again")
    finally:
        undo()


def test_a_slow_nvml_call_stalls_neither_the_nodes_grpc_nor_its_registration(cluster: Cluster) -> None:
    """NVML calls can block for seconds (a GPU in a bad state, a driver without persistence mode). The
    daemon scans off its event loop: during a 4.5 s NVML call it answers GetInventory, and its host stays
    registered (its TTL is 3 s). (Review finding R14: the scan ran on the event loop, which stalled the
    keepalive, the lease watch, CheckToken and GetInventory; the host expired although the daemon lived.)"""
    from coordinator.etcd.store import Store
    from coordinator.node.daemon import NodeDaemon
    from coordinator.node.inventory import MIB, NvmlGpuSource
    from coordinator.rpc.node_server import create_node_server

    stall = threading.Event()

    class SlowNvml(FakeNvml):
        def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
            if stall.is_set():
                stall.clear()
                time.sleep(4.5)                 # one NVML call that hangs for a while (the fault, not a wait)
            return super().nvmlDeviceGetMemoryInfo(handle)

    source = NvmlGpuSource(SlowNvml([FakeDevice("GPU-slow-0", "Sick GPU", 8192 * MIB)]))
    lt = LoopThread()                           # its own loop, so that the stall only stops the node

    async def start() -> tuple[Any, Any]:
        store = Store(cluster.endpoints)
        await store.connect()
        daemon = NodeDaemon(store, cluster.keys, "h1", "127.0.0.1:0", source, "/", 3, scan_interval_s=0.2)
        server, port = await create_node_server(daemon, "127.0.0.1:0")
        daemon.address = f"127.0.0.1:{port}"
        await daemon.start()
        return daemon, server
    daemon, server = lt.run(start())
    try:
        node = node_stub(daemon.address)
        node.GetInventory(npb.GetInventoryRequest(), timeout=5)
        stall.set()
        wait_for(lambda: not stall.is_set(), LIVENESS_S, "the scan to reach the slow call")
        t0 = time.monotonic()
        try:
            node.GetInventory(npb.GetInventoryRequest(), timeout=1)
            answered = "answered"
        except grpc.RpcError as e:
            answered = e.code().name
        gone: dict[str, float] = {}

        def gone_or_window_over() -> bool:
            if not cluster.get_prefix(cluster.keys.host("h1")):
                gone["at"] = time.monotonic() - t0
                return True
            return time.monotonic() - t0 >= 5
        wait_for(gone_or_window_over, 10, "hosts/h1 to go, or the stall window to end")
        gone_at = gone.get("at")
        assert answered == "answered" and gone_at is None, \
            f"during a 4.5 s NVML call: GetInventory {answered}; hosts/h1 gone after {gone_at}"
    finally:
        async def stop() -> None:
            await server.stop(grace=0.2)
            await daemon.stop()
            await daemon.store.close()
        lt.run(stop())
        lt.close()
