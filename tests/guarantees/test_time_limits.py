"""Time limits (issue 31, docs/policies.md "Time limits"): a lease granted with ``time_limit`` gets an eviction notice with
the reason ``time-limit`` at its end minus the warning, and is revoked at its end (the kill margin and G3's order
as for any notice); a waiter for its GPU is granted once it is gone. Only the order is asserted (not before the end
minus the warning, gone only after the end), with liveness deadlines and no upper time bound. The fleet's default
and maximum; bad input refused naming the field, nothing written. The history checker runs after every test
(G1, G3 and the time-limit rule: no lease outlives its end + grace + kill margin)."""
from __future__ import annotations

import json
import threading
import time
from typing import Any, Iterator

import grpc
import pytest

from agent_client import Client, errors
from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from tests.support.cluster import Cluster
from tests.support.rpcs import expect_refused
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]
C = grpc.StatusCode
LIVENESS_S = 60.0


@pytest.fixture
def fleet(cluster: Cluster) -> Iterator[tuple[Cluster, Any, str]]:
    """Host h1 (one 16 GiB GPU) and one coordinator with a 1 s warning and a 600 s maximum."""
    addr = cluster.start_coordinator(time_limit_warning_s=1.0, max_time_limit_s=600.0)
    wait_for(lambda: cluster.get_prefix(cluster.keys.election()), 10, "the coordinator's election key")
    cluster.start_node("h1", "1x16GiB")
    wait_for(lambda: cluster.get_prefix(cluster.keys.host("h1")), 10, "host h1 to register")
    channel = grpc.insecure_channel(addr)
    yield cluster, pb_grpc.CoordinatorStub(channel), addr
    channel.close()


def test_a_lease_gets_a_time_limit_notice_before_its_end_and_is_gone_after_it_and_its_waiter_is_granted(
        fleet: tuple[Cluster, Any, str]) -> None:
    cluster, _, addr = fleet
    with Client(addr, agent="agent-a", host="h1") as a, Client(addr, agent="agent-b", host="h1") as b:
        before = time.monotonic()
        held = a.acquire(12000, time_limit=3)
        assert held.time_limit == 3.0
        (record,) = cluster.leases()
        assert (record.time_limit_s, record.time_limit_warning_s) == (3.0, 1.0)
        # A waiter for the GPU (equal priority: no eviction for it): granted only once the lease is gone.
        got: list[Any] = []
        waiter = threading.Thread(target=lambda: got.append((b.acquire(8000, wait=LIVENESS_S), time.monotonic())))
        waiter.start()
        assert held.evicting.wait(LIVENESS_S), "no time-limit notice"
        noticed = time.monotonic()
        assert held.notice is not None and held.notice.reason == "time-limit"
        # Not before the end minus the warning (the leader first saw the lease after ``before``).
        assert noticed - before >= 3.0 - 1.0, noticed - before
        (notice,) = [json.loads(kv.value) for kv in cluster.get_prefix(cluster.keys.evictions())]
        assert notice["reason"] == "time-limit" and notice["requested_by"] == "operator"
        assert 0 < notice["deadline_unix"] - notice["created_at"] <= 1.0 + 1e-3
        # The holder does not release: the leader revokes it at its end (+ the kill margin).
        wait_for(lambda: not [x for x in cluster.leases() if x.id == held.id], LIVENESS_S, "the revoke")
        gone = time.monotonic()
        assert gone - before >= 3.0, gone - before
        waiter.join(LIVENESS_S)
        assert got, "the waiter was not granted"
        lease, granted = got[0]
        assert granted - before >= 3.0, granted - before   # (12000 + 8000 MiB do not fit on 16 GiB: G1)
        assert [x.id for x in cluster.leases()] == [lease.id] and lease.time_limit == 0.0
        lease.release()


def test_a_lease_without_a_limit_gets_no_notice_and_the_default_and_maximum_apply(
        fleet: tuple[Cluster, Any, str], cluster: Cluster) -> None:
    _, stub, addr = fleet
    with Client(addr, agent="agent-a", host="h1") as a:
        plain = a.acquire(1000)
        assert plain.time_limit == 0.0 and "time_limit_s" not in cluster.get_prefix(cluster.keys.leases())[0].value.decode()
        at_max = a.acquire(1000, time_limit=600, time_limit_warning=30)
        (stored,) = [x for x in cluster.leases() if x.id == at_max.id]
        assert (stored.time_limit_s, stored.time_limit_warning_s) == (600.0, 30.0)
        with pytest.raises(errors.InvalidArgument) as info:
            a.acquire(1000, time_limit=601)
        assert info.value.field == "time_limit_seconds" and "maximum" in str(info.value)
        assert not plain.evicting.is_set() and not at_max.evicting.is_set()
        sid = a.session_id

    def acquire(**kw: Any) -> Any:
        return lambda: stub.Acquire(pb.AcquireRequest(session=pb.SessionRef(agent="agent-a", session_id=sid),
                                                      vram_mb=1000, **kw), timeout=10)

    # (The session is closed: fields are checked before the session is looked up.)
    for field, bad in (("time_limit_seconds", -1.0), ("time_limit_seconds", float("nan")),
                       ("time_limit_seconds", 1e12), ("time_limit_seconds", 601.0),
                       ("time_limit_warning_seconds", -1.0)):
        expect_refused(cluster, acquire(**{field: bad}), C.INVALID_ARGUMENT, field)
    # A minimum runtime (teams) longer than the limit could not be run.
    expect_refused(cluster, acquire(time_limit_seconds=60, min_runtime_seconds=61), C.INVALID_ARGUMENT,
                   "min_runtime_seconds")


def test_the_fleets_default_limit_applies_to_a_request_that_asks_none(cluster: Cluster) -> None:
    addr = cluster.start_coordinator(default_time_limit_s=3600.0, time_limit_warning_s=60.0)
    wait_for(lambda: cluster.get_prefix(cluster.keys.election()), 10, "the coordinator's election key")
    cluster.start_node("h1", "1x16GiB")
    wait_for(lambda: cluster.get_prefix(cluster.keys.host("h1")), 10, "host h1 to register")
    with Client(addr, agent="agent-a", host="h1") as a:
        lease = a.acquire(1000)
        assert lease.time_limit == 3600.0
        (stored,) = cluster.leases()
        assert (stored.time_limit_s, stored.time_limit_warning_s) == (3600.0, 60.0)
        shorter = a.acquire(1000, time_limit=120)
        assert shorter.time_limit == 120.0


def test_after_a_leader_change_the_new_leader_warns_and_revokes_never_early(cluster: Cluster) -> None:
    """Two replicas: the lease is granted while A leads, then A stops before the warning; B, which saw the grant
    through its watch, sends the notice and revokes at the end as measured from when it saw the lease."""
    first = cluster.start_coordinator(time_limit_warning_s=1.0)
    wait_for(lambda: cluster.service(first).leadership.is_leader, 10, "the first replica to lead")
    second = cluster.start_coordinator(time_limit_warning_s=1.0)
    wait_for(lambda: len(cluster.get_prefix(cluster.keys.election())) == 2, 10, "the second replica's candidacy")
    cluster.start_node("h1", "1x16GiB")
    wait_for(lambda: cluster.get_prefix(cluster.keys.host("h1")), 10, "host h1 to register")
    with Client(second, agent="agent-a", host="h1") as a:
        before = time.monotonic()
        held = a.acquire(12000, time_limit=6)
        cluster.stop_coordinator(first)
        wait_for(lambda: cluster.service(second).leadership.is_leader, LIVENESS_S, "the second replica to lead")
        assert held.evicting.wait(LIVENESS_S), "no time-limit notice from the new leader"
        assert held.notice is not None and held.notice.reason == "time-limit"
        assert time.monotonic() - before >= 6.0 - 1.0
        wait_for(lambda: not [x for x in cluster.leases() if x.id == held.id], LIVENESS_S, "the revoke")
        assert time.monotonic() - before >= 6.0


def test_a_load_with_time_limits_over_two_replicas_keeps_every_guarantee(cluster: Cluster) -> None:
    """8 agents over two replicas, half of them asking 1 s limits and holding up to 2 s, while a held lease with a
    limit is never released: every call ends with a documented status, the held lease is revoked, and the history
    checker (G1, G3, G5, G6 and the time-limit rule) replays it all."""
    import asyncio

    from tests.support.load import run_load

    cluster.start_node("h1", "2x16GiB")
    a, b = cluster.start_coordinator(time_limit_warning_s=0.5), cluster.start_coordinator(time_limit_warning_s=0.5)
    limits = {f"agent-{i}": 1.0 for i in range(0, 8, 2)}
    with Client([b, a], agent="holder", host="h1") as c:
        held = c.acquire(2000, time_limit=2)
        load = asyncio.run(run_load([[a, b], [b, a]] * 4, "h1", 8.0, seed=31, time_limits=limits))
        assert not load.undocumented(), load.undocumented()[:5]
        assert load.granted > 0
        assert held.evicting.wait(LIVENESS_S) and held.notice is not None and held.notice.reason == "time-limit"
        wait_for(lambda: not [x for x in cluster.leases() if x.id == held.id], LIVENESS_S, "the held lease's revoke")


def test_a_teams_maximum_and_default_apply_to_its_agents_only(fleet: tuple[Cluster, Any, str]) -> None:
    """The fleet: a 600 s maximum, no default. Team ``short`` (agent-s): at most 60 s, 30 s by default."""
    cluster, stub, addr = fleet
    resp = stub.SetTeam(pb.SetTeamRequest(name="short", members=pb.TeamMembers(patterns=["agent-s"]),
                                          max_time_limit_seconds=60, default_time_limit_seconds=30), timeout=10)
    assert (resp.team.max_time_limit_seconds, resp.team.default_time_limit_seconds) == (60.0, 30.0)
    stored = json.loads(cluster.get_prefix(cluster.keys.team("short"))[0].value)
    assert (stored["max_time_limit_s"], stored["default_time_limit_s"]) == (60.0, 30.0)
    expect_refused(cluster, lambda: stub.SetTeam(pb.SetTeamRequest(name="short", default_time_limit_seconds=61),
                                                 timeout=10), C.INVALID_ARGUMENT, "default_time_limit_s")
    with Client(addr, agent="agent-s", host="h1") as s, Client(addr, agent="agent-o", host="h1") as o:
        # (the replica's mirror follows the team's write: poll until the default shows)
        def default_shows() -> bool:
            lease = s.acquire(100)
            lease.release()
            return lease.time_limit == 30.0
        wait_for(default_shows, LIVENESS_S, "the team's default")
        assert s.acquire(100, time_limit=60).time_limit == 60.0
        with pytest.raises(errors.InvalidArgument) as info:
            s.acquire(100, time_limit=61)
        assert info.value.field == "time_limit_seconds"
        assert o.acquire(100).time_limit == 0.0                    # another team: the fleet's (no default)
        assert o.acquire(100, time_limit=600).time_limit == 600.0  # and the fleet's maximum
