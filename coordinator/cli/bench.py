"""``gpucoord bench``: performance targets as ratios to baselines measured in the same run.

``bench acquire`` starts its own etcd, coordinator and node daemon on loopback, then measures:

* P1: acquire p50 through agent_client, against (empty gRPC unary p50 + raw etcd read-txn p50 +
  raw compare-and-put txn p50). Target <= 1.3.
* P2: raft proposals per successful acquire, from etcd's /metrics, serial and with 16 concurrent
  agents (where group commit batches them). Target <= 1.05.

``bench p7`` measures P7 on the same kind of setup: the eviction-notice latency (a priority request
arrives -> the victim's on_evict callback runs) and the release-to-grant latency (the holder's release
call starts -> the waiter's acquire returns), p50 and p99. Target p99 <= 50 ms.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any, Awaitable, Callable

from coordinator.etcd.process import EtcdCluster


def _p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def proposals(metrics_url: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("etcd_server_proposals_committed_total"):
                return float(line.split()[-1])
    raise RuntimeError("etcd_server_proposals_committed_total not in etcd's /metrics")


async def _time_async(n: int, op: Callable[[], Awaitable[Any]]) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await op()
        out.append(time.perf_counter() - t0)
    return out


def _spawn(argv: list[str], kind: str) -> tuple[subprocess.Popen[bytes], int]:
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if not line.startswith(f"READY {kind}"):
        proc.kill()
        raise RuntimeError(f"{kind} did not start")
    return proc, int(line.split("port=")[1])


def bench_acquire(n: int) -> dict[str, float]:
    import grpc

    from agent_client import AsyncClient, Client
    from agent_client.api import coordinator_pb2 as pb
    from agent_client.api import coordinator_pb2_grpc as pb_grpc
    from coordinator.etcd.store import Store
    from coordinator.etcd.ops import cmp_mod_revision, op_put, range_req

    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="gpucoord-bench-") as tmp:
        etcd = EtcdCluster(1, base_dir=tmp).start()
        procs = []
        try:
            ep = etcd.endpoints[0]
            metrics_url = etcd.members[0].metrics_url
            coord, cport = _spawn(["coordinator", "--etcd", ep, "--listen", "127.0.0.1:0"], "coordinator")
            procs.append(coord)
            node, _ = _spawn(["node", "--etcd", ep, "--host", "bench", "--listen", "127.0.0.1:0",
                              "--fake-gpus", "8x80GiB", "--heartbeat", "600"], "node")
            procs.append(node)
            addr = f"127.0.0.1:{cport}"

            # Baseline 1: an empty unary RPC to the same server.
            stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(addr))
            for _ in range(50):
                stub.Ping(pb.PingRequest())
            grpc_t = []
            for _ in range(n):
                t0 = time.perf_counter()
                stub.Ping(pb.PingRequest())
                grpc_t.append(time.perf_counter() - t0)

            # Baselines 2 and 3: raw etcd read txn and compare-and-put txn, with the same client library.
            async def raw() -> tuple[list[float], list[float]]:
                async with Store([ep]) as s:
                    key = b"/bench/raw"
                    rev = await s.put(key, b"0")
                    for _ in range(50):
                        await s.snapshot([range_req(key)])
                    reads = await _time_async(n, lambda: s.snapshot([range_req(key)]))
                    state = {"rev": rev}

                    async def cas() -> None:
                        res = await s.commit([cmp_mod_revision(key, state["rev"])], [op_put(key, b"1")])
                        assert res.succeeded
                        state["rev"] = res.revision
                    writes = await _time_async(n, cas)
                    return reads, writes
            read_t, cas_t = asyncio.run(raw())

            # P1: acquire through agent_client (sync API), release untimed.
            with Client(addr, agent="bench-a", host="bench") as c:
                for _ in range(30):
                    c.acquire(16).release()
                acq_t = []
                for _ in range(n):
                    t0 = time.perf_counter()
                    lease = c.acquire(16)
                    acq_t.append(time.perf_counter() - t0)
                    lease.release()
                # P2 serial: only acquires in the window (releases come after).
                m = min(n, 200)  # stays under the per-agent lease limit
                before = proposals(metrics_url)
                held = [c.acquire(16) for _ in range(m)]
                serial_props = (proposals(metrics_url) - before) / m
                for lease in held:
                    lease.release()

            # P2 with 16 concurrent agents on one host: group commit.
            async def concurrent() -> float:
                clients = [AsyncClient(addr, agent=f"bench-{i}", host="bench") for i in range(16)]
                for cl in clients:
                    await cl.connect()
                per = max(1, n // 16)
                before = proposals(metrics_url)
                leases = await asyncio.gather(*(cl.acquire(16) for cl in clients for _ in range(per)))
                props = (proposals(metrics_url) - before) / len(leases)
                for cl in clients:
                    await cl.close()
                return props
            conc_props = asyncio.run(concurrent())
        finally:
            for p in procs:
                p.terminate()
                p.wait(10)
            etcd.stop()

    base = _p(grpc_t, .5) + _p(read_t, .5) + _p(cas_t, .5)
    results.update(grpc_p50_ms=_p(grpc_t, .5) * 1e3, read_txn_p50_ms=_p(read_t, .5) * 1e3,
                   cas_txn_p50_ms=_p(cas_t, .5) * 1e3, acquire_p50_ms=_p(acq_t, .5) * 1e3,
                   acquire_p99_ms=_p(acq_t, .99) * 1e3, acquire_mean_ms=statistics.mean(acq_t) * 1e3,
                   p1_ratio=_p(acq_t, .5) / base, p2_serial=serial_props, p2_concurrent=conc_props)
    return results


def bench_p7(n: int) -> dict[str, float]:
    from agent_client import AsyncClient
    from coordinator.etcd.store import Store

    with tempfile.TemporaryDirectory(prefix="gpucoord-bench-") as tmp:
        etcd = EtcdCluster(1, base_dir=tmp).start()
        procs = []
        try:
            ep = etcd.endpoints[0]
            coord, cport = _spawn(["coordinator", "--etcd", ep, "--listen", "127.0.0.1:0", "--grace", "30"],
                                  "coordinator")
            procs.append(coord)
            node, _ = _spawn(["node", "--etcd", ep, "--host", "bench", "--listen", "127.0.0.1:0",
                              "--fake-gpus", "1x16GiB", "--heartbeat", "600"], "node")
            procs.append(node)
            addr = f"127.0.0.1:{cport}"

            async def run() -> tuple[list[float], list[float]]:
                async with Store([ep]) as store, AsyncClient(addr, agent="holder", host="bench") as holder, \
                        AsyncClient(addr, agent="waiter", host="bench") as waiter:
                    queue_prefix = b"/gpucoord/queue/bench/"

                    async def queued() -> None:
                        while not (await store.get_prefix(queue_prefix)).ranges[0]:
                            await asyncio.sleep(0.001)
                    promote, notice = [], []
                    for _ in range(n):
                        held = await holder.acquire(16384, preemptible=False)
                        task = asyncio.create_task(waiter.acquire(16384, wait=10))
                        await asyncio.wait_for(queued(), 10)
                        t0 = time.perf_counter()
                        await held.release()
                        lease = await task
                        promote.append(time.perf_counter() - t0)
                        await lease.release()
                    for _ in range(n):
                        victim = await holder.acquire(16384, priority=0)
                        got = asyncio.Event()
                        stamp: list[float] = []

                        def on_evict(_notice: Any, victim: Any = victim) -> None:
                            stamp.append(time.perf_counter())
                            got.set()
                        victim.on_evict(on_evict)
                        t0 = time.perf_counter()
                        task = asyncio.create_task(waiter.acquire(8192, priority=10, wait=10))
                        await asyncio.wait_for(got.wait(), 10)
                        notice.append(stamp[0] - t0)
                        await victim.release()
                        await (await task).release()
                    return promote, notice
            promote, notice = asyncio.run(run())
        finally:
            for p in procs:
                p.terminate()
                p.wait(10)
            etcd.stop()
    return {"release_to_grant_p50_ms": _p(promote, .5) * 1e3, "release_to_grant_p99_ms": _p(promote, .99) * 1e3,
            "eviction_notice_p50_ms": _p(notice, .5) * 1e3, "eviction_notice_p99_ms": _p(notice, .99) * 1e3}


def main(args: argparse.Namespace) -> int:
    if args.what in ("p7", "all"):
        r = bench_p7(min(args.n, 100))
        print(f"P7        eviction notice    p50 {r['eviction_notice_p50_ms']:.1f} ms   "
              f"p99 {r['eviction_notice_p99_ms']:.1f} ms   (target p99 <= 50 ms)")
        print(f"P7        release -> grant   p50 {r['release_to_grant_p50_ms']:.1f} ms   "
              f"p99 {r['release_to_grant_p99_ms']:.1f} ms   (target p99 <= 50 ms)")
    if args.what in ("acquire", "all"):
        r = bench_acquire(args.n)
        print(f"baseline  empty gRPC unary p50     {r['grpc_p50_ms']:.3f} ms")
        print(f"baseline  raw etcd read txn p50    {r['read_txn_p50_ms']:.3f} ms")
        print(f"baseline  raw compare-and-put p50  {r['cas_txn_p50_ms']:.3f} ms")
        print(f"measured  acquire p50 (agent_client) {r['acquire_p50_ms']:.3f} ms  (p99 {r['acquire_p99_ms']:.3f} ms)")
        print(f"P1 ratio  acquire p50 / sum of baselines = {r['p1_ratio']:.2f}   (target <= 1.3)")
        print(f"P2        raft proposals per acquire: serial {r['p2_serial']:.3f}, "
              f"16 concurrent agents {r['p2_concurrent']:.3f}   (target <= 1.05)")
    return 0
