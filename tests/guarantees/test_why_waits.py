"""Why a request waits, and until when (issue 31 point 5, docs/policies.md "Why a request waits"), against a real etcd, a
coordinator and a simulated node: the status's queue entries carry their position, a reason naming what blocks
them (the lease, with its end; the request ahead; the cordon; the team's limit) and, where the blocking lease
has a time limit, an estimated start, compared with the grant observed in the same run. Every lease a reason
names exists at the status's revision (read from etcd's history). ``gpucoord queue`` and ``status --json``
print the fields; a bad host is refused with the documented exit codes."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from typing import Any

import pytest

from agent_client import Client
from agent_client.api import coordinator_pb2 as pb
from tests.history import read_history
from tests.support import REPO
from tests.support.cluster import Cluster, queue
from tests.support.processes import child_env
from tests.support.rpcs import coordinator_stub
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]
LIVENESS_S = 60.0
WAIT_S = 300.0   # the waiters outlast the test: its CLI calls take seconds each on a loaded machine


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *args], capture_output=True, text=True,
                          env=child_env(), cwd=REPO, timeout=60)


def _fleet(cluster: Cluster, **config: Any) -> str:
    addr = cluster.start_coordinator(**config)
    wait_for(lambda: cluster.get_prefix(cluster.keys.election()), 10, "the coordinator's election key")
    cluster.start_node("h1", "1x16GiB")
    wait_for(lambda: cluster.get_prefix(cluster.keys.host("h1")), 10, "host h1 to register")
    return addr


def _entries(addr: str) -> tuple[int, list[Any]]:
    resp = coordinator_stub(addr).GetStatus(pb.GetStatusRequest(host="h1"), timeout=10)
    return resp.revision, list(resp.hosts[0].queue)


def _wait_in_background(c: Client, vram_mb: int, got: list[Any]) -> threading.Thread:
    """``c`` waits for ``vram_mb``; its lease, or the error it got, is appended to ``got``."""
    def wait() -> None:
        try:
            got.append(c.acquire(vram_mb, wait=WAIT_S))
        except Exception as e:   # noqa: BLE001 - the test asserts what the thread got
            got.append(e)
    t = threading.Thread(target=wait, daemon=True)
    t.start()
    return t


def _named_leases_exist_at(cluster: Cluster, revision: int, entries: list[Any]) -> None:
    """History rule: every lease a reason names was live at the revision the status was read at."""
    live: set[str] = set()
    leases = cluster.keys.leases()
    for ev in cluster.lt.run(read_history(cluster.store, cluster.keys.root())):   # (its sentinel: not in leases/)
        if ev.kv.mod_revision > revision:
            break
        if not ev.kv.key.startswith(leases):
            continue
        lease_id = ev.kv.key.decode().rsplit("/", 1)[-1]
        (live.discard if ev.kind == "DELETE" else live.add)(lease_id)
    named = {b.lease_id for e in entries for b in e.blockers if b.kind == "lease"}
    assert named and named <= live, (named, live, revision)


def test_a_lease_with_a_time_limit_is_named_and_the_estimate_is_within_1s_of_the_grant(cluster: Cluster) -> None:
    """The acceptance line's scene: a holds 12 GiB of the 16 GiB GPU for 3 s and does not release; b waits for
    8 GiB. b's reason names a's lease; its estimate (a's end + the kill margin, when the leader revokes it) is
    within 1 s of the grant this run observes (the granted record's created_at: the same machine's clock)."""
    addr = _fleet(cluster, time_limit_warning_s=1.0)
    with Client(addr, agent="agent-a", host="h1") as a, Client(addr, agent="agent-b", host="h1") as b:
        held = a.acquire(12000, time_limit=3)
        (record,) = cluster.leases()
        got: list[Any] = []
        waiter = _wait_in_background(b, 8000, got)
        wait_for(lambda: len(queue(cluster)) == 1, 10, "b's request to wait")
        revision, (entry,) = _entries(addr)
        assert entry.agent == "agent-b" and entry.position == 1
        assert held.id in entry.reason and "estimated start in" in entry.reason
        (blocker,) = [x for x in entry.blockers if x.kind == "lease"]
        assert (blocker.lease_id, blocker.agent, list(blocker.gpus)) == (held.id, "agent-a", [0])
        assert entry.has_estimate
        margin = cluster.config().eviction_kill_margin_s
        assert entry.estimated_start_unix == pytest.approx(record.created_at + 3 + margin, abs=1e-3)
        assert blocker.ends_at_unix == pytest.approx(entry.estimated_start_unix, abs=1e-3)
        _named_leases_exist_at(cluster, revision, [entry])
        waiter.join(LIVENESS_S)
        assert got and not isinstance(got[0], Exception), got
        (granted,) = [x for x in cluster.leases() if x.id == got[0].id]
        assert abs(granted.created_at - entry.estimated_start_unix) <= 1.0, (granted.created_at,
                                                                             entry.estimated_start_unix)
        got[0].release()


def test_position_the_request_ahead_a_cordon_and_the_cli(cluster: Cluster) -> None:
    """a holds 12 GiB without a limit; b then c wait for 8 GiB: b is first, blocked by a's lease with no
    estimate; c is second, blocked by b's request too. A cordon is named with its reason. ``gpucoord queue``
    (table and --json) and ``status --json`` carry the fields; a bad or unknown host exits 2 or 1."""
    addr = _fleet(cluster)
    with Client(addr, agent="agent-a", host="h1") as a, Client(addr, agent="agent-b", host="h1") as b, \
            Client(addr, agent="agent-c", host="h1") as c:
        held = a.acquire(12000)
        got: list[Any] = []
        first = _wait_in_background(b, 8000, got)
        wait_for(lambda: len(queue(cluster)) == 1, 10, "b's request to wait")
        second = _wait_in_background(c, 8000, got)
        wait_for(lambda: len(queue(cluster)) == 2, 10, "c's request to wait")
        revision, (eb, ec) = _entries(addr)
        assert (eb.agent, eb.position, ec.agent, ec.position) == ("agent-b", 1, "agent-c", 2)
        assert held.id in eb.reason and not eb.has_estimate and "no estimated start" in eb.reason
        (ahead,) = [x for x in ec.blockers if x.kind == "ahead"]
        assert (ahead.agent, ahead.rank) == ("agent-b", eb.rank) and "position 2 of 2" in ec.reason
        _named_leases_exist_at(cluster, revision, [eb, ec])

        out = _cli("queue", "--host", "h1", "--json", "--coordinator", addr)
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert [(q["agent"], q["position"]) for q in doc["waiting"]] == [("agent-b", 1), ("agent-c", 2)]
        assert doc["waiting"][0]["estimated_start_unix"] is None and held.id in doc["waiting"][0]["reason"]
        table = _cli("queue", "--coordinator", addr)
        assert table.returncode == 0 and "agent-b" in table.stdout and "unknown" in table.stdout, table
        status = json.loads(_cli("status", "--json", "--coordinator", addr).stdout)
        (q1, _) = status["hosts"][0]["queue"]
        assert {"position", "reason", "blockers", "estimated_start_unix", "has_estimate"} <= set(q1)
        assert q1["blockers"][0]["lease_id"] == held.id and q1["blockers"][0]["kind"] == "lease"
        assert held.id in _cli("status", "--coordinator", addr).stdout.split("waiting: agent-b")[1]

        bad = _cli("queue", "--host", "a/b", "--coordinator", addr)
        assert bad.returncode == 2 and "--host" in bad.stderr, bad
        unknown = _cli("queue", "--host", "nowhere", "--coordinator", addr)
        assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr and "host" in unknown.stderr, unknown

        stub = coordinator_stub(addr)
        stub.CordonHost(pb.CordonHostRequest(host="h1", reason="driver upgrade"), timeout=10)
        _, (eb, _) = _entries(addr)
        assert eb.blockers[0].kind == "cordon" and "driver upgrade" in eb.reason and not eb.has_estimate
        stub.UncordonHost(pb.UncordonHostRequest(host="h1"), timeout=10)
        held.release()            # both fit then (8 + 8 GiB), granted in any order
        first.join(LIVENESS_S)
        second.join(LIVENESS_S)
        assert len(got) == 2 and not any(isinstance(x, Exception) for x in got), got
        for x in got:
            x.release()


def test_a_request_its_teams_limit_holds_back_names_the_team(cluster: Cluster) -> None:
    """Team t (limit 4 GiB) holds 4 GiB; a member's 1 GiB request waits for its team, though the GPU has room:
    its reason names the team and the limit, with no estimate."""
    addr = _fleet(cluster)
    coordinator_stub(addr).SetTeam(pb.SetTeamRequest(name="t", limit_mb=4096,
                                                     members=pb.TeamMembers(patterns=["t-*"])), timeout=10)
    with Client(addr, agent="t-1", host="h1") as t1, Client(addr, agent="t-2", host="h1") as t2:
        held = t1.acquire(4096)
        got: list[Any] = []
        waiter = _wait_in_background(t2, 1024, got)
        wait_for(lambda: len(queue(cluster)) == 1, 10, "t-2's request to wait")
        _, (entry,) = _entries(addr)
        assert [x.kind for x in entry.blockers] == ["team"], entry
        assert "team 't'" in entry.reason and "4096" in entry.reason and not entry.has_estimate
        held.release()
        waiter.join(LIVENESS_S)
        assert got and not isinstance(got[0], Exception), got
        got[0].release()
