"""Usage accounting (issue 33): one usage record for every lease that ends, however it ends, checked against
etcd's history (tests/support/history_usage.py): none missing, none twice, GPU-seconds equal to the
history's. With two replicas as processes, the leader SIGKILLed while leases come and go, the next leader
resumes from the cursor and the records are still exactly once."""
from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from agent_client import Client
from coordinator.cli.common import fetch_status
from tests.history import check_store, read_history
from tests.support.cluster import Cluster
from tests.support.history_usage import UsageReport, check_usage
from tests.support.processes import spawn_coordinator
from tests.support.waiting import wait_for


def usage(cluster: Cluster) -> UsageReport:
    return check_usage(cluster.lt.run(read_history(cluster.store, cluster.keys.root()), timeout=120), cluster.keys)


def records(cluster: Cluster) -> dict[str, dict[str, Any]]:
    return {kv.key.decode().rsplit("/", 1)[1]: json.loads(kv.value)
            for kv in cluster.get_prefix(cluster.keys.usage_records())}


def cursor_started(cluster: Cluster) -> bool:
    return bool(cluster.get_prefix(cluster.keys.accounting_cursor()))


def test_every_way_a_lease_ends_leaves_one_record(cluster: Cluster) -> None:
    cluster.start_node("h1", "2x16GiB")
    addr = cluster.start_coordinator(eviction_grace_s=0.5, eviction_kill_margin_s=0.5)
    wait_for(lambda: cursor_started(cluster), 20, "the accountant's cursor")
    with Client(addr, agent="a", host="h1") as a:
        a.acquire(1000, gpu=0).release()
        a.acquire(0, gpu_count=2, exclusive=True).release()
    with Client(addr, agent="b", host="h1") as b:
        b.acquire(2000, gpu=0)
    # b closed its session with its lease: "session".
    with Client(addr, agent="low", host="h1") as low, Client(addr, agent="high", host="h1") as high:
        low.acquire(16000, gpu=1, priority=0)            # it ignores its notice: revoked at the deadline
        high.acquire(16000, gpu=1, priority=5, wait=30).release()
    # a's two releases and high's; b's session; low's eviction.
    def reasons() -> dict[str, int]:
        out: dict[str, int] = {}
        for r in records(cluster).values():
            out[r["reason"]] = out.get(r["reason"], 0) + 1
        return out
    wait_for(lambda: reasons() == {"release": 3, "session": 1, "eviction": 1}, 30,
             "records of the five leases that ended")
    gang = [r for r in records(cluster).values() if len(r["gpus"]) == 2]
    assert len(gang) == 1 and gang[0]["exclusive"] and gang[0]["gpu_seconds"] == pytest.approx(
        2 * (gang[0]["end_unix"] - gang[0]["start_unix"]), abs=0.002)
    rep = usage(cluster)
    rep.assert_ok()
    assert rep.ended == rep.records == 5


@pytest.fixture
def two_replicas(cluster: Cluster, tmp_path: Path) -> dict[str, Any]:
    procs = []
    for i in range(2):
        proc, port = spawn_coordinator(cluster.endpoints, cluster.prefix, "127.0.0.1:0", str(tmp_path / f"c{i}.log"),
                                       extra=["--grace", "1"])
        procs.append((proc, f"127.0.0.1:{port}"))
    by_id: dict[str, Any] = {}

    def registered() -> bool:
        for kv in cluster.get_prefix(cluster.keys.coordinators()):
            info = json.loads(kv.value)
            for proc, addr in procs:
                if info["address"] == addr:
                    by_id[info["replica"]] = (proc, addr)
        return len(by_id) == 2
    wait_for(registered, 20, "both replicas to register")
    yield by_id
    for proc, _ in procs:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(10)


def test_records_stay_exactly_once_when_the_leader_is_killed(cluster: Cluster, two_replicas: dict[str, Any]) -> None:
    cluster.start_node("h1", "4x16GiB")
    addrs = [addr for _, addr in two_replicas.values()]
    leader_id = wait_for(lambda: str(fetch_status(addrs[0]).get("leader", "")), 20, "a leader")
    leader_proc, leader_addr = two_replicas[leader_id]
    (follower_addr,) = [a for a in addrs if a != leader_addr]
    wait_for(lambda: cursor_started(cluster), 20, "the accountant's cursor")
    stop = threading.Event()
    ended = [0]

    def churn(agent: str) -> None:
        with Client(follower_addr, agent=agent, host="h1") as c:
            while not stop.is_set():
                c.acquire(1000).release()
                ended[0] += 1
    threads = [threading.Thread(target=churn, args=(f"agent-{i}",), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    wait_for(lambda: len(records(cluster)) >= 10, 30, "records while the first leader accounts")
    os.kill(leader_proc.pid, signal.SIGKILL)           # mid-run: the accountant dies between two commits, or in one
    leader_proc.wait()

    def next_leader() -> bool:
        leader = str(fetch_status(follower_addr).get("leader", ""))
        return bool(leader) and leader != leader_id
    wait_for(next_leader, 30, "the next leader")
    seen = ended[0]
    wait_for(lambda: ended[0] >= seen + 20, 60, "leases ending under the next leader")
    stop.set()
    for t in threads:
        t.join(30)
    wait_for(lambda: len(records(cluster)) >= ended[0], 60, "a record for every lease that ended")
    rep = usage(cluster)
    rep.assert_ok()
    assert rep.ended == rep.records == ended[0]
    cluster.lt.run(check_store(cluster.store, cluster.keys), timeout=240).assert_ok()
