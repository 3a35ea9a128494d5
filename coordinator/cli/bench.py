"""``gpucoord bench``: every performance target of DESIGN.md as a ratio to a baseline measured in the same run.

Each phase starts what it needs on loopback (its own etcd, coordinator, node daemons), as subprocesses,
so that the coordinator's CPU can be read from its process alone:

* P1: acquire p50 through agent_client, against (empty gRPC unary p50 + raw etcd read p50 + raw
  compare-and-put txn p50). The raw read is a linearizable Range: gpucoord never sends a read-only Txn
  (they crash etcd 3.5.0-3.5.6 when cancelled), and neither does the baseline.
* P2: raft proposals per successful acquire (etcd's /metrics), serial and with 16 agents (group commit).
* P3: acquire+release pairs/s with 64 agents over 16 simulated hosts x 8 GPUs, against raw
  compare-and-put txn/s with 64 concurrent writers.
* P4: against a lock-based admission built here (etcd's lock recipe as Go's concurrency.Mutex does it;
  read the ledger and leases; put the lease and the ledger; unlock; release the same way), on one GPU:
  serial acquire p50, and acquire+release pairs/s with 16 agents; both p99s. The side-by-side at 1, 4
  and 16 agents also reports the coordinator's CPU seconds per pair (robust to a loaded machine).
* P5: acquire p50 with 1,000 simulated hosts x 8 GPUs and 10,000 live leases, against the same on an empty
  cluster; and the time from starting a new coordinator (the old one killed) to its first acquire.
* P6: reclaim after the holder is SIGKILLed, against a raw etcd_lease holder killed the same way with the
  same TTL and keepalive interval; and 1,000 sessions killed at once, all reclaimed within TTL + 2 s.
* P7: eviction notice and release-to-grant latency, p99.
* P8: idle cost with 1,000 open sessions: coordinator CPU % and RSS, node daemon CPU %, etcd writes/s
  (raft proposals/s: every writer, not only the node).

``--quick`` runs every phase small (under a minute): the suite runs it to prove every line is produced.
Its numbers mean little.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any, Awaitable, Callable, Iterator

from coordinator.etcd.process import EtcdCluster

PREFIX = b"/gpucoord/"


def _p(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def etcd_metric(metrics_url: str, name: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.split()[-1])
    raise RuntimeError(f"{name} not in etcd's /metrics")


def proposals(metrics_url: str) -> float:
    return etcd_metric(metrics_url, "etcd_server_proposals_committed_total")


async def _time_async(n: int, op: Callable[[], Awaitable[Any]]) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await op()
        out.append(time.perf_counter() - t0)
    return out


def _acquire_times(client: Any, n: int, warmup: int) -> list[float]:
    """Seconds of each of ``n`` acquires of a sync client (each released at once, untimed), after
    ``warmup`` untimed acquire+release pairs."""
    for _ in range(warmup):
        client.acquire(16).release()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        lease = client.acquire(16)
        out.append(time.perf_counter() - t0)
        lease.release()
    return out


def cpu_seconds(pid: int) -> float:
    import psutil
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def rss_mb(pid: int) -> float:
    import psutil
    return float(psutil.Process(pid).memory_info().rss) / (1 << 20)


# -- the rig: etcd, coordinators and nodes as subprocesses ----------------------------------------------------
def _spawn(argv: list[str], kind: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], int]:
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if not line.startswith(f"READY {kind}"):
        proc.kill()
        raise RuntimeError(f"{kind} did not start")
    return proc, int(line.split("port=")[1])


class Rig:
    """One etcd member and the processes of one phase; everything is stopped on exit."""

    def __init__(self, tmp: str, profile: str = "") -> None:
        self.etcd = EtcdCluster(1, base_dir=tmp).start()
        self.ep = self.etcd.endpoints[0]
        self.metrics_url = self.etcd.members[0].metrics_url
        self.procs: list[subprocess.Popen[bytes]] = []
        self.profile = profile

    def coordinator(self, *extra: str, listen: str = "127.0.0.1:0") -> tuple[subprocess.Popen[bytes], str]:
        argv = ["coordinator", "--etcd", self.ep, "--listen", listen, *extra]
        if self.profile:
            # cProfile writes its stats when the coordinator exits on SIGTERM.
            proc = subprocess.Popen([sys.executable, "-m", "cProfile", "-o", self.profile, "-m", "coordinator.cli",
                                     *argv], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            assert proc.stdout is not None
            line = proc.stdout.readline().decode()
            port = int(line.split("port=")[1])
        else:
            proc, port = _spawn(argv, "coordinator")
        self.procs.append(proc)
        return proc, f"127.0.0.1:{port}"

    def node(self, host: str, gpus: str, fake_hosts: int = 0, heartbeat: float = 600) -> subprocess.Popen[bytes]:
        argv = ["node", "--etcd", self.ep, "--host", host, "--listen", "127.0.0.1:0", "--fake-gpus", gpus,
                "--heartbeat", str(heartbeat)]
        if fake_hosts:
            argv += ["--fake-hosts", str(fake_hosts)]
        proc, _ = _spawn(argv, "node")
        self.procs.append(proc)
        return proc

    def worker(self, addr: str, hosts: list[str], sessions: int, leases: int, ttl: int, agents: int = 0,
               ) -> subprocess.Popen[bytes]:
        """A process holding ``sessions`` sessions (round robin over ``hosts``), ``leases`` leases each."""
        spec = json.dumps({"addr": addr, "hosts": hosts, "sessions": sessions, "leases": leases, "ttl": ttl,
                           "agents": agents or max(1, -(-sessions // 32))})
        proc = subprocess.Popen([sys.executable, "-c", "import sys; from coordinator.cli.bench import _worker_main; "
                                 "_worker_main(sys.argv[1])", spec], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        if not line.startswith("READY worker"):
            proc.kill()
            raise RuntimeError("bench worker did not start")
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.etcd.stop()


@contextlib.contextmanager
def rig(profile: str = "") -> Iterator[Rig]:
    with tempfile.TemporaryDirectory(prefix="gpucoord-bench-") as tmp:
        r = Rig(tmp, profile)
        try:
            yield r
        finally:
            r.stop()


def _worker_main(spec_json: str) -> None:
    """Entry of a worker process: opens its sessions, acquires, says READY, then idles until killed."""
    from agent_client import AsyncClient
    spec = json.loads(spec_json)

    async def run() -> None:
        hosts = spec["hosts"]
        clients = [AsyncClient(spec["addr"], agent=f"w{os.getpid()}-{i % spec['agents']}",
                               host=hosts[i % len(hosts)], ttl=spec["ttl"], rpc_timeout=60, retry_for=60)
                   for i in range(spec["sessions"])]
        sem = asyncio.Semaphore(32)

        async def one(c: AsyncClient) -> None:
            async with sem:
                await c.connect()
                for _ in range(spec["leases"]):
                    await c.acquire(16)
        await asyncio.gather(*(one(c) for c in clients))
        print("READY worker port=0", flush=True)
        await asyncio.Event().wait()
    asyncio.run(run())


def _raw_holder_main(spec_json: str) -> None:
    """A raw etcd_lease holder (the P6 baseline): grant, put a key on it, keep it alive like a session."""
    from coordinator.etcd.store import Store
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


# -- measurements --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Line:
    id: str
    what: str
    figure: float
    unit: str
    baseline: float | None
    baseline_what: str
    ratio: float | None
    target: str
    ok: bool | None

    def render(self) -> str:
        base = f"baseline {self.baseline:9.3f} {self.unit:<6} ({self.baseline_what})" if self.baseline is not None \
            else f"({self.baseline_what})" if self.baseline_what else ""
        ratio = f"ratio {self.ratio:7.3f}" if self.ratio is not None else " " * 13
        verdict = "PASS" if self.ok else "FAIL" if self.ok is not None else "----"
        return f"{self.id:<4} {verdict}  {self.what:<46} {self.figure:10.3f} {self.unit:<6} {ratio}  " \
               f"target {self.target:<12} {base}"


def _line(id: str, what: str, figure: float, unit: str, baseline: float | None, baseline_what: str, target: str,
          ok: Callable[[float], bool], use_ratio: bool = True) -> Line:
    ratio = figure / baseline if baseline and use_ratio else None
    value = ratio if ratio is not None else figure
    return Line(id, what, figure, unit, baseline, baseline_what, ratio, target,
                None if target == "report" else bool(ok(value)))


async def _pairs(clients: list[Any], seconds: float, vram: int = 16) -> tuple[int, list[float], list[float]]:
    """Every client loops acquire+release for ``seconds``; returns pairs, acquire and release latencies."""
    stop_at = time.perf_counter() + seconds
    acq: list[float] = []
    rel: list[float] = []

    async def loop(c: Any) -> None:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            lease = await c.acquire(vram)
            t1 = time.perf_counter()
            await lease.release()
            acq.append(t1 - t0)
            rel.append(time.perf_counter() - t1)
    await asyncio.gather(*(loop(c) for c in clients))
    return len(acq), acq, rel


async def _clients(addr: str, agents: int, hosts: list[str], ttl: int | None = None) -> list[Any]:
    from agent_client import AsyncClient
    cs = [AsyncClient(addr, agent=f"a{i}", host=hosts[i % len(hosts)], ttl=ttl) for i in range(agents)]
    await asyncio.gather(*(c.connect() for c in cs))
    return cs


async def _close(clients: list[Any]) -> None:
    await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


def phase_latency(n: int, out: dict[str, Any]) -> list[Line]:
    """P1 and P2."""
    import grpc

    from agent_client import Client
    from agent_client.api import coordinator_pb2 as pb
    from agent_client.api import coordinator_pb2_grpc as pb_grpc
    from coordinator.etcd.ops import cmp_mod_revision, op_put, range_req
    from coordinator.etcd.store import Store

    with rig() as r:
        _coord, addr = r.coordinator()
        r.node("bench", "8x80GiB")
        stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(addr))
        for _ in range(50):
            stub.Ping(pb.PingRequest())
        grpc_t = []
        for _ in range(n):
            t0 = time.perf_counter()
            stub.Ping(pb.PingRequest())
            grpc_t.append(time.perf_counter() - t0)

        async def raw() -> tuple[list[float], list[float]]:
            async with Store([r.ep]) as s:
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
                return reads, await _time_async(n, cas)
        read_t, cas_t = asyncio.run(raw())

        with Client(addr, agent="bench-a", host="bench") as c:
            acq_t = _acquire_times(c, n, warmup=30)
            m = min(n, 200)   # under the per-agent lease limit
            before = proposals(r.metrics_url)
            held = [c.acquire(16) for _ in range(m)]
            serial_props = (proposals(r.metrics_url) - before) / m
            for lease in held:
                lease.release()

        async def concurrent() -> float:
            clients = await _clients(addr, 16, ["bench"])
            per = max(1, n // 16)
            before = proposals(r.metrics_url)
            leases = await asyncio.gather(*(cl.acquire(16) for cl in clients for _ in range(per)))
            props = (proposals(r.metrics_url) - before) / len(leases)
            await _close(clients)
            return props
        conc_props = asyncio.run(concurrent())

    base = _p(grpc_t, .5) + _p(read_t, .5) + _p(cas_t, .5)
    out["p1"] = {"grpc_p50_ms": _p(grpc_t, .5) * 1e3, "etcd_range_p50_ms": _p(read_t, .5) * 1e3,
                 "cas_txn_p50_ms": _p(cas_t, .5) * 1e3, "acquire_p50_ms": _p(acq_t, .5) * 1e3,
                 "acquire_p99_ms": _p(acq_t, .99) * 1e3}
    out["p2"] = {"serial": serial_props, "agents16": conc_props}
    return [
        _line("P1", "acquire p50 / (gRPC + etcd Range + CAS txn) p50", _p(acq_t, .5) * 1e3, "ms", base * 1e3,
              "empty unary + linearizable Range (no read-only Txn: crashes etcd 3.5.1) + compare-and-put",
              "<= 1.3", lambda x: x <= 1.3),
        _line("P2", "raft proposals per acquire, serial", serial_props, "", None, "etcd /metrics", "<= 1.05",
              lambda x: x <= 1.05),
        _line("P2", "raft proposals per acquire, 16 agents", conc_props, "", None, "etcd /metrics, group commit",
              "<= 1.05", lambda x: x <= 1.05),
    ]


# -- P4: the lock-based admission ------------------------------------------------------------------------------
class LockAdmission:
    """The pattern gpucoord replaces: lock the GPU, read, decide, write, unlock.

    The lock is etcd's recipe (Go's ``concurrency.Mutex``): put ``lock/<gpu>/<etcd_lease>`` under the
    holder's etcd_lease, wait until every key of the lock with a lower create_revision is deleted, then
    hold; unlock deletes the key.
    """

    def __init__(self, store: Any, gpu: str, capacity_mb: int) -> None:
        self.store, self.capacity_mb = store, capacity_mb
        # The baseline's own keys, outside gpucoord's prefix and schema (coordinator/keys.py is not involved).
        self.gpu = gpu
        self.lock_prefix = f"/lockbench/lock/{gpu}/".encode()
        self.ledger = f"/lockbench/gpus/{gpu}".encode()
        self.leases = f"/lockbench/leases/{gpu}/".encode()

    def _lease_key(self, lease_id: str) -> bytes:
        return f"/lockbench/leases/{self.gpu}/{lease_id}".encode()

    async def _lock(self, etcd_lease: int) -> bytes:
        from coordinator.etcd.ops import cmp_create_revision, op_get, op_put, range_req
        key = f"/lockbench/lock/{self.gpu}/{etcd_lease:x}".encode()
        res = await self.store.commit([cmp_create_revision(key, 0)], [op_put(key, b"", etcd_lease)], [op_get(key)])
        my_rev = res.revision if res.succeeded else res.responses[0].response_range.kvs[0].create_revision
        while True:
            snap = await self.store.snapshot([range_req(self.lock_prefix, prefix=True, keys_only=True)])
            older = [kv for kv in snap.ranges[0] if kv.create_revision < my_rev]
            if not older:
                return key
            last = max(older, key=lambda kv: kv.create_revision)
            async for batch in self.store.watch(last.key, prefix=False, start_revision=snap.revision + 1):
                if any(ev.kind == "DELETE" for ev in batch.events):
                    break

    async def _locked(self, etcd_lease: int, change: Callable[[int, int, list[Any]], list[Any]]) -> None:
        from coordinator.etcd.ops import op_delete, range_req
        key = await self._lock(etcd_lease)
        try:
            snap = await self.store.snapshot([range_req(self.ledger), range_req(self.leases, prefix=True)])
            seq = int(snap.ranges[0][0].value) if snap.ranges[0] else 0
            used = sum(int(kv.value) for kv in snap.ranges[1])
            await self.store.commit([], change(seq, used, list(snap.ranges[1])))
        finally:
            await self.store.commit([], [op_delete(key)])

    async def acquire(self, etcd_lease: int, lease_id: str, vram_mb: int) -> None:
        from coordinator.etcd.ops import op_put

        def grant(seq: int, used: int, _kvs: list[Any]) -> list[Any]:
            if used + vram_mb > self.capacity_mb:
                raise RuntimeError("lock baseline: no room")
            return [op_put(self._lease_key(lease_id), str(vram_mb).encode(), etcd_lease),
                    op_put(self.ledger, str(seq + 1).encode())]
        await self._locked(etcd_lease, grant)

    async def release(self, etcd_lease: int, lease_id: str) -> None:
        from coordinator.etcd.ops import op_delete, op_put

        def free(seq: int, _used: int, _kvs: list[Any]) -> list[Any]:
            return [op_delete(self._lease_key(lease_id)), op_put(self.ledger, str(seq + 1).encode())]
        await self._locked(etcd_lease, free)


async def _lock_pairs(ep: str, agents: int, seconds: float) -> tuple[int, list[float], list[float]]:
    from coordinator.etcd.store import Store
    stop_at = time.perf_counter() + seconds
    acq: list[float] = []
    rel: list[float] = []
    stores = [Store([ep]) for _ in range(agents)]   # one client (channel) per agent, as agents would have
    for s in stores:
        await s.connect()
    try:
        async def loop(i: int, store: Any) -> None:
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


def phase_contended(seconds: float, levels: tuple[int, ...], out: dict[str, Any], profile: str = "") -> list[Line]:
    """P4, and the side-by-side on one GPU: pairs/s, acquire p50/p99 and the coordinator's CPU per pair."""
    side: dict[str, Any] = {}
    with rig(profile) as r:
        coord, addr = r.coordinator()
        r.node("one", "1x80GiB")
        for agents in levels:
            async def ours() -> tuple[int, list[float], list[float], float]:
                clients = await _clients(addr, agents, ["one"])
                await _pairs(clients, min(1.0, seconds / 4))    # warm up
                cpu0 = cpu_seconds(coord.pid)
                t0 = time.perf_counter()
                pairs, acq, rel = await _pairs(clients, seconds)
                wall = time.perf_counter() - t0
                cpu = cpu_seconds(coord.pid) - cpu0
                await _close(clients)
                return pairs, acq, [wall], cpu
            pairs, acq, wall, cpu = asyncio.run(ours())
            t0 = time.perf_counter()
            lpairs, lacq, _ = asyncio.run(_lock_pairs(r.ep, agents, seconds))
            lwall = time.perf_counter() - t0
            side[str(agents)] = {
                "gpucoord_pairs_s": pairs / wall[0], "gpucoord_acquire_p50_ms": _p(acq, .5) * 1e3,
                "gpucoord_acquire_p99_ms": _p(acq, .99) * 1e3, "coordinator_cpu_ms_per_pair": cpu / max(1, pairs) * 1e3,
                "coordinator_cpu_share": cpu / wall[0],
                "lock_pairs_s": lpairs / lwall, "lock_acquire_p50_ms": _p(lacq, .5) * 1e3,
                "lock_acquire_p99_ms": _p(lacq, .99) * 1e3}
    out["side_by_side"] = side
    lo, hi = side[str(levels[0])], side[str(levels[-1])]
    return [
        _line("P4", f"acquire p50, {levels[0]} agent, lock p50 / ours", lo["lock_acquire_p50_ms"] / lo["gpucoord_acquire_p50_ms"],
              "x", None, f"ours {lo['gpucoord_acquire_p50_ms']:.2f} ms vs lock {lo['lock_acquire_p50_ms']:.2f} ms",
              ">= 2", lambda x: x >= 2),
        _line("P4", f"pairs/s, {levels[-1]} agents on 1 GPU", hi["gpucoord_pairs_s"], "/s", hi["lock_pairs_s"],
              "lock-based admission, same etcd", ">= 5", lambda x: x >= 5),
        _line("P4", f"acquire p99, {levels[-1]} agents: ours / lock", hi["gpucoord_acquire_p99_ms"], "ms",
              hi["lock_acquire_p99_ms"], "lock-based p99 (reported)", "report", lambda x: True),
        Line("P4", f"coordinator CPU per pair, {levels[-1]} agents", hi["coordinator_cpu_ms_per_pair"], "ms", None,
             "CPU seconds of the coordinator process / pairs", None, "report", None),
    ]


def phase_p3(seconds: float, agents: int, hosts: int, replicas: tuple[int, ...], out: dict[str, Any]) -> list[Line]:
    """P3 with 1, 2, 3... replicas: replicas join one by one, and the agents are spread over them (each host
    is admitted by its owning replica; the others forward)."""
    from coordinator.etcd.ops import cmp_mod_revision, op_put
    from coordinator.etcd.store import Store
    from coordinator.node.fake_hosts import fake_host_names
    results: dict[int, tuple[float, float]] = {}
    with rig() as r:
        r.node("p3", "8x80GiB", fake_hosts=hosts)
        names = fake_host_names("p3", hosts)
        coords: list[tuple[subprocess.Popen[bytes], str]] = []
        for count in replicas:
            while len(coords) < count:
                coords.append(r.coordinator())
            time.sleep(0.5 if len(coords) > 1 else 0)   # the newcomer's registration reaches every mirror

            async def ours() -> tuple[float, float]:
                from agent_client import AsyncClient
                clients = [AsyncClient(coords[i % len(coords)][1], agent=f"a{i}", host=names[i % len(names)])
                           for i in range(agents)]
                await asyncio.gather(*(c.connect() for c in clients))
                await _pairs(clients, min(1.0, seconds / 4))
                cpu0 = sum(cpu_seconds(p.pid) for p, _ in coords)
                t0 = time.perf_counter()
                pairs, _, _ = await _pairs(clients, seconds)
                wall = time.perf_counter() - t0
                cpu = sum(cpu_seconds(p.pid) for p, _ in coords) - cpu0
                await _close(clients)
                return pairs / wall, cpu / max(1, pairs)
            results[count] = asyncio.run(ours())

        async def raw() -> float:
            stores = [Store([r.ep]) for _ in range(min(agents, 16))]
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
                    res = await s.commit([cmp_mod_revision(key, rev)], [op_put(key, b"1")])
                    rev = res.revision
                    count += 1
            t0 = time.perf_counter()
            await asyncio.gather(*(writer(i) for i in range(agents)))
            wall = time.perf_counter() - t0
            for s in stores:
                await s.close()
            return count / wall
        base = asyncio.run(raw())
    out["p3"] = {"raw_cas_txn_s": base, "agents": agents, "hosts": hosts,
                 "by_replicas": {str(n): {"pairs_s": rate, "coordinators_cpu_ms_per_pair": cpu * 1e3}
                                 for n, (rate, cpu) in results.items()}}
    return [_line("P3", f"pairs/s, {agents} agents, {hosts} hosts x 8 GPUs, {n} replica{'s' if n > 1 else ''}",
                  rate, "/s", base, f"raw compare-and-put txn/s, {agents} writers", ">= 0.5", lambda x: x >= 0.5)
            for n, (rate, _cpu) in results.items()]


def phase_p5(n: int, hosts: int, leases: int, out: dict[str, Any]) -> list[Line]:
    from agent_client import Client
    from coordinator.node.fake_hosts import fake_host_names

    def p50(addr: str, agent: str) -> float:
        with Client(addr, agent=agent, host="p5-target") as c:
            return _p(_acquire_times(c, n, warmup=20), .5)

    with rig() as r:
        coord, addr = r.coordinator()
        r.node("p5-target", "8x80GiB")
        empty = p50(addr, "probe-empty")
        r.node("p5", "8x80GiB", fake_hosts=hosts - 1)
        names = ["p5-target", *fake_host_names("p5", hosts - 1)]
        sessions = min(hosts, leases)
        r.worker(addr, names, sessions, max(1, leases // sessions), ttl=30)
        full = p50(addr, "probe-full")
        # Restart: kill the coordinator, start a new one on the same port, time its first acquire.
        coord.kill()
        coord.wait()
        t0 = time.perf_counter()
        _new, _ = r.coordinator(listen=addr)
        ready = time.perf_counter() - t0
        with Client(addr, agent="probe-restart", host="p5-target") as c:
            c.acquire(16).release()
        first = time.perf_counter() - t0
    out["p5"] = {"empty_p50_ms": empty * 1e3, "full_p50_ms": full * 1e3, "hosts": hosts, "leases": leases,
                 "restart_ready_s": ready, "restart_first_acquire_s": first}
    return [
        _line("P5", f"acquire p50, {hosts} hosts x 8 GPUs, {leases} leases", full * 1e3, "ms", empty * 1e3,
              "same on an empty cluster", "<= 1.2", lambda x: x <= 1.2),
        _line("P5", "restarted coordinator: start to first acquire", first, "s", None,
              f"process start {ready:.2f} s of it", "<= 2 s", lambda x: x <= 2.0, use_ratio=False),
    ]


def phase_idle_and_reclaim(sessions: int, idle_s: float, ttl: int, samples: int, out: dict[str, Any]) -> list[Line]:
    """P8 (idle cost with many sessions), then P6 (reclaim after SIGKILL) on the same rig."""
    from coordinator.etcd.ops import range_req
    from coordinator.etcd.store import Store
    with rig() as r:
        coord, addr = r.coordinator()
        node = r.node("idle", "8x80GiB", heartbeat=5.0)
        worker = r.worker(addr, ["idle"], sessions, 1, ttl=ttl)
        time.sleep(min(2.0, idle_s / 2))    # settle: the worker's last acquires, the first keepalives
        c0, n0, p0 = cpu_seconds(coord.pid), cpu_seconds(node.pid), proposals(r.metrics_url)
        t0 = time.perf_counter()
        time.sleep(idle_s)   # the measurement window itself: nothing to wait for
        wall = time.perf_counter() - t0
        coord_cpu = (cpu_seconds(coord.pid) - c0) / wall
        node_cpu = (cpu_seconds(node.pid) - n0) / wall
        writes = (proposals(r.metrics_url) - p0) / wall
        rss = rss_mb(coord.pid)

        # P6: single holders, gpucoord sessions and raw etcd_leases, killed at the same instant.
        holders = [r.worker(addr, ["idle"], 1, 1, ttl=ttl, agents=1) for _ in range(samples)]
        interval = min(3.0, ttl / 3)
        raws = []
        for i in range(samples):
            spec = json.dumps({"ep": r.ep, "ttl": ttl, "interval": interval, "key": f"/bench/raw-holder/{i}"})
            p = subprocess.Popen([sys.executable, "-c", "import sys; from coordinator.cli.bench import "
                                  "_raw_holder_main; _raw_holder_main(sys.argv[1])", spec],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            assert p.stdout is not None
            p.stdout.readline()
            r.procs.append(p)
            raws.append(p)

        async def reclaim() -> tuple[list[float], list[float], float, int]:
            async with Store([r.ep]) as s:
                async def count(prefix: bytes) -> int:
                    snap = await s.snapshot([range_req(prefix, prefix=True, keys_only=True)])
                    return len(snap.ranges[0])
                leases_prefix = PREFIX + b"leases/idle/"
                sessions_prefix = PREFIX + b"sessions/"
                # Which lease keys belong to which process: the sessions' pids.
                snap = await s.snapshot([range_req(sessions_prefix, prefix=True)])
                pid_of = {json.loads(kv.value)["pid"]: kv.etcd_lease for kv in snap.ranges[0]}
                lease_snap = await s.snapshot([range_req(leases_prefix, prefix=True)])
                by_etcd_lease: dict[int, list[bytes]] = {}
                for kv in lease_snap.ranges[0]:
                    by_etcd_lease.setdefault(kv.etcd_lease, []).append(kv.key)
                single_keys = [by_etcd_lease[pid_of[h.pid]][0] for h in holders]
                raw_keys = [f"/bench/raw-holder/{i}".encode() for i in range(samples)]
                t0 = time.perf_counter()
                for p in [*holders, *raws]:
                    os.kill(p.pid, signal.SIGKILL)
                mass_before = await count(leases_prefix) - samples
                os.kill(worker.pid, signal.SIGKILL)
                t_mass = time.perf_counter()
                ours: dict[bytes, float] = {}
                theirs: dict[bytes, float] = {}
                mass_done = 0.0
                deadline = t0 + ttl * 3 + 10
                while time.perf_counter() < deadline and (len(ours) < samples or len(theirs) < samples
                                                          or not mass_done):
                    snap = await s.snapshot([range_req(k) for k in [*single_keys, *raw_keys]]
                                            + [range_req(leases_prefix, prefix=True, keys_only=True)])
                    now = time.perf_counter()
                    for k, kvs in zip([*single_keys, *raw_keys], snap.ranges):
                        book = ours if k in single_keys else theirs
                        if not kvs and k not in book:
                            book[k] = now - t0
                    if not snap.ranges[-1] and not mass_done:
                        mass_done = now - t_mass
                    await asyncio.sleep(0.02)
                return list(ours.values()), list(theirs.values()), mass_done or float("inf"), mass_before
        ours, theirs, mass, mass_n = asyncio.run(reclaim())
    out["p8"] = {"sessions": sessions, "ttl_s": ttl, "window_s": wall, "coordinator_cpu_pct": coord_cpu * 100,
                 "coordinator_rss_mb": rss, "node_cpu_pct": node_cpu * 100, "etcd_proposals_s": writes}
    out["p6"] = {"ttl_s": ttl, "gpucoord_reclaim_s": ours, "raw_expiry_s": theirs, "mass_sessions": mass_n,
                 "mass_reclaim_s": mass}
    return [
        _line("P6", f"reclaim after SIGKILL, median of {samples}, TTL {ttl} s", statistics.median(ours) if ours else
              float("inf"), "s", statistics.median(theirs) if theirs else float("nan"),
              "raw etcd_lease holder killed alike", "<= 1.1", lambda x: x <= 1.1),
        _line("P6", f"{mass_n} sessions killed at once: all reclaimed", mass, "s", None, f"TTL {ttl} s + 2 s",
              f"<= {ttl + 2} s", lambda x: x <= ttl + 2, use_ratio=False),
        _line("P8", f"coordinator CPU, {sessions} idle sessions", coord_cpu * 100, "%", None,
              f"of one core, TTL {ttl} s, {wall:.0f} s window", "<= 5 %", lambda x: x <= 5.0),
        Line("P8", "coordinator RSS", rss, "MiB", None, "", None, "report", None),
        _line("P8", "node daemon CPU", node_cpu * 100, "%", None, "of one core", "<= 1 %", lambda x: x <= 1.0),
        _line("P8", "etcd writes/s while idle", writes, "/s", None, "raft proposals/s, every writer", "<= 1",
              lambda x: x <= 1.0),
    ]


def phase_p7(n: int, out: dict[str, Any]) -> list[Line]:
    from agent_client import AsyncClient
    from coordinator.etcd.store import Store

    with rig() as r:
        _coord, addr = r.coordinator("--grace", "30")
        r.node("bench", "1x16GiB")

        async def run() -> tuple[list[float], list[float]]:
            async with Store([r.ep]) as store, AsyncClient(addr, agent="holder", host="bench") as holder, \
                    AsyncClient(addr, agent="waiter", host="bench") as waiter:
                queue_prefix = PREFIX + b"queue/bench/"

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

                    def on_evict(_notice: Any) -> None:
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
    out["p7"] = {"release_to_grant_p50_ms": _p(promote, .5) * 1e3, "release_to_grant_p99_ms": _p(promote, .99) * 1e3,
                 "eviction_notice_p50_ms": _p(notice, .5) * 1e3, "eviction_notice_p99_ms": _p(notice, .99) * 1e3}
    return [
        _line("P7", "eviction notice p99", _p(notice, .99) * 1e3, "ms", None, f"p50 {_p(notice, .5) * 1e3:.1f} ms",
              "<= 50 ms", lambda x: x <= 50),
        _line("P7", "release -> grant p99", _p(promote, .99) * 1e3, "ms", None, f"p50 {_p(promote, .5) * 1e3:.1f} ms",
              "<= 50 ms", lambda x: x <= 50),
    ]


@dataclasses.dataclass(frozen=True)
class Sizes:
    n: int = 300                 # timed acquires for latency figures
    seconds: float = 8.0         # throughput windows
    levels: tuple[int, ...] = (1, 4, 16)
    p3_agents: int = 64
    p3_hosts: int = 16
    replicas: tuple[int, ...] = (1, 2, 3)
    p5_hosts: int = 1000
    p5_leases: int = 10_000
    idle_sessions: int = 1000
    idle_s: float = 20.0
    ttl: int = 10
    samples: int = 5
    p7_n: int = 100


QUICK = Sizes(n=20, seconds=1.0, levels=(1, 16), p3_agents=16, p3_hosts=4, p5_hosts=20, p5_leases=40,
              idle_sessions=20, idle_s=1.0, ttl=2, samples=1, p7_n=5)


PHASES = ("latency", "contended", "p3", "p5", "reclaim", "p7")


def run(what: str, sizes: Sizes, out: dict[str, Any], profile: str = "",
        emit: Callable[[Line], None] = lambda _l: None) -> list[Line]:
    lines: list[Line] = []
    phases: dict[str, Callable[[], list[Line]]] = {
        "latency": lambda: phase_latency(sizes.n, out),
        "contended": lambda: phase_contended(sizes.seconds, sizes.levels, out, profile),
        "p3": lambda: phase_p3(sizes.seconds, sizes.p3_agents, sizes.p3_hosts, sizes.replicas, out),
        "p5": lambda: phase_p5(sizes.n, sizes.p5_hosts, sizes.p5_leases, out),
        "reclaim": lambda: phase_idle_and_reclaim(sizes.idle_sessions, sizes.idle_s, sizes.ttl, sizes.samples, out),
        "p7": lambda: phase_p7(sizes.p7_n, out),
    }
    wanted = {"all": PHASES, "acquire": ("latency",), "p7": ("p7",), "p4": ("contended",)}.get(what, (what,))
    for name in wanted:
        for line in phases[name]():
            lines.append(line)
            emit(line)
    return lines


def main(args: argparse.Namespace) -> int:
    sizes = QUICK if args.quick else Sizes(n=args.n)
    out: dict[str, Any] = {"quick": bool(args.quick), "cores": os.cpu_count()}
    started = time.time()
    lines = run(args.what, sizes, out, getattr(args, "profile_coordinator", "") or "",
                emit=(lambda _l: None) if args.json else (lambda line: print(line.render(), flush=True)))
    out["lines"] = [dataclasses.asdict(x) for x in lines]
    out["seconds"] = time.time() - started
    if args.json:
        print(json.dumps(out, indent=2))
    elif "side_by_side" in out:
        print("side by side on one GPU (acquire+release pairs/s; acquire p50/p99 ms; coordinator CPU ms per pair):")
        for agents, s in out["side_by_side"].items():
            print(f"  {agents:>3} agents  gpucoord {s['gpucoord_pairs_s']:7.1f}/s  p50 {s['gpucoord_acquire_p50_ms']:6.2f}"
                  f"  p99 {s['gpucoord_acquire_p99_ms']:7.2f}  cpu/pair {s['coordinator_cpu_ms_per_pair']:.2f} ms  "
                  f"(coordinator at {s['coordinator_cpu_share'] * 100:.0f}% of a core)   lock-based "
                  f"{s['lock_pairs_s']:7.1f}/s  p50 {s['lock_acquire_p50_ms']:6.2f}  p99 {s['lock_acquire_p99_ms']:7.2f}")
    return 0
