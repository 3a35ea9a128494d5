"""Cordon and drain (issue 31, point 6) with the leader SIGKILLed in the middle, two coordinator processes.

A drain's notices are written by the replica that serves the call; what is left (revoking each lease at its
deadline, with G3's order for a lease bound to processes, and finishing a drain cut short before its notices) is
the leader's duty. So the leader is stopped (SIGSTOP) before the drain, which then runs through the other
replica, and SIGKILLed once the drain's notices are in etcd: the stopped leader cannot have revoked a lease (the
host is certainly not empty when it dies, at any speed), and the survivor, once it leads, finishes the drain:
every lease on the host gone (a ``gpucoord run`` child that traps SIGTERM first), ``host drain --wait`` returns
with the host drained, ``status`` shows it so, and the history checker finds no grant on the cordoned host at
any revision. The same when the drain was cut short after its cordon and before its notices."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from agent_client import Client, errors
from coordinator.cli.common import fetch_status
from coordinator.host_records import CordonRecord
from coordinator.records import EvictionRecord, dumps
from tests.history import check_store
from tests.support import REPO
from tests.support.cluster import Cluster
from tests.support.processes import ProcessGone, child_env, replica_processes
from tests.support.run_victim import start_victim
from tests.support.waiting import LIVENESS_S, wait_for


@pytest.fixture
def replicas(cluster: Cluster, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Two coordinator processes (replica id -> (process, address)); the history checker runs at the end."""
    with replica_processes(cluster, tmp_path) as by_id:
        yield by_id
    cluster.lt.run(check_store(cluster.store, cluster.keys), timeout=240).assert_ok()


def gpucoord(addr: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "coordinator.cli", *args, "--coordinator", addr],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=REPO)


def _host_leases(cluster: Cluster, host: str = "h1") -> list[Any]:
    return [x for x in cluster.leases() if x.host == host]


def _notices(cluster: Cluster) -> dict[str, EvictionRecord]:
    return {r.lease_id: r for r in (EvictionRecord.from_kv(kv) for kv in cluster.get_prefix(cluster.keys.evictions()))}


def _leader(replicas: dict[str, Any]) -> tuple[Any, str, str]:
    """The leader: (its process, its id, the other replica's address)."""
    addrs = [addr for _, addr in replicas.values()]
    leader_id = wait_for(lambda: str(fetch_status(addrs[0]).get("leader", "")), LIVENESS_S, "a leader")
    proc, leader_addr = replicas[leader_id]
    (other,) = [a for a in addrs if a != leader_addr]
    return proc, leader_id, other


def _kill(proc: Any) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def _assert_drained(cluster: Cluster, addr: str, leader_id: str) -> None:
    """Nothing left on h1, under a new leader; ``status`` shows h1 cordoned by a drain that is done; h1 refuses a
    grant, naming itself, while h2 grants."""
    assert fetch_status(addr)["leader"] not in ("", leader_id)
    assert _host_leases(cluster) == []
    (doc,) = fetch_status(addr, "h1")["hosts"]
    assert doc["cordoned"] and doc["cordon"]["drain"] and not doc["draining"] and not doc.get("leases"), doc
    with Client(addr, agent="late", host="h1") as late:
        with pytest.raises(errors.FailedPrecondition) as info:
            late.acquire(1000)
        assert "host 'h1' is draining" in str(info.value), info.value
    with Client(addr, agent="late", host="h2") as late:
        late.acquire(1000).release()


def test_a_drain_whose_leader_is_killed_after_its_notices_finishes_under_the_new_leader(
        cluster: Cluster, replicas: dict[str, Any], victim_py: str, started: list[int]) -> None:
    cluster.start_node("h1", "3x16GiB")
    cluster.start_node("h2", "1x16GiB")
    leader, leader_id, other = _leader(replicas)
    # (run and the holder keep their sessions through the survivor, which also serves the drain)
    with Client(other, agent="holder", host="h1") as holder:
        run, child = start_victim(other, "h1", victim_py, "ignore", started)    # traps SIGTERM
        wait_for(lambda: [x for x in cluster.leases() if x.pgid], LIVENESS_S, "the run's lease to record its processes")
        held = [holder.acquire(4096), holder.acquire(4096)]     # the holder ignores its notices
        os.kill(leader.pid, signal.SIGSTOP)
        gone = ProcessGone(child)
        drain = gpucoord(other, "host", "drain", "h1", "--grace", "2", "--wait", "--reason", "maintenance")
        ids = {x.id for x in _host_leases(cluster)}
        assert len(ids) == 3
        notices = wait_for(lambda: (n := _notices(cluster)) and ids <= set(n) and n, LIVENESS_S, "the drain's notices")
        assert {notices[i].reason for i in ids} == {"drain"}
        assert len(_host_leases(cluster)) == 3     # (the leader is stopped: nobody revoked yet)
        _kill(leader)                               # the leader dies during the drain, its notices pending
        out, err = drain.communicate(timeout=2 * LIVENESS_S)
        assert drain.returncode == 0, err
        lines = out.splitlines()
        assert lines[0] == "host h1 cordoned: no new lease on it; 3 leases on it, 3 eviction notices sent (reason drain)"
        assert lines[-1] == "host h1 drained: no lease left", lines
        assert ProcessGone.now_gone(child), "the drain returned while the run's child still ran"
        gone.wait(10)
        assert all(x.evicting.is_set() and x.notice is not None and x.notice.reason == "drain" for x in held)
        run.communicate(timeout=30)
        _assert_drained(cluster, other, leader_id)


def test_a_drain_cut_short_before_its_notices_is_finished_by_the_new_leader(
        cluster: Cluster, replicas: dict[str, Any]) -> None:
    """The drain's replica died between its cordon and its notices (the cordon written as a drain leaves it), and
    the leader dies before its sweep sends them (stopped first): the next leader sends them and revokes."""
    cluster.start_node("h1", "2x16GiB")
    cluster.start_node("h2", "1x16GiB")
    leader, leader_id, other = _leader(replicas)
    with Client(other, agent="holder", host="h1") as holder:
        held = [holder.acquire(4096), holder.acquire(4096)]
        os.kill(leader.pid, signal.SIGSTOP)
        record = CordonRecord(host="h1", reason="reboot", drain=True, grace_s=1.0, asked_by="ops",
                              created_at=time.time())
        cluster.lt.run(cluster.store.put(cluster.keys.cordon("h1"), dumps(record.to_json())))
        _kill(leader)
        for lease in held:
            assert lease.evicting.wait(2 * LIVENESS_S), "no drain notice from the next leader"
            assert lease.notice is not None and lease.notice.reason == "drain"
        wait_for(lambda: not _host_leases(cluster), LIVENESS_S, "the next leader's revokes")
        waited = gpucoord(other, "host", "drain", "h1", "--wait")
        out, err = waited.communicate(timeout=LIVENESS_S)
        assert waited.returncode == 0 and out.splitlines()[-1] == "host h1 drained: no lease left", (out, err)
        _assert_drained(cluster, other, leader_id)
