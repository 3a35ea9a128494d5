"""In-process services on a background event loop, for integration tests against a real etcd.

Coordinators and node daemons here are the real servers (real gRPC on loopback, real etcd); they only
share one Python process with the test so that starting them is cheap. Tests that kill processes use
``spawn_coordinator``/``spawn_agent`` instead, which start real child processes.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from typing import Any, Awaitable, Callable, TypeVar

from coordinator.config import CoordinatorConfig
from coordinator.keys import Keys
from coordinator.node.daemon import NodeDaemon
from coordinator.node.enforce import Enforcer
from coordinator.rpc.node_server import create_node_server
from coordinator.node.inventory import FakeGpuSource
from coordinator.rpc.coordinator_server import create_server
from coordinator.etcd.store import Store

T = TypeVar("T")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class LoopThread:
    """An asyncio loop in a daemon thread; ``run`` waits for a coroutine from sync test code."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Awaitable[T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Background:
    """Run a blocking call in a thread; ``result()`` waits for it (with a deadline) and re-raises its error."""

    def __init__(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.finished_at = 0.0

        def run() -> None:
            try:
                self.value = fn(*args, **kw)
            except BaseException as e:  # noqa: BLE001 - handed to the test
                self.error = e
            finally:
                self.finished_at = time.monotonic()
                self.done.set()
        threading.Thread(target=run, daemon=True).start()

    def result(self, timeout: float = 30) -> Any:
        assert self.done.wait(timeout), "the background call did not finish"
        if self.error is not None:
            raise self.error
        return self.value


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    """Poll ``predicate`` until it is truthy, with a deadline (never a bare sleep as synchronisation)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class Cluster:
    """Coordinators and node daemons of one test, all under the test's own key prefix."""

    def __init__(self, endpoints: list[str], prefix: str) -> None:
        self.endpoints = endpoints
        self.prefix = prefix
        self.keys = Keys(prefix)
        self.lt = LoopThread()
        self.store = Store(endpoints)
        self.lt.run(self.store.connect())
        self.coordinators: dict[str, tuple[Any, Any]] = {}
        self.nodes: dict[str, tuple[NodeDaemon, Any, FakeGpuSource]] = {}

    def config(self, **overrides: Any) -> CoordinatorConfig:
        base = dict(etcd=tuple(self.endpoints), prefix=self.prefix, listen="127.0.0.1:0")
        base.update(overrides)
        return CoordinatorConfig(**base).validate()

    def start_coordinator(self, **overrides: Any) -> str:
        server, port, svc = self.lt.run(create_server(self.config(**overrides)))
        addr = f"127.0.0.1:{port}"
        self.coordinators[addr] = (server, svc)
        return addr

    def stop_coordinator(self, addr: str) -> None:
        server, svc = self.coordinators.pop(addr)

        async def stop() -> None:
            await svc.stop()
            await server.stop(grace=0.5)
        self.lt.run(stop())

    def start_node(self, host: str, fake_gpus: str = "1x16GiB", ttl: int = 10, heartbeat_s: float = 5.0,
                   fake_processes: str | None = None, enforce: str = "report", over_use_tolerance_mb: int = 256,
                   tls: Any = None,
                   **overrides: Any) -> NodeDaemon:
        source = FakeGpuSource(fake_gpus, host, fake_processes)

        async def start() -> tuple[NodeDaemon, Any]:
            store = Store(self.endpoints)
            await store.connect()
            daemon = NodeDaemon(store, self.keys, host, "127.0.0.1:0", source, "/", ttl, scan_interval_s=0.2,
                                heartbeat_s=heartbeat_s, overrides=overrides,
                                enforcer=Enforcer(enforce, over_use_tolerance_mb))
            server, port = await create_node_server(daemon, "127.0.0.1:0", tls)
            daemon.address = f"127.0.0.1:{port}"
            await daemon.start()
            return daemon, server
        daemon, server = self.lt.run(start())
        self.nodes[host] = (daemon, server, source)
        return daemon

    def stop_node(self, host: str, revoke: bool = True) -> None:
        daemon, server, _ = self.nodes.pop(host)

        async def stop() -> None:
            await server.stop(grace=0.2)
            await daemon.stop(revoke=revoke)
            await daemon.store.close()
        self.lt.run(stop())

    def close(self) -> None:
        for addr in list(self.coordinators):
            self.stop_coordinator(addr)
        for host in list(self.nodes):
            self.stop_node(host)
        self.lt.run(self.store.close())
        self.lt.close()

    # -- reads for assertions --------------------------------------------------------------------
    def get_prefix(self, prefix: bytes) -> list[Any]:
        return list(self.lt.run(self.store.get_prefix(prefix)).ranges[0])

    def state(self) -> set[tuple[bytes, int]]:
        """(key, mod_revision) of every key a coordinator writes: equal before and after means no write."""
        out = set()
        for kv in self.get_prefix(self.keys.root()):
            kind, _ = self.keys.parse(kv.key)
            if kind not in ("hosts", "usage", "coordinators", "election"):
                out.add((kv.key, kv.mod_revision))
        return out

    def replicas(self) -> dict[str, str]:
        """replica id -> address, of the replicas registered under ``coordinators/``."""
        import json
        return {json.loads(kv.value)["replica"]: json.loads(kv.value)["address"]
                for kv in self.get_prefix(self.keys.coordinators())}

    def owner(self, host: str, replicas: int) -> str:
        """The address of the replica that owns ``host`` once ``replicas`` replicas are registered."""
        from coordinator.replica.service import owner_of
        reps = wait_for(lambda: (lambda r: r if len(r) == replicas else None)(self.replicas()), 15,
                        f"{replicas} replicas to register")
        return str(reps[owner_of(host, reps)])

    def leases(self) -> list[Any]:
        from coordinator.records import VramLease
        return [VramLease.from_kv(kv) for kv in self.get_prefix(self.keys.leases())]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def spawn_coordinator(endpoints: list[str], prefix: str, listen: str, log_path: str,
                      extra: list[str] | None = None,
                      env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], int]:
    """A coordinator as a real child process; returns it once it serves, with its port."""
    log = open(log_path, "ab")
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "coordinator", "--etcd", ",".join(endpoints),
                             "--prefix", prefix, "--listen", listen, *(extra or [])],
                            stdout=subprocess.PIPE, stderr=log, env={**child_env(), **(env or {})}, cwd=REPO)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if not line.startswith("READY coordinator port="):
        proc.kill()
        raise AssertionError(f"coordinator did not start: {line!r}; see {log_path}")
    return proc, int(line.split("port=")[1])


def spawn_node(endpoints: list[str], prefix: str, host: str, fake_gpus: str, log_path: str,
               extra: list[str] | None = None, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """A node daemon (``gpucoord node --fake-gpus``) as a real child process; returns it once it serves."""
    log = open(log_path, "ab")
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "node", "--etcd", ",".join(endpoints),
                             "--prefix", prefix, "--host", host, "--listen", "127.0.0.1:0", "--fake-gpus", fake_gpus,
                             *(extra or [])],
                            stdout=subprocess.PIPE, stderr=log, env={**child_env(), **(env or {})}, cwd=REPO)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if not line.startswith("READY node port="):
        proc.kill()
        raise AssertionError(f"node did not start: {line!r}; see {log_path}")
    return proc


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10) -> None:
    """SIGCONT (it may be stopped), then SIGTERM, then SIGKILL: by PID, only our own child."""
    import signal
    if proc.poll() is not None:
        return
    try:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    except ProcessLookupError:
        pass


def spawn_agent(addr: str, host: str, agent: str, vram_mb: int, ttl: int, log_path: str = os.devnull,
                wait: float = 0.0, read_answer: bool = True) -> tuple[subprocess.Popen[bytes], str]:
    """A real agent process (``coordinator.cli.demo agent``) that acquires and holds; returns it and its answer."""
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli.demo", "agent", "--coordinator", addr, "--host", host,
                             "--agent", agent, "--vram-mb", str(vram_mb), "--ttl", str(ttl), "--wait", str(wait)],
                            stdout=subprocess.PIPE, stdin=subprocess.PIPE, stderr=open(log_path, "ab"),
                            env=child_env(), cwd=REPO)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().decode().strip() if read_answer else ""
