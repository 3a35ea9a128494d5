"""P1 (acquire p50 against an empty unary + a raw Range + a raw compare-and-put) and P2 (raft proposals
per acquire, serial, with 16 agents on one host (group commit), and with 64 agents over 16 hosts (commits
shared across hosts))."""
from __future__ import annotations

import asyncio

from agent_client import Client
from coordinator.bench import baselines, eventloop, load
from coordinator.bench.report import Figures, Line, line
from coordinator.bench.rig import proposals, rig
from coordinator.bench.stats import percentile
from coordinator.node.fake_hosts import fake_host_names


def phase_latency(n: int, out: Figures) -> list[Line]:
    """P1 and P2."""
    with rig() as r:
        _coord, addr = r.coordinator()
        r.node("bench", "8x80GiB")
        r.node("p2", "8x80GiB", fake_hosts=16)
        grpc_t = baselines.unary_times(addr, n)
        read_t, cas_t = eventloop.run(baselines.read_and_cas_times(r.ep, n))

        with Client(addr, agent="bench-a", host="bench") as c:
            acq_t = load.acquire_times(c, n, warmup=30)
            m = min(n, 200)   # under the per-agent lease limit
            before = proposals(r.metrics_url)
            held = [c.acquire(16) for _ in range(m)]
            serial_props = (proposals(r.metrics_url) - before) / m
            for lease in held:
                lease.release()

        async def concurrent(agents: int, hosts: list[str]) -> float:
            clients = await load.clients(addr, agents, hosts)
            per = max(1, n // agents)
            before = proposals(r.metrics_url)
            leases = await asyncio.gather(*(cl.acquire(16) for cl in clients for _ in range(per)))
            props = (proposals(r.metrics_url) - before) / len(leases)
            await load.close(clients)
            return props
        conc_props = eventloop.run(concurrent(16, ["bench"]))
        shared_props = eventloop.run(concurrent(64, fake_host_names("p2", 16)))

    base = percentile(grpc_t, .5) + percentile(read_t, .5) + percentile(cas_t, .5)
    out["p1"] = {"grpc_p50_ms": percentile(grpc_t, .5) * 1e3, "etcd_range_p50_ms": percentile(read_t, .5) * 1e3,
                 "cas_txn_p50_ms": percentile(cas_t, .5) * 1e3, "acquire_p50_ms": percentile(acq_t, .5) * 1e3,
                 "acquire_p99_ms": percentile(acq_t, .99) * 1e3}
    out["p2"] = {"serial": serial_props, "agents16": conc_props, "agents64_hosts16": shared_props}
    return [
        line("P1", "acquire p50 / (gRPC + etcd Range + CAS txn) p50", percentile(acq_t, .5) * 1e3, "ms", base * 1e3,
             "empty unary + linearizable Range (no read-only Txn: crashes etcd 3.5.1) + compare-and-put",
             "<= 1.3", lambda x: x <= 1.3),
        line("P2", "raft proposals per acquire, serial", serial_props, "", None, "etcd /metrics", "<= 1.05",
             lambda x: x <= 1.05),
        line("P2", "raft proposals per acquire, 16 agents", conc_props, "", None, "etcd /metrics, group commit",
             "<= 1.05", lambda x: x <= 1.05),
        line("P2", "raft proposals per acquire, 64 agents over 16 hosts", shared_props, "", None,
             "etcd /metrics, commits shared across hosts", "< 1", lambda x: x < 1.0),
    ]
