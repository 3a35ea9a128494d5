"""Idle GPUs (issue 31, docs/policies.md "Idle GPUs"): real etcd, a coordinator and a node with simulated GPUs whose
utilization the ``--fake-processes`` file sets. A lease on a GPU at 0 % for the idle window is evicted with the
reason ``idle`` under ``evict``, only shown (status and ``gpucoord_idle_leases``) under ``warn``; a lease on a GPU
at 50 % is never touched, nor one on a GPU whose utilization is unknown. Only the order is asserted (the notice
not before the window has passed since the grant), with liveness deadlines. The history checker runs after every
test (with its idle rule: an ``idle`` revoke only after its notice's grace)."""
from __future__ import annotations

import json
import pathlib
import time
from typing import Any, Iterator

import grpc
import pytest

from agent_client import Client
from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from coordinator import metrics
from tests.support.cluster import Cluster
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]
LIVENESS_S = 60.0
WINDOW_S = 2.0


def fleet(cluster: Cluster, tmp_path: pathlib.Path, action: str) -> tuple[str, Any]:
    """Host h1: GPU 0 at 0 %, GPU 1 at 50 %, GPU 2 unknown; a coordinator with a 2 s window below 5 %."""
    procs = tmp_path / "procs.json"
    procs.write_text(json.dumps({"utilization": {"0": 0, "1": 50}}))
    addr = cluster.start_coordinator(idle_after_s=WINDOW_S, idle_below_pct=5.0, idle_action=action,
                                     eviction_grace_s=1.0)
    wait_for(lambda: cluster.get_prefix(cluster.keys.election()), 10, "the coordinator's election key")
    cluster.start_node("h1", "3x16GiB", fake_processes=str(procs))
    wait_for(lambda: cluster.get_prefix(cluster.keys.host("h1")), 10, "host h1 to register")
    return addr, pb_grpc.CoordinatorStub(grpc.insecure_channel(addr))


def leases_by_id(stub: Any) -> dict[str, Any]:
    status = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
    return {x.id: x for h in status.hosts for x in h.leases}


@pytest.fixture
def evicting(cluster: Cluster, tmp_path: pathlib.Path) -> Iterator[tuple[str, Any]]:
    yield fleet(cluster, tmp_path, "evict")


def test_an_idle_lease_is_evicted_with_reason_idle_and_a_busy_one_is_never_touched(
        cluster: Cluster, evicting: tuple[str, Any]) -> None:
    addr, stub = evicting
    with Client(addr, agent="agent-a", host="h1") as a:
        before = time.monotonic()
        idle = a.acquire(1000, gpu=0)
        busy = a.acquire(1000, gpu=1)
        unknown = a.acquire(1000, gpu=2)
        assert idle.evicting.wait(LIVENESS_S), "no idle notice"
        assert time.monotonic() - before >= WINDOW_S   # not before the window has passed since the grant
        assert idle.notice is not None and idle.notice.reason == "idle"
        (notice,) = [json.loads(kv.value) for kv in cluster.get_prefix(cluster.keys.evictions())]
        assert notice["lease_id"] == idle.id and notice["reason"] == "idle" and notice["requested_by"] == "operator"
        # The holder does not release: the leader revokes it after the grace.
        wait_for(lambda: idle.id not in {x.id for x in cluster.leases()}, LIVENESS_S, "the idle lease's revoke")
        shown = leases_by_id(stub)
        assert set(shown) == {busy.id, unknown.id}
        assert not shown[busy.id].idle and shown[busy.id].idle_since == 0 and shown[busy.id].idle_action == "evict"
        assert not shown[unknown.id].idle and shown[unknown.id].idle_since == 0
        gpus = {g.index: g for h in stub.GetStatus(pb.GetStatusRequest(), timeout=10).hosts for g in h.gpus}
        assert [gpus[i].utilization_percent for i in range(3)] == [0, 50, -1]
        assert not busy.evicting.is_set() and not unknown.evicting.is_set()
        assert len(cluster.get_prefix(cluster.keys.evictions())) == 0
        busy.release()
        unknown.release()


def test_under_warn_an_idle_lease_is_shown_idle_and_never_noticed(cluster: Cluster, tmp_path: pathlib.Path) -> None:
    addr, stub = fleet(cluster, tmp_path, "warn")
    with Client(addr, agent="agent-a", host="h1") as a:
        idle = a.acquire(1000, gpu=0)
        busy = a.acquire(1000, gpu=1)
        wait_for(lambda: leases_by_id(stub)[idle.id].idle, LIVENESS_S, "status to show the lease idle")
        shown = leases_by_id(stub)[idle.id]
        assert shown.idle_action == "warn" and 0 < shown.idle_since <= time.time()

        def gauge() -> float:
            return metrics.REGISTRY.get_sample_value("gpucoord_idle_leases", {"team": "default", "action": "warn"}) or 0

        wait_for(lambda: gauge() >= 1, LIVENESS_S, "gpucoord_idle_leases to count it")
        # Several sweeps of the leader after it was idle: still no notice, both leases held.
        seen = time.monotonic()
        wait_for(lambda: time.monotonic() - seen > 3 * WINDOW_S, LIVENESS_S, "a few more sweeps")
        assert not cluster.get_prefix(cluster.keys.evictions())
        assert {idle.id, busy.id} <= {x.id for x in cluster.leases()}
        assert not idle.evicting.is_set() and not leases_by_id(stub)[busy.id].idle
        idle.release()
        busy.release()


def test_status_json_and_the_teams_policy(cluster: Cluster, evicting: tuple[str, Any]) -> None:
    """A team that sets its own policy (here: warn, over the fleet's evict) is judged by it; status --json carries
    the new fields."""
    addr, stub = evicting
    stub.SetTeam(pb.SetTeamRequest(name="calm", members=pb.TeamMembers(patterns=["agent-c"]), idle_action="warn"),
                 timeout=10)
    with Client(addr, agent="agent-c", host="h1") as c:
        lease = c.acquire(1000, gpu=0)
        wait_for(lambda: leases_by_id(stub)[lease.id].idle, LIVENESS_S, "status to show the team's lease idle")
        assert leases_by_id(stub)[lease.id].idle_action == "warn" and not lease.evicting.is_set()
        team = stub.GetTeam(pb.GetTeamRequest(name="calm"), timeout=10).team.team
        assert team.idle_action == "warn" and team.idle_after_seconds == 0
        lease.release()


def test_a_load_over_two_replicas_with_idle_eviction_keeps_every_guarantee(cluster: Cluster,
                                                                            tmp_path: pathlib.Path) -> None:
    """8 agents over two replicas on GPUs at 0 %, with a 2 s window under ``evict``, while a held lease is never
    released: every call ends with a documented status, the held lease gets its idle notice and is revoked, and the
    history checker (G1, G3, G5, G6 and the idle rule) replays it all."""
    import asyncio

    from tests.support.load import run_load

    procs = tmp_path / "procs.json"
    procs.write_text(json.dumps({"utilization": {"0": 0, "1": 0}}))
    cluster.start_node("h1", "2x16GiB", fake_processes=str(procs))
    policy = {"idle_after_s": WINDOW_S, "idle_below_pct": 5.0, "idle_action": "evict", "eviction_grace_s": 1.0}
    a, b = cluster.start_coordinator(**policy), cluster.start_coordinator(**policy)
    with Client([b, a], agent="holder", host="h1") as c:
        held = c.acquire(2000)
        load = asyncio.run(run_load([[a, b], [b, a]] * 4, "h1", 8.0, seed=37))
        assert not load.undocumented(), load.undocumented()[:5]
        assert load.granted > 0
        assert held.evicting.wait(LIVENESS_S) and held.notice is not None and held.notice.reason == "idle"
        wait_for(lambda: not [x for x in cluster.leases() if x.id == held.id], LIVENESS_S, "the held lease's revoke")
