"""The rig of a phase: one etcd member and gpucoord's processes on loopback, and what is read of them.

Coordinators, node daemons and session-holding workers run as subprocesses, so that each one's CPU
seconds and RSS are read from its process alone; etcd's raft proposals are read from its ``/metrics``.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from typing import Iterator

from prometheus_client.parser import text_string_to_metric_families

from coordinator.etcd.process import EtcdCluster


def etcd_metric(metrics_url: str, name: str) -> float:
    """The value of the first sample called ``name`` (whatever its labels) in etcd's ``/metrics``."""
    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise RuntimeError(f"{name} not in etcd's /metrics")


def proposals(metrics_url: str) -> float:
    return etcd_metric(metrics_url, "etcd_server_proposals_committed_total")


def cpu_seconds(pid: int) -> float:
    import psutil
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def rss_mb(pid: int) -> float:
    import psutil
    return float(psutil.Process(pid).memory_info().rss) / (1 << 20)


def renice(pid: int, nice: int) -> None:
    """Every thread of ``pid`` at ``nice`` (Linux's niceness is a thread's: gRPC's threads would keep theirs)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        with contextlib.suppress(OSError):    # a thread that ended meanwhile
            os.setpriority(os.PRIO_PROCESS, tid, nice)


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
        proc = subprocess.Popen([sys.executable, "-c", "import sys; from coordinator.bench.rig import worker_main; "
                                 "worker_main(sys.argv[1])", spec], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        if not line.startswith("READY worker"):
            proc.kill()
            raise RuntimeError("bench worker did not start")
        self.procs.append(proc)
        return proc

    def raw_holder(self, key: str, ttl: int, interval: float) -> subprocess.Popen[bytes]:
        """A process holding a raw etcd_lease with ``key`` on it (``baselines.raw_holder_main``)."""
        spec = json.dumps({"ep": self.ep, "ttl": ttl, "interval": interval, "key": key})
        proc = subprocess.Popen([sys.executable, "-c", "import sys; from coordinator.bench.baselines import "
                                 "raw_holder_main; raw_holder_main(sys.argv[1])", spec],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert proc.stdout is not None
        proc.stdout.readline()
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
            if p.stdout is not None:
                p.stdout.close()
        self.etcd.stop()


@contextlib.contextmanager
def rig(profile: str = "") -> Iterator[Rig]:
    with tempfile.TemporaryDirectory(prefix="gpucoord-bench-") as tmp:
        r = Rig(tmp, profile)
        try:
            yield r
        finally:
            r.stop()


def worker_main(spec_json: str) -> None:
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
