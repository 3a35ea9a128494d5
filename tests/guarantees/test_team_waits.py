"""G11, a team at its limit waits when asked (issue 22: "refused RESOURCE_EXHAUSTED naming `team` and its limit,
or waits, as asked"), against a real etcd and real replicas: a waiter is granted once a lease of its team ends,
on any host and through any replica, or when an operator raises the limit; a wait that ends is answered naming
``team`` and the limit with its queue entry gone; and while it waits it holds no GPU back from another team's
request behind it (G2 with teams)."""
from __future__ import annotations

import json
from typing import Any

import pytest

from agent_client import Client, errors
from agent_client.api import coordinator_pb2 as pb
from tests.history import read_history
from tests.support.cluster import Cluster, queue
from tests.support.rpcs import coordinator_stub
from tests.support.waiting import Background, wait_for

pytestmark = pytest.mark.integration


def _team_a(addr: str, limit_mb: int) -> None:
    coordinator_stub(addr).SetTeam(pb.SetTeamRequest(name="a", limit_mb=limit_mb,
                                                     members=pb.TeamMembers(patterns=["a-*"])), timeout=10)


def _queued(cluster: Cluster, host: str, n: int) -> None:
    wait_for(lambda: len(queue(cluster, host)) == n, 10, f"{n} waiting request(s) on {host}")


def test_a_waiter_at_its_teams_limit_is_granted_when_its_team_releases_a_lease_on_another_replicas_host(
        cluster: Cluster) -> None:
    """Team a (limit 8 GiB) holds 8 GiB on host y, through y's owner replica; a member's 4 GiB request on host x,
    owned by the other replica, waits. The lease on y is released through y's owner: x's owner, which never
    touched y, sees it in its watch, decides x again and grants the waiter; at no revision is a above its limit."""
    addrs = [cluster.start_coordinator() for _ in range(2)]
    owners = {h: cluster.owner(h, 2) for h in (f"h{i}" for i in range(1, 40))}   # ownership hashes replica ids
    x = "h1"
    y = next(h for h, o in owners.items() if o != owners[x])
    for host in (x, y):
        cluster.start_node(host, "1x16GiB", heartbeat_s=3600)
    _team_a(addrs[0], 8192)
    with Client(owners[y], agent="a-1", host=y) as holder, Client(owners[x], agent="a-2", host=x) as waiter, \
            Client(owners[x], agent="bob", host=x) as bob:
        held = holder.acquire(8192)
        waiting = Background(waiter.acquire, 4096, wait=30)
        _queued(cluster, x, 1)
        bob.acquire(1024)          # a round on x while a is at its limit: bob (no team limit) in, the waiter not
        assert not waiting.done.is_set() and len(queue(cluster, x)) == 1
        held.release()
        lease = waiting.result(20)
        assert lease.host == x and queue(cluster, x) == []
        lease.release()
    live: dict[bytes, int] = {}     # team a's lease records -> their VRAM
    for ev in cluster.lt.run(read_history(cluster.store, cluster.keys.leases())):
        if ev.kind == "DELETE":
            live.pop(ev.kv.key, None)
        elif json.loads(ev.kv.value)["agent"].startswith("a-"):
            live[ev.kv.key] = json.loads(ev.kv.value)["vram_mb"]
        assert sum(live.values()) <= 8192, f"revision {ev.kv.mod_revision}: team a holds {live}"


def test_a_wait_for_the_teams_limit_that_ends_is_answered_naming_team_and_limit(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB", heartbeat_s=3600)
    addr = cluster.start_coordinator()
    _team_a(addr, 8192)
    with Client(addr, agent="a-1", host="h1") as a:
        a.acquire(8192)
        waiting = Background(a.acquire, 1024, wait=1.0)
        _queued(cluster, "h1", 1)
        with pytest.raises(errors.ResourceExhausted) as info:
            waiting.result(20)
        assert info.value.field == "team", info.value
        assert info.value.message.startswith("team: team 'a' uses 8192 MiB; 1024 MiB more would pass its limit of "
                                             "8192 MiB"), info.value.message
        assert "waited 1 s for its team's limit" in info.value.message
        assert queue(cluster, "h1") == []
        with pytest.raises(errors.ResourceExhausted, match="limit of 8192 MiB"):   # no wait: refused at once
            a.acquire(1024)
        assert queue(cluster, "h1") == []


def test_a_request_waiting_for_its_team_holds_no_gpu_back_from_another_team_behind_it(cluster: Cluster) -> None:
    """One 16 GiB GPU; team a (limit 4 GiB) holds 4 GiB of it. A member's 4 GiB request waits for its team,
    ranked first; another team's 12 GiB request behind it is granted at once on that GPU. When a's lease ends,
    the waiter is granted in the room left."""
    cluster.start_node("h1", "1x16GiB", heartbeat_s=3600)
    addr = cluster.start_coordinator()
    _team_a(addr, 4096)
    with Client(addr, agent="a-1", host="h1") as a, Client(addr, agent="bob", host="h1") as bob:
        held = a.acquire(4096)
        waiting = Background(a.acquire, 4096, wait=30)
        _queued(cluster, "h1", 1)
        bob.acquire(12288)                      # wait 0: granted now, or refused
        assert not waiting.done.is_set()
        held.release()
        assert waiting.result(20).vram_mb == 4096
        assert queue(cluster, "h1") == []


def test_a_waiter_is_granted_when_an_operator_raises_its_teams_limit(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB", heartbeat_s=3600)
    addr = cluster.start_coordinator()
    _team_a(addr, 4096)
    with Client(addr, agent="a-1", host="h1") as a:
        a.acquire(4096)
        waiting = Background(a.acquire, 4096, wait=30)
        _queued(cluster, "h1", 1)
        coordinator_stub(addr).SetTeam(pb.SetTeamRequest(name="a", limit_mb=8192), timeout=10)
        assert waiting.result(20).vram_mb == 4096
        assert queue(cluster, "h1") == []


def test_a_lease_ending_while_a_round_decides_a_waiter_holds_for_its_team_still_wakes_it(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The wake-up's race: a member's 8 GiB request waits on h1 for GPU room, not for its team. Another member
    takes 4 GiB on h2 (team a, limit 8 GiB, is now 4 GiB short); then h1's room frees, and the round that decides
    the waiter reads the teams (4 GiB used) just before that h2 lease ends: the watch sees the end while the
    waiter is not yet one that waits for its team (so it wakes nobody), and the round holds it for its team.
    The round sees that a lease ended after the teams' copy it used and decides again: the waiter is granted
    at once, not when its wait ends. (The round writes nothing and h1 sees no other event afterwards.)"""
    from coordinator.replica import round as round_module
    from coordinator.txn import Delete
    for host in ("h1", "h2"):
        cluster.start_node(host, "1x16GiB", heartbeat_s=3600)
    addr = cluster.start_coordinator()
    mirror = cluster.service(addr).mirror
    _team_a(addr, 8192)
    real = round_module.team_state
    armed: list[bytes] = []     # the lease key to delete within the next round's read of the teams
    ended: list[int] = []

    async def racing_team_state(ctx: Any, revision: int, wait_s: float, again: bool = False) -> Any:
        state, read_at = await real(ctx, revision, wait_s, again)
        if armed and state is not None and state.used.get("a") == 4096:
            res = await cluster.store.commit([], [Delete(armed.pop())])
            assert await mirror.caught_up(res.revision, 5)
            ended.append(res.revision)
        return state, read_at
    monkeypatch.setattr(round_module, "team_state", racing_team_state)
    with Client(addr, agent="bob", host="h1") as bob, Client(addr, agent="a-1", host="h2") as a1, \
            Client(addr, agent="a-2", host="h1") as a2:
        full = bob.acquire(16384)
        waiting = Background(a2.acquire, 8192, wait=30)
        _queued(cluster, "h1", 1)
        a1.acquire(4096)
        armed.append(cluster.get_prefix(cluster.keys.leases("h2"))[0].key)
        full.release()
        assert waiting.result(10).vram_mb == 8192
        assert ended, "the race was not played"
