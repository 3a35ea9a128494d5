"""G9 for a node daemon's /metrics, end to end: a real ``gpucoord node`` process (registry mode, no etcd
credentials) with real certificates serves HTTPS to a live certificate of the ``operator`` or ``metrics`` role
only. An agent's, a node's or a coordinator's certificate gets 403 (counted, not logged); a client without a
certificate, or with another CA's, fails the TLS handshake; a certificate revoked through the coordinator is
refused by the node from then on (it follows the deny list through its coordinator), without a restart."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from coordinator.etcd.process import free_port
from tests.support import REPO
from tests.support.cluster import Cluster, EtcdEndpoint
from tests.support.pki import Pki, coordinator_tls, scrape
from tests.support.processes import child_env
from tests.support.waiting import LIVENESS_S, wait_for

pytestmark = pytest.mark.integration
HOST = "h1"   # the node certificate of the pki fixture is gpucoord://node/h1


class NodeProcess:
    def __init__(self, coordinator: str, pki: Pki, log_path: Path) -> None:
        node = pki["node"]
        self.metrics_port = free_port()
        self.log_path = log_path
        env = {k: v for k, v in child_env().items() if not k.startswith("GPUCOORD_")}
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "coordinator.cli", "node", "--coordinator", coordinator, "--host", HOST,
                 "--fake-gpus", "1x16GiB", "--listen", "127.0.0.1:0", "--metrics-listen",
                 f"127.0.0.1:{self.metrics_port}", "--tls-ca", node.ca, "--tls-cert", node.cert, "--tls-key",
                 node.key], stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=REPO,
                stdin=subprocess.DEVNULL)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert re.match(r"READY node port=\d+", line), (line, log_path.read_text()[-3000:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


@pytest.fixture
def node(etcd: EtcdEndpoint, pki: Pki, tmp_path: Path) -> Iterator[tuple[Cluster, str, NodeProcess]]:
    cluster = Cluster(etcd.endpoints, f"/gpucoord-nodemetrics-{os.getpid()}-{uuid.uuid4().hex[:6]}/")
    daemon = None
    try:
        addr = cluster.start_coordinator(**coordinator_tls(pki))
        daemon = NodeProcess(addr, pki, tmp_path / "node.log")
        yield cluster, addr, daemon
    finally:
        if daemon is not None:
            daemon.stop()
        cluster.close()


def _refusals(body: str, why: str) -> float:
    m = re.search(rf'^gpucoord_metrics_refusals_total{{why="{why}"}} (\S+)$', body, re.M)
    return float(m.group(1)) if m else 0.0


def test_node_metrics_serve_only_a_live_operator_or_metrics_certificate(
        node: tuple[Cluster, str, NodeProcess], pki: Pki) -> None:
    cluster, addr, daemon = node
    port = daemon.metrics_port
    # Every scrape is 403 until the node has read the deny list through its coordinator; then the operator's
    # certificate reads the node's own families, and no coordinator family.
    wait_for(lambda: scrape(port, pki.ca, pki["operator"])[0] == 200, 30, "the node's /metrics to serve the operator")
    status, body = scrape(port, pki.ca, pki["operator"])
    assert status == 200 and "gpucoord_node_vram_used_bytes" in body, body[:500]
    assert "gpucoord_releases_total" not in body and "gpucoord_leases" not in body.replace("gpucoord_node_", "")
    roles_before = _refusals(body, "role")
    log_before = daemon.log_path.read_text()

    for who in ("agent-a", "node", "coordinator"):
        status, body = scrape(port, pki.ca, pki[who])
        assert status == 403 and "gpucoord_" not in body and "(role)" in body, (who, status, body[:200])
    for who in ("expired", "other-ca"):   # the handshake refuses them: no HTTP answer at all
        status, why = scrape(port, pki.ca, pki[who])
        assert status == 0, (who, status, why[:200])
    status, why = scrape(port, pki.ca, None)   # no client certificate
    assert status == 0, (status, why[:200])
    status, body = scrape(port, pki.ca, pki["metrics"])
    assert status == 200 and "gpucoord_node_vram_used_bytes" in body, (status, body[:200])
    # Counted, never logged per refused scrape.
    assert _refusals(scrape(port, pki.ca, pki["operator"])[1], "role") == roles_before + 3
    added = daemon.log_path.read_text()[len(log_before):]
    assert not re.search(r"403|forbidden|metrics", added, re.I), added[-2000:]

    # Revoked through the coordinator (the operator's certificate): the node refuses it without a restart.
    op = pki["operator"]
    done = subprocess.run([sys.executable, "-m", "coordinator.cli", "certs", "revoke", "--dir", str(pki.dir),
                           "metrics/prometheus", "--reason", "node metrics test", "--coordinator", addr,
                           "--tls-ca", op.ca, "--tls-cert", op.cert, "--tls-key", op.key],
                          capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=60,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    # (The deny list is this test's prefix's: other tests' clusters do not see it.)
    wait_for(lambda: scrape(port, pki.ca, pki["metrics"])[0] == 403, LIVENESS_S, "the node to refuse the revoked certificate")
    status, body = scrape(port, pki.ca, pki["metrics"])
    assert status == 403 and "(revoked)" in body, (status, body)
    assert scrape(port, pki.ca, pki["operator"])[0] == 200
    assert [kv.key for kv in cluster.get_prefix(cluster.keys.revocations())], "no revocation was written"
