"""P4: gpucoord against the lock-based admission on one GPU, side by side at each level of agents:
pairs/s, acquire p50/p99 and the coordinator's CPU seconds per pair."""
from __future__ import annotations

import time

from coordinator.bench import baselines, eventloop, load
from coordinator.bench.report import Figures, Line, line
from coordinator.bench.rig import cpu_seconds, rig
from coordinator.bench.stats import percentile


def phase_contended(seconds: float, levels: tuple[int, ...], out: Figures, profile: str = "") -> list[Line]:
    """P4, and the side-by-side on one GPU: pairs/s, acquire p50/p99 and the coordinator's CPU per pair."""
    side: dict[str, dict[str, float]] = {}
    with rig(profile) as r:
        coord, addr = r.coordinator()
        r.node("one", "1x80GiB")
        for agents in levels:
            async def ours() -> tuple[int, list[float], list[float], float]:
                clients = await load.clients(addr, agents, ["one"])  # noqa: B023 - awaited within this iteration
                await load.pairs(clients, min(1.0, seconds / 4))    # warm up
                cpu0 = cpu_seconds(coord.pid)
                t0 = time.perf_counter()
                pairs, acq, rel = await load.pairs(clients, seconds)
                wall = time.perf_counter() - t0
                cpu = cpu_seconds(coord.pid) - cpu0
                await load.close(clients)
                return pairs, acq, [wall], cpu
            pairs, acq, wall, cpu = eventloop.run(ours())
            t0 = time.perf_counter()
            lpairs, lacq, _ = eventloop.run(baselines.lock_pairs(r.ep, agents, seconds))
            lwall = time.perf_counter() - t0
            side[str(agents)] = {
                "gpucoord_pairs_s": pairs / wall[0], "gpucoord_acquire_p50_ms": percentile(acq, .5) * 1e3,
                "gpucoord_acquire_p99_ms": percentile(acq, .99) * 1e3,
                "coordinator_cpu_ms_per_pair": cpu / max(1, pairs) * 1e3, "coordinator_cpu_share": cpu / wall[0],
                "lock_pairs_s": lpairs / lwall, "lock_acquire_p50_ms": percentile(lacq, .5) * 1e3,
                "lock_acquire_p99_ms": percentile(lacq, .99) * 1e3}
    out["side_by_side"] = side
    lo, hi = side[str(levels[0])], side[str(levels[-1])]
    return [
        line("P4", f"acquire p50, {levels[0]} agent, lock p50 / ours",
             lo["lock_acquire_p50_ms"] / lo["gpucoord_acquire_p50_ms"], "x", None,
             f"ours {lo['gpucoord_acquire_p50_ms']:.2f} ms vs lock {lo['lock_acquire_p50_ms']:.2f} ms",
             ">= 2", lambda x: x >= 2),
        line("P4", f"pairs/s, {levels[-1]} agents on 1 GPU", hi["gpucoord_pairs_s"], "/s", hi["lock_pairs_s"],
             "lock-based admission, same etcd", ">= 5", lambda x: x >= 5),
        line("P4", f"acquire p99, {levels[-1]} agents: ours / lock", hi["gpucoord_acquire_p99_ms"], "ms",
             hi["lock_acquire_p99_ms"], "lock-based p99 (reported)", "report", lambda x: True),
        Line("P4", f"coordinator CPU per pair, {levels[-1]} agents", hi["coordinator_cpu_ms_per_pair"], "ms", None,
             "CPU seconds of the coordinator process / pairs", None, "report", None),
    ]
