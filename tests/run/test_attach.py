"""AttachProcesses (a lease records the processes it covers) and the Python face of binding leases,
against a real etcd."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

import grpc
import pytest

from agent_client import Client, errors
from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from tests.support.cluster import Cluster
from tests.support.rpcs import expect_refused
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration
C = grpc.StatusCode


def _lease_value(cluster: Cluster) -> tuple[dict[str, Any], int, int]:
    (kv,) = cluster.get_prefix(cluster.keys.leases())
    return json.loads(kv.value), kv.mod_revision, kv.etcd_lease


def test_attach_records_pids_and_group_keeping_everything_else(env: tuple[Cluster, Any, Client]) -> None:
    cluster, _, c = env
    lease = c.acquire(1000)
    before, rev, etcd_lease = _lease_value(cluster)
    assert "pids" not in before
    assert lease.attach() is True                      # default: this process
    after, rev2, etcd_lease2 = _lease_value(cluster)
    assert after == before | {"pids": [os.getpid()], "pgid": 0}
    assert rev2 > rev and etcd_lease2 == etcd_lease    # still on the session
    assert lease.attach() is False                     # the same again: no write
    assert _lease_value(cluster)[1] == rev2
    # Processes this caller started (G9: only its own are accepted): two children, one leading its group.
    kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
            for _ in range(2)]
    try:
        a, b = sorted(k.pid for k in kids)
        assert lease.attach([b, a, b], pgid=a) is True
        assert _lease_value(cluster)[0]["pids"] == [a, b]
        (st,) = c.status("h1").hosts[0].leases
        assert (list(st.pids), st.pgid, st.token) == ([a, b], a, lease.token)
    finally:
        for k in kids:
            k.kill()
            k.wait()
    lease.release()
    with pytest.raises(errors.NotFound, match="lease_id"):
        lease.attach()


def test_attach_bad_input_and_foreign_leases_change_nothing(env: tuple[Cluster, Any, Client]) -> None:
    cluster, stub, c = env
    lease = c.acquire(1000)
    ref = pb.SessionRef(agent="agent-a", session_id=c.session_id)

    def attach(**kw: Any) -> Any:
        return lambda: stub.AttachProcesses(pb.AttachProcessesRequest(**{"session": ref, "lease_id": lease.id,
                                                                         **kw}), timeout=10)
    expect_refused(cluster, attach(pids=[0]), C.INVALID_ARGUMENT, "pids")
    expect_refused(cluster, attach(pids=[-5]), C.INVALID_ARGUMENT, "pids")
    expect_refused(cluster, attach(pids=[(1 << 22) + 1]), C.INVALID_ARGUMENT, "pids")
    expect_refused(cluster, attach(pids=list(range(1, 66))), C.INVALID_ARGUMENT, "pids")
    expect_refused(cluster, attach(pgid=-1), C.INVALID_ARGUMENT, "pgid")
    expect_refused(cluster, attach(lease_id="no/such"), C.INVALID_ARGUMENT, "lease_id")
    expect_refused(cluster, attach(lease_id="0123456789abcdef0123"), C.NOT_FOUND, "lease_id")
    with Client(c._async.addresses, agent="agent-b",
                host="h1") as other:
        other_ref = pb.SessionRef(agent="agent-b", session_id=other.session_id)
        expect_refused(cluster, lambda: stub.AttachProcesses(pb.AttachProcessesRequest(
            session=other_ref, lease_id=lease.id, pids=[1]), timeout=10), C.PERMISSION_DENIED, "lease_id")


def test_client_run_binds_a_command_from_python(env: tuple[Cluster, Any, Client]) -> None:
    cluster, _, c = env
    with c.run([sys.executable, "-c", "import os, sys; sys.exit(int(os.environ['GPUCOORD_VRAM_MB']) % 256)"],
               vram_mb=1003) as proc:
        assert proc.wait(timeout=30) == 1003 % 256
        assert proc.reason == "exited"
    assert cluster.get_prefix(cluster.keys.leases()) == []
    # An operator's revoke of a lease bound to processes: a revoke notice, so the command is SIGKILLed at once
    # (SIGTERM ignored), and the lease ends once it is gone.
    with c.run([sys.executable, "-c", "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                      "signal.pause()"], vram_mb=1000, check_interval=0.2) as proc:
        wait_for(lambda: _lease_value(cluster)[0].get("pgid") == proc.pgid, 10, "the lease to record the group")
        stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(c._async.addresses[0]))
        resp = stub.RevokeLease(pb.RevokeLeaseRequest(lease_id=proc.lease.id), timeout=10)
        assert resp.revoked and resp.processes
        assert proc.wait(timeout=30) == 128 + signal.SIGKILL
        assert proc.reason == "revoked" and "revoked by operator: SIGKILL at once" in proc.message, proc.message
    # Leaving the block early stops the command (SIGTERM) and releases.
    with c.run(["sleep", "60"], vram_mb=1000) as proc:
        pass
    assert proc.returncode == 128 + signal.SIGTERM and proc.reason == "stopped"
    assert cluster.get_prefix(cluster.keys.leases()) == []
