"""The CLI end to end: `gpucoord up --demo` plays its scene; status and keys read the real state."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agent_client import Client
from coordinator.etcd_process import free_port
from tests.harness import REPO, Cluster, child_env

pytestmark = pytest.mark.integration


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *args], capture_output=True, text=True,
                          env=child_env(), cwd=REPO, timeout=timeout)


def test_up_demo_runs_to_its_end(tmp_path: Path) -> None:
    proc = _cli("up", "--demo", "--fake-gpus", "2x16GiB", "--host", "demo-host", "--data-dir", str(tmp_path / "d"),
                "--listen", f"127.0.0.1:{free_port()}", "--node-listen", "127.0.0.1:0", timeout=180)
    out = proc.stdout
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert out.count("GRANTED") == 4 and "REFUSED (RESOURCE_EXHAUSTED)" in out
    assert "released by etcd itself" in out and "demo finished" in out
    assert "=== every agent released and closed its session" in out


def test_status_and_keys(cluster: Cluster) -> None:
    cluster.start_node("h1", "2x16GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="agent-a", host="h1") as c:
        lease = c.acquire(3000, priority=7)
        table = _cli("status", "--coordinator", addr)
        assert table.returncode == 0, table.stderr
        assert "host h1 alive simulated" in table.stdout and lease.id in table.stdout
        doc = json.loads(_cli("status", "--coordinator", addr, "--json").stdout)
        (host,) = [h for h in doc["hosts"] if h["host"] == "h1"]
        assert host["leases"][0]["id"] == lease.id and int(host["leases"][0]["ttl_remaining"]) > 0
        assert {int(g["leased_mb"]) for g in host["gpus"]} == {3000, 0}
        keys = _cli("keys", "--etcd", cluster.endpoints[0], "--prefix", cluster.prefix)
        assert keys.returncode == 0
        assert f"{cluster.prefix}leases/h1/{lease.gpu_uuid}/{lease.id}" in keys.stdout
        assert f"{cluster.prefix}sessions/agent-a/{c.session_id}" in keys.stdout


def test_status_reports_an_unreachable_coordinator() -> None:
    proc = _cli("status", "--coordinator", f"127.0.0.1:{free_port()}")
    assert proc.returncode == 1 and "UNAVAILABLE" in proc.stderr
