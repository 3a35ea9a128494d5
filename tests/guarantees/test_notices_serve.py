"""Notices serve their requester until the deadline (G3, G11; ``policy/notices.py``): a victim that its
requester no longer needs has its notice withdrawn, is not revoked, and the requester takes room it finds free
rather than waiting for a victim. Each scene ends with the history checker (its rule: a request's notice stands
only while the requester's queue entry lists its lease)."""
from __future__ import annotations

import threading
from typing import Any, Callable

import pytest

from agent_client import Client, errors
from agent_client.api import coordinator_pb2 as pb
from tests.support.cluster import Cluster
from tests.support.rpcs import coordinator_stub
from tests.support.waiting import LIVENESS_S, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]

GRACE_S = 8.0          # long: each scene acts within it
KILL_MARGIN_S = 1.0


def _usable(addr: str) -> int:
    status = coordinator_stub(addr).GetStatus(pb.GetStatusRequest(), timeout=10)
    return min(g.usable_mb for h in status.hosts for g in h.gpus)


def _background(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except errors.GpucoordError as e:
            out["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _two_hosts(cluster: Cluster, h1_gpus: str = "1x16GiB") -> str:
    """Nodes h1 (``h1_gpus``) and h2 (one 16 GiB GPU), reports only when leases change, and a coordinator with the
    scenes' grace and kill margin: its address."""
    cluster.start_node("h1", h1_gpus, heartbeat_s=3600)
    cluster.start_node("h2", "1x16GiB", heartbeat_s=3600)
    return cluster.start_coordinator(eviction_grace_s=GRACE_S, eviction_kill_margin_s=KILL_MARGIN_S)


def _big_and_oth(addr: str) -> None:
    """Team big with a quota of one GPU's usable VRAM, team oth with two (members big-*, oth-*)."""
    usable = _usable(addr)
    stub = coordinator_stub(addr)
    for team, quota in (("big", usable), ("oth", 2 * usable)):
        stub.SetTeam(pb.SetTeamRequest(name=team, quota_mb=quota, members=pb.TeamMembers(patterns=[f"{team}-*"])),
                     timeout=10)


def _notices(cluster: Cluster) -> list[Any]:
    return cluster.get_prefix(cluster.keys.evictions())


def test_a_victim_back_in_quota_during_its_grace_is_not_revoked_and_the_requester_takes_free_gpus(
        cluster: Cluster) -> None:
    """Team big (quota: one GPU) holds h2's GPU (its oldest lease) and both of h1's; oth reclaims the newest, on
    h1's GPU 0. Within the grace big's two older leases end: GPU 1 of h1 is free, and the victim is big's only
    lease, in quota. oth is granted GPU 1 at once, the notice is withdrawn, and the victim keeps its lease."""
    addr = _two_hosts(cluster, "2x16GiB")
    _big_and_oth(addr)
    with Client(addr, agent="big-1", host="h2") as b1, Client(addr, agent="big-2", host="h1") as b2, \
            Client(addr, agent="oth-1", host="h1") as o:
        oldest = b1.acquire(0, exclusive=True)
        older = b2.acquire(0, gpu=1, exclusive=True)
        victim = b2.acquire(0, gpu=0, exclusive=True, request_id="victim")
        t, out = _background(lambda: o.acquire(0, exclusive=True, wait=GRACE_S * 2))
        wait_for(victim.evicting.is_set, 10, "the reclaim notice to big's newest lease")
        assert not older.evicting.is_set()
        oldest.release()
        older.release()
        t.join(GRACE_S)
        assert "value" in out, f"oth was not granted the free GPU within the grace: {out}"
        assert [g.index for g in out["value"].gpus] == [1], "oth waited for the victim instead of the free GPU"
        wait_for(lambda: not _notices(cluster), LIVENESS_S, "the notice withdrawn")
        assert victim.id in {x.id for x in cluster.leases()}


def test_a_requester_that_its_team_limit_blocks_after_choosing_victims_withdraws_them(cluster: Cluster) -> None:
    """Team b (quota 0) holds 12 GiB on h1, all of it over quota; team a (quota 16 GiB, limit 20 GiB) asks for
    8 GiB there and reclaims it. Within the grace team a takes 16 GiB on h2: the request, now held back by
    its team's limit (and no longer within its quota), needs no victim, so the notice is withdrawn and b's
    lease stays; the wait ends naming the team. (A victim of the requester's own team would free room under
    the limit as well: G3 within a team, so the scene takes another team's lease.)"""
    addr = _two_hosts(cluster)
    stub = coordinator_stub(addr)
    stub.SetTeam(pb.SetTeamRequest(name="a", quota_mb=16384, limit_mb=20480,
                                   members=pb.TeamMembers(patterns=["a-*"])), timeout=10)
    stub.SetTeam(pb.SetTeamRequest(name="b", quota_mb=0, members=pb.TeamMembers(patterns=["b-*"])), timeout=10)
    with Client(addr, agent="b-1", host="h1") as b1, Client(addr, agent="a-2", host="h1") as a2, \
            Client(addr, agent="a-3", host="h2") as a3:
        low = b1.acquire(12288)
        # Its wait outlasts the notice's deadline: a notice kept for it would be carried out (b's lease revoked).
        t, out = _background(lambda: a2.acquire(8192, wait=GRACE_S * 2))
        wait_for(low.evicting.is_set, 10, "the reclaim notice to team b's lease")
        a3.acquire(16384)
        wait_for(lambda: not _notices(cluster), GRACE_S - 3, "the notice withdrawn")
        wait_for(lambda: not t.is_alive(), GRACE_S * 3, "the requester's wait to end, past the notice's deadline")
        assert isinstance(out.get("error"), errors.ResourceExhausted), out
        assert low.id in {x.id for x in cluster.leases()}, "b's lease was revoked for a request its limit held back"


def test_when_the_requesters_wait_ends_its_notices_are_withdrawn_and_the_victim_hears_it(cluster: Cluster) -> None:
    """A priority-5 request evicts a priority-0 lease and its wait ends within the grace: the notice is withdrawn,
    the victim's client hears it (``on_withdrawn`` runs, ``evicting`` is cleared) and the lease is not revoked."""
    cluster.start_node("h1", "1x16GiB", heartbeat_s=3600)
    addr = cluster.start_coordinator(eviction_grace_s=GRACE_S, eviction_kill_margin_s=KILL_MARGIN_S)
    with Client(addr, agent="low", host="h1") as lo, Client(addr, agent="high", host="h1") as hi:
        low = lo.acquire(12288)
        heard = threading.Event()
        low.on_withdrawn(lambda notice: heard.set() if notice.withdrawn else None)
        t, out = _background(lambda: hi.acquire(8192, priority=5, wait=1.0))
        wait_for(low.evicting.is_set, 10, "the notice")
        t.join(GRACE_S)
        assert isinstance(out.get("error"), errors.ResourceExhausted), out
        wait_for(heard.is_set, GRACE_S - 2, "the victim to hear that its notice was withdrawn")
        assert not low.evicting.is_set() and low.notice is None
        assert not _notices(cluster)
        assert low.id in {x.id for x in cluster.leases()}


def test_a_reclaim_victim_back_in_quota_is_not_revoked_while_its_requester_still_waits(cluster: Cluster) -> None:
    """Team big (quota: one GPU) holds h2's GPU (its oldest lease) and h1's; oth reclaims h1's. Within the grace
    big's lease on h2 ends: the victim is big's only lease, in quota, and may not be reclaimed any more. oth's
    request (for h1, where nothing is free) keeps waiting, past the notice's deadline: the notice is withdrawn,
    the victim is not revoked, and oth's wait ends without a grant."""
    addr = _two_hosts(cluster)
    _big_and_oth(addr)
    with Client(addr, agent="big-1", host="h2") as b1, Client(addr, agent="big-2", host="h1") as b2, \
            Client(addr, agent="oth-1", host="h1") as o:
        oldest = b1.acquire(0, exclusive=True)
        victim = b2.acquire(0, exclusive=True)
        t, out = _background(lambda: o.acquire(0, exclusive=True, wait=GRACE_S * 2))
        wait_for(victim.evicting.is_set, 10, "the reclaim notice to big's newer lease")
        oldest.release()
        wait_for(lambda: not _notices(cluster), GRACE_S - 3, "the notice withdrawn")
        wait_for(lambda: not t.is_alive(), GRACE_S * 3, "oth's wait to end, past the notice's deadline")
        assert isinstance(out.get("error"), errors.ResourceExhausted), out
        assert victim.id in {x.id for x in cluster.leases()}, "an in-quota lease was revoked for another team"


def test_an_exclusive_requester_whose_team_passes_its_quota_meanwhile_withdraws_its_reclaim(cluster: Cluster) -> None:
    """Team oth (quota: one GPU's usable VRAM) asks for h1's GPU whole (charged all of it: within its quota) and
    reclaims team b's lease there (b has no quota). Within the grace oth takes 4 GiB on h2: counting its
    exclusive request (at least a whole GPU) it is over its quota, so it may not reclaim; the notice is withdrawn,
    b's lease is not revoked, and oth's request waits until its wait ends. (Counted as 0 MiB, an exclusive
    request stayed "within its quota" and the reclaim was carried out.)"""
    addr = _two_hosts(cluster)
    usable = _usable(addr)
    stub = coordinator_stub(addr)
    stub.SetTeam(pb.SetTeamRequest(name="oth", quota_mb=usable, members=pb.TeamMembers(patterns=["oth-*"])),
                 timeout=10)
    stub.SetTeam(pb.SetTeamRequest(name="b", quota_mb=0, members=pb.TeamMembers(patterns=["b-*"])), timeout=10)
    with Client(addr, agent="b-1", host="h1") as b1, Client(addr, agent="oth-1", host="h1") as o1, \
            Client(addr, agent="oth-2", host="h2") as o2:
        low = b1.acquire(12288)
        t, out = _background(lambda: o1.acquire(0, exclusive=True, wait=GRACE_S * 2))
        wait_for(low.evicting.is_set, 10, "the reclaim notice to team b's lease")
        o2.acquire(4096)
        wait_for(lambda: not _notices(cluster), GRACE_S - 3, "the notice withdrawn")
        wait_for(lambda: not t.is_alive(), GRACE_S * 3, "oth's wait to end, past the notice's deadline")
        assert isinstance(out.get("error"), errors.ResourceExhausted), out
        assert low.id in {x.id for x in cluster.leases()}, "b's lease was reclaimed for a team over its quota"
