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
from typing import Any, Iterator

import pytest

from agent_client import Client
from coordinator.cli.common import fetch_status
from coordinator.cli.main import main as cli_main
from tests.history import check_store, read_history
from tests.support.cluster import Cluster
from tests.support.history_usage import UsageReport, check_usage
from tests.support.processes import replica_processes
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
    wait_for(lambda: len(records(cluster)) >= 5, 30, "records of the five leases that ended")
    rep = usage(cluster)
    rep.assert_ok()      # the checker's own reading of each end, GPU-seconds and revisions
    assert rep.ended == rep.records == 5
    reasons: dict[str, int] = {}
    for r in records(cluster).values():
        reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    assert reasons == {"release": 3, "session": 1, "eviction": 1}
    # Who caused each end: the eviction, high's request (its team: default); nobody else's.
    assert sorted((r["reason"], r["caused_by"], r["caused_team"]) for r in records(cluster).values()
                  if r["caused_by"]) == [("eviction", "high", "default")]
    gang = [r for r in records(cluster).values() if len(r["gpus"]) == 2]
    assert len(gang) == 1 and gang[0]["exclusive"]


def test_a_session_that_ends_with_many_leases_is_written_in_parts_exactly_once(cluster: Cluster) -> None:
    """150 leases end in one revision (their session closes): more records than one transaction takes (etcd's
    --max-txn-ops), so the accountant writes them over several, the cursor counting those written."""
    cluster.start_node("h1", "4x16GiB")
    addr = cluster.start_coordinator(max_leases_per_agent=200)
    wait_for(lambda: cursor_started(cluster), 20, "the accountant's cursor")
    with Client(addr, agent="many", host="h1") as c:
        for _ in range(150):
            c.acquire(100)
    wait_for(lambda: len(records(cluster)) >= 150, 60, "150 records")
    cursors = [json.loads(kv.value) for kv in cluster.get_prefix(cluster.keys.accounting_cursor())]
    assert cursors and "skip" not in cursors[0]
    rep = usage(cluster)
    rep.assert_ok()
    assert rep.ended == rep.records == 150
    assert rep.partial_commits >= 1, "one transaction took them all: the test does not cover parts"
    assert {r["reason"] for r in records(cluster).values()} == {"session"}


def test_usage_by_team_equals_the_history(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    """Three teams' leases, of several lengths and GPU counts: ``gpucoord usage --by team`` says what the
    checker computes from etcd's history, to the millisecond; ``--csv`` has its header with units."""
    cluster.start_node("h1", "4x16GiB")
    addr = cluster.start_coordinator()
    for team in ("t1", "t2", "t3"):
        assert cli_main(["team", "set", team, "--members", f"{team}-*", "--coordinator", addr]) == 0
    wait_for(lambda: cursor_started(cluster), 20, "the accountant's cursor")
    with Client(addr, agent="t1-a", host="h1") as a, Client(addr, agent="t2-a", host="h1") as b, \
            Client(addr, agent="t3-a", host="h1") as c:
        held = [a.acquire(4000), b.acquire(0, gpu_count=2, exclusive=True), c.acquire(1000), a.acquire(2000)]
        for lease in held:
            lease.release()
        c.acquire(3000).release()
    wait_for(lambda: len(records(cluster)) >= 5, 30, "the five records")
    rep = usage(cluster)
    rep.assert_ok()
    capsys.readouterr()
    assert cli_main(["usage", "--by", "team", "--since", "1h", "--json", "--etcd", ",".join(cluster.endpoints),
                     "--prefix", cluster.prefix]) == 0
    rows = {r["team"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert set(rows) == {"t1", "t2", "t3"}
    for team, secs in rep.gpu_seconds.items():
        assert rows[team]["gpu_seconds"] == pytest.approx(secs, abs=0.01)
    assert rows["t2"]["leases"] == 1 and rows["t1"]["leases"] == 2
    assert cli_main(["usage", "--by", "agent", "--csv", "--etcd", ",".join(cluster.endpoints),
                     "--prefix", cluster.prefix]) == 0
    head, *lines = capsys.readouterr().out.splitlines()
    assert head == ("agent,GPU-hours [GPU*h],VRAM-GiB-hours [GiB*h],evictions suffered [count],leases ended [count],"
                    "evictions caused [count],idle GPU-hours [GPU*h]")
    assert sorted(line.split(",")[0] for line in lines) == ["t1-a", "t2-a", "t3-a"]
    gang = next(r for r in records(cluster).values() if r["agent"] == "t2-a")
    assert cli_main(["usage", "--lease", gang["lease_id"], "--etcd", ",".join(cluster.endpoints),
                     "--prefix", cluster.prefix]) == 0
    line = capsys.readouterr().out
    assert f"granted at revision {gang['start_revision']}" in line and "ended by release" in line
    assert f"GPUs {','.join(str(i) for i in gang['gpu_indexes'])}:" in line and len(gang["gpu_indexes"]) == 2


def exported(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for path in sorted(directory.glob("usage-*.jsonl")) for line in
            path.read_text().splitlines()]


def assert_export_matches(cluster: Cluster, directory: Path) -> None:
    """Every record in etcd is one line of the export, none twice, in the order they were written."""
    lines = exported(directory)
    names = [f"{x['lease_id']}@{x['start_revision']}" for x in lines]
    assert len(names) == len(set(names)), "a record exported twice"
    assert set(names) == set(records(cluster)), "records missing from the export, or lines of no record"
    revisions = [x["record_revision"] for x in sorted(lines, key=lambda x: x["end_unix"])]
    assert revisions == sorted(revisions)


def test_records_and_rollups_past_their_retention_are_swept(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator(usage_retention_s=0.2)
    wait_for(lambda: cursor_started(cluster), 20, "the accountant's cursor")
    with Client(addr, agent="a", host="h1") as a:
        a.acquire(1000).release()
    wait_for(lambda: records(cluster), 30, "the record")
    leadership = cluster.service(addr).leadership
    old_hour = cluster.keys.usage_rollup("2000-01-01T00", "default")     # far past usage_rollup_days
    cluster.lt.run(cluster.store.put(old_hour, b'{"gpu_s":1,"vram_mib_s":1,"evictions":0,"leases":1,"agents":{}}'))
    before = {kv.key for kv in cluster.get_prefix(cluster.keys.usage_rollups())}
    # The record ended more than 0.2 s ago by the leader's clock once the sweep runs (it compares end_unix).
    def swept() -> bool:
        cluster.lt.run(leadership.accountant.sweep(leadership.election))
        return not records(cluster)
    wait_for(swept, 30, "the sweep of the record past its retention")
    after = {kv.key for kv in cluster.get_prefix(cluster.keys.usage_rollups())}
    assert after == before - {old_hour} and after, "the old hour's rollup goes, this hour's stays"


def test_a_half_written_last_line_is_cut_off_and_written_again(tmp_path: Path) -> None:
    from coordinator.replica.export import exported_through
    day = tmp_path / "usage-2026-12-04.jsonl"
    day.write_text('{"record_revision": 7}\n{"record_revision": 9}\n{"record_rev')   # a crash mid-line
    (tmp_path / "usage-2026-12-03.jsonl").write_text('{"record_revision": 5}\n')
    assert exported_through(tmp_path) == 9
    assert day.read_text().endswith('{"record_revision": 9}\n')


def test_the_export_survives_a_leader_change_with_no_gap_and_no_duplicate(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_node("h1", "4x16GiB")
    export = tmp_path / "export"
    first = cluster.start_coordinator(usage_export_dir=str(export))
    wait_for(lambda: cursor_started(cluster), 20, "the accountant's cursor")
    second = cluster.start_coordinator(usage_export_dir=str(export))
    with Client(second, agent="a", host="h1") as a:
        for _ in range(10):
            a.acquire(1000).release()
        wait_for(lambda: len(exported(export)) >= 10, 30, "the first leader's lines")
        leader = cluster.service(first).replica_id
        wait_for(lambda: fetch_status(second)["leader"] == leader, 30, "the second replica to see the first lead")
        cluster.stop_coordinator(first)        # the leader steps down: the other one leads and exports
        wait_for(lambda: fetch_status(second)["leader"] not in ("", leader), 30, "the next leader")
        for _ in range(10):
            a.acquire(1000).release()
    wait_for(lambda: len(records(cluster)) >= 20 and len(exported(export)) >= 20, 60, "every record exported")
    assert_export_matches(cluster, export)
    usage(cluster).assert_ok()


@pytest.fixture
def two_replicas(cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    monkeypatch.setenv("GPUCOORD_USAGE_EXPORT_DIR", str(tmp_path / "export"))   # both replicas': one directory
    with replica_processes(cluster, tmp_path, extra=["--grace", "1"]) as by_id:
        yield by_id


def test_records_stay_exactly_once_when_the_leader_is_killed(cluster: Cluster, two_replicas: dict[str, Any],
                                                             tmp_path: Path) -> None:
    cluster.start_node("h1", "4x16GiB")
    addrs = [addr for _, addr in two_replicas.values()]
    leader_id = wait_for(lambda: str(fetch_status(addrs[0]).get("leader", "")), 20, "a leader")
    leader_proc, leader_addr = two_replicas[leader_id]
    (follower_addr,) = [a for a in addrs if a != leader_addr]
    wait_for(lambda: cursor_started(cluster), 20, "the accountant's cursor")
    stop = threading.Event()
    counts = [0, 0, 0]        # leases each agent acquired and released (one counter per thread)

    def churn(i: int) -> None:
        with Client(follower_addr, agent=f"agent-{i}", host="h1") as c:
            while not stop.is_set():
                c.acquire(1000).release()
                counts[i] += 1

    def ended() -> int:
        return sum(counts)
    threads = [threading.Thread(target=churn, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    wait_for(lambda: len(records(cluster)) >= 10, 30, "records while the first leader accounts")
    os.kill(leader_proc.pid, signal.SIGKILL)           # mid-run: the accountant dies between two commits, or in one
    leader_proc.wait()

    def next_leader() -> bool:
        leader = str(fetch_status(follower_addr).get("leader", ""))
        return bool(leader) and leader != leader_id
    wait_for(next_leader, 30, "the next leader")
    seen = ended()
    wait_for(lambda: ended() >= seen + 20, 60, "leases ending under the next leader")
    stop.set()
    for t in threads:
        t.join(30)
    wait_for(lambda: len(records(cluster)) >= ended(), 60, "a record for every lease that ended")
    rep = usage(cluster)
    rep.assert_ok()
    # (A release whose answer was lost ends with its session instead: the history's count is the truth.)
    assert rep.ended == rep.records >= ended()
    wait_for(lambda: len(exported(tmp_path / "export")) >= rep.records, 60, "every record exported")
    assert_export_matches(cluster, tmp_path / "export")
    cluster.lt.run(check_store(cluster.store, cluster.keys), timeout=240).assert_ok()


def test_a_reclaim_counts_as_caused_by_the_reclaiming_team_and_suffered_by_the_other(
        cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    """Team a fills two hosts (h2's GPUs over its quota); team b asks for h2's two GPUs and reclaims them. The
    victims' records say reclaim, caused by b-1 of team b; ``usage --by team`` counts 2 evictions suffered by a
    and 2 caused by b, ``--by agent`` 2 caused by b-1; the checker agrees with etcd's history."""
    from agent_client.api import coordinator_pb2 as pb
    from tests.support.rpcs import coordinator_stub
    cluster.start_node("h1", "2x16GiB")
    cluster.start_node("h2", "2x16GiB")
    addr = cluster.start_coordinator(eviction_grace_s=0.5, eviction_kill_margin_s=0.5)
    stub = coordinator_stub(addr)
    usable = min(g.usable_mb for h in stub.GetStatus(pb.GetStatusRequest(), timeout=10).hosts for g in h.gpus)
    for team in ("a", "b"):
        stub.SetTeam(pb.SetTeamRequest(name=team, quota_mb=2 * usable, limit_mb=4 * usable,
                                       members=pb.TeamMembers(patterns=[f"{team}-*"])), timeout=10)
    wait_for(lambda: cursor_started(cluster), 20, "the accountant's cursor")
    with Client(addr, agent="a-1", host="h1") as a1, Client(addr, agent="a-2", host="h2") as a2, \
            Client(addr, agent="b-1", host="h2") as b1:
        for c in (a1, a2):
            for i in (0, 1):
                c.acquire(0, gpu=i, exclusive=True, priority=9)
        b1.acquire(0, gpu_count=2, exclusive=True, wait=30).release()
    wait_for(lambda: sum(r["reason"] == "reclaim" for r in records(cluster).values()) == 2, 30,
             "the two reclaimed leases' records")
    wait_for(lambda: len(records(cluster)) >= 5, 30, "every lease's record")
    rep = usage(cluster)
    rep.assert_ok()
    reclaimed = [r for r in records(cluster).values() if r["reason"] == "reclaim"]
    assert {(r["agent"], r["caused_by"], r["caused_team"]) for r in reclaimed} == {("a-2", "b-1", "b")}
    capsys.readouterr()
    where = ["--etcd", ",".join(cluster.endpoints), "--prefix", cluster.prefix]
    assert cli_main(["usage", "--by", "team", "--since", "1h", "--json", *where]) == 0
    rows = {r["team"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert (rows["a"]["evictions"], rows["a"]["evictions_caused"]) == (2, 0)
    assert (rows["b"]["evictions"], rows["b"]["evictions_caused"]) == (0, 2)
    assert cli_main(["usage", "--by", "agent", "--since", "1h", "--json", *where]) == 0
    rows = {r["agent"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["b-1"]["evictions_caused"] == 2 and rows["a-2"]["evictions"] == 2
