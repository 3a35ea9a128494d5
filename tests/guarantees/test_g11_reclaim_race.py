"""G11 under concurrency: a reclaim decision commits only while it is still true. 24 clients of two teams over
two replica processes and two hosts of 2 GPUs each, singles, 2-GPU gangs and exclusive gangs, acquire and
release for a bounded time. Team ``big`` has a quota of half the fleet and borrows the rest; team ``oth`` has a
quota of a quarter and reclaims from ``big`` whenever it does not fit. Releases of ``big``'s older leases on the
other host race with ``oth``'s reclaim decisions; the history checker, with the team rules, replays etcd's whole
history afterwards: no notice names an in-quota lease at its revision, and no notice outlives its requester's
need for it (``tests/support/history_notices.py``)."""
from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from agent_client import Client, errors
from agent_client.api import coordinator_pb2 as pb
from coordinator.txn import Delete
from tests.history import read_history
from tests.support.cluster import Cluster
from tests.support.load import LoadReport, run_load
from tests.support.patching import is_put, patch_commit
from tests.support.processes import spawn_coordinator, stop_process
from tests.support.rpcs import coordinator_stub

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]

DURATION_S = float(os.environ.get("GPUCOORD_RECLAIM_RACE_S", "20"))
CLIENTS = 24
GRACE_S = 1.0
KILL_MARGIN_S = 1.0


def test_reclaim_under_a_24_client_race_over_two_replicas_never_takes_an_in_quota_lease(cluster: Cluster,
                                                                                        tmp_path: Path) -> None:
    for host in ("h1", "h2"):
        cluster.start_node(host, "2x16GiB", heartbeat_s=3600)
    procs = []
    try:
        for i in range(2):
            proc, port = spawn_coordinator(
                cluster.endpoints, cluster.prefix, "127.0.0.1:0", str(tmp_path / f"c{i}.log"),
                extra=["--grace", str(GRACE_S), "--eviction-kill-margin", str(KILL_MARGIN_S)])
            procs.append((proc, f"127.0.0.1:{port}"))
        a, b = (addr for _, addr in procs)
        stub = coordinator_stub(a)
        status = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
        usable = min(g.usable_mb for h in status.hosts for g in h.gpus)
        fleet = 4 * usable
        # Team big: 18 agents at priority 0 that wait briefly; team oth: 6 agents at priority 5 that wait longer
        # (the head of every queue), each below its team's quota when it does not fit: it reclaims.
        stub.SetTeam(pb.SetTeamRequest(name="big", quota_mb=fleet // 4, members=pb.TeamMembers(patterns=["big-*"])),
                     timeout=10)
        stub.SetTeam(pb.SetTeamRequest(name="oth", quota_mb=fleet // 2, members=pb.TeamMembers(patterns=["oth-*"])),
                     timeout=10)

        async def race() -> tuple[LoadReport, LoadReport]:
            return await asyncio.gather(
                run_load([[a, b], [b, a]] * 9, ["h1", "h2"], DURATION_S, seed=28, sizes=(4000, 8000, 12000),
                         waits=(0.3, 1.0), hold_s=2.0, agent_prefix="big", gang_every=3),
                run_load([[b, a], [a, b]] * 3, ["h2", "h1"], DURATION_S, seed=29, sizes=(4000, 8000),
                         waits=(5.0,), hold_s=0.5, agent_prefix="oth", gang_every=3,
                         priorities={f"oth-{i}": 5 for i in range(6)}))
        reports = asyncio.run(race())
    finally:
        for proc, _ in procs:
            stop_process(proc)
    report = LoadReport(calls=[*reports[0].calls, *reports[1].calls])
    reclaims, withdrawn = _reclaim_notices(cluster)
    print(f"reclaim race: {len(report.calls)} calls, outcomes {report.outcomes()}, {reclaims} reclaim notices, "
          f"{withdrawn} withdrawn")
    assert report.granted > 0
    assert not report.undocumented(), report.undocumented()[:5]
    assert reclaims > 0, "the race made no reclaim decision: it proves nothing about G11"


def _reclaim_notices(cluster: Cluster) -> tuple[int, int]:
    """How many reclaim notices the run wrote, and how many of them were withdrawn (deleted while their lease
    lived on), from etcd's history."""
    events = cluster.lt.run(read_history(cluster.store, cluster.keys.root()), timeout=120)
    evictions, leases = cluster.keys.evictions(), cluster.keys.kind("leases")
    made, withdrawn = 0, 0
    live: set[str] = set()
    by_rev: dict[int, list[Any]] = {}
    for ev in events:
        by_rev.setdefault(ev.kv.mod_revision, []).append(ev)
    for _, batch in sorted(by_rev.items()):
        deleted = []
        for ev in batch:       # the whole revision first: a notice deleted with its lease was not withdrawn
            key = ev.kv.key
            if key.startswith(leases):
                lease_id = key.rsplit(b"/", 1)[-1].decode()
                (live.add if ev.kind == "PUT" else live.discard)(lease_id)
            elif key.startswith(evictions) and ev.kind == "PUT" and json.loads(ev.kv.value).get("reclaim"):
                made += 1
            elif key.startswith(evictions) and ev.kind == "DELETE" and ev.prev_kv is not None:
                deleted.append(json.loads(ev.prev_kv.value))
        withdrawn += sum(1 for rec in deleted if rec.get("reclaim") and rec.get("lease_id") in live)
    return made, withdrawn


def test_a_reclaim_notice_does_not_commit_once_an_older_lease_of_the_victims_team_ends(cluster: Cluster) -> None:
    """The race, played once: team big holds h1's GPU (its oldest lease: in quota) and h2's (over quota); team
    oth asks for h2's GPU and decides to reclaim big's lease there, and between that decision and its commit
    big's lease on h1 ends (deleted as its session's expiry would: no transaction of the coordinator's). The
    lease on h2 is then big's oldest, in quota: the notice must not commit, and oth's wait ends without it."""
    for host in ("h1", "h2"):
        cluster.start_node(host, "1x16GiB", heartbeat_s=3600)
    addr = cluster.start_coordinator(eviction_grace_s=GRACE_S, eviction_kill_margin_s=KILL_MARGIN_S)
    svc = cluster.service(addr)
    stub = coordinator_stub(addr)
    usable = min(g.usable_mb for h in stub.GetStatus(pb.GetStatusRequest(), timeout=10).hosts for g in h.gpus)
    for team in ("big", "oth"):
        stub.SetTeam(pb.SetTeamRequest(name=team, quota_mb=usable, members=pb.TeamMembers(patterns=[f"{team}-*"])),
                     timeout=10)
    armed: list[bytes] = []
    raced: list[int] = []

    async def hook(compares: Any, success: Any, commit: Any) -> Any:
        if armed and any(is_put(op, cluster.keys.evictions()) for op in success):
            res = await cluster.store.commit([], [Delete(armed.pop())])
            assert await svc.mirror.caught_up(res.revision, 5)
            raced.append(res.revision)
        return await commit()
    undo = patch_commit(cluster, svc, hook)
    try:
        with Client(addr, agent="big-1", host="h1") as b1, Client(addr, agent="big-2", host="h2") as b2, \
                Client(addr, agent="oth-1", host="h2") as o:
            oldest = b1.acquire(0, exclusive=True)
            newer = b2.acquire(0, exclusive=True)
            assert (oldest.over_quota, newer.over_quota) == (False, True)
            armed.append(cluster.keys.lease("h1", oldest.gpus[0].uuid, oldest.id))
            with pytest.raises(errors.ResourceExhausted):
                o.acquire(0, exclusive=True, wait=2)
            assert raced, "the race was not played"
            assert not newer.evicting.is_set(), "big's lease was reclaimed once it was in quota"
    finally:
        undo()
