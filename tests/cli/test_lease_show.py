"""``gpucoord lease show ID`` and ``gpucoord run --join`` against a running coordinator (docs/agents.md, "Joining a
multi-host lease"): a lease of one host shows its fields and no hostfile; an unknown lease is NOT_FOUND (exit 1);
a join whose rank is on another host than ``--host`` ends before the command runs, exit 125, naming the rank."""
from __future__ import annotations

import subprocess
import sys

import pytest

from agent_client import Client
from tests.support import REPO
from tests.support.cluster import Cluster
from tests.support.processes import child_env

pytestmark = pytest.mark.integration


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *args], capture_output=True, text=True,
                          env=child_env(), cwd=REPO, timeout=timeout)


@pytest.fixture
def coord(cluster: Cluster) -> str:
    cluster.start_node("h1", "2x16GiB")
    cluster.start_node("h2", "2x16GiB")
    return cluster.start_coordinator()


def test_lease_show_of_a_lease_of_one_host_prints_its_fields(coord: str) -> None:
    with Client(coord, agent="agent-a", host="h1") as c:
        lease = c.acquire(vram_mb=1000, gpu_count=2)
        proc = cli("lease", "show", lease.id, "--coordinator", coord)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith(f"lease {lease.id}\n") and "agent agent-a" in proc.stdout
        for g in lease.gpus:
            assert f"h1 GPU {g.index} {g.uuid} 1000 MiB token {g.token}" in proc.stdout
        assert "hostfile" not in proc.stdout and "PET_" not in proc.stdout


def test_lease_show_of_an_unknown_lease_is_not_found(coord: str) -> None:
    proc = cli("lease", "show", "no-such-lease", "--coordinator", coord)
    assert proc.returncode == 1 and "NOT_FOUND" in proc.stderr and "no-such-lease" in proc.stderr


def test_join_of_a_rank_on_another_host_exits_125_naming_the_rank(coord: str) -> None:
    with Client(coord, agent="agent-a", host="h1") as c:
        lease = c.acquire(vram_mb=1000)
        proc = cli("run", "--agent", "agent-a", "--host", "h2", "--join", lease.id, "--rank", "0",
                   "--coordinator", coord, "--", "true")
        assert proc.returncode == 125, proc.stderr
        assert f"cannot join lease {lease.id}" in proc.stderr
        assert f"rank: rank 0 of lease {lease.id} is on host h1, not on this session's host h2" in proc.stderr
        assert c.status("h1").hosts[0].leases[0].id == lease.id     # the lease is untouched
