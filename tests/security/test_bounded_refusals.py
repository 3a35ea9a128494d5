"""G9: a refusal is always its own status, however large the request's fields; a stream's answers are
bounded; a client that cancels a stream in any state leaves no traceback behind.

The coordinator of the memory test is a real process with mTLS (its RSS and its log are measured); the
others run in-process against the module's own etcd.
"""
from __future__ import annotations

import logging
import pathlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import grpc
import pytest

from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from coordinator.security.tls import channel_credentials
from tests.support.cluster import Cluster
from tests.support.pki import Pki, coordinator_tls, secure_cluster
from tests.support.processes import spawn_coordinator, stop_process
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration
C = grpc.StatusCode
HOST = "h1"
BIG = "x" * 200_000      # a 200 kB field
QUOTED = 32              # docs/guarantees.md "Limits": a message quotes at most 32 characters of a value


@pytest.fixture(scope="module")
def cluster(own_etcd: list[str], pki: Pki) -> Iterator[Cluster]:
    with secure_cluster(own_etcd, pki, "bounded", HOST) as c:
        yield c


def _stub(addr: str, pki: Pki, who: str, **options: Any) -> tuple[grpc.Channel, Any]:
    ch = grpc.secure_channel(addr, channel_credentials(pki[who]), options=list(options.items()))
    return ch, pb_grpc.CoordinatorStub(ch)


def _refused_calls(stub: Any) -> list[Any]:
    """Calls by agent-b that name 200 kB fields: each one is refused by authorization."""
    ref = pb.SessionRef(agent="agent-a", session_id=BIG)
    return [lambda: stub.OpenSession(pb.OpenSessionRequest(agent=BIG, host=BIG), timeout=30),
            lambda: stub.Acquire(pb.AcquireRequest(session=ref, vram_mb=1, request_id=BIG[:128]), timeout=30),
            lambda: stub.Release(pb.ReleaseRequest(session=ref, lease_id=BIG), timeout=30),
            lambda: stub.GetStatus(pb.GetStatusRequest(host=BIG), timeout=30),
            lambda: stub.RevokeLease(pb.RevokeLeaseRequest(lease_id=BIG), timeout=30),
            lambda: stub.EvictLease(pb.EvictLeaseRequest(lease_id=BIG, reason=BIG), timeout=30)]


def _stream_messages(n: int) -> Iterator[pb.SessionRequest]:
    ref = pb.SessionRef(agent="agent-a", session_id=BIG)
    for i in range(n):
        field = ("acquire", pb.AcquireRequest(session=ref, vram_mb=1)) if i % 2 else \
            ("release", pb.ReleaseRequest(session=ref, lease_id=BIG))
        yield pb.SessionRequest(call_id=i + 1, timeout_seconds=30, **{field[0]: field[1]})


def _rss_kib(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_every_refusal_of_a_200kB_field_is_permission_denied_and_quotes_32_characters(
        cluster: Cluster, pki: Pki) -> None:
    addr = cluster.start_coordinator(**coordinator_tls(pki))
    try:
        ch, stub = _stub(addr, pki, "agent-b")
        with ch:
            for call in _refused_calls(stub):
                with pytest.raises(grpc.RpcError) as info:
                    call()
                assert info.value.code() == C.PERMISSION_DENIED, (info.value.code(), info.value.details()[:300])
                details = info.value.details()
                assert len(details) < 600 and "x" * (QUOTED + 1) not in details, details[:300]
                assert "gpucoord://agent/agent-b" in details
            answers = list(stub.Session(_stream_messages(6), timeout=30))
        assert len(answers) == 6 and {a.code for a in answers} == {C.PERMISSION_DENIED.value[0]}, answers
        assert all(len(a.message) < 600 and "x" * (QUOTED + 1) not in a.message for a in answers)
    finally:
        cluster.stop_coordinator(addr)


def test_a_thousand_refused_200kB_calls_leave_memory_and_log_flat(
        cluster: Cluster, pki: Pki, tmp_path: pathlib.Path) -> None:
    """1,000 unary calls and 1,000 messages of a stream its client reads only at the end, each with a 200 kB
    field: every one PERMISSION_DENIED, the coordinator's RSS grows by less than 20 MiB and its log by less
    than 1 MB."""
    c = pki["coordinator"]
    log_path = tmp_path / "coordinator.log"
    proc, port = spawn_coordinator(cluster.endpoints, cluster.prefix, "127.0.0.1:0", str(log_path),
                                   extra=["--tls-ca", c.ca, "--tls-cert", c.cert, "--tls-key", c.key],
                                   env={"GPUCOORD_CALLS_PER_S_PER_IDENTITY": "0"})
    addr = f"127.0.0.1:{port}"
    try:
        ch, stub = _stub(addr, pki, "agent-b")
        with ch:
            calls = _refused_calls(stub)

            def one(i: int) -> str:
                try:
                    calls[i % len(calls)]()
                except grpc.RpcError as e:
                    return str(e.code().name)
                return "OK"
            with ThreadPoolExecutor(4) as pool:
                assert set(pool.map(one, range(40))) == {"PERMISSION_DENIED"}   # warm up
                rss0, log0 = _rss_kib(proc.pid), log_path.stat().st_size
                codes = list(pool.map(one, range(1000)))
            answers = list(stub.Session(_stream_messages(1000), timeout=120))   # read once all are sent
            rss1, log1 = _rss_kib(proc.pid), log_path.stat().st_size
    finally:
        stop_process(proc)
    assert codes.count("PERMISSION_DENIED") == 1000, {x: codes.count(x) for x in set(codes)}
    assert len(answers) == 1000 and {a.code for a in answers} == {C.PERMISSION_DENIED.value[0]}
    grew_mib, logged = (rss1 - rss0) / 1024, log1 - log0
    print(f"\n2,000 refusals of 200 kB fields: RSS +{grew_mib:.1f} MiB, log +{logged / 1e3:.0f} kB")
    assert grew_mib < 20, f"the coordinator grew by {grew_mib:.1f} MiB"
    assert logged < 1_000_000, f"the coordinator logged {logged} bytes"


def test_a_stream_whose_client_does_not_read_is_closed_resource_exhausted(cluster: Cluster, pki: Pki) -> None:
    """The answers waiting for a client that does not read are bounded: past the bound the stream stops
    reading and ends with RESOURCE_EXHAUSTED naming ``stream``, once the client reads what was already sent."""
    addr = cluster.start_coordinator(stream_answers_max=16, calls_per_s_per_identity=0, **coordinator_tls(pki))
    try:
        # Without BDP probing the client's window stays at its 64 KiB default: the server's writes then
        # wait after a few hundred answers, and the queue behind them fills.
        ch, stub = _stub(addr, pki, "agent-b", **{"grpc.http2.bdp_probe": 0})
        sent = threading.Event()
        with ch:
            def messages() -> Iterator[pb.SessionRequest]:
                ref = pb.SessionRef(agent="agent-a", session_id="x" * 16)
                for i in range(20_000):
                    yield pb.SessionRequest(call_id=i + 1, acquire=pb.AcquireRequest(session=ref, vram_mb=1,
                                                                                     gpu="g" * 128))
                sent.set()
            call = stub.Session(messages(), timeout=60)
            svc = cluster.service(addr)
            # The server stops reading requests once the queue is full: the client's sends block too.
            wait_for(lambda: metric_refusals(svc, "stream") > 0, 30, "the stream to overflow")
            received = 0
            with pytest.raises(grpc.RpcError) as info:
                for _ in call:
                    received += 1
        assert info.value.code() == C.RESOURCE_EXHAUSTED, (info.value.code(), info.value.details())
        assert info.value.details().startswith("stream: ") and "unread" in info.value.details()
        assert 0 < received < 20_000 and not sent.is_set(), received
    finally:
        cluster.stop_coordinator(addr)


def metric_refusals(svc: Any, field: str) -> float:
    from coordinator import metrics
    return sum(s.value for m in metrics.REFUSALS.collect() for s in m.samples
               if s.name.endswith("_total") and s.labels.get("field") == field)


@pytest.mark.parametrize("rpc", ["Session", "KeepAlive"])
def test_cancelling_a_stream_mid_write_leaves_no_traceback(cluster: Cluster, pki: Pki, rpc: str,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Many answers pending (the client does not read), then the client cancels: the coordinator logs no
    traceback, no 'Task exception was never retrieved', nothing about a context."""
    caplog.set_level(logging.DEBUG)
    addr = cluster.start_coordinator(calls_per_s_per_identity=0, **coordinator_tls(pki))
    try:
        ch_a, a = _stub(addr, pki, "agent-a")
        ch, b = _stub(addr, pki, "agent-a" if rpc == "KeepAlive" else "agent-b", **{"grpc.http2.bdp_probe": 0})
        with ch_a, ch:
            sid = a.OpenSession(pb.OpenSessionRequest(agent="agent-a", host=HOST, ttl_seconds=30), timeout=10).session_id
            progress = threading.Semaphore(0)

            def messages() -> Iterator[Any]:
                for i in range(5_000):
                    if rpc == "KeepAlive":
                        yield pb.KeepAliveRequest(session=pb.SessionRef(agent="agent-a", session_id=sid))
                    else:
                        yield pb.SessionRequest(call_id=i + 1, release=pb.ReleaseRequest(
                            session=pb.SessionRef(agent="agent-a", session_id=BIG[:100_000]), lease_id=BIG[:100_000]))
                    progress.release()
            call = getattr(b, rpc)(messages(), timeout=60)
            for _ in range(300):   # mid-write: a few hundred answers on their way, none read
                assert progress.acquire(timeout=30)
            call.cancel()
            # The coordinator has seen the cancellation once it logged it (debug) or failed over it (error).
            wait_for(lambda: any("cancel" in r.getMessage().lower() or "went away" in r.getMessage()
                                 or r.levelno >= logging.ERROR for r in caplog.records), 10,
                     "the coordinator to see the cancellation")
            assert a.Ping(pb.PingRequest(), timeout=10) is not None
    finally:
        cluster.stop_coordinator(addr)
    # What the coordinator's log shows (INFO and above; -v adds debug lines, gRPC's own included).
    bad = [r for r in caplog.records if r.levelno >= logging.INFO and (
        r.exc_info or "Traceback" in r.getMessage() or "never retrieved" in r.getMessage()
        or "different Context" in r.getMessage() or r.levelno >= logging.ERROR)]
    assert not bad, [(r.name, r.getMessage()[:300]) for r in bad]
