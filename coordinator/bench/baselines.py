"""What gpucoord's figures are measured against, in the same run on the same etcd.

* An empty gRPC unary (``Ping``) and raw etcd calls: a linearizable Range and a compare-and-put txn, timed
  one by one (P1), and compare-and-put txns/s from concurrent writers (P3).
* A raw etcd_lease holder process: grant, put a key on it, keep it alive like a session (P6).
* A lock-based admission (P4): the pattern gpucoord replaces. Its keys live under ``/lockbench/``, built
  here, apart from gpucoord's prefix and schema (``coordinator/keys.py`` is not involved).
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Callable

from coordinator.bench.load import time_async
from coordinator.etcd.store import Store
from coordinator.etcd.types import KV, GetResult
from coordinator.txn import CreateRevisionIs, Delete, Get, ModRevisionIs, Op, Put, Range


def unary_times(addr: str, n: int) -> list[float]:
    """Seconds of each of ``n`` empty unary calls (``Ping``) to the coordinator at ``addr``, after 50 untimed."""
    import grpc

    from agent_client.api import coordinator_pb2 as pb
    from agent_client.api import coordinator_pb2_grpc as pb_grpc

    with grpc.insecure_channel(addr) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        for _ in range(50):
            stub.Ping(pb.PingRequest())
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            stub.Ping(pb.PingRequest())
            out.append(time.perf_counter() - t0)
    return out


async def read_and_cas_times(ep: str, n: int) -> tuple[list[float], list[float]]:
    """Seconds of each of ``n`` linearizable Ranges of one key (after 50 untimed), then of each of ``n``
    compare-and-put txns on it, each comparing the mod_revision the previous one wrote."""
    async with Store([ep]) as s:
        key = b"/bench/raw"
        rev = await s.put(key, b"0")
        for _ in range(50):
            await s.snapshot([Range(key)])
        reads = await time_async(n, lambda: s.snapshot([Range(key)]))
        state = {"rev": rev}

        async def cas() -> None:
            res = await s.commit([ModRevisionIs(key, state["rev"])], [Put(key, b"1")])
            assert res.succeeded
            state["rev"] = res.revision
        return reads, await time_async(n, cas)


async def cas_rate(ep: str, writers: int, seconds: float) -> float:
    """Compare-and-put txns/s of ``writers`` concurrent writers, each on its own key, over up to 16 clients."""
    stores = [Store([ep]) for _ in range(min(writers, 16))]
    for s in stores:
        await s.connect()
    count = 0
    stop_at = time.perf_counter() + seconds

    async def writer(i: int) -> None:
        nonlocal count
        s = stores[i % len(stores)]
        key = f"/bench/cas/{i}".encode()
        rev = await s.put(key, b"0")
        while time.perf_counter() < stop_at:
            res = await s.commit([ModRevisionIs(key, rev)], [Put(key, b"1")])
            rev = res.revision
            count += 1
    t0 = time.perf_counter()
    await asyncio.gather(*(writer(i) for i in range(writers)))
    wall = time.perf_counter() - t0
    for s in stores:
        await s.close()
    return count / wall


def raw_holder_main(spec_json: str) -> None:
    """A raw etcd_lease holder (the P6 baseline): grant, put a key on it, keep it alive like a session."""
    spec = json.loads(spec_json)

    async def run() -> None:
        async with Store([spec["ep"]]) as store:
            etcd_lease = await store.grant(spec["ttl"])
            await store.put(spec["key"].encode(), b"x", etcd_lease)
            print("READY raw port=0", flush=True)
            while True:
                await asyncio.sleep(spec["interval"])
                await store.keepalive(etcd_lease)
    asyncio.run(run())


class LockAdmission:
    """The pattern gpucoord replaces: lock the GPU, read, decide, write, unlock.

    The lock is etcd's recipe (Go's ``concurrency.Mutex``): put ``lock/<gpu>/<etcd_lease>`` under the
    holder's etcd_lease, wait until every key of the lock with a lower create_revision is deleted, then
    hold; unlock deletes the key.
    """

    def __init__(self, store: Store, gpu: str, capacity_mb: int) -> None:
        self.store, self.capacity_mb = store, capacity_mb
        # The baseline's own keys, outside gpucoord's prefix and schema (coordinator/keys.py is not involved).
        self.gpu = gpu
        self.lock_prefix = f"/lockbench/lock/{gpu}/".encode()
        self.ledger = f"/lockbench/gpus/{gpu}".encode()
        self.leases = f"/lockbench/leases/{gpu}/".encode()

    def _lease_key(self, lease_id: str) -> bytes:
        return f"/lockbench/leases/{self.gpu}/{lease_id}".encode()

    async def _lock(self, etcd_lease: int) -> bytes:
        key = f"/lockbench/lock/{self.gpu}/{etcd_lease:x}".encode()
        res = await self.store.commit([CreateRevisionIs(key, 0)], [Put(key, b"", etcd_lease)], [Get(key)])
        my_rev = res.revision
        if not res.succeeded:
            got = res.responses[0]
            assert isinstance(got, GetResult)
            my_rev = got.kvs[0].create_revision
        while True:
            snap = await self.store.snapshot([Range(self.lock_prefix, prefix=True, keys_only=True)])
            older = [kv for kv in snap.ranges[0] if kv.create_revision < my_rev]
            if not older:
                return key
            last = max(older, key=lambda kv: kv.create_revision)
            async for batch in self.store.watch(last.key, prefix=False, start_revision=snap.revision + 1):
                if any(ev.kind == "DELETE" for ev in batch.events):
                    break

    async def _locked(self, etcd_lease: int, change: Callable[[int, int, list[KV]], list[Op]]) -> None:
        key = await self._lock(etcd_lease)
        try:
            snap = await self.store.snapshot([Range(self.ledger), Range(self.leases, prefix=True)])
            seq = int(snap.ranges[0][0].value) if snap.ranges[0] else 0
            used = sum(int(kv.value) for kv in snap.ranges[1])
            await self.store.commit([], change(seq, used, list(snap.ranges[1])))
        finally:
            await self.store.commit([], [Delete(key)])

    async def acquire(self, etcd_lease: int, lease_id: str, vram_mb: int) -> None:
        def grant(seq: int, used: int, _kvs: list[KV]) -> list[Op]:
            if used + vram_mb > self.capacity_mb:
                raise RuntimeError("lock baseline: no room")
            return [Put(self._lease_key(lease_id), str(vram_mb).encode(), etcd_lease),
                    Put(self.ledger, str(seq + 1).encode())]
        await self._locked(etcd_lease, grant)

    async def release(self, etcd_lease: int, lease_id: str) -> None:
        def free(seq: int, _used: int, _kvs: list[KV]) -> list[Op]:
            return [Delete(self._lease_key(lease_id)), Put(self.ledger, str(seq + 1).encode())]
        await self._locked(etcd_lease, free)


async def lock_pairs(ep: str, agents: int, seconds: float) -> tuple[int, list[float], list[float]]:
    """The lock-based admission's acquire+release loop on one GPU, ``agents`` at once for ``seconds``:
    returns pairs, acquire and release latencies."""
    stop_at = time.perf_counter() + seconds
    acq: list[float] = []
    rel: list[float] = []
    stores = [Store([ep]) for _ in range(agents)]   # one client (channel) per agent, as agents would have
    for s in stores:
        await s.connect()
    try:
        async def loop(i: int, store: Store) -> None:
            lock = LockAdmission(store, "gpu0", 80 * 1024)
            etcd_lease = await store.grant(60)
            n = 0
            while time.perf_counter() < stop_at:
                lease_id = f"{i}-{n}"
                n += 1
                t0 = time.perf_counter()
                await lock.acquire(etcd_lease, lease_id, 16)
                t1 = time.perf_counter()
                await lock.release(etcd_lease, lease_id)
                acq.append(t1 - t0)
                rel.append(time.perf_counter() - t1)
            await store.revoke(etcd_lease)
        await asyncio.gather(*(loop(i, s) for i, s in enumerate(stores)))
    finally:
        for s in stores:
            await s.close()
    return len(acq), acq, rel
