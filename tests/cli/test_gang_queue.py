"""The multi-host gangs waiting in status (issue 30, G12): `GetStatus.gang_queue` lists each with its position,
shape and the hosts it reserves, or says it reserves none (every set of hosts it could get cordoned); `gpucoord
queue` prints it; an agent sees no other agent's request id there."""
from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest

from agent_client import Client
from agent_client.api import coordinator_pb2 as pb
from tests.support import REPO
from tests.support.cluster import Cluster
from tests.support.processes import child_env
from tests.support.rpcs import coordinator_stub
from tests.support.waiting import LIVENESS_S, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]


def _queue(addr: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coordinator.cli", "queue", "--coordinator", addr, *extra],
                          capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=60)


def test_a_waiting_gang_is_listed_with_the_hosts_it_reserves_or_why_it_reserves_none(cluster: Cluster) -> None:
    for host in ("a", "b"):
        cluster.start_node(host, "1x16GiB")
    addr = cluster.start_coordinator()
    stub = coordinator_stub(addr)
    with Client(addr, agent="holder", host="a") as holder, Client(addr, agent="big", host="b") as big:
        held = holder.acquire(1024, gpu=0)
        call = stub.Acquire.future(pb.AcquireRequest(
            session=pb.SessionRef(agent="big", session_id=big.session_id), request_id="g", hosts=2, gpu_count=1,
            exclusive=True, wait_seconds=LIVENESS_S))
        wait_for(lambda: len(stub.GetStatus(pb.GetStatusRequest(), timeout=10).gang_queue) == 1, LIVENESS_S,
                 "the gang in status")
        (entry,) = stub.GetStatus(pb.GetStatusRequest(), timeout=10).gang_queue
        assert (entry.position, entry.agent, entry.hosts, entry.request_id) == (1, "big", 2, "g")
        assert entry.reason == "waits for 2 hosts x 1 whole GPUs; reserves a, b", entry.reason
        doc = json.loads(_queue(addr, "--json").stdout)
        assert [g["reason"] for g in doc["gangs"]] == [entry.reason]
        assert f"multi-host gang 1: big priority 0: {entry.reason}" in _queue(addr).stdout
        for host in ("a", "b"):
            stub.CordonHost(pb.CordonHostRequest(host=host, reason="maintenance"), timeout=10)
        wait_for(lambda: "reserves no host" in stub.GetStatus(pb.GetStatusRequest(), timeout=10).gang_queue[0].reason,
                 LIVENESS_S, "the gang's reservation gone with the cordons")
        for host in ("a", "b"):
            stub.UncordonHost(pb.UncordonHostRequest(host=host), timeout=10)
        held.release()
        assert call.result(timeout=LIVENESS_S).lease.id
        assert not stub.GetStatus(pb.GetStatusRequest(), timeout=10).gang_queue


def test_a_host_of_its_own_lists_no_gang(cluster: Cluster) -> None:
    cluster.start_node("a", "1x16GiB")
    addr = cluster.start_coordinator()
    assert not coordinator_stub(addr).GetStatus(pb.GetStatusRequest(host="a"), timeout=10).gang_queue
    with pytest.raises(grpc.RpcError):
        coordinator_stub(addr).GetStatus(pb.GetStatusRequest(host="nope"), timeout=10)
