"""Fair share over time in reclaim (issue 33 point 3, G11, docs/teams.md "Fair share"), against a real etcd and a
replica: two teams borrow one GPU each; one of them, zz-heavy, used the fleet all of the last day (its hourly
rollups say so). A third team below its quota reclaims one GPU: by weight alone the tie would go to the name
(aa-light first); with the decayed usage, zz-heavy's factor is a quarter of aa-light's and its borrowed lease is
taken. The history checker ends the test."""
from __future__ import annotations

import json
import time

import pytest

from agent_client import Client
from agent_client.api import coordinator_pb2 as pb
from coordinator.policy.accounting import hour_of
from tests.support.cluster import Cluster
from tests.support.rpcs import coordinator_stub
from tests.support.waiting import LIVENESS_S, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]


def test_reclaim_takes_the_borrowed_lease_of_the_team_that_used_the_fleet_all_day(cluster: Cluster) -> None:
    cluster.start_node("h1", "4x16GiB")
    addr = cluster.start_coordinator(eviction_grace_s=0.5, eviction_kill_margin_s=0.5, fair_share_every_s=0.2)
    stub = coordinator_stub(addr)
    usable = min(g.usable_mb for h in stub.GetStatus(pb.GetStatusRequest(), timeout=10).hosts for g in h.gpus)
    for team, quota in (("aa-light", usable), ("zz-heavy", usable), ("rec", 2 * usable)):
        stub.SetTeam(pb.SetTeamRequest(name=team, quota_mb=quota, limit_mb=4 * usable,
                                       members=pb.TeamMembers(patterns=[f"{team}-*"])), timeout=10)
    now = time.time()
    for h in range(2, 26):   # the last day, every hour: 4 GPUs busy (a rollup as the accountant writes it)
        cluster.lt.run(cluster.store.put(cluster.keys.usage_rollup(hour_of(now - h * 3600), "zz-heavy"), json.dumps(
            {"gpu_s": 4 * 3600.0, "vram_mib_s": 0.0, "evictions": 0, "leases": 4, "agents": {}}).encode()))
    ctx = cluster.service(addr).ctx
    wait_for(lambda: 0 < ctx.fair_share.get("zz-heavy", 1.0) < ctx.fair_share.get("aa-light", 0.0), LIVENESS_S,
             "the replica's fair-share factors from the rollups")
    assert ctx.fair_share["zz-heavy"] < 0.5 * ctx.fair_share["aa-light"], ctx.fair_share
    with Client(addr, agent="aa-light-1", host="h1") as light, Client(addr, agent="zz-heavy-1", host="h1") as heavy, \
            Client(addr, agent="rec-1", host="h1") as rec:
        held = {("light", i): light.acquire(0, gpu=i, exclusive=True, priority=5) for i in (0, 1)}
        held |= {("heavy", i): heavy.acquire(0, gpu=i, exclusive=True, priority=5) for i in (2, 3)}
        over = {k for k, x in held.items() if x.over_quota}
        assert over == {("light", 1), ("heavy", 3)}, over    # each team's second GPU borrows
        granted = rec.acquire(0, exclusive=True, wait=LIVENESS_S)
        noticed = {k for k, x in held.items() if x.evicting.is_set()}
        assert noticed == {("heavy", 3)}, f"reclaim took {noticed}, not zz-heavy's borrowed lease"
        assert granted.gpus[0].index == 3
        granted.release()
