"""The CLI end to end: status and keys read the real state (`gpucoord up --demo` is run by tests/cli/test_readme.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent_client import Client
from tests.support import REPO
from tests.support.cluster import Cluster
from tests.support.processes import child_env
from tests.support.waiting import LIVENESS_S, wait_for

pytestmark = pytest.mark.integration

# Every address of `up` on a free port: other test runs on this machine may hold the defaults.
FREE_PORTS = [f"--{flag}=127.0.0.1:0" for flag in ("listen", "metrics-listen", "node-listen", "node-metrics-listen",
                                                   "etcd-listen")]


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *args], capture_output=True, text=True,
                          env=child_env(), cwd=REPO, timeout=timeout)


def test_status_and_keys(cluster: Cluster) -> None:
    cluster.start_node("h1", "2x16GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="agent-a", host="h1") as c:
        lease = c.acquire(3000, priority=7)
        table = _cli("status", "--coordinator", addr)
        assert table.returncode == 0, table.stderr
        assert "host h1 alive simulated" in table.stdout and lease.id in table.stdout
        doc = json.loads(_cli("status", "--coordinator", addr, "--json").stdout)
        members = doc["etcd_members"]     # the suite's etcd: one member, its leader
        assert len(members) == 1 and members[0]["leader"] and members[0]["client_urls"], members
        assert f"etcd 1 member  leader {members[0]['name'] or members[0]['id']}" in table.stdout
        (host,) = [h for h in doc["hosts"] if h["host"] == "h1"]
        assert host["leases"][0]["id"] == lease.id and int(host["leases"][0]["ttl_remaining"]) > 0
        assert {int(g["leased_mb"]) for g in host["gpus"]} == {3000, 0}
        keys = _cli("keys", "--etcd", cluster.endpoints[0], "--prefix", cluster.prefix)
        assert keys.returncode == 0
        assert f"{cluster.prefix}leases/h1/{lease.gpu_uuid}/{lease.id}" in keys.stdout
        assert f"{cluster.prefix}sessions/agent-a/{c.session_id}" in keys.stdout


def test_keys_shows_a_gang_as_one_lease_over_its_gpus(cluster: Cluster) -> None:
    cluster.start_node("h1", "4x16GiB:nvlink=0-1,2-3")
    addr = cluster.start_coordinator()
    with Client(addr, agent="agent-a", host="h1") as c:
        gang = c.acquire(2000, gpu_count=2, topology="nvlink")
        keys = _cli("keys", "--etcd", cluster.endpoints[0], "--prefix", cluster.prefix)
        assert keys.returncode == 0, keys.stderr
        indexes = ",".join(str(g.index) for g in gang.gpus)
        uuids = ", ".join(g.uuid for g in gang.gpus)
        assert f"# gang lease {gang.id}: one lease over GPUs {indexes} ({uuids})" in keys.stdout, keys.stdout
        assert keys.stdout.count(f"/{gang.id}  (mod_revision=") == 2


def test_lease_evict_and_revoke_commands(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="agent-a", host="h1") as c:
        one, two = c.acquire(1000), c.acquire(1000)
        evict = _cli("lease", "--coordinator", addr, "evict", one.id, "--grace", "60")
        assert evict.returncode == 0 and "eviction notice sent" in evict.stdout
        assert c.status("h1").hosts[0].leases  # still held during its grace period
        revoke = _cli("lease", "--coordinator", addr, "revoke", two.id)
        assert revoke.returncode == 0 and "revoked" in revoke.stdout
        assert {x.id for x in cluster.leases()} == {one.id}
        missing = _cli("lease", "--coordinator", addr, "evict", "no-such-lease")
        assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr and "lease_id" in missing.stderr


_HOLDER = """
import sys
from agent_client import Client
c = Client(sys.argv[1], agent="holder", host=sys.argv[2]).connect()   # no ttl: the coordinator's default
lease = c.acquire(vram_mb=1024)
print(c._async.ttl, c._async.keepalive_interval, lease.id, flush=True)
sys.stdin.read()
"""


def test_up_with_a_short_session_ttl_reclaims_a_killed_client(tmp_path: Path) -> None:
    """``up --session-ttl 3`` gives the client a TTL of 3 s and a keepalive interval of 1 s, and a killed client's
    lease goes (G4's TTL + 1 s is measured by ``gpucoord bench``; here it is a liveness deadline and a print)."""
    import signal
    import time

    from coordinator.cli.common import fetch_status
    up = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "up", "--session-ttl", "3", "--fake-gpus", "1x16GiB",
                           "--host", "ttl-host", "--data-dir", str(tmp_path / "d"), *FREE_PORTS],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(), cwd=REPO)
    holder = None
    try:
        assert up.stdout is not None
        addr = ""
        for line in up.stdout:
            if line.startswith("coordinator:"):
                addr = line.split()[1]
            if "gpucoord is up" in line:
                break
        assert addr, "up did not print the coordinator's address"
        holder = subprocess.Popen([sys.executable, "-c", _HOLDER, addr, "ttl-host"], stdout=subprocess.PIPE,
                                  stdin=subprocess.PIPE, text=True, env=child_env(), cwd=REPO)
        assert holder.stdout is not None
        ttl, interval, lease_id = holder.stdout.readline().split()
        assert (int(ttl), float(interval)) == (3, 1.0)
        holder.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        holder.wait()

        def leases() -> list[str]:
            return [x["id"] for h in fetch_status(addr)["hosts"] for x in h.get("leases", [])]
        wait_for(lambda: lease_id not in leases(), LIVENESS_S, "the killed client's lease to go")
        print(f"the killed client's lease went {time.monotonic() - killed:.2f} s after the kill (TTL 3 s)")
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
        up.send_signal(signal.SIGTERM)
        up.wait(30)
