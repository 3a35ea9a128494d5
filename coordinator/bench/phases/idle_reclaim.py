"""P8 (idle cost with many open sessions) and then P6 (reclaim after SIGKILL, against raw etcd_lease
holders killed at the same instant; and many sessions killed at once), on one rig."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import time

from coordinator.bench import eventloop
from coordinator.bench.heartbeats import report_usage
from coordinator.bench.report import Figures, Line, line
from coordinator.bench.rig import cpu_seconds, proposals, rig, rss_mb
from coordinator.etcd.store import Store
from coordinator.keys import Keys
from coordinator.node.fake_hosts import fake_host_names
from coordinator.txn import Range

REPORT_EVERY_S = 5.0    # a node daemon's usage interval (its heartbeat)


def phase_idle_and_reclaim(sessions: int, idle_s: float, ttl: int, samples: int, out: Figures,
                           reporting_hosts: int = 0) -> list[Line]:
    """P8 (idle cost with many sessions; then with ``reporting_hosts`` more hosts whose usage reports come every
    ``REPORT_EVERY_S``, as daemons write them), then P6 (reclaim after SIGKILL) on the same rig."""
    keys = Keys()
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
        reporting_cpu, join_cpu, reports = 0.0, 0.0, 0
        if reporting_hosts:
            # The hosts join first: registered, and what the replica does once for a new host (its gauges' series,
            # a first sample), given half the window. That is its own line; the reports' line measures a fleet that
            # reports, not one that joins.
            c0 = cpu_seconds(coord.pid)
            r.node("reporting", "8x80GiB", fake_hosts=reporting_hosts)
            names = fake_host_names("reporting", reporting_hosts)
            time.sleep(idle_s / 2)   # a measurement window: nothing to wait for
            join_cpu = cpu_seconds(coord.pid) - c0
            c0, t0 = cpu_seconds(coord.pid), time.perf_counter()
            reports = eventloop.run(report_usage([r.ep], keys, names, REPORT_EVERY_S, idle_s))
            reporting_cpu = (cpu_seconds(coord.pid) - c0) / (time.perf_counter() - t0)

        # P6: single holders, gpucoord sessions and raw etcd_leases, killed at the same instant.
        holders = [r.worker(addr, ["idle"], 1, 1, ttl=ttl, agents=1) for _ in range(samples)]
        interval = min(3.0, ttl / 3)
        raws = [r.raw_holder(f"/bench/raw-holder/{i}", ttl, interval) for i in range(samples)]

        async def reclaim() -> tuple[list[float], list[float], float, float, int]:
            async with Store([r.ep]) as s:
                async def count(prefix: bytes) -> int:
                    snap = await s.snapshot([Range(prefix, prefix=True, keys_only=True)])
                    return len(snap.ranges[0])
                leases_prefix = keys.leases("idle")
                sessions_prefix = keys.sessions()
                # Which lease keys belong to which process: the sessions' pids.
                snap = await s.snapshot([Range(sessions_prefix, prefix=True)])
                pid_of = {json.loads(kv.value)["pid"]: kv.etcd_lease for kv in snap.ranges[0]}
                lease_snap = await s.snapshot([Range(leases_prefix, prefix=True)])
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
                mass_done = mass_first = 0.0
                deadline = t0 + ttl * 3 + 10
                while time.perf_counter() < deadline and (len(ours) < samples or len(theirs) < samples
                                                          or not mass_done):
                    snap = await s.snapshot([Range(k) for k in [*single_keys, *raw_keys]]
                                            + [Range(leases_prefix, prefix=True, keys_only=True)])
                    now = time.perf_counter()
                    for k, kvs in zip([*single_keys, *raw_keys], snap.ranges):
                        book = ours if k in single_keys else theirs
                        if not kvs and k not in book:
                            book[k] = now - t0
                    if not snap.ranges[-1] and not mass_done:
                        mass_done = now - t_mass
                    if len(snap.ranges[-1]) < mass_before and not mass_first:
                        mass_first = now - t_mass    # the first expiry: the rest is the revokes' pace
                    await asyncio.sleep(0.02)
                return (list(ours.values()), list(theirs.values()), mass_done or float("inf"), mass_first,
                        mass_before)
        ours, theirs, mass, mass_first, mass_n = eventloop.run(reclaim())
    out["p8"] = {"sessions": sessions, "ttl_s": ttl, "window_s": wall, "coordinator_cpu_pct": coord_cpu * 100,
                 "coordinator_rss_mb": rss, "node_cpu_pct": node_cpu * 100, "etcd_proposals_s": writes,
                 "reporting_hosts": reporting_hosts, "usage_reports": reports,
                 "coordinator_cpu_pct_with_reports": reporting_cpu * 100, "join_cpu_s": join_cpu}
    out["p6"] = {"ttl_s": ttl, "gpucoord_reclaim_s": ours, "raw_expiry_s": theirs, "mass_sessions": mass_n,
                 "mass_reclaim_s": mass, "mass_first_reclaimed_s": mass_first}
    return [
        line("P6", f"reclaim after SIGKILL, median of {samples}, TTL {ttl} s", statistics.median(ours) if ours else
             float("inf"), "s", statistics.median(theirs) if theirs else float("nan"),
             "raw etcd_lease holder killed alike", "<= 1.1", lambda x: x <= 1.1),
        line("P6", f"{mass_n} sessions killed at once: all reclaimed", mass, "s", None,
             f"TTL {ttl} s + 2 s; the first at {mass_first:.1f} s",
             f"<= {ttl + 2} s", lambda x: x <= ttl + 2, use_ratio=False),
        line("P8", f"coordinator CPU, {sessions} idle sessions", coord_cpu * 100, "%", None,
             f"of one core, TTL {ttl} s, {wall:.0f} s window", "<= 5 %", lambda x: x <= 5.0),
        Line("P8", "coordinator RSS", rss, "MiB", None, "", None, "report", None),
        *([Line("P8", f"coordinator CPU, {reporting_hosts} hosts joining", join_cpu, "s", None,
                f"CPU seconds: registered, and the {idle_s / 2:.0f} s after", None, "report", None),
           line("P8", f"coordinator CPU, + {reporting_hosts} hosts reporting usage", reporting_cpu * 100, "%", None,
                f"every {REPORT_EVERY_S:.0f} s, as daemons do ({reports} reports)", "<= 5 %", lambda x: x <= 5.0)]
          if reporting_hosts else []),
        line("P8", "node daemon CPU", node_cpu * 100, "%", None, "of one core", "<= 1 %", lambda x: x <= 1.0),
        line("P8", "etcd writes/s while idle", writes, "/s", None, "raft proposals/s, every writer", "<= 1",
             lambda x: x <= 1.0),
    ]
