"""The node daemon in the registry mode (``gpucoord node --coordinator``): no etcd connection at all; its
host's registration, usage and lease view go through a coordinator's Registry service, and the
registration lives as long as the daemon does, whichever replica holds it."""
from __future__ import annotations

import json
import pathlib
import threading
from typing import Any, Iterator

import grpc
import pytest

from agent_client import Client
from agent_client.api import node_pb2 as npb
from agent_client.api import registry_pb2 as rpb
from agent_client.api import registry_pb2_grpc as rpb_grpc
from coordinator.node.inventory import FakeGpuSource
from coordinator.node.registration import HostTaken
from coordinator.node.remote import RemoteNodeDaemon
from coordinator.records import GpuProcess
from tests.support.cluster import Cluster, revision, writes_since
from tests.support.processes import spawn_coordinator, spawn_node, stop_process
from tests.support.rpcs import node_stub
from tests.support.waiting import pass_time, wait_for

pytestmark = pytest.mark.integration


def usage_of(cluster: Cluster, host: str) -> dict[str, object] | None:
    kvs = cluster.get_prefix(cluster.keys.usage(host))
    return json.loads(kvs[0].value) if kvs else None


def used_mb(cluster: Cluster, host: str) -> int:
    doc: Any = usage_of(cluster, host) or {}
    return int(doc.get("gpus", [{}])[0].get("vram_used_mb", -1))


def test_a_node_registers_publishes_and_serves_through_the_coordinator(cluster: Cluster) -> None:
    addr = cluster.start_coordinator()
    daemon = cluster.start_node("h1", "1x16GiB", via=[addr])
    assert daemon._store is None   # no etcd connection at all
    (host_kv,) = cluster.get_prefix(cluster.keys.host("h1"))
    doc = json.loads(host_kv.value)
    assert doc["address"] == daemon.address and doc["inventory"]["gpus"][0]["vram_total_mb"] == 16384
    assert host_kv.etcd_lease == daemon.etcd_lease != 0
    wait_for(lambda: usage_of(cluster, "h1") is not None, 10, "the first usage report")
    (usage_kv,) = cluster.get_prefix(cluster.keys.usage("h1"))
    assert usage_kv.etcd_lease == daemon.etcd_lease

    _, _, source = cluster.nodes["h1"]
    source.set_used(0, 10000, (GpuProcess(pid=4242, used_mb=10000),))
    wait_for(lambda: used_mb(cluster, "h1") == 10000, 10, "the new usage, published through the coordinator")
    with Client(addr, agent="agent-a", host="h1") as c:
        from agent_client import errors
        with pytest.raises(errors.ResourceExhausted):
            c.acquire(7000)     # 16384 - 10000 untracked leaves 6384
        lease = c.acquire(6000)
        # The node's own view of leases comes through the coordinator's stream: CheckToken answers live.
        stub = node_stub(daemon.address)
        wait_for(lambda: stub.CheckToken(npb.CheckTokenRequest(gpu_uuid=lease.gpu_uuid, token=lease.token)).live,
                 10, "the node to see the lease")
        lease.release()
        wait_for(lambda: not stub.CheckToken(npb.CheckTokenRequest(gpu_uuid=lease.gpu_uuid, token=lease.token)).live,
                 10, "the node to see the release")
        # A token newer than any the node has seen is looked up through the coordinator (ListLeases).
        got = stub.CheckToken(npb.CheckTokenRequest(gpu_uuid=lease.gpu_uuid, token=lease.token + 1000))
        assert not got.live


@pytest.mark.usefixtures("history_checked")
def test_a_node_daemon_that_stops_loses_its_registration_at_once_and_one_that_dies_within_its_ttl(
        cluster: Cluster) -> None:
    addr = cluster.start_coordinator()
    cluster.start_node("h1", via=[addr], ttl=3)
    cluster.stop_node("h1")    # deregisters
    assert cluster.get_prefix(cluster.keys.host("h1")) == []
    cluster.start_node("h1", via=[addr], ttl=3)
    cluster.stop_node("h1", revoke=False)   # as if killed: no more heartbeats
    wait_for(lambda: cluster.get_prefix(cluster.keys.host("h1")) == [], 3 + 5, "the registration to expire")


@pytest.mark.usefixtures("history_checked")
def test_a_live_registration_survives_its_coordinator(cluster: Cluster) -> None:
    first, second = cluster.start_coordinator(), cluster.start_coordinator()
    daemon = cluster.start_node("h1", via=[first, second], ttl=3)
    assert isinstance(daemon, RemoteNodeDaemon)
    lease_before = daemon.etcd_lease
    cluster.stop_coordinator(first)
    wait_for(lambda: daemon.coordinator == second and daemon.reaches_etcd, 10, "the node to move to the second")
    # Past two TTLs the host is still registered, on the same etcd_lease: the second replica refreshes it.
    pass_time(2 * 3, "two TTLs of the registration")
    (kv,) = cluster.get_prefix(cluster.keys.host("h1"))
    assert kv.etcd_lease == lease_before == daemon.etcd_lease
    assert cluster.lt.run(cluster.store.time_to_live(lease_before)) > 0
    with Client(second, agent="agent-a", host="h1") as c:
        c.acquire(1000).release()


@pytest.mark.usefixtures("history_checked")
def test_a_second_daemon_for_a_live_host_is_refused(cluster: Cluster) -> None:
    addr = cluster.start_coordinator()
    cluster.start_node("h1", via=[addr], ttl=3)
    second = RemoteNodeDaemon([addr], cluster.keys, "h1", "127.0.0.1:1", FakeGpuSource("1x16GiB", "h1"), ttl_s=3)
    with pytest.raises(HostTaken, match="already has a live node daemon"):
        cluster.lt.run(second.start())
    (kv,) = cluster.get_prefix(cluster.keys.host("h1"))
    assert kv.etcd_lease == cluster.nodes["h1"][0].etcd_lease


def _register_stream(addr: str, messages: list[rpb.RegisterRequest], timeout: float = 10) -> list[rpb.RegisterResponse]:
    """The answers of a raw Register stream that sends ``messages`` and then waits for the server to end it."""
    with grpc.insecure_channel(addr) as channel:
        stub = rpb_grpc.RegistryStub(channel)
        return list(stub.Register(iter(messages), timeout=timeout))


def _inventory(host: str) -> str:
    return json.dumps({"host": host, "address": "127.0.0.1:1", "cpu_count": 1, "mem_bytes": 1 << 30,
                       "disk_bytes": 1 << 30, "gpus": [{"index": 0, "uuid": "GPU-x", "name": "n",
                                                        "vram_total_mb": 1024}]})


def test_a_node_cannot_keep_a_foreign_etcd_lease_alive_through_the_registry(cluster: Cluster) -> None:
    """Resuming names an etcd lease: the coordinator refreshes it only if ``hosts/<host>`` is on it. A node
    naming an agent's session lease (or any other) gets a registration of its own, and that lease runs out."""
    addr = cluster.start_coordinator()
    foreign = cluster.lt.run(cluster.store.grant(3))
    register = rpb.HostRegistration(host="h9", address="127.0.0.1:1", inventory_json=_inventory("h9"),
                                    ttl_seconds=3, etcd_lease=foreign)
    heartbeats = [rpb.RegisterRequest(heartbeat=rpb.Heartbeat()) for _ in range(3)]
    answers = _register_stream(addr, [rpb.RegisterRequest(register=register), *heartbeats,
                                      rpb.RegisterRequest(deregister=rpb.Deregister())])
    granted = {a.registered.etcd_lease for a in answers if a.WhichOneof("event") == "registered"}
    assert foreign not in granted and len(granted) == 1 and 0 not in granted
    wait_for(lambda: cluster.lt.run(cluster.store.time_to_live(foreign)) < 0, 3 + 5, "the foreign lease to expire")


@pytest.mark.parametrize("field, change", [
    ("host", {"host": "bad/host"}),
    ("address", {"address": ""}),
    ("ttl_seconds", {"ttl_seconds": 1}),
    ("ttl_seconds", {"ttl_seconds": 100000}),
    ("pid", {"pid": -1}),
    ("etcd_lease", {"etcd_lease": -5}),
    ("inventory_json", {"inventory_json": "{not json"}),
    ("inventory_json", {"inventory_json": json.dumps({"host": "h9"})}),
    ("inventory_json", {"inventory_json": _inventory("other-host")}),
    ("inventory_json", {"inventory_json": "x" * (300 << 10)}),
    ("version", {"version": "v" * 100}),
])
def test_bad_registrations_are_refused_naming_the_field_and_write_nothing(cluster: Cluster, field: str,
                                                                           change: dict[str, Any]) -> None:
    addr = cluster.start_coordinator()
    before = revision(cluster)
    fields = {"host": "h9", "address": "127.0.0.1:1", "inventory_json": _inventory("h9"), "ttl_seconds": 5,
              **change}
    with pytest.raises(grpc.RpcError) as info:
        _register_stream(addr, [rpb.RegisterRequest(register=rpb.HostRegistration(**fields))])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert info.value.details().startswith(f"{field}:"), info.value.details()
    assert len(info.value.details()) < 400
    assert not [w for w in writes_since(cluster, before) if "/hosts/" in w or "/usage/" in w]


def test_bad_usage_reports_and_calls_are_refused_naming_the_field(cluster: Cluster) -> None:
    addr = cluster.start_coordinator()
    register = rpb.RegisterRequest(register=rpb.HostRegistration(host="h9", address="127.0.0.1:1",
                                                                 inventory_json=_inventory("h9"), ttl_seconds=5))
    for message, field in ((rpb.RegisterRequest(usage=rpb.UsageReport(usage_json='{"gpus": [{"uuid": 5}]}')),
                            "usage_json"),
                           (rpb.RegisterRequest(usage=rpb.UsageReport(usage_json="[")), "usage_json"),
                           (rpb.RegisterRequest(), "call"), (register, "register")):
        with pytest.raises(grpc.RpcError) as info:
            _register_stream(addr, [register, message])
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert info.value.details().startswith(f"{field}:"), info.value.details()
        assert cluster.get_prefix(cluster.keys.usage("h9")) == []
        wait_for(lambda: cluster.get_prefix(cluster.keys.host("h9")) == [], 5 + 5, "the registration to run out")
    with pytest.raises(grpc.RpcError) as info:
        _register_stream(addr, [rpb.RegisterRequest(heartbeat=rpb.Heartbeat())])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("register:")


def test_a_node_process_with_no_etcd_credentials_serves_moves_and_dies_within_its_ttl(
        cluster: Cluster, tmp_path: pathlib.Path) -> None:
    """A real ``gpucoord node --coordinator A,B`` (no etcd endpoint, no etcd credential in its command line or
    environment): registered through A; A is killed, the node moves to B and its host stays registered past
    its TTL; then the node is killed -9 and its host's registration is gone within its TTL (G4)."""
    a, port_a = spawn_coordinator(cluster.endpoints, cluster.prefix, "127.0.0.1:0", str(tmp_path / "a.log"))
    b, port_b = spawn_coordinator(cluster.endpoints, cluster.prefix, "127.0.0.1:0", str(tmp_path / "b.log"))
    procs = [a, b]
    try:
        node = spawn_node([], cluster.prefix, "h1", "1x16GiB", str(tmp_path / "node.log"), ["--ttl", "3"],
                          coordinators=[f"127.0.0.1:{port_a}", f"127.0.0.1:{port_b}"])
        procs.append(node)
        wait_for(lambda: cluster.get_prefix(cluster.keys.usage("h1")), 10, "the node's first usage report")
        (kv,) = cluster.get_prefix(cluster.keys.host("h1"))
        a.kill()
        a.wait()
        pass_time(2 * 3, "two TTLs of the registration, with its first coordinator dead")
        (after,) = cluster.get_prefix(cluster.keys.host("h1"))
        assert after.etcd_lease == kv.etcd_lease, (tmp_path / "node.log").read_text()[-3000:]
        with Client(f"127.0.0.1:{port_b}", agent="agent-a", host="h1") as c:
            c.acquire(1000).release()
        node.kill()
        node.wait()
        wait_for(lambda: cluster.get_prefix(cluster.keys.host("h1")) == [], 3 + 2, "the dead node's registration to go")
        assert "talks to etcd directly" not in (tmp_path / "node.log").read_text()
    finally:
        for p in procs:
            stop_process(p)


@pytest.mark.usefixtures("history_checked")
def test_a_rolling_upgrade_old_and_new_nodes_side_by_side_and_a_host_upgraded_in_place(cluster: Cluster) -> None:
    """An etcd-direct node (an earlier release's mode) and a registry-mode node serve side by side; a host's
    etcd-direct daemon that is killed and replaced by a registry-mode one (no etcd credentials) gets its host
    back once the old registration has expired (the coordinator waits it out, as a restart always did)."""
    addr = cluster.start_coordinator()
    old = cluster.start_node("h-old", "1x16GiB", ttl=3, via=[])   # via=[]: the etcd mode, explicitly
    cluster.start_node("h-new", "1x16GiB", ttl=3, via=[addr])
    assert old.reads_etcd
    with Client(addr, agent="a", host="h-old") as a, Client(addr, agent="b", host="h-new") as b:
        a.acquire(1000).release()
        b.acquire(1000).release()
    (before,) = cluster.get_prefix(cluster.keys.host("h-old"))
    cluster.stop_node("h-old", revoke=False)       # killed: its registration runs down
    upgraded = cluster.start_node("h-old", "1x16GiB", ttl=3, via=[addr])
    (after,) = cluster.get_prefix(cluster.keys.host("h-old"))
    assert after.etcd_lease == upgraded.etcd_lease != before.etcd_lease
    with Client(addr, agent="a", host="h-old") as a:
        a.acquire(1000).release()


def test_a_silent_registration_stream_is_ended_and_its_registration_runs_out(cluster: Cluster) -> None:
    """A node that stops sending (SIGSTOP, a hung daemon) while its connection stays open: no heartbeat, so
    its registration runs out within its TTL; the coordinator ends the stream after three TTLs of silence."""
    addr = cluster.start_coordinator()
    register = rpb.HostRegistration(host="h9", address="127.0.0.1:1", inventory_json=_inventory("h9"), ttl_seconds=2)
    done = threading.Event()

    def requests() -> Iterator[rpb.RegisterRequest]:
        yield rpb.RegisterRequest(register=register)
        done.wait(60)

    try:
        with grpc.insecure_channel(addr) as channel:
            answers = rpb_grpc.RegistryStub(channel).Register(requests(), timeout=60)
            assert next(answers).registered.etcd_lease
            wait_for(lambda: cluster.get_prefix(cluster.keys.host("h9")) == [], 2 + 2, "the registration to run out")
            with pytest.raises(grpc.RpcError) as info:
                list(answers)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "heartbeat" in info.value.details()
    finally:
        done.set()
