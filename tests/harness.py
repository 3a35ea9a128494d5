"""The one home of the tests' shared helpers and fakes; test modules import only this, ``tests.history``,
``tests.faultlink`` and ``tests.static.import_graph``, never each other.

* waiting: ``wait_for`` (poll with a deadline), ``pass_time`` (when the passing of time is itself the
  test), ``Background``, ``LoopThread``;
* in-process services: ``Cluster`` runs real coordinators and node daemons (real gRPC on loopback, real
  etcd) in the test's process, so that starting them is cheap; ``queue``, ``session_alive`` read state;
* gRPC: ``coordinator_stub``, ``node_stub``, ``acquire_req``, ``expect_refused``; ``session_call`` (one call
  as a message of the Session stream, its answer or ``StreamCallError``);
* fault injection by wrapping one component's own objects, never by editing the code under test:
  ``patch_method``, ``patch_commit``;
* child processes for kill and restart tests: ``spawn_coordinator``, ``spawn_agent``, ``child_env``;
* bound processes: ``gpucoord_run``, ``write_fake_processes``, ``ProcessGone`` (when a process exited);
* fakes: ``FakeNvml``/``FakeDevice`` (the pynvml module at its function level);
* the etcd boundary: ``EtcdEndpoint``, ``record_etcd_calls``, ``read_only``;
* network faults: ``Cluster``'s linked coordinators and nodes and ``LinkedReplica`` (a coordinator process)
  put their connections behind a ``tests.faultlink.FaultLink`` that a test cuts, slows and heals;
* security: ``make_pki``/``Pki``, ``writes_since``;
* a 3-member etcd for the fault tier: ``Etcd3``;
* a load of agents: ``run_load``/``LoadReport``.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import datetime
import json
import logging
import os
import pathlib
import random
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace
from typing import (
    TYPE_CHECKING,
    Any,
    Awaitable,
    Callable,
    Collection,
    Sequence,
    TypeVar,
)

import grpc
import pynvml
import pytest

import coordinator.etcd.store as store_module
from agent_client import AsyncClient, errors
from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from agent_client.api import node_pb2_grpc as npb_grpc
from coordinator.config import CoordinatorConfig
from coordinator.etcd.process import EtcdCluster, EtcdMember, EtcdOptions
from coordinator.etcd.store import Store
from coordinator.keys import Keys
from coordinator.node.daemon import NodeDaemon
from coordinator.node.enforce import Enforcer
from coordinator.node.inventory import FakeGpuSource
from coordinator.records import QueueEntry
from coordinator.rpc.coordinator_server import create_server
from coordinator.rpc.node_server import create_node_server
from coordinator.txn import Delete, Op, Put, Range
from tests.faultlink import FaultLink

if TYPE_CHECKING:
    from coordinator.security.tls import TlsFiles

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


def pass_time(seconds: float, what: str) -> None:
    """Let wall-clock time pass (a TTL, a grace period) when what happens meanwhile is the thing under test.

    Never to let something finish: wait for that with ``wait_for`` and its condition."""
    until = time.monotonic() + seconds
    wait_for(lambda: time.monotonic() >= until, seconds + 5, what, interval=0.05)


@dataclasses.dataclass(frozen=True)
class EtcdEndpoint:
    """What the ``etcd`` fixture hands a test: client endpoints and the metrics URL of the first member."""
    endpoints: list[str]
    metrics_url: str
    provider: str = "process"    # or "docker IMAGE"


# The image the docker provider of the ``etcd`` fixture runs unless GPUCOORD_TEST_ETCD_IMAGE names another.
DEFAULT_ETCD_IMAGE = "gpucoord/etcd:3.5.1"


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
        # Network faults: the link of a linked coordinator's (by its address) or node's (by host) etcd
        # connection, and of a linked coordinator's clients (its address is that link's endpoint).
        self.etcd_links: dict[str, FaultLink] = {}
        self.client_links: dict[str, FaultLink] = {}

    def config(self, **overrides: Any) -> CoordinatorConfig:
        base = dict(etcd=tuple(self.endpoints), prefix=self.prefix, listen="127.0.0.1:0")
        base.update(overrides)
        return CoordinatorConfig(**base).validate()

    def start_coordinator(self, linked: bool = False, **overrides: Any) -> str:
        """An in-process coordinator; returns the address its clients use. ``linked``: its etcd connection
        (``etcd_links[addr]``) and its clients' connections to it (``client_links[addr]``; it advertises that
        link's endpoint, so the other replicas' forwarded calls take it too) each run through a FaultLink."""
        if not linked:
            server, port, svc = self.lt.run(create_server(self.config(**overrides)))
            addr = f"127.0.0.1:{port}"
            self.coordinators[addr] = (server, svc)
            return addr
        from coordinator.etcd.process import free_port
        port = free_port()
        clients, etcd = FaultLink(f"127.0.0.1:{port}", "clients"), FaultLink(self.endpoints, "etcd")
        overrides = {"listen": f"127.0.0.1:{port}", "advertise": clients.endpoint, "etcd": tuple(etcd.endpoints),
                     **overrides}
        server, _, svc = self.lt.run(create_server(self.config(**overrides)))
        addr = clients.endpoint
        self.coordinators[addr] = (server, svc)
        self.etcd_links[addr], self.client_links[addr] = etcd, clients
        return addr

    def service(self, addr: str) -> Any:
        """The CoordinatorService of the in-process coordinator at ``addr``."""
        return self.coordinators[addr][1]

    def stop_coordinator(self, addr: str) -> None:
        server, svc = self.coordinators.pop(addr)

        async def stop() -> None:
            await svc.stop()
            await server.stop(grace=0.5)
        self.lt.run(stop())
        for links in (self.etcd_links, self.client_links):
            link = links.pop(addr, None)
            if link is not None:
                link.close()

    def start_node(self, host: str, fake_gpus: str = "1x16GiB", ttl: int = 10, heartbeat_s: float = 5.0,
                   fake_processes: str | None = None, enforce: str = "report", over_use_tolerance_mb: int = 256,
                   tls: Any = None, linked: bool = False,
                   **overrides: Any) -> NodeDaemon:
        """An in-process node daemon; ``linked``: its etcd connection runs through ``etcd_links[host]``."""
        source = FakeGpuSource(fake_gpus, host, fake_processes)
        endpoints = self.endpoints
        if linked:
            link = self.etcd_links[host] = FaultLink(self.endpoints, f"node {host}")
            endpoints = link.endpoints

        async def start() -> tuple[NodeDaemon, Any]:
            store = Store(endpoints)
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
        link = self.etcd_links.pop(host, None)
        if link is not None:
            link.close()

    def close(self) -> None:
        for link in [*self.etcd_links.values(), *self.client_links.values()]:
            link.heal()      # a quick shutdown: nothing waits on a cut link
        for addr in list(self.coordinators):
            self.stop_coordinator(addr)
        for host in list(self.nodes):
            self.stop_node(host)
        self.lt.run(self.store.close())
        self.lt.close()

    # -- reads for assertions --------------------------------------------------------------------
    def get_prefix(self, prefix: bytes) -> list[Any]:
        return list(self.lt.run(self.store.get_prefix(prefix)).kvs)

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


def queue(cluster: Cluster, host: str = "h1") -> list[QueueEntry]:
    """The host's queue entries in etcd, in rank order."""
    return [QueueEntry.from_kv(kv) for kv in cluster.get_prefix(cluster.keys.queue(host))]


def session_alive(cluster: Cluster, agent: str, session_id: str) -> bool:
    return bool(cluster.get_prefix(cluster.keys.session(agent, session_id)))


def leaked(cluster: Cluster) -> list[bytes]:
    """The leases, queue entries, eviction notices and sessions under the cluster's prefix."""
    return [kv.key for kv in cluster.get_prefix(cluster.keys.root())
            if cluster.keys.parse(kv.key)[0] in ("leases", "queue", "evictions", "sessions")]


def wait_no_leaks(cluster: Cluster, within: float) -> None:
    """The leak check that ends a fault test once every agent is gone: nothing of theirs is left in etcd."""
    wait_for(lambda: not leaked(cluster), within, "no leaked lease, queue entry, eviction or session")


# -- gRPC --------------------------------------------------------------------------------------------

def coordinator_stub(addr: str) -> pb_grpc.CoordinatorStub:
    return pb_grpc.CoordinatorStub(grpc.insecure_channel(addr))


def node_stub(address: str) -> npb_grpc.NodeStub:
    return npb_grpc.NodeStub(grpc.insecure_channel(address))


def acquire_req(agent: str, session_id: str, vram_mb: int, request_id: str, wait: float = 0.0,
                **kw: Any) -> pb.AcquireRequest:
    return pb.AcquireRequest(session=pb.SessionRef(agent=agent, session_id=session_id), vram_mb=vram_mb,
                             request_id=request_id, wait_seconds=wait, **kw)


class StreamCallError(grpc.RpcError):  # type: ignore[misc]
    """A Session stream message answered with an error status: read like a unary call's RpcError."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def session_call(stub: pb_grpc.CoordinatorStub, field: str, request: Any, timeout: float = 10,
                 call_id: int = 1, before: Sequence[pb.SessionRequest] = ()) -> Any:
    """``request`` (an AcquireRequest, ReleaseRequest or KeepAliveRequest, by ``field``) as one message of a
    new Session stream, after the messages ``before``: its answer, or StreamCallError with the code and the
    message it was answered with. An error that ends the stream itself is raised as gRPC raises it."""
    messages = [*before, pb.SessionRequest(call_id=call_id, timeout_seconds=timeout, **{field: request})]
    for response in stub.Session(iter(messages), timeout=timeout + 5):
        if response.call_id == call_id:
            if response.code:
                codes = {c.value[0]: c for c in grpc.StatusCode}
                raise StreamCallError(codes[response.code], response.message)
            return getattr(response, field)
    raise AssertionError(f"the Session stream ended without answering call {call_id}")


def expect_refused(cluster: Cluster, fn: Callable[[], Any], code: grpc.StatusCode, field: str) -> None:
    """``fn()`` fails with ``code``, its message names ``field``, and it wrote nothing to etcd."""
    before = cluster.state()
    with pytest.raises(grpc.RpcError) as info:
        fn()
    assert info.value.code() == code, info.value.details()
    assert field in info.value.details(), info.value.details()
    assert cluster.state() == before, "a refused request wrote to etcd"


# -- fault injection ---------------------------------------------------------------------------------

def patch_method(cluster: Cluster, obj: Any, name: str, replacement: Callable[..., Any]) -> Callable[[], None]:
    """Install ``obj.name = replacement`` on the cluster's loop thread (where ``obj`` is used); returns an
    undo that removes it there again and waits until it is gone."""
    cluster.lt.loop.call_soon_threadsafe(lambda: setattr(obj, name, replacement))
    wait_for(lambda: obj.__dict__.get(name) is replacement, 2, f"the patch of {name}")

    def undo() -> None:
        if cluster.lt.thread.is_alive():
            cluster.lt.loop.call_soon_threadsafe(lambda: obj.__dict__.pop(name, None))
            wait_for(lambda: obj.__dict__.get(name) is not replacement, 2, f"the undo of the patch of {name}")
        else:
            obj.__dict__.pop(name, None)
    return undo


def patch_commit(cluster: Cluster, svc: Any,
                 hook: Callable[[Any, Any, Callable[[], Awaitable[Any]]], Awaitable[Any]]) -> Callable[[], None]:
    """Wrap ``svc.store.commit``: ``await hook(compares, success, commit)`` decides, ``commit()`` being the
    real call. Returns an undo."""
    store = svc.store
    orig = store.commit

    async def commit(compares: Any, success: Any, failure: Any = (), deadline: float | None = None) -> Any:
        return await hook(list(compares), list(success), lambda: orig(compares, success, failure, deadline))
    return patch_method(cluster, store, "commit", commit)


def is_put(op: Op, key_part: bytes) -> bool:
    """``op`` (an operation of ``coordinator.txn``) puts a key containing ``key_part``."""
    return isinstance(op, Put) and key_part in op.key


def is_delete(op: Op, key_part: bytes) -> bool:
    return isinstance(op, Delete) and key_part in op.key


# -- child processes ---------------------------------------------------------------------------------

def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def gpucoord_run(addr: str, *args: str, stdin: Any = subprocess.DEVNULL) -> subprocess.Popen[str]:
    """``gpucoord run --coordinator ADDR ARGS...`` as a child process, its stdout and stderr piped."""
    return subprocess.Popen([sys.executable, "-m", "coordinator.cli", "run", "--coordinator", addr, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=stdin, text=True,
                            env=child_env(), cwd=REPO)


def write_fake_processes(path: pathlib.Path, doc: dict[int, dict[int, Any]]) -> None:
    """A ``--fake-processes`` file, written atomically (the node never reads half a file): GPU index ->
    {pid: MiB, or {"mib": MiB, "until": unix seconds}}."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({str(g): {str(p): mb for p, mb in procs.items()} for g, procs in doc.items()}))
    tmp.replace(path)


class ProcessGone:
    """When a process (not necessarily our child) is gone: exited, as a zombie or reaped. A small watcher
    process waits on its pidfd, which becomes readable the moment the process exits, and prints the wall
    time then. A process of its own, so that the time is taken at once, not when a thread of this process
    (which may run a busy coordinator) gets the GIL back."""

    _WATCH = ("import os, select, sys, time\n"
              "try:\n fd = os.pidfd_open(int(sys.argv[1]))\n"
              "except ProcessLookupError:\n print(repr(time.time()), flush=True); sys.exit()\n"
              "print('watching', flush=True)\n"
              "select.select([fd], [], [])\n"
              "print(repr(time.time()), flush=True)\n")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.at: float | None = None
        self._proc = subprocess.Popen([sys.executable, "-S", "-c", self._WATCH, str(pid)], stdout=subprocess.PIPE,
                                      text=True)
        assert self._proc.stdout is not None
        first = self._proc.stdout.readline().strip()
        if first != "watching":     # it was gone already
            self.at = float(first)

    def wait(self, timeout: float) -> float:
        if self.at is None:
            try:
                out, _ = self._proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
                raise AssertionError(f"pid {self.pid} did not exit within {timeout}s") from None
            self.at = float(out.strip())
        else:
            self._proc.wait(timeout)
        return self.at

    @staticmethod
    def now_gone(pid: int) -> bool:
        """/proc says so: no such process, or a zombie."""
        try:
            stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            return True
        return stat.rsplit(")", 1)[1].split()[0] == "Z"


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


class LinkedReplica:
    """A coordinator as a real child process whose etcd connection runs through ``etcd_link`` and whose clients
    reach it through ``link``: ``address`` is that link's endpoint, which it advertises, so the other
    replicas' forwarded calls and the clients it names as owner take the link too. ``restart()`` (after a
    kill) brings it back on the same port, behind the same links."""

    def __init__(self, endpoints: list[str], prefix: str, log_path: str, extra: Sequence[str] = ()) -> None:
        from coordinator.etcd.process import free_port
        self.port = free_port()
        self.link = FaultLink(f"127.0.0.1:{self.port}", "clients")
        self.etcd_link = FaultLink(endpoints, "etcd")
        self.address = self.link.endpoint
        self.prefix, self.log_path, self.extra = prefix, log_path, list(extra)
        self.id = ""    # the replica id, once ``registered`` has seen it
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen[bytes]:
        proc, _ = spawn_coordinator(self.etcd_link.endpoints, self.prefix, f"127.0.0.1:{self.port}", self.log_path,
                                    extra=[*self.extra, "--advertise", self.address])
        return proc

    def restart(self) -> None:
        self.proc = self._spawn()
        self.id = ""

    def registered(self, cluster: Cluster) -> bool:
        """Whether it has registered under ``coordinators/`` (and learn its id)."""
        for replica, address in cluster.replicas().items():
            if address == self.address:
                self.id = replica
        return bool(self.id)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def close(self) -> None:
        self.link.heal()
        self.etcd_link.heal()
        stop_process(self.proc)
        self.link.close()
        self.etcd_link.close()


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
                wait: float = 0.0, read_answer: bool = True,
                extra: list[str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """A real agent process (``coordinator.cli.demo agent``) that acquires and holds; returns it and its answer."""
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli.demo", "agent", "--coordinator", addr, "--host", host,
                             "--agent", agent, "--vram-mb", str(vram_mb), "--ttl", str(ttl), "--wait", str(wait),
                             *(extra or [])],
                            stdout=subprocess.PIPE, stdin=subprocess.PIPE, stderr=open(log_path, "ab"),
                            env=child_env(), cwd=REPO)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().decode().strip() if read_answer else ""


# -- fakes -------------------------------------------------------------------------------------------

def nvml_error(code: int) -> pynvml.NVMLError:
    """A real pynvml error; NVMLError.__new__ maps the code to its subclass (e.g. NVMLError_GpuIsLost)."""
    return pynvml.NVMLError(code)


class FakeDevice:
    """One GPU of a FakeNvml. Topology: ``bus_id`` (None: nvmlDeviceGetPciInfo is NotSupported), ``numa``
    (None: nvmlDeviceGetNumaNodeId is NotSupported) and ``links``, per NVLink (active: 0/1, the remote end's
    PCI bus id, its NVML_NVLINK_DEVICE_TYPE_*), None for a GPU without NVLink (NotSupported); a link
    number past the list is InvalidArgument, as NVML answers past a GPU's last link."""

    def __init__(self, uuid: str | bytes, name: str | bytes, total: int, used: int = 0,
                 procs: list[Any] | None = None, graphics: list[Any] | None = None,
                 bus_id: str | bytes | None = None, numa: int | None = None,
                 links: list[tuple[int, str | bytes, int]] | None = None) -> None:
        self.uuid = uuid
        self.name = name
        self.total = total
        self.used = used
        self.procs: list[Any] = procs or []
        self.graphics: list[Any] = graphics or []
        self.bus_id = bus_id
        self.numa = numa
        self.links = links
        # call name -> error code to raise from that call on this device
        self.fail: dict[str, int] = {}


class FakeNvml:
    """Stands in for the pynvml module: same function names, real exception classes (tests/unit/
    test_inventory.py checks every name against the real module, so the fake cannot drift)."""

    NVMLError = pynvml.NVMLError
    NVML_NVLINK_MAX_LINKS = pynvml.NVML_NVLINK_MAX_LINKS

    def __init__(self, devices: list[FakeDevice]) -> None:
        self.devices = devices
        self.init_error: BaseException | None = None
        self.count_error: int | None = None
        self.shutdown_error: int | None = None
        self.calls: list[str] = []

    def _dev(self, handle: Any, call: str) -> FakeDevice:
        self.calls.append(call)
        dev: FakeDevice = handle.dev
        if call in dev.fail:
            raise nvml_error(dev.fail[call])
        return dev

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.calls.append("nvmlShutdown")
        if self.shutdown_error is not None:
            raise nvml_error(self.shutdown_error)

    def nvmlDeviceGetCount(self) -> int:
        self.calls.append("nvmlDeviceGetCount")
        if self.count_error is not None:
            raise nvml_error(self.count_error)
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self.calls.append("nvmlDeviceGetHandleByIndex")
        dev = self.devices[index]
        if "nvmlDeviceGetHandleByIndex" in dev.fail:
            raise nvml_error(dev.fail["nvmlDeviceGetHandleByIndex"])
        return SimpleNamespace(dev=dev)

    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes:
        return self._dev(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetName(self, handle: Any) -> str | bytes:
        return self._dev(handle, "nvmlDeviceGetName").name

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        d = self._dev(handle, "nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(total=d.total, used=d.used, free=d.total - d.used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        return list(self._dev(handle, "nvmlDeviceGetComputeRunningProcesses").procs)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[Any]:
        return list(self._dev(handle, "nvmlDeviceGetGraphicsRunningProcesses").graphics)

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        d = self._dev(handle, "nvmlDeviceGetPciInfo")
        if d.bus_id is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(busId=d.bus_id)

    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int:
        d = self._dev(handle, "nvmlDeviceGetNumaNodeId")
        if d.numa is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return d.numa

    def _link(self, handle: Any, link: int, call: str) -> tuple[int, str | bytes, int]:
        d = self._dev(handle, call)
        if d.links is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < len(d.links):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return d.links[link]

    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int:
        return self._link(handle, link, "nvmlDeviceGetNvLinkState")[0]

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: Any, link: int) -> Any:
        return SimpleNamespace(busId=self._link(handle, link, "nvmlDeviceGetNvLinkRemotePciInfo")[1])

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: Any, link: int) -> int:
        return self._link(handle, link, "nvmlDeviceGetNvLinkRemoteDeviceType")[2]


# -- the etcd boundary -------------------------------------------------------------------------------

class EtcdCalls(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Every unary etcd call of every Store opened while installed: (method name, request). A client
    interceptor on the Store's own channel: etcd stays real."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        # Awaited before a call goes out, to act between two calls of one operation.
        self.before: Callable[[str, Any], Awaitable[None]] | None = None

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        name = method.rsplit("/", 1)[-1]
        self.calls.append((name, request))
        if self.before is not None:
            await self.before(name, request)
        return await continuation(details, request)

    def of(self, name: str) -> list[Any]:
        return [req for n, req in self.calls if n == name]


def record_etcd_calls(monkeypatch: pytest.MonkeyPatch) -> EtcdCalls:
    calls = EtcdCalls()

    def open_channel(target: str, security: Any = None) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(target, options=list(store_module.CHANNEL_OPTIONS.items()),
                                         interceptors=[calls])
    monkeypatch.setattr(store_module, "_open_channel", open_channel)
    return calls


def read_only(txn: Any) -> bool:
    """etcd's own rule (isTxnReadonly): every op of both branches is a range."""
    return all(op.WhichOneof("request") == "request_range" for op in (*txn.success, *txn.failure))


# -- security ----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Pki:
    """Certificates for the security tests: one CA with every role, another CA, an expired certificate."""
    dir: pathlib.Path
    ca: str
    files: dict[str, TlsFiles]   # "coordinator", "node", "agent-a", "agent-b", "operator", "other-ca", "expired"

    def __getitem__(self, name: str) -> TlsFiles:
        return self.files[name]


def make_pki(base: pathlib.Path, host: str = "h1") -> Pki:
    from coordinator.security import certs
    from coordinator.security.tls import TlsFiles
    d = base / "pki"
    certs.init_ca(d)
    ca = str(d / "ca.crt")

    def issue(kind: str, name: str, directory: pathlib.Path = d, **kw: object) -> TlsFiles:
        f = certs.issue(directory, kind, name, **kw)  # type: ignore[arg-type]
        return TlsFiles(str(directory / "ca.crt"), str(f.cert), str(f.key))

    files = {"coordinator": issue("coordinator", "c1"), "node": issue("node", host),
             "agent-a": issue("agent", "agent-a"), "agent-b": issue("agent", "agent-b"),
             "operator": issue("operator", "ops")}
    past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=2)
    files["expired"] = issue("agent", "agent-a", not_before=past - datetime.timedelta(days=1),
                             not_after=past, out_name="expired-agent-a")
    other = base / "other-pki"
    certs.init_ca(other)
    theirs = issue("agent", "agent-a", directory=other)
    # Presented to our servers, verified against OUR CA: its client cert is from the other CA.
    files["other-ca"] = TlsFiles(ca, theirs.cert, theirs.key)
    return Pki(d, ca, files)


def revision(cluster: Cluster) -> int:
    """etcd's current revision."""
    return int(cluster.lt.run(cluster.store.snapshot([Range(b"/")])).revision)


def writes_since(cluster: Cluster, before: int) -> list[str]:
    """Keys written (put or deleted) after revision ``before``, other than the node daemon's own
    ``hosts/`` and ``usage/`` (it republishes usage by itself when leases change): on an etcd of the
    module's own, an empty list means nothing that a request could have caused was written."""
    now = revision(cluster)
    if now == before:
        return []

    async def collect() -> list[tuple[str, bytes, int]]:
        seen: list[tuple[str, bytes, int]] = []
        async for batch in cluster.store.watch(b"/", start_revision=before + 1):
            seen += [(ev.kind, ev.kv.key, ev.kv.mod_revision) for ev in batch.events]
            if any(rev >= now for *_, rev in seen):
                return seen
        return seen
    events = cluster.lt.run(asyncio.wait_for(collect(), 10))
    return [f"{kind} {key.decode(errors='replace')}" for kind, key, rev in events
            if rev <= now and cluster.keys.parse(key)[0] not in ("hosts", "usage")]


# -- a 3-member etcd ---------------------------------------------------------------------------------

class Etcd3:
    """A 3-member etcd cluster on loopback for the fault tier: find the leader, kill -9, SIGSTOP, bring back.

    Members run with ``--unsafe-no-fsync``: this machine's disk is slow and shared, and the tests kill whole
    processes (not machines), so what a member acknowledged is in its page cache and survives. The fixture
    ``etcd3`` (tests/faults/conftest.py) starts one and closes it."""

    def __init__(self) -> None:
        self.cluster = EtcdCluster(3, options=EtcdOptions(unsafe_no_fsync=True))
        self.stopped: set[str] = set()

    @property
    def endpoints(self) -> list[str]:
        return self.cluster.endpoints

    @property
    def members(self) -> list[EtcdMember]:
        return self.cluster.members

    def leader(self, timeout: float = 10.0) -> EtcdMember:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for m in self.members:
                if m.proc is not None and m.name not in self.stopped and m.is_leader():
                    return m
            time.sleep(0.05)
        raise TimeoutError("no etcd leader")

    def followers(self) -> list[EtcdMember]:
        lead = self.leader()
        return [m for m in self.members if m is not lead]

    def kill(self, m: EtcdMember) -> None:
        m.kill()

    def restart(self, m: EtcdMember, timeout: float = 20.0) -> None:
        m.restart(self.cluster.initial_cluster)
        deadline = time.monotonic() + timeout
        while not m.healthy():
            if time.monotonic() > deadline:
                raise TimeoutError(f"etcd member {m.name} did not come back; log {m.log_path}")
            time.sleep(0.05)

    def stop(self, m: EtcdMember) -> None:
        m.signal(signal.SIGSTOP)
        self.stopped.add(m.name)

    def cont(self, m: EtcdMember) -> None:
        m.signal(signal.SIGCONT)
        self.stopped.discard(m.name)

    def close(self) -> None:
        for m in self.members:
            m.signal(signal.SIGCONT)
        self.cluster.stop()


class ClientFailovers(logging.Handler):
    """What the agent clients of this process were answered when they moved to another replica, counted by
    call and status ("Acquire UNAVAILABLE", "KeepAlive no answer", ...), from agent_client's own log. Use
    ``with ClientFailovers() as seen:``."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.counts: collections.Counter[str] = collections.Counter()
        self._logger = logging.getLogger("agent_client.client")
        self._level = self._logger.level

    def emit(self, record: logging.LogRecord) -> None:
        msg, args = str(record.msg), record.args if isinstance(record.args, tuple) else ()
        if msg.startswith("%s: coordinator %s failed") and len(args) == 3:
            self.counts[f"{args[0]} {str(args[2]).split(':')[0]}"] += 1
        elif msg.startswith("keepalive stream broke") and args:
            self.counts[f"KeepAlive {args[0]}"] += 1
        elif msg.startswith("keepalive: no answer"):
            self.counts["KeepAlive no answer"] += 1

    def __enter__(self) -> ClientFailovers:
        self._logger.addHandler(self)
        self._logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)


# -- a load of agents --------------------------------------------------------------------------------
# Agents doing random acquire/release cycles, each call's outcome and timing recorded: used by the replica
# tests (throughput with one and two replicas, waits answered on time) and the nemesis run (every call must
# end with a documented status). Agents are ``AsyncClient``s on one event loop.

# What a call may end with, and stay within the contract: a grant, or one of these documented statuses.
DOCUMENTED = {"ok", "ResourceExhausted", "Unavailable", "DeadlineExceeded", "SessionExpired", "FailedPrecondition"}


@dataclasses.dataclass
class LoadCall:
    agent: str
    wait_s: float
    elapsed_s: float
    outcome: str          # "ok" or the agent_client error class name
    host: str = ""
    ended_at: float = 0.0     # time.monotonic() when it was answered
    lease_id: str = ""        # the lease granted ("ok")

    @property
    def late_s(self) -> float:
        """How long after its wait the call was answered (calls with a wait only)."""
        return self.elapsed_s - self.wait_s


@dataclasses.dataclass
class LoadReport:
    calls: list[LoadCall] = dataclasses.field(default_factory=list)
    releases: int = 0
    open_failures: list[str] = dataclasses.field(default_factory=list)
    expired: list[str] = dataclasses.field(default_factory=list)    # agents whose session was lost

    @property
    def granted(self) -> int:
        return sum(1 for c in self.calls if c.outcome == "ok")

    def outcomes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.calls:
            out[c.outcome] = out.get(c.outcome, 0) + 1
        return out

    def waits(self) -> list[LoadCall]:
        """Calls with a wait that ended by the coordinator's answer (a grant or RESOURCE_EXHAUSTED)."""
        return [c for c in self.calls if c.wait_s > 0 and c.outcome in ("ok", "ResourceExhausted")]

    def max_late_s(self) -> float:
        return max((c.late_s for c in self.waits()), default=0.0)

    def undocumented(self) -> list[LoadCall]:
        return [c for c in self.calls if c.outcome not in DOCUMENTED]


async def agent_loop(client: AsyncClient, report: LoadReport, until: float, rng: random.Random,
                     sizes: Sequence[int], waits: Sequence[float], hold_s: float,
                     low_priority: Collection[int] = ()) -> None:
    while time.monotonic() < until:
        vram, wait = rng.choice(sizes), rng.choice(waits)
        t0 = time.monotonic()
        try:
            lease = await client.acquire(vram, wait=wait, priority=-1 if vram in low_priority else 0)
        except errors.GpucoordError as e:
            report.calls.append(LoadCall(client.agent, wait, time.monotonic() - t0, type(e).__name__, client.host,
                                         time.monotonic()))
            if isinstance(e, errors.SessionExpired):
                return
            if not isinstance(e, errors.ResourceExhausted):
                await asyncio.sleep(0.05)    # a fault: do not spin while it lasts
            continue
        report.calls.append(LoadCall(client.agent, wait, time.monotonic() - t0, "ok", client.host, time.monotonic(),
                                     lease.id))
        await asyncio.sleep(rng.uniform(0, hold_s))
        try:
            await lease.release()
            report.releases += 1
        except errors.GpucoordError:
            pass   # the lease goes with the session, or was evicted


async def run_load(addresses: Sequence[Sequence[str]], host: str | Sequence[str], duration_s: float, seed: int,
                   sizes: Sequence[int] = (2000, 4000, 6000), waits: Sequence[float] = (0.0, 0.5, 2.0),
                   hold_s: float = 0.02, agent_prefix: str = "agent", ttl: int = 10,
                   report: LoadReport | None = None, low_priority: Collection[int] = ()) -> LoadReport:
    """One agent per entry of ``addresses`` (the replicas that agent talks to), each on ``host`` (or the
    hosts in turn), for ``duration_s`` seconds. Sessions are closed at the end. Requests of the sizes in
    ``low_priority`` ask with priority -1 (they wait behind the others instead of blocking them)."""
    report = report or LoadReport()
    hosts = [host] if isinstance(host, str) else list(host)
    rng = random.Random(seed)
    clients = [AsyncClient(list(addrs), agent=f"{agent_prefix}-{i}", host=hosts[i % len(hosts)], ttl=ttl)
               for i, addrs in enumerate(addresses)]
    connected: list[AsyncClient] = []
    for c in clients:
        try:
            await c.connect()
            connected.append(c)
        except errors.GpucoordError as e:
            report.open_failures.append(f"{c.agent}: {e!r}")
    until = time.monotonic() + duration_s
    try:
        await asyncio.gather(*(agent_loop(c, report, until, random.Random(rng.random()), sizes, waits, hold_s,
                                          low_priority)
                               for c in connected))
    finally:
        for c in connected:
            if c.expired:
                report.expired.append(c.agent)
            try:
                await c.close()
            except errors.GpucoordError:
                pass
    return report


# -- a flood of calls by one identity (fair service) ----------------------------------------------------------

def flood(addr: str, ca: str, cert: str, key: str, agent: str, host: str, kind: str, count: int,
          concurrency: int = 32, seconds: float = 3600.0) -> dict[str, int]:
    """``count`` calls of ``kind`` by ``agent`` (its certificate), ``concurrency`` at a time, as fast as the
    coordinator answers, for at most ``seconds``: ``status`` (GetStatus of ``host``, where it holds a
    session), ``acquire`` (requests that never fit), ``open`` (OpenSession). Returns how many ended with each
    status code. Run it in a process of its own (``python -c``), so that its work is not the test's."""
    from coordinator.security.tls import TlsFiles, channel_credentials

    async def run() -> dict[str, int]:
        codes: dict[str, int] = {}
        creds = channel_credentials(TlsFiles(ca, cert, key))
        async with grpc.aio.secure_channel(addr, creds) as ch:
            stub = pb_grpc.CoordinatorStub(ch)
            sid = (await stub.OpenSession(pb.OpenSessionRequest(agent=agent, host=host, ttl_seconds=60),
                                          timeout=30)).session_id
            ref = pb.SessionRef(agent=agent, session_id=sid)
            calls = {"status": lambda: stub.GetStatus(pb.GetStatusRequest(host=host), timeout=30),
                     "acquire": lambda: stub.Acquire(pb.AcquireRequest(session=ref, vram_mb=1 << 29), timeout=30),
                     "open": lambda: stub.OpenSession(pb.OpenSessionRequest(agent=agent, host=host, ttl_seconds=5),
                                                      timeout=30)}
            left = count
            until = time.monotonic() + seconds

            async def worker() -> None:
                nonlocal left
                while left > 0 and time.monotonic() < until:
                    left -= 1
                    try:
                        await calls[kind]()
                        code = "OK"
                    except grpc.aio.AioRpcError as e:
                        code = e.code().name
                    codes[code] = codes.get(code, 0) + 1
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        return codes
    return asyncio.run(run())
