"""G11 reclaim, end to end: two teams with a quota of half a 4-GPU fleet over two hosts. Team A alone fills
all four GPUs (the two it took last borrow: over quota); team B then asks for its quota and is granted it
within the eviction grace plus the kill margin plus 1 s, by reclaiming exactly A's over-quota leases (whatever
their priority); A's in-quota leases stay. With one replica in process, and with two replicas as processes,
one of them killed while B waits. The history checker runs over etcd's whole history after each."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import pytest

from agent_client import Client
from agent_client.api import coordinator_pb2 as pb
from coordinator.cli.common import fetch_status
from tests.history import check_store
from tests.support.cluster import Cluster
from tests.support.processes import spawn_coordinator, stop_process
from tests.support.rpcs import coordinator_stub
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]

GRACE_S = 2.0
KILL_MARGIN_S = 2.0


def _usable_mb(addr: str) -> int:
    status = coordinator_stub(addr).GetStatus(pb.GetStatusRequest(), timeout=10)
    usable = {g.usable_mb for h in status.hosts for g in h.gpus}
    assert len(usable) == 1, usable
    return usable.pop()


def _set_teams(addr: str, quota_mb: int) -> None:
    """Teams a and b: each a quota of half the fleet and a limit of all of it."""
    stub = coordinator_stub(addr)
    for team in ("a", "b"):
        stub.SetTeam(pb.SetTeamRequest(name=team, quota_mb=quota_mb, limit_mb=2 * quota_mb,
                                       members=pb.TeamMembers(patterns=[f"{team}-*"])), timeout=10)


def _a_fills_the_fleet(a1: Client, a2: Client) -> tuple[list[Any], list[Any]]:
    """A takes h1's two GPUs first (in quota), then h2's (over quota), at a high priority, exclusive."""
    in_quota = [a1.acquire(0, gpu=i, exclusive=True, priority=9) for i in (0, 1)]
    over = [a2.acquire(0, gpu=i, exclusive=True, priority=9) for i in (0, 1)]
    assert [x.over_quota for x in in_quota] == [False, False] and [x.over_quota for x in over] == [True, True]
    return in_quota, over


def _b_reclaims(cluster: Cluster, b: Client, in_quota: Sequence[Any], over: Sequence[Any],
                during_wait: Any = None) -> float:
    """B asks for its quota (both of h2's GPUs, whole) and waits; A's holders ignore their notices. Returns
    how long B waited."""
    result: dict[str, Any] = {}

    def ask() -> None:
        t0 = time.monotonic()
        result["lease"] = b.acquire(0, gpu_count=2, exclusive=True, wait=30)
        result["waited"] = time.monotonic() - t0
    t = threading.Thread(target=ask, daemon=True)
    t.start()
    for lease in over:
        wait_for(lease.evicting.is_set, 10, "a reclaim notice to A's over-quota lease")
        assert lease.notice.reclaim_team == "b", lease.notice
        assert "reclaims its quota" in lease.notice.reason
    if during_wait is not None:
        during_wait()
    t.join(30)
    assert "lease" in result, "team B was not granted its quota"
    granted = result["lease"]
    assert {g.index for g in granted.gpus} == {0, 1} and granted.host == "h2"
    assert not any(lease.evicting.is_set() for lease in in_quota), "an in-quota lease got a notice"
    held = {x.id for x in cluster.leases()}
    assert held == {*(x.id for x in in_quota), granted.id}, "reclaim took other leases than A's over-quota ones"
    return float(result["waited"])


def test_a_team_below_its_quota_reclaims_exactly_the_other_teams_over_quota_leases(cluster: Cluster) -> None:
    cluster.start_node("h1", "2x16GiB", heartbeat_s=3600)
    cluster.start_node("h2", "2x16GiB", heartbeat_s=3600)
    addr = cluster.start_coordinator(eviction_grace_s=GRACE_S, eviction_kill_margin_s=KILL_MARGIN_S)
    _set_teams(addr, 2 * _usable_mb(addr))
    with Client(addr, agent="a-1", host="h1") as a1, Client(addr, agent="a-2", host="h2") as a2, \
            Client(addr, agent="b-1", host="h2") as b:
        in_quota, over = _a_fills_the_fleet(a1, a2)
        waited = _b_reclaims(cluster, b, in_quota, over)
    # A's holders ignore their notices: the grant waits for the grace (and the margin) at any speed; that it
    # came within B's wait is asserted above, how soon after them is the machine's speed.
    print(f"team B granted its quota after {waited:.2f} s (grace {GRACE_S} s + kill margin {KILL_MARGIN_S} s)")
    assert waited >= GRACE_S - 0.1, "B was granted before the reclaimed leases' grace ended"


@pytest.mark.fault
@pytest.mark.parametrize("kill", ["owner", "leader"])
def test_reclaim_holds_over_two_replicas_when_one_is_killed_while_the_team_waits(cluster: Cluster,
                                                                                 tmp_path: Path, kill: str) -> None:
    """A's agents use one replica, B's the other (each client knows both). While B waits for the reclaimed
    GPUs, one replica is killed: the one that owns h2 (it wrote the notices and serves B's wait, or had it
    forwarded), or the leader (which enforces the notices' deadlines). The survivor takes over and grants B."""
    cluster.start_node("h1", "2x16GiB", heartbeat_s=3600)
    cluster.start_node("h2", "2x16GiB", heartbeat_s=3600)
    procs = []
    for i in range(2):
        proc, port = spawn_coordinator(cluster.endpoints, cluster.prefix, "127.0.0.1:0", str(tmp_path / f"c{i}.log"),
                                       extra=["--grace", str(GRACE_S), "--eviction-kill-margin", str(KILL_MARGIN_S)])
        procs.append((proc, f"127.0.0.1:{port}"))
    addrs = [a for _, a in procs]
    try:
        owner = cluster.owner("h2", 2)
        _set_teams(addrs[0], 2 * _usable_mb(addrs[0]))
        other = [a for a in addrs if a != owner][0]
        with Client([owner, other], agent="a-1", host="h1") as a1, \
                Client([owner, other], agent="a-2", host="h2") as a2, \
                Client([other, owner], agent="b-1", host="h2") as b:
            in_quota, over = _a_fills_the_fleet(a1, a2)
            if kill == "leader":
                leader = wait_for(lambda: fetch_status(addrs[0]).get("leader"), 10, "a leader")
                doomed = cluster.replicas()[str(leader)]
            else:
                doomed = owner
            victim = next(p for p, a in procs if a == doomed)

            def kill_the_owner() -> None:
                os.kill(victim.pid, signal.SIGKILL)
                victim.wait()
            waited = _b_reclaims(cluster, b, in_quota, over, during_wait=kill_the_owner)
        print(f"team B granted its quota after {waited:.2f} s with the {kill} ({doomed}; h2's owner {owner}) killed "
              "while it waited")
        assert waited >= GRACE_S - 0.1, "B was granted before the reclaimed leases' grace ended"
    finally:
        for proc, _ in procs:
            stop_process(proc)
    cluster.lt.run(check_store(cluster.store, cluster.keys)).assert_ok()


@pytest.mark.parametrize("team_max_s", [3600.0, 0.0])
def test_a_borrowed_lease_is_reclaimed_only_after_its_minimum_runtime(cluster: Cluster, team_max_s: float) -> None:
    """A's lease (over quota: A has none) declares a minimum runtime of 2 s. Under A's maximum of an hour it
    gets its reclaim notice only once 2 s have passed since its grant, and B is granted after that plus the
    grace; with a maximum of 0 the declaration (30 s there) counts for nothing and the notice comes before it
    ends."""
    cluster.start_node("h1", "1x16GiB", heartbeat_s=3600)
    addr = cluster.start_coordinator(eviction_grace_s=GRACE_S, eviction_kill_margin_s=KILL_MARGIN_S)
    stub = coordinator_stub(addr)
    usable = _usable_mb(addr)
    stub.SetTeam(pb.SetTeamRequest(name="a", quota_mb=0, max_min_runtime_seconds=team_max_s,
                                   members=pb.TeamMembers(patterns=["a-*"])), timeout=10)
    stub.SetTeam(pb.SetTeamRequest(name="b", quota_mb=usable, members=pb.TeamMembers(patterns=["b-*"])), timeout=10)
    with Client(addr, agent="a-1", host="h1") as a, Client(addr, agent="b-1", host="h1") as b:
        # With a maximum of 0, a declaration far longer than a notice takes on a loaded machine: the notice
        # coming before it ended shows that it counted for nothing, at any speed.
        min_runtime = 2.0 if team_max_s else 30.0
        borrowed = a.acquire(0, exclusive=True, min_runtime=min_runtime)
        granted_at = time.monotonic()
        # The lease records its declaration capped by its team's maximum (0 under a maximum of 0).
        assert borrowed.over_quota and borrowed.min_runtime == min(min_runtime, team_max_s)
        result: dict[str, Any] = {}
        t = threading.Thread(target=lambda: result.update(lease=b.acquire(0, exclusive=True, wait=30)), daemon=True)
        t.start()
        wait_for(borrowed.evicting.is_set, 10, "the reclaim notice")
        noticed = time.monotonic() - granted_at
        t.join(30)
        assert "lease" in result
    print(f"team max {team_max_s:g} s: the notice came {noticed:.2f} s after the grant")
    if team_max_s:
        # Never before the minimum runtime; how soon after it is the machine's speed (B's grant, above, says
        # that it came).
        assert noticed >= 2.0 - 0.05, "reclaimed within its minimum runtime"
    else:
        assert noticed < min_runtime, "the minimum runtime counted though the team's maximum is 0"
