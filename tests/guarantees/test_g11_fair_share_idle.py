"""The idle capacity beyond the quotas, shared by fair share over time (issue 33 acceptance, docs/teams.md "Fair
share"), against a real etcd, two replicas and a node of 10 GPUs: teams light and heavy, equal weights, no quota;
heavy used the fleet all of the last week (its hourly rollups say so), so its factor is 1/4 against light's 1 and
the shares of the 10 GPUs beyond the quotas are 1/5 and 4/5. Heavy holds all 10 GPUs (nobody else asked: the
share holds nobody back then); then 10 of light's and 10 of heavy's requests wait (light's ranked first), and
heavy's first leases end one by one. Each freed GPU goes to light until light borrows its 8; after that light's
waiters wait for their team's fair share, and heavy's get its 2 back: the GPUs end 8 to 2, the formula's ratio,
through either replica. The history checker ends the test."""
from __future__ import annotations

import json
import time

import pytest

from agent_client import Client
from agent_client.api import coordinator_pb2 as pb
from coordinator.policy.accounting import hour_of
from tests.support.cluster import Cluster
from tests.support.rpcs import coordinator_stub
from tests.support.waiting import LIVENESS_S, Background, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]
GPUS = 10


def _held(cluster: Cluster) -> dict[str, int]:
    out = {"light": 0, "heavy": 0}
    for kv in cluster.get_prefix(cluster.keys.leases()):
        out[json.loads(kv.value)["agent"].split("-")[0]] += 1
    return out


def _queued(cluster: Cluster) -> int:
    return len(cluster.get_prefix(cluster.keys.queue()))


def test_with_a_week_of_heavy_use_the_idle_gpus_go_four_to_one_to_the_other_team_while_both_wait(
        cluster: Cluster) -> None:
    cluster.start_node("h1", f"{GPUS}x16GiB")
    replicas = [cluster.start_coordinator(fair_share_every_s=0.2) for _ in range(2)]
    stub = coordinator_stub(replicas[0])
    for team in ("light", "heavy"):   # a limit (above the fleet) serializes each team's grants through its ledger
        stub.SetTeam(pb.SetTeamRequest(name=team, quota_mb=0, limit_mb=GPUS * 1 << 20,
                                       members=pb.TeamMembers(patterns=[f"{team}-*"])), timeout=10)
    now = time.time()
    for h in range(2, 2 + 7 * 24):   # the last week, every hour: all 10 GPUs busy (rollups as the accountant writes)
        cluster.lt.run(cluster.store.put(cluster.keys.usage_rollup(hour_of(now - h * 3600), "heavy"), json.dumps(
            {"gpu_s": GPUS * 3600.0, "vram_mib_s": 0.0, "evictions": 0, "leases": GPUS, "agents": {}}).encode()))
    for addr in replicas:
        ctx = cluster.service(addr).ctx
        wait_for(lambda ctx=ctx: ctx.fair_share.get("heavy", 1.0) < 0.3 and ctx.borrowable_mb == GPUS * 16384,
                 LIVENESS_S,
                 "each replica's fair-share factors and the fleet's VRAM beyond the quotas")
        print(f"replica {addr}: factors {ctx.fair_share}, beyond the quotas {ctx.borrowable_mb} MiB")
    clients: list[Client] = []
    try:
        heavy = Client(replicas[1], agent="heavy-0", host="h1")
        clients.append(heavy)
        first = [heavy.acquire(0, exclusive=True) for _ in range(GPUS)]      # nobody else waits: all 10
        assert _held(cluster) == {"light": 0, "heavy": GPUS}
        waiters: list[Background] = []
        for team, addr in (("light", replicas[0]), ("heavy", replicas[1])):
            for i in range(GPUS):
                c = Client(addr, agent=f"{team}-{i + 1}", host="h1")
                clients.append(c)
                waiters.append(Background(c.acquire, 0, exclusive=True, wait=4 * LIVENESS_S))
                queued = len(waiters)
                wait_for(lambda queued=queued: _queued(cluster) == queued, LIVENESS_S, f"{team}'s waiter {i + 1} queued")
        for n, lease in enumerate(first):
            lease.release()
            wait_for(lambda: sum(_held(cluster).values()) == GPUS, LIVENESS_S, f"the GPU freed by release {n + 1} "
                     "granted again")
            print(f"after {n + 1} of heavy's first leases ended: {_held(cluster)}")
        # Settled: light has its 4/5 (8 GPUs), heavy its 1/5 (2); the rest of each team's waiters wait.
        assert _held(cluster) == {"light": 8, "heavy": 2}
        assert _queued(cluster) == 10
    finally:
        for c in clients:
            c.close()
