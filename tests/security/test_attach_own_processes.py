"""G9: an agent attaches only processes that are its own, and the enforcer kills only what a lease attached.

The attack of issue 29: with ``--enforce kill``, an agent acquires a lease, attaches the pid of an untracked
process it does not own (any pid the status table shows), and releases; the node then killed that process as
"its lease no longer exists". Now the node of the host confirms every pid first: PERMISSION_DENIED naming
``pids``, nothing recorded, and the process lives. ``gpucoord run`` (its children carry the lease) and a
process's attach of itself still work.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from agent_client import Client, errors
from tests.support.cluster import Cluster
from tests.support.processes import write_fake_processes
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration


def _alive(pid: int) -> bool:
    """Measured on the process itself: it exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.fixture
def stranger() -> Iterator[int]:
    """A process that is not this test's: started by a shell of its own session that exits at once, so that
    its parent is no longer anyone here (it is reparented) and its group leader is gone."""
    out = subprocess.run(["sh", "-c", "sleep 300 >/dev/null 2>&1 </dev/null & echo $!"], capture_output=True,
                         text=True, check=True, start_new_session=True)
    pid = int(out.stdout.strip())
    yield pid
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _scans(cluster: Cluster, host: str, n: int) -> None:
    """Wait until the node's enforcer has scanned ``n`` more times."""
    daemon = cluster.nodes[host][0]
    seen: list[object] = [daemon.enforcer.last]

    def another() -> bool:
        if daemon.enforcer.last is not seen[-1]:
            seen.append(daemon.enforcer.last)
        return len(seen) > n
    wait_for(another, timeout=30, what=f"{n} scans of the node")


@pytest.mark.parametrize("mode", ["registry", "etcd"])
def test_an_agent_cannot_make_the_node_kill_a_process_it_does_not_own(cluster: Cluster, tmp_path: Path,
                                                                       stranger: int, mode: str) -> None:
    """With the node in the registry mode (no etcd connection: this release's) and in the etcd mode (an
    earlier release's, during a rolling upgrade)."""
    procs = tmp_path / "procs.json"
    write_fake_processes(procs, {0: {stranger: 2000}})    # the stranger uses GPU 0: untracked
    addr = cluster.start_coordinator()
    daemon = cluster.start_node("h1", "1x16GiB", fake_processes=str(procs), enforce="kill",
                                via=[addr] if mode == "registry" else [])
    assert daemon.reads_etcd == (mode == "etcd")
    pgid = os.getpgid(stranger)
    with Client([addr], agent="agent-a", host="h1") as c:
        lease = c.acquire(1000)
        with pytest.raises(errors.PermissionDenied, match=r"^pids: .*" + str(stranger)):
            lease.attach([stranger])
        with pytest.raises(errors.PermissionDenied, match=r"^pids: "):
            lease.attach([os.getpid()], pgid=pgid)         # its group, whose leader is gone: not ours either
        (kv,) = cluster.get_prefix(cluster.keys.leases())
        assert "pids" not in json.loads(kv.value), "a refused attach recorded processes"
        lease.release()
        daemon = cluster.nodes["h1"][0]
        wait_for(lambda: not daemon.check_token(lease.gpu_uuid, lease.token)[0], timeout=30,
                 what="the node sees the lease gone")
        _scans(cluster, "h1", 3)
        assert _alive(stranger), "the node killed a process no lease of its agent ever attached"
        verdicts = [v for v in cluster.nodes["h1"][0].enforcer.last.processes if v.pid == stranger]
        assert [v.state for v in verdicts] == ["untracked"]

        # What is the caller's is still accepted: itself, and what `run` starts (it carries the lease).
        own = c.acquire(1000)
        assert own.attach() is True
        own.release()
        with c.run([sys.executable, "-c", "import os, sys; sys.exit(0 if os.environ['GPUCOORD_LEASE_ID'] else 3)"],
                   vram_mb=1000) as proc:
            assert proc.wait(timeout=30) == 0
    assert _alive(stranger)


def test_only_a_coordinator_may_ask_a_node_whose_processes_these_are(cluster: Cluster, stranger: int) -> None:
    """Without TLS every caller is trusted (loopback dev mode); the node's answer itself refuses a stranger's
    pid, whoever asks."""
    import grpc

    from agent_client.api import node_pb2 as npb
    from agent_client.api import node_pb2_grpc as npb_grpc
    daemon = cluster.start_node("h1", "1x16GiB")
    with grpc.insecure_channel(daemon.address) as ch:
        resp = npb_grpc.NodeStub(ch).ConfirmProcesses(
            npb.ConfirmProcessesRequest(lease_id="l1", pids=[stranger], peer="ipv4:127.0.0.1:1"), timeout=10)
    assert list(resp.refused) == [stranger]
