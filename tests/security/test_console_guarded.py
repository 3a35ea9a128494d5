"""G9 for the fleet console: over TLS it takes a live certificate of the operator or viewer role; a metrics,
agent or node certificate gets 403 (and a viewer's gets 403 on /metrics and nothing on gRPC but health). It is
read-only: any method but GET and HEAD is 405."""
from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request
import uuid
from typing import Iterator

import grpc
import pytest

from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from coordinator import metrics
from coordinator.metrics_http import MetricsGate
from coordinator.rpc.coordinator_server import create_server
from coordinator.security.tls import TlsFiles
from tests.support.cluster import Cluster
from tests.support.pki import Pki, coordinator_tls
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration


def get(port: int, path: str, files: TlsFiles, ca: str, method: str = "GET") -> tuple[int, str]:
    ctx = ssl.create_default_context(cafile=ca)
    ctx.load_cert_chain(files.cert, files.key)
    request = urllib.request.Request(f"https://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(request, context=ctx, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture
def console(own_etcd: list[str], pki: Pki) -> Iterator[tuple[Cluster, str, int]]:
    """A TLS coordinator (with host h1) whose console and /metrics (HTTPS) follow its own deny list."""
    cluster = Cluster(own_etcd, f"/gpucoord-console-{os.getpid()}-{uuid.uuid4().hex[:6]}/")
    try:
        cluster.start_node("h1", "1x16GiB")
        gate = MetricsGate()
        server, port, svc = cluster.lt.run(create_server(cluster.config(**coordinator_tls(pki)), metrics_gate=gate))
        addr = f"127.0.0.1:{port}"
        cluster.coordinators[addr] = (server, svc)
        yield cluster, addr, metrics.serve("127.0.0.1:0", pki["coordinator"], gate=gate)
    finally:
        cluster.close()


def test_the_console_takes_a_live_operator_or_viewer_certificate(console: tuple[Cluster, str, int],
                                                                  pki: Pki) -> None:
    _, addr, port = console
    # Until the server has read its deny list every request is 403 ("revocations"): wait for that.
    wait_for(lambda: get(port, "/", pki["viewer"], pki.ca)[0] == 200, 10, "the console served to a viewer")
    for who in ("viewer", "operator"):
        status, page = get(port, "/hosts", pki[who], pki.ca)
        assert status == 200 and 'data-host="h1"' in page, (who, status, page[:300])
        status, body = get(port, "/api/status", pki[who], pki.ca)
        assert status == 200 and [h["host"] for h in json.loads(body)["hosts"]] == ["h1"], (who, body[:300])
    for who in ("metrics", "agent-a", "node"):
        status, body = get(port, "/", pki[who], pki.ca)
        refused = "forbidden: the console needs a live operator or viewer certificate (role)\n"
        assert status == 403 and body == refused, (who, status, body)
    # /metrics stays the operator's and the scraper's; a viewer reads only the console.
    assert get(port, "/metrics", pki["metrics"], pki.ca)[0] == 200
    status, body = get(port, "/metrics", pki["viewer"], pki.ca)
    assert status == 403 and "operator or metrics" in body, body
    # The viewer role may call nothing of the gRPC API but health.
    creds = grpc.ssl_channel_credentials(*(open(f, "rb").read() for f in (pki.ca, pki["viewer"].key,
                                                                           pki["viewer"].cert)))
    with grpc.secure_channel(addr, creds) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.CoordinatorStub(channel).GetStatus(pb.GetStatusRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value
    # Read-only: no method that could change anything is served.
    status, body = get(port, "/api/status", pki["operator"], pki.ca, method="POST")
    assert status == 405 and body == "the console is read-only\n", (status, body)
