"""A host has one node daemon: a second one never takes the host over, and the owner repairs its key.

The exit-code case runs real ``gpucoord node`` processes; the others use in-process daemons of the
``tests.support.cluster.Cluster`` (real etcd, real gRPC).
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from coordinator.etcd.store import KV, Store
from coordinator.node.daemon import HostTaken, NodeDaemon
from coordinator.node.inventory import FakeGpuSource
from coordinator.rpc.node_server import create_node_server
from tests.support import REPO
from tests.support.cluster import Cluster
from tests.support.patching import patch_method
from tests.support.processes import child_env
from tests.support.waiting import LIVENESS_S, wait_for


def spawn_node(cluster: Cluster, host: str, fake_gpus: str, log_path: Path) -> tuple[subprocess.Popen[bytes], int]:
    """A node daemon as a real child process; returns it once it has registered, with its port."""
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "node", "--etcd", ",".join(cluster.endpoints),
                             "--prefix", cluster.prefix, "--host", host, "--listen", "127.0.0.1:0",
                             "--fake-gpus", fake_gpus],
                            stdout=subprocess.PIPE, stderr=open(log_path, "ab"), env=child_env(), cwd=REPO)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if not line.startswith("READY node port="):
        proc.kill()
        raise AssertionError(f"node did not start: {line!r}; see {log_path}")
    return proc, int(line.split("port=")[1])


def host_kv(cluster: Cluster, host: str = "h1") -> KV | None:
    kvs = cluster.get_prefix(cluster.keys.host(host))
    return kvs[0] if kvs else None


def test_a_second_daemon_for_a_live_host_exits_naming_the_live_one(cluster: Cluster, tmp_path: Path) -> None:
    first, port = spawn_node(cluster, "h1", "1x16GiB", tmp_path / "first.log")
    try:
        before = host_kv(cluster)
        assert before is not None and json.loads(before.value)["pid"] == first.pid
        # Another GPU size, as in the report: had it published, hosts/h1 would now show an 80 GiB GPU.
        second = subprocess.run([sys.executable, "-m", "coordinator.cli", "node", "--etcd", ",".join(cluster.endpoints),
                                 "--prefix", cluster.prefix, "--host", "h1", "--listen", "127.0.0.1:0",
                                 "--fake-gpus", "1x80GiB"],
                                capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=60)
        assert second.returncode == 4, second.stderr
        assert "READY" not in second.stdout
        assert f"127.0.0.1:{port}" in second.stderr and f"pid {first.pid}" in second.stderr, second.stderr
        after = host_kv(cluster)
        assert after is not None
        assert (after.mod_revision, after.value, after.etcd_lease) == (before.mod_revision, before.value,
                                                                       before.etcd_lease)
        assert first.poll() is None, "the live daemon must not be disturbed"
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(15)
    # The first daemon revoked its etcd_lease on the way out, and the second left nothing behind.
    assert host_kv(cluster) is None and cluster.get_prefix(cluster.keys.usage("h1")) == []


def test_registration_is_create_only_even_when_two_daemons_race(cluster: Cluster) -> None:
    """The check before binding is only for a clear message: the registration transaction itself refuses to
    overwrite a host key on another etcd_lease."""
    owner = cluster.start_node("h1", "1x16GiB")
    before = host_kv(cluster)
    usage_before = cluster.get_prefix(cluster.keys.usage("h1"))
    intruder = NodeDaemon(cluster.store, cluster.keys, "h1", "127.0.0.1:1", FakeGpuSource("1x80GiB", "h1"), "/", 10)

    async def skip_check() -> None:
        return None
    intruder.ensure_host_free = skip_check  # type: ignore[method-assign]
    with pytest.raises(HostTaken) as e:
        cluster.lt.run(intruder.start())
    assert owner.address in e.value.message and f"pid {os.getpid()}" in e.value.message
    assert intruder.etcd_lease == 0, "the refused daemon's etcd_lease is revoked"
    assert host_kv(cluster) == before
    assert cluster.get_prefix(cluster.keys.usage("h1")) == usage_before


def test_a_daemon_restarted_after_a_crash_takes_over_when_the_old_registration_expires(cluster: Cluster) -> None:
    """A dead daemon's registration only runs down (nobody refreshes its etcd_lease): a new daemon waits it
    out instead of refusing, so a supervisor's immediate restart works."""
    cluster.start_node("h1", "1x16GiB", ttl=3)
    old = host_kv(cluster)
    assert old is not None
    cluster.stop_node("h1", revoke=False)          # as if killed: hosts/h1 stays until the TTL passes
    new = cluster.start_node("h1", "1x16GiB", ttl=3)
    now = host_kv(cluster)
    assert now is not None and now.etcd_lease == new.etcd_lease != old.etcd_lease


def test_a_host_key_deleted_by_hand_is_restored_within_a_heartbeat(cluster: Cluster) -> None:
    # A heartbeat far longer than the wait below: the usage write that comes with it must not be what repairs
    # the key. Restored before the daemon's first heartbeat, it was the watch that did it, at any speed.
    heartbeat = 600.0
    started = time.monotonic()
    daemon = cluster.start_node("h1", "1x16GiB", heartbeat_s=heartbeat)
    before = host_kv(cluster)
    assert before is not None
    cluster.lt.run(cluster.store.delete(cluster.keys.host("h1")))
    deleted_at = time.monotonic()
    restored = wait_for(lambda: host_kv(cluster), 60, "hosts/h1 to be registered again")
    took = time.monotonic() - deleted_at
    assert restored.etcd_lease == daemon.etcd_lease == before.etcd_lease
    assert restored.value == before.value
    assert time.monotonic() - started < heartbeat, "the heartbeat may have repaired it"
    print(f"restored {took:.2f} s after the delete")


def start_daemon(cluster: Cluster, host: str, fake_gpus: str, ttl: int = 10) -> tuple[NodeDaemon, Any]:
    """A second in-process daemon for a host (``Cluster.start_node`` keeps one per host)."""
    async def start() -> tuple[NodeDaemon, Any]:
        store = Store(cluster.endpoints)
        await store.connect()
        daemon = NodeDaemon(store, cluster.keys, host, "127.0.0.1:0", FakeGpuSource(fake_gpus, host), "/", ttl,
                            scan_interval_s=0.2)
        server, port = await create_node_server(daemon, "127.0.0.1:0")
        daemon.address = f"127.0.0.1:{port}"
        try:
            await daemon.start()
        except BaseException:
            await server.stop(grace=0)
            await store.close()
            raise
        return daemon, server
    return cluster.lt.run(start())


def stop_daemon(cluster: Cluster, daemon: NodeDaemon, server: Any) -> None:
    async def stop() -> None:
        await server.stop(grace=0.2)
        await daemon.stop()
        await daemon.store.close()
    cluster.lt.run(stop())


def test_a_daemon_that_lost_its_host_to_another_stays_a_standby(cluster: Cluster) -> None:
    """Daemon A's etcd_lease expires (etcd out of reach past the TTL) and daemon B registers the host
    meanwhile. A does not write over B's keys, keeps trying every keepalive round, and takes the host back
    as soon as B's registration goes away."""
    a = cluster.start_node("h1", "1x16GiB", ttl=3)
    gate = asyncio.Event()
    orig_grant = a.store.grant

    async def held_grant(ttl: int) -> int:     # A gets no new etcd_lease until the gate opens
        await gate.wait()
        return await orig_grant(ttl)
    undo_grant = patch_method(cluster, a.store, "grant", held_grant)
    refusals: list[str] = []
    orig_publish = a._publish_host

    async def publish_host() -> None:
        try:
            await orig_publish()
        except HostTaken as e:
            refusals.append(e.message)
            raise
    undo_publish = patch_method(cluster, a, "_publish_host", publish_host)

    old_lease = a.etcd_lease
    cluster.lt.run(cluster.store.revoke(old_lease))              # as if A's etcd_lease expired
    wait_for(lambda: host_kv(cluster) is None, LIVENESS_S, "hosts/h1 to go with A's etcd_lease")
    b, b_server = start_daemon(cluster, "h1", "1x80GiB")
    try:
        owned = host_kv(cluster)
        assert owned is not None and owned.etcd_lease == b.etcd_lease
        cluster.lt.loop.call_soon_threadsafe(gate.set)
        wait_for(lambda: len(refusals) >= 2, 10, "A to try to register twice, and be refused")
        assert a.etcd_lease not in (0, old_lease)
        assert b.address in refusals[-1]
        cluster.lt.run(a._publish_usage(force=True))             # even a forced usage write is refused
        assert host_kv(cluster) == owned
        assert [kv.etcd_lease for kv in cluster.get_prefix(cluster.keys.usage("h1"))] == [b.etcd_lease]
    finally:
        undo_grant()
        stop_daemon(cluster, b, b_server)
    # B is gone: A, the standby, takes the host back at once.
    back = wait_for(lambda: host_kv(cluster), LIVENESS_S, "A to register h1 again")
    undo_publish()
    assert back.etcd_lease == a.etcd_lease != 0
    assert json.loads(back.value)["inventory"]["gpus"][0]["vram_total_mb"] == 16384
