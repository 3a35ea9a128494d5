"""Issue 31's acceptance scene, with a real coordinator process and the ``gpucoord`` command line:
``host drain h1 --grace 2 --wait`` with three leases on h1, one of them a ``gpucoord run`` child that traps
SIGTERM. The command returns once all three are gone, the child first; meanwhile a client that loops acquires on
h1 and on h2 is refused on h1 (FAILED_PRECONDITION naming the host) and keeps being granted on h2, and no lease is
created on h1 (this test's history, and the history checker's cordon rule over it); ``host uncordon`` restores
grants on h1, and a waiter queued during the cordon is granted then."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from agent_client import Client, errors
from tests.history import read_history
from tests.support import REPO
from tests.support.cluster import Cluster
from tests.support.processes import (
    ProcessGone,
    child_env,
    spawn_coordinator,
    stop_process,
)
from tests.support.run_victim import start_victim
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]


def gpucoord(addr: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *args, "--coordinator", addr],
                          capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=timeout)


class Looper:
    """A client that loops acquire-and-release on h1 and h2 (no wait), counting each outcome."""

    def __init__(self, addr: str) -> None:
        self.counts: dict[str, int] = {"h1 granted": 0, "h1 cordoned": 0, "h2 granted": 0}
        self.unexpected: list[str] = []
        self.stop = threading.Event()
        self.clients = {h: Client(addr, agent="looper", host=h) for h in ("h1", "h2")}
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            for host, c in self.clients.items():
                try:
                    c.acquire(1024, request_id=f"loop-{n}").release()
                    self.counts[f"{host} granted"] += 1
                except errors.FailedPrecondition as e:
                    self.counts[f"{host} cordoned"] = self.counts.get(f"{host} cordoned", 0) + 1
                    if host != "h1" or "host: host 'h1' is draining: 'maintenance'" not in str(e):
                        self.unexpected.append(str(e))
                except errors.GpucoordError as e:
                    self.unexpected.append(f"{host}: {e}")

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)
        for c in self.clients.values():
            c.close()


@pytest.fixture
def coordinator(cluster: Cluster, tmp_path: Path) -> Iterator[str]:
    proc, port = spawn_coordinator(cluster.endpoints, cluster.prefix, "127.0.0.1:0", str(tmp_path / "c.log"))
    yield f"127.0.0.1:{port}"
    stop_process(proc)


def test_drain_with_wait_empties_the_host_child_first_while_other_hosts_grant_and_uncordon_restores_grants(
        cluster: Cluster, coordinator: str, victim_py: str, started: list[int]) -> None:
    addr = coordinator
    cluster.start_node("h1", "3x16GiB")
    cluster.start_node("h2", "1x16GiB")
    run, child = start_victim(addr, "h1", victim_py, "ignore", started)   # traps SIGTERM
    wait_for(lambda: [x for x in cluster.leases() if x.pgid], 20, "the run's lease to record its processes")
    holder = Client(addr, agent="holder", host="h1")
    held = [holder.acquire(4096), holder.acquire(4096)]
    looper = Looper(addr)
    try:
        wait_for(lambda: looper.counts["h1 granted"] and looper.counts["h2 granted"], 30, "the loop's first grants")
        gone = ProcessGone(child)
        drained = gpucoord(addr, "host", "drain", "h1", "--grace", "2", "--wait", "--reason", "maintenance")
        assert drained.returncode == 0, drained.stderr
        assert ProcessGone.now_gone(child), "the drain returned while the run's child still ran"
        gone.wait(10)
        out = drained.stdout.splitlines()
        # The run's lease and the two held, and the looping client's when the cordon caught one of its leases on
        # h1 between its acquire and its release (which a machine's speed decides; so does whether that lease
        # was still there for its notice, or its holder released it first).
        first = re.fullmatch(r"host h1 cordoned: no new lease on it; ([34]) leases on it, ([34]) eviction notices "
                             r"sent \(reason drain\)", out[0])
        assert first is not None and int(first[2]) <= int(first[1]), out[0]
        assert out[1].startswith("draining h1: ") and out[-1] == "host h1 drained: no lease left", out
        assert all(x.evicting.is_set() and x.notice is not None and x.notice.reason == "drain" for x in held)
        assert not [x for x in cluster.leases() if x.host == "h1"]
        run.communicate(timeout=30)
        # Other hosts keep granting while h1 is cordoned; h1 refuses, naming itself and the reason.
        at_drain = dict(looper.counts)
        wait_for(lambda: looper.counts["h2 granted"] >= at_drain["h2 granted"] + 3, 30, "grants on h2")
        wait_for(lambda: looper.counts["h1 cordoned"] > at_drain["h1 cordoned"], 30, "a refusal on h1")
        status = gpucoord(addr, "status", "--host", "h1")
        assert "CORDONED (no new lease until 'gpucoord host uncordon'): maintenance" in status.stdout, status.stdout
        (doc,) = json.loads(gpucoord(addr, "status", "--host", "h1", "--json").stdout)["hosts"]
        assert doc["cordoned"] and not doc["draining"] and doc["cordon"]["reason"] == "maintenance"
        assert doc["cordon"]["drain"] and doc["cordon"]["grace_seconds"] == 2.0, doc["cordon"]
        # A waiter queued on the cordoned host stays queued until the uncordon.
        waiter: list[Any] = []
        w = threading.Thread(target=lambda: waiter.append(holder.acquire(8192, wait=60)), daemon=True)
        w.start()
        wait_for(lambda: cluster.get_prefix(cluster.keys.queue("h1")), 20, "the waiter's queue entry")
        assert not waiter
        h1_granted = looper.counts["h1 granted"]
        undone = gpucoord(addr, "host", "uncordon", "h1")
        assert undone.returncode == 0 and undone.stdout.strip() == "host h1 uncordoned", undone
        w.join(30)
        assert waiter and waiter[0].host == "h1"
        wait_for(lambda: looper.counts["h1 granted"] > h1_granted, 30, "grants on h1 again")
    finally:
        looper.close()
        holder.close()
    assert looper.unexpected == []
    # No lease was created on h1 from the cordon's revision until its delete.
    events = cluster.lt.run(read_history(cluster.store, cluster.keys.root()))
    cordon = [e.kv.mod_revision for e in events if e.kv.key == cluster.keys.cordon("h1")]
    assert len(cordon) == 2   # put by the drain, deleted by the uncordon
    during = [e for e in events if e.kind == "PUT" and e.kv.version == 1 and cordon[0] <= e.kv.mod_revision < cordon[1]
              and e.kv.key.startswith(cluster.keys.leases("h1"))]
    assert during == []
