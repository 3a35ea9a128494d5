"""G9 for /metrics: over TLS a scrape needs a live (not revoked) certificate of the operator or metrics role; an
agent's or a revoked one's gets 403, and no log line per refused scrape. And failed TLS handshakes (clients
without a certificate) are counted, not logged one line each."""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator import metrics
from coordinator.etcd.process import free_port
from coordinator.metrics_http import MetricsGate
from coordinator.rpc.coordinator_server import create_server
from tests.support import REPO
from tests.support.cluster import Cluster, EtcdEndpoint
from tests.support.pki import Pki, coordinator_tls, scrape
from tests.support.processes import child_env
from tests.support.waiting import LIVENESS_S, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def guarded(own_etcd: list[str], pki: Pki) -> Iterator[tuple[Cluster, int]]:
    """A TLS coordinator whose /metrics (HTTPS) follows its own deny list."""
    cluster = Cluster(own_etcd, f"/gpucoord-metrics-{os.getpid()}-{uuid.uuid4().hex[:6]}/")
    try:
        gate = MetricsGate()
        server, port, svc = cluster.lt.run(create_server(cluster.config(**coordinator_tls(pki)), metrics_gate=gate))
        cluster.coordinators[f"127.0.0.1:{port}"] = (server, svc)
        yield cluster, metrics.serve("127.0.0.1:0", pki["coordinator"], gate=gate)
    finally:
        cluster.close()


def test_metrics_take_a_live_operator_or_metrics_certificate(guarded: tuple[Cluster, int], pki: Pki,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    cluster, port = guarded
    caplog.set_level(logging.DEBUG)   # any line a refusal wrote would show
    before = caplog.records[:]
    refused_before = metrics.REGISTRY.get_sample_value("gpucoord_metrics_refusals_total", {"why": "role"}) or 0.0
    for who in ("agent-a", "node"):
        status, body = scrape(port, pki.ca, pki[who])
        assert status == 403 and "gpucoord_" not in body, (who, status, body[:200])
    assert metrics.REGISTRY.get_sample_value("gpucoord_metrics_refusals_total", {"why": "role"}) == refused_before + 2
    assert [r for r in caplog.records if r not in before and "metrics" in r.getMessage()] == []
    for who in ("operator", "metrics"):
        status, body = scrape(port, pki.ca, pki[who])
        assert status == 200 and "gpucoord_releases_total" in body, (who, status)

    # Revoked: refused from the moment the server's deny list has it (no restart).
    op = pki["operator"]
    done = subprocess.run([sys.executable, "-m", "coordinator.cli", "certs", "revoke", "--dir", str(pki.dir),
                           "metrics/prometheus", "--reason", "test", "--coordinator", next(iter(cluster.coordinators)),
                           "--tls-ca", op.ca, "--tls-cert", op.cert, "--tls-key", op.key],
                          capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=60,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    wait_for(lambda: scrape(port, pki.ca, pki["metrics"])[0] == 403, LIVENESS_S, "the revoked certificate refused")
    status, body = scrape(port, pki.ca, pki["metrics"])
    assert status == 403 and "revoked" in body
    assert scrape(port, pki.ca, pki["operator"])[0] == 200


def _hammer(address: str, ca: bytes, seconds: float, threads: int = 32) -> int:
    """``threads`` loops of certificate-less connections for ``seconds`` (load, not synchronisation)."""
    count = [0] * threads
    until = time.monotonic() + seconds

    def loop(i: int) -> None:
        while time.monotonic() < until:
            with grpc.secure_channel(address, grpc.ssl_channel_credentials(ca)) as ch:
                try:
                    health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                except grpc.RpcError:
                    count[i] += 1
    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return sum(count)


def test_certificate_less_connections_are_counted_not_logged_one_line_each(etcd: EtcdEndpoint, pki: Pki,
                                                                            tmp_path: Path) -> None:
    endpoint = etcd.endpoints[0]
    c = pki["coordinator"]
    mport = free_port()
    log_path = tmp_path / "coordinator.log"
    env = {k: v for k, v in child_env().items() if not k.startswith(("GPUCOORD_", "GRPC_"))}
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", "coordinator", "--etcd", endpoint, "--prefix",
             f"/gpucoord-hs-{uuid.uuid4().hex[:6]}/", "--listen", "127.0.0.1:0", "--metrics-listen",
             f"127.0.0.1:{mport}", "--tls-ca", c.ca, "--tls-cert", c.cert, "--tls-key", c.key],
            stdout=subprocess.PIPE, stderr=log_file, text=True, env=env, cwd=REPO, stdin=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.match(r"READY coordinator port=(\d+)", line)
        assert m, (line, log_path.read_text()[-2000:])
        lines_before = len(log_path.read_bytes().splitlines())
        failed = _hammer(f"127.0.0.1:{m.group(1)}", Path(pki.ca).read_bytes(), seconds=10)
        assert failed > 100, failed
        # Nearly every one is a server-side handshake failure, counted; a few of the client's may end before
        # the server's handshake does (a connection reset on a busy machine: 8 of 5,674 in one run).
        wait_for(lambda: _handshake_failures(mport, pki) >= 0.95 * failed, 10, "the failed handshakes counted")
        # Only the lines about handshakes count: a replica's own start-up (its election, its leader duties)
        # may still be logging when the hammer starts.
        after = log_path.read_text(errors="replace").splitlines()[lines_before:]
        about = [x for x in after if re.search(r"handshake|ssl|tls", x, re.I)]
        print(f"\n{failed} failed handshakes in 10 s: the log grew by {len(after)} line(s), {len(about)} about "
              "handshakes")
        assert len(about) <= 3, "\n".join(after[-40:])
        # And the log as a whole grew by a few lines at most: those, and the replica's few start-up lines.
        assert len(after) <= 8, "\n".join(after[-40:])
        assert "TLS handshake(s) failed" in log_path.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _handshake_failures(port: int, pki: Pki) -> float:
    status, body = scrape(port, pki.ca, pki["operator"])
    assert status == 200
    m = re.search(r"^gpucoord_tls_handshake_failures_total (\S+)$", body, re.M)
    return float(m.group(1)) if m else 0.0
