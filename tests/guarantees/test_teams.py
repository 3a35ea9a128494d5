"""G11, teams as operator-managed state: ``gpucoord team set|show|list|delete`` through the coordinator's
operator RPCs, against a real etcd and a real gRPC server. A bad team is refused naming the field with
nothing written; no two teams claim the same member pattern at any revision, even when two replicas race."""
from __future__ import annotations

import json
import threading
from typing import Any

import grpc
import pytest

from agent_client import Client, errors
from agent_client.api import coordinator_pb2 as pb
from coordinator import metrics
from coordinator.cli.main import main as cli
from coordinator.policy.teams import Team
from tests.history import read_history
from tests.support.cluster import Cluster, queue
from tests.support.rpcs import coordinator_stub, expect_refused
from tests.support.waiting import Background, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]
C = grpc.StatusCode


def _team(cluster: Cluster, name: str) -> dict[str, Any] | None:
    kvs = cluster.get_prefix(cluster.keys.team(name))
    return json.loads(kvs[0].value) if kvs else None


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = cli(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_an_operator_sets_shows_lists_and_deletes_a_team(cluster: Cluster,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    cluster.start_node("h1", "2x16GiB", heartbeat_s=3600)
    addr = cluster.start_coordinator()
    rc, out, err = _cli(capsys, "team", "set", "research", "--quota", "16GiB", "--limit", "24GiB", "--weight", "2",
                      "--members", "research-*,alice", "--coordinator", addr)
    assert rc == 0
    assert err == "" and out == ("team research created: quota 16GiB, limit 24GiB, weight 2, members alice, "
                                 "research-*\n")
    assert _team(cluster, "research") == {"name": "research", "quota_mb": 16384, "limit_mb": 24576, "weight": 2.0,
                                          "members": ["alice", "research-*"], "quota_by_model": {},
                                          "max_min_runtime_s": 0.0}
    # Fields not given keep their values.
    rc, out, _ = _cli(capsys, "team", "set", "research", "--weight", "3", "--coordinator", addr)
    assert rc == 0 and out.startswith("team research changed: quota 16GiB, limit 24GiB, weight 3,")
    stored = _team(cluster, "research")
    assert stored is not None and (stored["weight"], stored["quota_mb"], stored["limit_mb"]) == (3.0, 16384, 24576)

    with Client(addr, agent="research-1", host="h1") as a, Client(addr, agent="bob", host="h1") as b:
        a.acquire(4096)
        b.acquire(1024)
        rc, out, _ = _cli(capsys, "team", "list", "--json", "--coordinator", addr)
        rows = {r["team"]["name"]: r for r in json.loads(out)}
        assert rows["research"]["usage"]["used_mb"] == 4096 and rows["research"]["stored"]
        assert rows["default"]["usage"]["used_mb"] == 1024 and not rows["default"]["stored"]
        rc, out, _ = _cli(capsys, "team", "show", "research", "--coordinator", addr)
        assert rc == 0
        assert out.split("\n")[0].split() == ["TEAM", "QUOTA", "LIMIT", "USED", "BORROWED", "WAITING", "WEIGHT",
                                              "DECAYED", "MEMBERS"]
        row = out.split("\n")[1].split()
        assert row[:10] + row[11:] == ["research", "16GiB", "24GiB", "4GiB", "(1)", "0MiB", "(0)", "0MiB", "(0)", "3",
                                      "alice,research-*"]
        assert row[10].endswith("h") and float(row[10][:-1]) >= 0.0   # its live lease's decayed GPU-hours

    rc, out, _ = _cli(capsys, "team", "delete", "research", "--coordinator", addr)
    assert rc == 0 and _team(cluster, "research") is None
    rc, _, err = _cli(capsys, "team", "show", "research", "--coordinator", addr)
    assert rc == 1 and "NOT_FOUND: name: no team 'research'" in err
    rc, _, err = _cli(capsys, "team", "delete", "research", "--coordinator", addr)
    assert rc == 1 and "NOT_FOUND" in err


def test_a_team_over_its_quota_shows_what_it_borrows(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    cluster.start_node("h1", "2x16GiB", heartbeat_s=3600)
    addr = cluster.start_coordinator()
    assert _cli(capsys, "team", "set", "a", "--quota", "6GiB", "--members", "a-*", "--coordinator", addr)[0] == 0
    with Client(addr, agent="a-1", host="h1") as a:
        for _ in range(3):
            a.acquire(4096)
        row = coordinator_stub(addr).GetTeam(pb.GetTeamRequest(name="a"), timeout=10).team
        assert (row.usage.used_mb, row.usage.borrowed_mb, row.usage.leases, row.usage.over_quota_leases) == \
            (12288, 6144, 3, 2)


def test_status_shows_each_teams_quota_limit_use_borrowing_and_waiting(cluster: Cluster,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    cluster.start_node("h1", "1x16GiB", heartbeat_s=3600)
    addr = cluster.start_coordinator()
    rc, out, _ = _cli(capsys, "status", "--coordinator", addr)
    assert rc == 0 and "teams:" not in out          # no team configured: status as before
    assert _cli(capsys, "team", "set", "a", "--quota", "6GiB", "--limit", "14GiB", "--members", "a-*",
                "--coordinator", addr)[0] == 0
    with Client(addr, agent="a-1", host="h1") as a, Client(addr, agent="bob", host="h1") as b:
        held = [a.acquire(4096) for _ in range(3)]
        waiter = Background(b.acquire, 8192, wait=30)
        wait_for(lambda: queue(cluster), 10, "bob's request to wait")
        rc, out, _ = _cli(capsys, "status", "--json", "--coordinator", addr)
        rows = {r["team"]["name"]: r for r in json.loads(out)["teams"]}
        decayed = rows["a"]["usage"].pop("decayed_gpu_hours")   # its live leases' GPU-hours, decayed (a few seconds' worth)
        assert 0 <= decayed < 1.0
        assert rows["a"]["usage"] == {"used_mb": 12288, "borrowed_mb": 6144, "waiting_mb": 0, "leases": 3,
                                      "over_quota_leases": 2, "waiting": 0}
        assert rows["default"]["usage"]["waiting_mb"] == 8192 and rows["default"]["usage"]["waiting"] == 1
        rc, out, _ = _cli(capsys, "status", "--coordinator", addr)
        table = out.split("teams:\n")[1].splitlines()
        row = table[1].split()
        assert row[:10] + row[11:] == ["a", "6GiB", "14GiB", "12GiB", "(3)", "6GiB", "(2)", "0MiB", "(0)", "1", "a-*"]
        assert row[10].endswith("h")   # DECAYED: its decayed GPU-hours
        assert table[2].split()[:2] == ["default", "(no"] and table[2].split()[9:11] == ["8GiB", "(1)"]
        sample = metrics.REGISTRY.get_sample_value
        # The gauges follow the replica's watch (not the status reads above).
        wait_for(lambda: [sample("gpucoord_team_vram_bytes", {"team": "a", "kind": k}) for k in
                          ("quota", "limit", "used", "borrowed", "waiting")] == [m * metrics.MIB for m in
                                                                                 (6144, 14336, 12288, 6144, 0)]
                 and sample("gpucoord_team_vram_bytes", {"team": "default", "kind": "waiting"}) == 8192 * metrics.MIB, 10,
                 "the team gauges")
        assert sample("gpucoord_team_vram_bytes", {"team": "default", "kind": "limit"}) is None
        # A host's status alone has no team table: a team's use is over the fleet.
        rc, out, _ = _cli(capsys, "status", "--json", "--host", "h1", "--coordinator", addr)
        assert json.loads(out)["teams"] == []
        for lease in held:
            lease.release()
        waiter.result().release()


BAD = [
    (pb.SetTeamRequest(name="t", quota_mb=100, limit_mb=50), "limit_mb"),
    (pb.SetTeamRequest(name="t", weight=0), "weight"),
    (pb.SetTeamRequest(name="t", quota_mb=-1), "quota_mb"),
    (pb.SetTeamRequest(name="t", members=pb.TeamMembers(patterns=["a/b"])), "members"),
    (pb.SetTeamRequest(name="t", members=pb.TeamMembers(patterns=["a b"])), "members"),
    (pb.SetTeamRequest(name="t", quota_mb=10, quota_by_model=pb.TeamModelQuotas(mb={"H100": 20})), "quota_by_model"),
    (pb.SetTeamRequest(name="t", max_min_runtime_seconds=-1), "max_min_runtime_s"),
    (pb.SetTeamRequest(name="a/b"), "name"),
    (pb.SetTeamRequest(name=""), "name"),
    (pb.SetTeamRequest(name="default", members=pb.TeamMembers(patterns=["x"])), "members"),
]


@pytest.mark.parametrize(("request_", "field"), BAD, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD)])
def test_a_bad_team_is_refused_naming_the_field_and_nothing_is_written(cluster: Cluster, request_: Any,
                                                                       field: str) -> None:
    addr = cluster.start_coordinator()
    stub = coordinator_stub(addr)
    expect_refused(cluster, lambda: stub.SetTeam(request_, timeout=10), C.INVALID_ARGUMENT, field)


def test_a_change_that_breaks_the_stored_team_is_refused_and_keeps_it(cluster: Cluster) -> None:
    stub = coordinator_stub(cluster.start_coordinator())
    stub.SetTeam(pb.SetTeamRequest(name="t", quota_mb=100, limit_mb=200), timeout=10)
    expect_refused(cluster, lambda: stub.SetTeam(pb.SetTeamRequest(name="t", quota_mb=300), timeout=10),
                   C.INVALID_ARGUMENT, "limit_mb")
    assert stub.SetTeam(pb.SetTeamRequest(name="t", quota_mb=300, limit_mb=-1), timeout=10).team.has_limit is False


def test_two_teams_never_claim_the_same_member_pattern(cluster: Cluster) -> None:
    stub = coordinator_stub(cluster.start_coordinator())
    stub.SetTeam(pb.SetTeamRequest(name="a", members=pb.TeamMembers(patterns=["research-*"])), timeout=10)
    expect_refused(cluster, lambda: stub.SetTeam(pb.SetTeamRequest(
        name="b", members=pb.TeamMembers(patterns=["bob", "research-*"])), timeout=10),
        C.FAILED_PRECONDITION, "members: 'research-*' already belongs to team 'a'")
    # A longer prefix is another pattern: the longest match decides membership.
    stub.SetTeam(pb.SetTeamRequest(name="b", members=pb.TeamMembers(patterns=["research-gpu-*"])), timeout=10)


def test_replicas_racing_to_claim_one_pattern_never_share_it_at_any_revision(cluster: Cluster) -> None:
    """Two replicas, eight operators, each setting its own team to claim the same pattern at once: exactly one
    wins, and etcd's history shows no revision at which two teams held the pattern."""
    stubs = [coordinator_stub(cluster.start_coordinator()) for _ in range(2)]
    start = threading.Barrier(8)
    outcomes: list[str] = []

    def claim(i: int) -> None:
        start.wait()
        try:
            stubs[i % 2].SetTeam(pb.SetTeamRequest(name=f"t{i}", members=pb.TeamMembers(patterns=["x-*"])),
                                 timeout=20)
            outcomes.append("won")
        except grpc.RpcError as e:
            assert e.code() == C.FAILED_PRECONDITION, e.details()
            outcomes.append("refused")

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(outcomes) == ["refused"] * 7 + ["won"]
    events = cluster.lt.run(read_history(cluster.store, cluster.keys.teams()))
    live: dict[bytes, Team] = {}
    for ev in events:
        if ev.kind == "DELETE":
            live.pop(ev.kv.key, None)
        else:
            live[ev.kv.key] = Team.from_kv(ev.kv)
        claimed = [p for t in live.values() for p in t.members]
        assert len(claimed) == len(set(claimed)), f"revision {ev.kv.mod_revision}: {claimed}"
    assert len(live) == 1


# -- admission charges the team (G11) ---------------------------------------------------------------------------

def test_a_team_at_its_limit_is_refused_naming_team_and_limit(cluster: Cluster) -> None:
    cluster.start_node("h1", "2x16GiB", heartbeat_s=3600)
    addr = cluster.start_coordinator()
    coordinator_stub(addr).SetTeam(pb.SetTeamRequest(name="a", quota_mb=4096, limit_mb=8192,
                                                     members=pb.TeamMembers(patterns=["a-*"])), timeout=10)
    with Client(addr, agent="a-1", host="h1") as a, Client(addr, agent="bob", host="h1") as b:
        first = a.acquire(4096)
        a.acquire(4096, gpu=1)
        before = cluster.state()
        with pytest.raises(errors.ResourceExhausted) as info:
            a.acquire(1024)
        assert "team: team 'a' uses 8192 MiB; 1024 MiB more would pass its limit of 8192 MiB" in str(info.value)
        assert cluster.state() == before
        b.acquire(8192)                        # another team (default, no limit) is not held back
        first.release()
        a.acquire(4096)                        # room under the limit again
    ledger = cluster.get_prefix(cluster.keys.team_ledger("a"))
    assert json.loads(ledger[0].value) == {"seq": 3}   # every grant charged to the limited team bumped it


def test_replicas_racing_on_four_hosts_never_take_a_team_above_its_limit(cluster: Cluster) -> None:
    """Twelve agents of one team (limit 3 x 4 GiB) acquire at once through two replicas on four hosts, in four
    rounds: each round three are granted and the rest refused naming the team, and at no revision of etcd's
    history does the team hold more than its limit."""
    hosts = ("h1", "h2", "h3", "h4")
    for host in hosts:
        cluster.start_node(host, "2x16GiB", heartbeat_s=3600)
    addrs = [cluster.start_coordinator() for _ in range(2)]
    coordinator_stub(addrs[0]).SetTeam(pb.SetTeamRequest(name="a", limit_mb=3 * 4096,
                                                         members=pb.TeamMembers(patterns=["a-*"])), timeout=10)
    clients = [Client(addrs[i % 2], agent=f"a-{i}", host=hosts[i % 4]) for i in range(12)]

    def acquire(c: Client, start: threading.Barrier, outcomes: list[Any]) -> None:
        start.wait()
        try:
            outcomes.append(c.acquire(4096))
        except errors.ResourceExhausted as e:
            assert "team 'a'" in str(e) and "limit of 12288 MiB" in str(e), str(e)
            outcomes.append("refused")

    try:
        for _ in range(4):
            start, outcomes = threading.Barrier(len(clients)), []
            threads = [threading.Thread(target=acquire, args=(c, start, outcomes)) for c in clients]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            granted = [x for x in outcomes if x != "refused"]
            assert len(granted) == 3 and len(outcomes) == len(clients), outcomes
            for lease in granted:
                lease.release()
        events = cluster.lt.run(read_history(cluster.store, cluster.keys.leases()))
        live: dict[bytes, int] = {}
        for ev in events:
            if ev.kind == "DELETE":
                live.pop(ev.kv.key, None)
            else:
                live[ev.kv.key] = json.loads(ev.kv.value)["vram_mb"]
            assert sum(live.values()) <= 3 * 4096, f"revision {ev.kv.mod_revision}: team a holds {live}"
    finally:
        for c in clients:
            c.close()


def test_changing_a_team_while_its_leases_run_revokes_nothing_and_holds_for_new_grants(cluster: Cluster) -> None:
    """Lowering a team's limit (and quota) below what it holds touches none of its leases; new grants follow
    the new values."""
    cluster.start_node("h1", "2x16GiB", heartbeat_s=3600)
    addr = cluster.start_coordinator()
    stub = coordinator_stub(addr)
    stub.SetTeam(pb.SetTeamRequest(name="a", quota_mb=8192, limit_mb=16384,
                                   members=pb.TeamMembers(patterns=["a-*"])), timeout=10)
    with Client(addr, agent="a-1", host="h1") as a:
        held = [a.acquire(4096) for _ in range(3)]
        leases_before = cluster.state()
        stub.SetTeam(pb.SetTeamRequest(name="a", quota_mb=2048, limit_mb=4096), timeout=10)
        assert {k for k, _ in cluster.state() if b"/leases/" in k} == {k for k, _ in leases_before if b"/leases/" in k}
        row = stub.GetTeam(pb.GetTeamRequest(name="a"), timeout=10).team
        assert (row.usage.used_mb, row.usage.borrowed_mb, row.usage.over_quota_leases) == (12288, 10240, 3)
        with pytest.raises(errors.ResourceExhausted, match="limit of 4096 MiB"):
            a.acquire(1024)
        stub.SetTeam(pb.SetTeamRequest(name="a", limit_mb=-1), timeout=10)
        held.append(a.acquire(1024))           # no limit any more
        assert len(cluster.leases()) == 4
