"""G9, fair service: one agent's flood does not slow everyone. Each identity has a token bucket of calls
(expensive calls cost more tokens) and a cap on its open streams; a refusal is RESOURCE_EXHAUSTED naming the
limit, costs no etcd read and no log line, and a flood that waits for its answers is slowed down (refusals
are held a moment first).

The measurement runs the coordinator and the flooding agent as processes of their own (the flood's CPU is
not the measuring test's): another agent's acquire p50, quiet and then under each flood of the finding
(GetStatus, acquires that never fit, OpenSession), in one run. Timing-sensitive: run it under the heavy lock.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any, Iterator

import grpc
import pytest

from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from coordinator.security.tls import channel_credentials
from tests.support import REPO
from tests.support.cluster import Cluster
from tests.support.pki import Pki, coordinator_tls, secure_cluster
from tests.support.processes import child_env, spawn_coordinator, stop_process
from tests.support.waiting import LIVENESS_S, wait_for

pytestmark = pytest.mark.integration
C = grpc.StatusCode
HOST = "h1"
# The target is 2x; the bound asserted here is looser, for a shared 2-core machine (the figures are
# printed, and the report quotes them).
MAX_RATIO = float(os.environ.get("GPUCOORD_FLOOD_MAX_RATIO", "3.0"))


@pytest.fixture
def cluster(own_etcd: list[str], pki: Pki) -> Iterator[Cluster]:
    with secure_cluster(own_etcd, pki, "fair", HOST) as c:
        yield c


def test_an_identity_holds_at_most_max_streams_open(cluster: Cluster, pki: Pki) -> None:
    """The finding: 1,000 Session streams of one agent were all kept (+19 MiB). Past the cap, the opening of a
    stream is RESOURCE_EXHAUSTED naming ``streams``; another agent is not affected; a closed stream frees its
    place."""
    addr = cluster.start_coordinator(max_streams_per_identity=8, **coordinator_tls(pki))
    chans = [grpc.secure_channel(addr, channel_credentials(pki[who])) for who in ("agent-a", "agent-b")]
    try:
        a, b = (pb_grpc.CoordinatorStub(ch) for ch in chans)
        sid = a.OpenSession(pb.OpenSessionRequest(agent="agent-a", host=HOST, ttl_seconds=60), timeout=10).session_id
        ref = pb.SessionRef(agent="agent-a", session_id=sid)
        held: list[Any] = []
        refused = 0
        for _ in range(200):
            call = _open_stream(a, ref)
            try:
                first = next(call)
                assert first.keepalive.ttl_seconds > 0
                held.append(call)
            except grpc.RpcError as e:
                assert e.code() == C.RESOURCE_EXHAUSTED, (e.code(), e.details())
                assert e.details().startswith("streams: ") and "gpucoord://agent/agent-a" in e.details()
                refused += 1
        assert len(held) == 8 and refused == 192, (len(held), refused)
        other = b.Session(iter([]), timeout=10)
        assert list(other) == []                       # agent-b opens (and ends) its own stream
        held.pop().cancel()
        wait_for(lambda: _opens(a, ref), LIVENESS_S, "a place to free up once a stream is closed")
    finally:
        for ch in chans:
            ch.close()
        cluster.stop_coordinator(addr)


def _open_stream(stub: Any, ref: pb.SessionRef) -> Any:
    """A Session stream that sends one keepalive and then stays open (its request iterator blocks)."""
    import threading
    never = threading.Event()

    def messages() -> Iterator[pb.SessionRequest]:
        yield pb.SessionRequest(call_id=1, keepalive=pb.KeepAliveRequest(session=ref))
        never.wait(120)
    return stub.Session(messages(), timeout=60)


def _opens(stub: Any, ref: pb.SessionRef) -> bool:
    call = _open_stream(stub, ref)
    try:
        next(call)
        return True
    except grpc.RpcError:
        return False
    finally:
        call.cancel()


def _acquire_p50(stub: Any, ref: pb.SessionRef, n: int) -> tuple[float, list[float]]:
    """Median latency of ``n`` acquires (each released), paced at about 20 a second: the measuring agent is
    an ordinary one, well within its own rate."""
    took = []
    for _ in range(n):
        t0 = time.perf_counter()
        lease = stub.Acquire(pb.AcquireRequest(session=ref, vram_mb=100, request_id=uuid.uuid4().hex),
                             timeout=10).lease
        took.append(time.perf_counter() - t0)
        stub.Release(pb.ReleaseRequest(session=ref, lease_id=lease.id), timeout=10)
        pace = time.monotonic() + 0.04
        while time.monotonic() < pace:   # pacing the load, not waiting for anything
            time.sleep(0.005)
    return statistics.median(took), took


def test_one_agents_flood_leaves_another_agents_acquire_p50_within_bounds(
        cluster: Cluster, pki: Pki, tmp_path: Any) -> None:
    c = pki["coordinator"]
    proc, port = spawn_coordinator(cluster.endpoints, cluster.prefix, "127.0.0.1:0", str(tmp_path / "c.log"),
                                   extra=["--tls-ca", c.ca, "--tls-cert", c.cert, "--tls-key", c.key])
    addr = f"127.0.0.1:{port}"
    ch = grpc.secure_channel(addr, channel_credentials(pki["agent-a"]))
    figures: list[str] = []
    try:
        stub = pb_grpc.CoordinatorStub(ch)
        sid = stub.OpenSession(pb.OpenSessionRequest(agent="agent-a", host=HOST, ttl_seconds=60),
                               timeout=10).session_id
        ref = pb.SessionRef(agent="agent-a", session_id=sid)
        _acquire_p50(stub, ref, 20)   # warm up
        b = pki["agent-b"]
        ratios, limited = {}, {}
        for kind, count in (("status", 1500), ("acquire", 2000), ("open", 300)):
            quiet, _ = _acquire_p50(stub, ref, 40)
            code = (f"import json; from tests.support.load import flood; print('flooding', flush=True); "
                    f"print(json.dumps(flood({addr!r}, {b.ca!r}, {b.cert!r}, {b.key!r}, 'agent-b', {HOST!r}, "
                    f"{kind!r}, {count}, seconds=4)))")
            flooder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=child_env(),
                                       cwd=REPO, text=True)
            try:
                assert flooder.stdout is not None and flooder.stdout.readline().strip() == "flooding"
                loud, took = _acquire_p50(stub, ref, 60)
                out, _ = flooder.communicate(timeout=60)
            finally:
                stop_process(flooder)  # type: ignore[arg-type]
            codes = json.loads(out)
            limited[kind] = codes.get("RESOURCE_EXHAUSTED", 0) > 0      # the flood did hit its limit
            ratios[kind] = loud / quiet
            figures.append(f"{kind}: quiet p50 {quiet * 1e3:.1f} ms, under flood {loud * 1e3:.1f} ms "
                           f"({ratios[kind]:.2f}x, max {max(took) * 1e3:.0f} ms); flood answered {codes}")
        print("\n" + "\n".join(figures))
        assert all(r <= MAX_RATIO for r in ratios.values()), figures
        assert all(limited.values()), figures
    finally:
        ch.close()
        stop_process(proc)
