"""Faults with real processes: the leader dies with an eviction deadline pending; a replica dies while it
serves a waiter. Both end with the history checker."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from agent_client import Client
from coordinator.cli.common import fetch_status
from coordinator.records import QueueEntry
from tests.harness import Cluster, spawn_coordinator, wait_for
from tests.history import check_store

pytestmark = [pytest.mark.integration, pytest.mark.fault]


@pytest.fixture
def replicas(cluster: Cluster, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Two coordinator processes; maps replica id -> (process, address)."""
    procs = []
    for i in range(2):
        proc, port = spawn_coordinator(cluster.endpoints, cluster.prefix, "127.0.0.1:0", str(tmp_path / f"c{i}.log"),
                                       extra=["--grace", "3"])
        procs.append((proc, f"127.0.0.1:{port}"))
    by_id: dict[str, Any] = {}

    def registered() -> bool:
        for kv in cluster.get_prefix(cluster.keys.coordinators()):
            info = json.loads(kv.value)
            for proc, addr in procs:
                if info["address"].endswith(addr.rsplit(":", 1)[1]) and info["address"] == addr:
                    by_id[info["replica"]] = (proc, addr)
        return len(by_id) == 2
    wait_for(registered, 10, "both replicas to register")
    try:
        yield by_id
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(10)
    cluster.lt.run(check_store(cluster.store, cluster.keys)).assert_ok()


def _leader(addr: str) -> str:
    return str(fetch_status(addr).get("leader", ""))


def test_new_leader_enforces_a_pending_eviction_deadline(cluster: Cluster, replicas: dict[str, Any]) -> None:
    cluster.start_node("h1", "1x8GiB")
    addrs = [addr for _, addr in replicas.values()]
    leader_id = wait_for(lambda: _leader(addrs[0]), 10, "a leader")
    leader_proc, leader_addr = replicas[leader_id]
    (follower_addr,) = [a for a in addrs if a != leader_addr]
    with Client(follower_addr, agent="low", host="h1") as low, Client(follower_addr, agent="high", host="h1") as high:
        victim = low.acquire(8000, priority=0)          # it will ignore its notice
        result: dict[str, Any] = {}

        def take() -> None:
            result["lease"] = high.acquire(6000, priority=5, wait=30)
        t = threading.Thread(target=take, daemon=True)
        t.start()
        wait_for(lambda: victim.evicting.is_set(), 5, "the eviction notice")
        deadline = victim.notice.deadline_unix
        os.kill(leader_proc.pid, signal.SIGKILL)       # the leader dies with the deadline pending
        leader_proc.wait()
        t.join(30)
        assert "lease" in result, "the waiter was never granted: the deadline was lost"
        granted_at = time.time()
        assert granted_at >= deadline - 0.1
        assert [x.id for x in cluster.leases()] == [result["lease"].id]
        assert wait_for(lambda: _leader(follower_addr), 10, "a new leader") != leader_id


def test_waiter_survives_the_death_of_its_replica(cluster: Cluster, replicas: dict[str, Any]) -> None:
    cluster.start_node("h1", "1x8GiB")
    (first_proc, first), (_, second) = list(replicas.values())
    with Client(second, agent="holder", host="h1") as holder, \
            Client([first, second], agent="waiter", host="h1", ttl=10) as waiter:
        held = holder.acquire(8000, preemptible=False)
        result: dict[str, Any] = {}

        def take() -> None:
            result["lease"] = waiter.acquire(4000, wait=30, request_id="survivor")
        t = threading.Thread(target=take, daemon=True)
        t.start()
        entries = lambda: [QueueEntry.from_kv(kv) for kv in cluster.get_prefix(cluster.keys.queue("h1"))]  # noqa: E731
        wait_for(lambda: len(entries()) == 1, 5, "the waiter to be queued")
        rank, served_by = entries()[0].rank, entries()[0].replica
        os.kill(first_proc.pid, signal.SIGKILL)
        first_proc.wait()
        # The client retries through the other replica with the same request_id and keeps its place.
        wait_for(lambda: entries() and entries()[0].replica != served_by, 10, "the retry to attach")
        assert entries()[0].rank == rank
        held.release()
        t.join(15)
        assert result["lease"].vram_mb == 4000
        assert not waiter.expired
