"""G3's order with idle leases (issue 31, docs/policies.md "Idle GPUs"): among the candidates of one priority, priority
eviction takes a lease its replica judges idle before a busy one, although G3 alone would take the newest. Real
etcd, a coordinator (idle action ``warn``: the idle lease is only judged, never noticed by idle reclaim itself) and
a node whose simulated GPU 0 runs at 0 % and GPU 1 at 50 %. The history checker runs after each test (G3: the
victims are preemptible leases of lower priority, gone before the grant)."""
from __future__ import annotations

import json
import pathlib

import grpc
import pytest

from agent_client import Client
from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from tests.support.cluster import Cluster
from tests.support.waiting import LIVENESS_S, Background, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]
WINDOW_S = 2.0


@pytest.mark.parametrize("exclusive", [False, True], ids=["vram", "exclusive"])
def test_priority_eviction_takes_the_idle_lease_before_a_newer_busy_one(cluster: Cluster, tmp_path: pathlib.Path,
                                                                        exclusive: bool) -> None:
    procs = tmp_path / "procs.json"
    procs.write_text(json.dumps({"utilization": {"0": 0, "1": 50}}))
    addr = cluster.start_coordinator(idle_after_s=WINDOW_S, idle_below_pct=5.0, idle_action="warn",
                                     eviction_grace_s=30.0)
    cluster.start_node("h1", "2x16GiB", fake_processes=str(procs))
    wait_for(lambda: cluster.get_prefix(cluster.keys.host("h1")), LIVENESS_S, "host h1 to register")
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(addr))
    size = {"exclusive": True} if exclusive else {"vram_mb": 10_000}
    with Client(addr, agent="low", host="h1") as low, Client(addr, agent="high", host="h1") as high:
        idle = low.acquire(gpu=0, **size)          # the older lease, on the GPU at 0 %
        busy = low.acquire(gpu=1, **size)          # the newer, on the GPU at 50 %: G3 alone would take it

        def judged_idle() -> bool:
            leases = {x.id: x for h in stub.GetStatus(pb.GetStatusRequest(), timeout=10).hosts for x in h.leases}
            return leases[idle.id].idle and not leases[busy.id].idle

        wait_for(judged_idle, LIVENESS_S, "the coordinator to judge the GPU-0 lease idle")
        want = Background(lambda: high.acquire(priority=9, wait=LIVENESS_S, **size))
        assert idle.evicting.wait(LIVENESS_S), "the idle lease got no eviction notice"
        assert idle.notice is not None and idle.notice.reason != "idle"    # a priority eviction, not idle reclaim
        (notice,) = [json.loads(kv.value) for kv in cluster.get_prefix(cluster.keys.evictions())]
        assert notice["lease_id"] == idle.id
        idle.release()
        got = want.result()
        assert got.gpu_index == 0
        assert not busy.evicting.is_set() and busy.id in {x.id for x in cluster.leases()}
        got.release()
        busy.release()
