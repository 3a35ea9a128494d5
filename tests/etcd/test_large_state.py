"""Reads of any size: with 10,000 sessions and 20,000 leases stored (about 14 MB, beyond gRPC's 4 MiB per
response) a coordinator starts and serves, ``gpucoord status`` shows them all (a 5 MB answer), ``gpucoord keys``
dumps everything, and a replica whose watch lost its history (a network cut, then a compaction) re-reads the
whole state and carries on."""
from __future__ import annotations

import asyncio
import json
import logging
import pathlib
import subprocess
import sys
import time
from typing import Any, Iterator

import grpc
import pytest

from agent_client import Client
from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from coordinator.etcd.process import EtcdCluster
from coordinator.etcd.store import Store
from coordinator.keys import Keys, session_id_from_etcd_lease
from coordinator.records import VramLease, dumps
from coordinator.txn import Put
from tests.faultlink import FaultLink
from tests.support import REPO
from tests.support.cluster import Cluster
from tests.support.processes import child_env
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

SESSIONS = 10_000
LEASES = 20_000
HOSTS = 50                      # 200 leases on each (hosts with no node daemon: GONE, which changes nothing here)
PREFIX = "/gpucoord/"


def _session_value(i: int, host: str) -> bytes:
    # About 400 bytes, as a session with a client_version at its 256-byte bound is.
    return dumps({"agent": f"agent-{i:05d}", "host": host, "pid": 100_000 + i, "client_version": "v" * 256,
                  "ttl": 300, "opened_at": time.time(), "coordinator": "c-0123456789abcdef"})


async def _fill(store: Store, keys: Keys) -> int:
    etcd_leases = [await store.grant(3600) for _ in range(16)]
    ops: list[Any] = []
    for i in range(SESSIONS):
        host = f"big-{i % HOSTS:03d}"
        sid = session_id_from_etcd_lease(0x7000_0000_0000 + i)
        ops.append(Put(keys.session(f"agent-{i:05d}", sid), _session_value(i, host), etcd_leases[i % 16]))
    for h in range(HOSTS):
        ops.append(Put(keys.gpu(f"big-{h:03d}", f"GPU-big-{h:03d}-0"), dumps({"capacity_mb": 10**9, "seq": 200})))
    for i in range(LEASES):
        host, n = f"big-{i % HOSTS:03d}", i // HOSTS
        lease = VramLease(id=f"l{i:08x}", host=host, gpu_uuid=f"GPU-big-{i % HOSTS:03d}-0", gpu_index=0,
                          agent=f"agent-{i % SESSIONS:05d}",
                          session_id=session_id_from_etcd_lease(0x7000_0000_0000 + i % SESSIONS), vram_mb=1024,
                          priority=0, preemptible=True, request_id=f"req-{i:08d}".ljust(128, "x"), token=n + 1,
                          created_at=time.time())
        ops.append(Put(keys.lease(host, lease.gpu_uuid, lease.id), dumps(lease.to_json()), etcd_leases[i % 16]))
    batches = [ops[i:i + 128] for i in range(0, len(ops), 128)]
    for start in range(0, len(batches), 8):
        await asyncio.gather(*(store.commit([], batch) for batch in batches[start:start + 8]))
    return len(ops)


@pytest.fixture(scope="module")
def big_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EtcdCluster, int]]:
    # Its own etcd: this test compacts, and 20,000 keys would slow every other test's reads.
    with EtcdCluster(1, base_dir=tmp_path_factory.mktemp("big-etcd")) as etcd:
        async def fill() -> int:
            async with Store(etcd.endpoints) as s:
                return await _fill(s, Keys(PREFIX))
        yield etcd, asyncio.run(fill())


def test_a_coordinator_starts_serves_and_resyncs_with_10k_sessions_and_20k_leases(
        big_etcd: tuple[EtcdCluster, int], caplog: pytest.LogCaptureFixture, tmp_path: pathlib.Path) -> None:
    etcd, stored = big_etcd
    proxy = FaultLink(etcd.endpoints[0])
    cluster = Cluster([proxy.endpoint], PREFIX)
    try:
        cluster.start_node("live", "1x16GiB")
        addr = cluster.start_coordinator()                    # reads the whole prefix at start
        _, svc = cluster.coordinators[addr]
        assert len(svc.mirror.items("sessions")) == SESSIONS
        with Client(addr, agent="agent-live", host="live") as c:
            c.acquire(4096).release()
        # Status reads six whole-prefix ranges (the test's channel takes the large answer).
        stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(
            addr, options=[("grpc.max_receive_message_length", 256 * 2**20)]))
        status = stub.GetStatus(pb.GetStatusRequest(), timeout=60)
        assert sum(len(h.leases) for h in status.hosts) == LEASES
        assert status.ByteSize() > 4 * 2**20   # beyond gRPC's default limit of an answer
        # `gpucoord status`, as an operator runs it (the CLI takes answers beyond that limit).
        proc = subprocess.run([sys.executable, "-m", "coordinator.cli", "status", "--json", "--coordinator", addr],
                              capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert sum(len(h["leases"]) for h in json.loads(proc.stdout)["hosts"]) == LEASES

        # The replica's watch loses its history: a cut, two writes and a compaction while it is away.
        caplog.set_level(logging.WARNING, logger="coordinator.etcd.store")
        late = cluster.keys.session("agent-late", "1234")
        proxy.cut(loud=True)

        async def write_and_compact() -> None:
            async with Store(etcd.endpoints) as s:
                await s.put(late, _session_value(0, "live"))
                await s.compact(await s.put(late, _session_value(1, "live")))
        asyncio.run(write_and_compact())
        proxy.heal()
        wait_for(lambda: any("lost history" in r.getMessage() for r in caplog.records), 30,
                 "the replica's watch to be told its history was compacted")
        wait_for(lambda: svc.mirror.ready and svc.mirror.get(late) is not None, 60,
                 "the replica to re-read the whole state")
        assert len(svc.mirror.items("sessions")) == SESSIONS + 1
        with Client(addr, agent="agent-live", host="live") as c:
            c.acquire(4096).release()
    finally:
        cluster.close()
        proxy.close()

    # `gpucoord keys`, as an operator runs it, against the same etcd.
    out_path = tmp_path / "keys.txt"
    with open(out_path, "w") as out:
        proc = subprocess.run([sys.executable, "-m", "coordinator.cli", "keys", "--etcd", etcd.endpoints[0],
                               "--prefix", PREFIX], stdout=out, stderr=subprocess.PIPE, text=True,
                              env=child_env(), cwd=REPO, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = out_path.read_text().rstrip().rsplit("\n", 1)[-1]
    assert last.startswith("# ") and int(last.split()[1]) >= stored, last
