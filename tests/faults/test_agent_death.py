"""G4 and G7 with real processes: a killed client's VRAM comes back; a coordinator restart loses nothing."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from agent_client import Client
from tests.harness import Cluster, spawn_agent, spawn_coordinator, wait_for
from tests.history import check_store

pytestmark = [pytest.mark.integration, pytest.mark.fault]


def test_sigkilled_client_frees_its_vram_within_ttl_plus_1s(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    ttl = 3
    proc, answer = spawn_agent(addr, "h1", "agent-k", 8000, ttl, log_path=str(tmp_path / "agent.log"))
    try:
        assert answer.startswith("GRANTED"), answer
        assert len(cluster.leases()) == 1
        killed_at = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        wait_for(lambda: cluster.leases() == [], ttl + 1, "the killed agent's lease to expire")
        freed_after = time.monotonic() - killed_at
        assert freed_after <= ttl + 1
        assert cluster.get_prefix(cluster.keys.sessions()) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # The freed VRAM is admissible again.
    with Client(addr, agent="agent-b", host="h1") as c:
        assert c.acquire(16384).vram_mb == 16384
    cluster.lt.run(check_store(cluster.store, cluster.keys)).assert_ok()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_coordinator_restart_keeps_the_lease_and_the_client_goes_on(cluster: Cluster, tmp_path: Path,
                                                                    sig: int) -> None:
    cluster.start_node("h1", "1x16GiB")
    proc, port = spawn_coordinator(cluster.endpoints, cluster.prefix, "127.0.0.1:0", str(tmp_path / "c1.log"))
    addr = f"127.0.0.1:{port}"
    c = Client(addr, agent="agent-a", host="h1", ttl=10).connect()
    try:
        lease = c.acquire(6000)
        os.kill(proc.pid, sig)
        proc.wait()
        # A new replica on the same address (as a supervisor would restart it).
        proc, port2 = spawn_coordinator(cluster.endpoints, cluster.prefix, addr, str(tmp_path / "c2.log"))
        assert port2 == port
        (stored,) = cluster.leases()
        assert stored.id == lease.id
        # The client keeps its session through the new replica and goes on working.
        second = c.acquire(2000)
        assert second.token == lease.token + 1
        assert not c.expired
        lease.release()
        second.release()
        assert cluster.leases() == []
    finally:
        c.close()
        proc.terminate()
        proc.wait()
    cluster.lt.run(check_store(cluster.store, cluster.keys)).assert_ok()


def test_client_fails_over_to_another_replica(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    a = cluster.start_coordinator()
    b = cluster.start_coordinator()
    with Client([a, b], agent="agent-a", host="h1", ttl=6) as c:
        lease = c.acquire(1000)
        cluster.stop_coordinator(a)
        other = c.acquire(1000)
        assert other.gpu_uuid == lease.gpu_uuid
        # Kept alive through b for longer than the TTL: the session survives.
        session_key = cluster.keys.session("agent-a", c.session_id)
        deadline = time.monotonic() + 8
        wait_for(lambda: time.monotonic() > deadline, 10, "a TTL and more to pass")
        assert cluster.get_prefix(session_key) and len(cluster.leases()) == 2
