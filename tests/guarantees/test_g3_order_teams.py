"""G3 over all candidates and under a team's limit (issue 28, points 4-5), against a real etcd and a real
replica: a one-GPU request evicts the newer single lease of the lowest priority rather than an older gang of
that priority on GPUs of lower indexes; a higher-priority request of a team at its limit evicts its own team's
newest lower-priority lease to free room under the limit and is granted once it is gone; an exclusive gang is
placed on the GPUs whose whole VRAM its team's limit allows. Every test ends with the history checker."""
from __future__ import annotations

import threading
from typing import Any

import pytest

from agent_client import Client
from agent_client.api import coordinator_pb2 as pb
from tests.support.cluster import Cluster
from tests.support.rpcs import coordinator_stub
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]


def _release_on_notice(lease: Any) -> threading.Event:
    done = threading.Event()

    def on_evict(_: Any) -> None:
        lease.release()
        done.set()
    lease.on_evict(on_evict)
    return done


def test_a_newer_single_lease_is_evicted_before_an_older_gang_of_the_same_priority(cluster: Cluster) -> None:
    cluster.start_node("h1", "3x8GiB")
    addr = cluster.start_coordinator(eviction_grace_s=10)
    with Client(addr, agent="g", host="h1") as g, Client(addr, agent="s", host="h1") as s, \
            Client(addr, agent="high", host="h1") as high:
        gang = g.acquire(8000, gpu_count=2, gpus=[0, 1], priority=0)
        single = s.acquire(8000, gpu=2, priority=0)            # newer, same priority
        released = _release_on_notice(single)
        lease = high.acquire(4000, priority=10, wait=15)
        wait_for(released.is_set, 10, "the single lease's on_evict to finish")
        assert lease.gpus[0].index == 2
        assert single.evicting.is_set() and not gang.evicting.is_set(), "the older gang got the notice"
        assert {x.id for x in cluster.leases()} == {gang.id, lease.id}


def test_a_higher_priority_request_of_a_team_at_its_limit_evicts_its_teams_newest_lower_priority_lease(
        cluster: Cluster) -> None:
    """Team t (limit 16 GiB) holds 16 GiB on GPU 0 (t-1's older lease, t-2's newer one, priority 0); GPU 1 is
    idle. t-3's priority-10 request fits on GPU 1 but not under the limit: t-2's lease gets the notice, and once
    it is gone t-3 is granted; t-1's lease and another team's lease are not touched."""
    cluster.start_node("h1", "2x16GiB")
    addr = cluster.start_coordinator(eviction_grace_s=10)
    coordinator_stub(addr).SetTeam(pb.SetTeamRequest(name="t", limit_mb=16384, members=pb.TeamMembers(
        patterns=["t-*"])), timeout=10)
    with Client(addr, agent="t-1", host="h1") as t1, Client(addr, agent="t-2", host="h1") as t2, \
            Client(addr, agent="t-3", host="h1") as t3, Client(addr, agent="other", host="h1") as other:
        old = t1.acquire(8192, gpu=0, priority=0)
        new = t2.acquire(8192, gpu=0, priority=0)
        theirs = other.acquire(4096, gpu=1, priority=0)       # newest of all, but another team's
        released = _release_on_notice(new)
        lease = t3.acquire(8192, priority=10, wait=15)
        wait_for(released.is_set, 10, "t-2's on_evict to finish")
        assert new.evicting.is_set() and not old.evicting.is_set() and not theirs.evicting.is_set()
        assert {x.id for x in cluster.leases()} == {old.id, theirs.id, lease.id}


def test_an_exclusive_gang_takes_the_gpus_its_teams_limit_allows(cluster: Cluster) -> None:
    cluster.start_node("h1", "2x32GiB,2x16GiB")
    addr = cluster.start_coordinator()
    coordinator_stub(addr).SetTeam(pb.SetTeamRequest(name="t", limit_mb=32768, members=pb.TeamMembers(
        patterns=["t-*"])), timeout=10)
    with Client(addr, agent="t-1", host="h1") as t1:
        lease = t1.acquire(0, gpu_count=2, exclusive=True)
        assert sorted(g.index for g in lease.gpus) == [2, 3]
