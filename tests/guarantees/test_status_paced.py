"""A whole fleet's status leaves the replica's other work room: its host views, and its message host by host, are
built in slices, with pauses for the event loop (``aio.Pacer``). (With 10,000 hosts and 100,000 leases a status was about 4 s of one block of
work, during which an acquire of the same replica waited up to 2 s, and the console reads the status every few
seconds while a page is open: docs/performance.md, "Fleet scale, the fifth day".)

Measured without a clock: a task that counts its turns on the replica's loop, and the count at each host built."""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import grpc
import pytest

from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from coordinator import aio
from coordinator.records import VramLease, dumps
from coordinator.replica import status
from coordinator.rpc import status_message
from coordinator.txn import Put
from tests.support.cluster import Cluster

pytestmark = pytest.mark.integration

HOSTS = 100


def _fill(cluster: Cluster) -> None:
    keys = cluster.keys

    async def fill() -> None:
        etcd_lease = await cluster.store.grant(600)
        ops: list[Any] = []
        for h in range(HOSTS):
            host, uuid = f"fleet-{h:03d}", f"GPU-fleet-{h:03d}-0"
            ops.append(Put(keys.gpu(host, uuid), dumps({"capacity_mb": 81920, "seq": 1})))
            lease = VramLease(id=f"l{h:08x}", host=host, gpu_uuid=uuid, gpu_index=0, agent="agent-a",
                              session_id="00000000000000aa", vram_mb=1024, priority=0, preemptible=True,
                              request_id=f"r{h}", token=1, created_at=time.time())
            ops.append(Put(keys.lease(host, uuid, lease.id), dumps(lease.to_json()), etcd_lease))
        for at in range(0, len(ops), 100):
            await cluster.store.commit([], ops[at:at + 100])
    cluster.lt.run(fill())


def _counted(fn: Callable[..., Any], turns: list[int], seen: list[int]) -> Callable[..., Any]:
    def counted(*args: Any, **kw: Any) -> Any:
        seen.append(turns[0])
        return fn(*args, **kw)
    return counted


def test_a_fleets_status_is_built_with_pauses_for_the_replicas_other_work(cluster: Cluster,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    addr = cluster.start_coordinator()
    _fill(cluster)
    turns, views_at, hosts_at = [0], [], []
    monkeypatch.setattr(aio, "SLICE_S", 0.0)    # a pause after every host (these hosts are little work each)
    monkeypatch.setattr(status, "host_view", _counted(status.host_view, turns, views_at))
    monkeypatch.setattr(status_message, "host_json", _counted(status_message.host_json, turns, hosts_at))
    stop = asyncio.Event()

    async def other_work() -> None:
        while not stop.is_set():
            turns[0] += 1
            await asyncio.sleep(0)
    worker = asyncio.run_coroutine_threadsafe(other_work(), cluster.lt.loop)
    try:
        with grpc.insecure_channel(addr) as channel:
            resp = pb_grpc.CoordinatorStub(channel).GetStatus(pb.GetStatusRequest(), timeout=60)
    finally:
        cluster.lt.loop.call_soon_threadsafe(stop.set)
        worker.result(10)
    assert len([h for h in resp.hosts if h.host.startswith("fleet-")]) == HOSTS
    assert len(views_at) >= HOSTS and len(hosts_at) >= HOSTS
    # The other task ran between one host and the next, in both steps: at each pause.
    assert len(set(views_at)) >= HOSTS, views_at
    assert len(set(hosts_at)) >= HOSTS, hosts_at
