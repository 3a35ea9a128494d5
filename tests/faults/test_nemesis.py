"""The nemesis run: 40 agents over two hosts and two coordinator replicas (real processes) on a 3-member
etcd, while a seeded scheduler injects one fault every few seconds and heals it: kill -9 of the etcd
leader, SIGSTOP of an etcd member, SIGSTOP of a replica, kill -9 of a replica (restarted on its port).

At the end: the history checker over etcd's whole history (G1, G2's queue order is the admitter's, G3,
G5, G6 at every revision), no lease, queue entry, eviction or session left once every agent is gone, and
every client call ended with a documented status. The seed is printed (``GPUCOORD_NEMESIS_SEED`` replays
one); ``GPUCOORD_NEMESIS_S`` sets the length (default 60 s).
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
from pathlib import Path
from typing import Callable, Iterator

import pytest

from tests.harness import Cluster, Etcd3, LoadReport, run_load, spawn_coordinator, stop_process, wait_for
from tests.history import check_store

pytestmark = pytest.mark.nemesis

TTL = 6
FAULT_EVERY_S = 4.0
FAULT_LASTS_S = 2.5


class Replicas:
    def __init__(self, endpoints: list[str], prefix: str, tmp: Path) -> None:
        self.endpoints, self.prefix, self.tmp = endpoints, prefix, tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self.addrs: list[str] = []
        for i in range(2):
            proc, port = self._spawn(i, "127.0.0.1:0")
            self.procs.append(proc)
            self.addrs.append(f"127.0.0.1:{port}")

    def _spawn(self, i: int, listen: str) -> tuple[subprocess.Popen[bytes], int]:
        return spawn_coordinator(self.endpoints, self.prefix, listen, str(self.tmp / f"c{i}.log"),
                                 extra=["--session-ttl", str(TTL)])

    def restart(self, i: int) -> None:
        self.procs[i], _ = self._spawn(i, self.addrs[i])

    def close(self) -> None:
        for p in self.procs:
            stop_process(p)


def _faults(e: Etcd3, reps: Replicas,
            rng: random.Random) -> dict[str, tuple[Callable[[], object], Callable[[object], None]]]:
    """name -> (inject, heal(what inject returned))."""
    def kill_leader() -> object:
        m = e.leader()
        e.kill(m)
        return m

    def stop_member(rng_pick: list[int] = [0]) -> object:  # noqa: B006 - a counter across calls
        m = e.members[rng_pick[0] % 3]
        rng_pick[0] += 1
        e.stop(m)
        return m

    def stop_replica() -> object:
        i = rng.randrange(2)
        os.kill(reps.procs[i].pid, signal.SIGSTOP)
        return i

    def cont_replica(i: object) -> None:
        os.kill(reps.procs[int(i)].pid, signal.SIGCONT)  # type: ignore[call-overload]

    def kill_replica() -> object:
        i = rng.randrange(2)
        reps.procs[i].kill()
        reps.procs[i].wait()
        return i

    return {
        "kill -9 etcd leader": (kill_leader, lambda m: e.restart(m)),  # type: ignore[arg-type]
        "SIGSTOP etcd member": (stop_member, lambda m: e.cont(m)),  # type: ignore[arg-type]
        "SIGSTOP replica": (stop_replica, cont_replica),
        "kill -9 replica": (kill_replica, lambda i: reps.restart(int(i))),  # type: ignore[call-overload]
    }


@pytest.fixture
def nemesis_cluster(etcd3: Etcd3) -> Iterator[Cluster]:
    c = Cluster(etcd3.endpoints, "/gpucoord-nemesis/")
    try:
        yield c
    finally:
        c.close()


def test_nemesis(etcd3: Etcd3, nemesis_cluster: Cluster, tmp_path: Path) -> None:  # noqa: F811
    seed = int(os.environ.get("GPUCOORD_NEMESIS_SEED") or random.randrange(1 << 30))
    duration = float(os.environ.get("GPUCOORD_NEMESIS_S", "60"))
    print(f"nemesis seed {seed} ({duration:g} s)")
    rng = random.Random(seed)    # the scheduler's own: other code's use of random must not change its picks
    c = nemesis_cluster
    c.start_node("h1", "2x16GiB", ttl=10)
    c.start_node("h2", "2x16GiB", ttl=10)
    reps = Replicas(etcd3.endpoints, c.prefix, tmp_path)
    injected: list[str] = []
    try:
        faults = _faults(etcd3, reps, rng)
        a, b = reps.addrs

        async def scenario() -> LoadReport:
            report = LoadReport()
            load = asyncio.create_task(run_load([[a, b], [b, a]] * 20, ["h1", "h2"], duration, seed=seed,
                                                report=report, ttl=TTL, agent_prefix="n"))
            loop = asyncio.get_running_loop()
            end = loop.time() + duration - FAULT_EVERY_S
            while loop.time() < end:
                await asyncio.sleep(FAULT_EVERY_S - FAULT_LASTS_S)
                name = rng.choice(sorted(faults))
                inject, heal = faults[name]
                what = await asyncio.to_thread(inject)
                injected.append(name)
                await asyncio.sleep(FAULT_LASTS_S)
                await asyncio.to_thread(heal, what)
            await load
            return report

        report = asyncio.run(scenario())
    finally:
        reps.close()
    print(f"nemesis seed {seed}: faults {injected}; calls {len(report.calls)}, outcomes {report.outcomes()}")
    assert not report.undocumented(), report.undocumented()[:5]

    def left() -> list[bytes]:
        return [kv.key for kv in c.get_prefix(c.keys.root())
                if c.keys.parse(kv.key)[0] in ("leases", "queue", "evictions", "sessions")]
    wait_for(lambda: not left(), 3 * TTL, "no leaked lease, queue entry, eviction or session")
    history = c.lt.run(check_store(c.store, c.keys), timeout=300)
    print(f"nemesis seed {seed}: history {history.revisions} revisions, {history.leases_created} leases, "
          f"violations {len(history.violations)}")
    history.assert_ok()
