"""One surface against a real cluster (issue 28's smaller points, issue 29 point 5): an exclusive waiter in
``team list`` counts what its grant would be charged and shows its shape in ``status``; its wait that ends
names it; a request its team's limit could never let in is refused at once, though it asked to wait;
``--json`` numbers are numbers and objects are objects (``numa_node`` null when unknown); a history read
twice on a prefix replays everything up to its own sentinel."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from agent_client import Client
from agent_client import errors as client_errors
from tests.history import read_history
from tests.support import REPO
from tests.support.cluster import Cluster
from tests.support.processes import child_env
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

SPEC = 'host = "h1"\nmode = "manual"\nagents = ["x", "y"]\n[allocations.x]\nvram = { 0 = "16GiB" }\n' \
       '[allocations.y]\nvram = { 0 = "16GiB" }\n'


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *args], capture_output=True, text=True,
                          env=child_env(), cwd=REPO, timeout=60)


def test_an_exclusive_waiter_is_charged_shown_and_answered_by_its_shape(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    spec = tmp_path / "p.toml"
    spec.write_text(SPEC)
    assert cli("partition", "apply", str(spec), "--coordinator", addr).returncode == 0
    made = cli("team", "set", "t", "--members", "x", "--limit", "1PiB", "--model-quota", "sim=1GiB",
               "--quota", "2GiB", "--coordinator", addr)
    assert made.returncode == 0 and "limit 1PiB" in made.stdout, made.stdout + made.stderr
    with Client(addr, agent="y", host="h1") as blocker, Client(addr, agent="x", host="h1") as waiter:
        held = blocker.acquire(1024)
        with pytest.raises(client_errors.ResourceExhausted) as over:
            waiter.acquire(exclusive=True, wait=0.3)
        assert "exclusive: 1 whole GPU did not fit after waiting 0.3 s" in over.value.message
        got: list[object] = []
        thread = threading.Thread(target=lambda: got.append(waiter.acquire(exclusive=True, wait=120)))
        thread.start()
        try:
            def waiting() -> dict[str, object]:
                rows = json.loads(cli("team", "list", "--json", "--coordinator", addr).stdout)
                (row,) = [r for r in rows if r["team"]["name"] == "t"]
                return row if row["usage"]["waiting"] == 1 else {}
            row = wait_for(waiting, 30, "the exclusive request to wait")
            assert row["usage"]["waiting_mb"] == 16384                       # the GPU's whole usable VRAM
            assert row["team"]["quota_by_model_mb"] == {"sim": 1024}        # a map of numbers, not strings
            listed = cli("team", "list", "--coordinator", addr).stdout
            assert "16GiB (1)" in listed and "1PiB" in listed, listed
            table = cli("status", "--coordinator", addr).stdout
            assert "waiting: x 1 whole GPU gpu=any priority 0" in table, table
            doc = json.loads(cli("status", "--json", "--coordinator", addr).stdout)
            (host,) = doc["hosts"]
            assert host["gpus"][0]["numa_node"] is None
            assert {a["agent"]: a["allocation"]["vram_caps_mb"] for a in host["agents"]}["x"] == [
                ["GPU-sim-h1-0", 16384]]
            assert "allocation_json" not in host["agents"][0]
        finally:
            held.release()
            thread.join(60)
        assert got and not thread.is_alive()


def test_a_request_its_teams_limit_never_allows_is_refused_at_once_though_it_would_wait(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    assert cli("team", "set", "t", "--members", "x", "--limit", "4GiB", "--coordinator", addr).returncode == 0
    with Client(addr, agent="x", host="h1") as c:
        with pytest.raises(client_errors.FailedPrecondition) as e:
            c.acquire(8192, wait=600)
        assert e.value.field == "team" and "more than the limit of team 't' (4096 MiB)" in e.value.message
        assert c.acquire(4096).vram_mb == 4096


def test_a_history_read_twice_replays_everything_before_its_own_sentinel(cluster: Cluster) -> None:
    root = cluster.keys.root()

    async def go() -> tuple[int, int]:
        await cluster.store.put(root + b"a", b"{}")
        first = await read_history(cluster.store, root)
        await cluster.store.put(root + b"b", b"{}")
        second = await read_history(cluster.store, root)
        assert root + b"b" in {ev.kv.key for ev in second}, "the second read stopped at the first sentinel"
        return len(first), len(second)
    first, second = cluster.lt.run(go())
    assert second >= first + 2      # b, and the first read's sentinel
