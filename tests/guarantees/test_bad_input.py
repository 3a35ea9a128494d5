"""Bad input gets a specific gRPC status, a message that names the field, and writes nothing to etcd; it
never crashes a process nor leaves anything behind (not even a client's thread)."""
from __future__ import annotations

import threading
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_client import Client, errors
from agent_client.api import coordinator_pb2 as pb
from tests.support.cluster import Cluster
from tests.support.rpcs import expect_refused
from tests.support.waiting import LIVENESS_S, wait_for

C = grpc.StatusCode


@pytest.fixture
def env_gpus() -> str:
    """``env``'s host h1 has two GPUs in these tests."""
    return "2x16GiB"


def test_acquire_bad_fields(env: tuple[Cluster, Any, Client]) -> None:
    cluster, stub, c = env
    me = pb.SessionRef(agent="agent-a", session_id=c.session_id)
    held = c.acquire(1000)

    def acq(**kw: Any) -> Any:
        req = pb.AcquireRequest(session=kw.pop("session", me), **{"vram_mb": 1000, **kw})
        return lambda: stub.Acquire(req, timeout=10)

    expect_refused(cluster, acq(vram_mb=0), C.INVALID_ARGUMENT, "vram_mb")
    expect_refused(cluster, acq(vram_mb=-5), C.INVALID_ARGUMENT, "vram_mb")
    expect_refused(cluster, acq(vram_mb=20000), C.INVALID_ARGUMENT, "vram_mb")
    expect_refused(cluster, acq(gpu="7"), C.NOT_FOUND, "gpu")
    expect_refused(cluster, acq(gpu="GPU-nope"), C.NOT_FOUND, "gpu")
    expect_refused(cluster, acq(gpu="a/b"), C.INVALID_ARGUMENT, "gpu")
    expect_refused(cluster, acq(priority=10**9), C.INVALID_ARGUMENT, "priority")
    expect_refused(cluster, acq(wait_seconds=-1), C.INVALID_ARGUMENT, "wait_seconds")
    expect_refused(cluster, acq(min_runtime_seconds=-1), C.INVALID_ARGUMENT, "min_runtime_seconds")
    expect_refused(cluster, acq(min_runtime_seconds=float("nan")), C.INVALID_ARGUMENT, "min_runtime_seconds")
    expect_refused(cluster, acq(min_runtime_seconds=8 * 86400), C.INVALID_ARGUMENT, "min_runtime_seconds")
    expect_refused(cluster, acq(request_id="x" * 500), C.INVALID_ARGUMENT, "request_id")
    expect_refused(cluster, acq(session=pb.SessionRef(agent="agent-a", session_id="123abc")), C.NOT_FOUND, "session")
    expect_refused(cluster, acq(session=pb.SessionRef(agent="agent-a", session_id="zz")),
                   C.INVALID_ARGUMENT, "session_id")
    expect_refused(cluster, acq(session=pb.SessionRef(agent="", session_id=c.session_id)), C.INVALID_ARGUMENT, "agent")
    expect_refused(cluster, acq(session=pb.SessionRef(agent="agent-b", session_id=c.session_id)),
                   C.NOT_FOUND, "session")
    held.release()


def test_open_session_bad_fields(env: tuple[Cluster, Any, Client]) -> None:
    cluster, stub, _ = env
    for req, code, field in [
        (pb.OpenSessionRequest(agent="agent-x", host="no-such-host"), C.NOT_FOUND, "host"),
        (pb.OpenSessionRequest(agent="", host="h1"), C.INVALID_ARGUMENT, "agent"),
        (pb.OpenSessionRequest(agent="a/b", host="h1"), C.INVALID_ARGUMENT, "agent"),
        (pb.OpenSessionRequest(agent="agent-x", host="h1", ttl_seconds=1), C.INVALID_ARGUMENT, "ttl_seconds"),
        (pb.OpenSessionRequest(agent="agent-x", host="h1", ttl_seconds=100000), C.INVALID_ARGUMENT, "ttl_seconds"),
    ]:
        expect_refused(cluster, lambda: stub.OpenSession(req, timeout=10), code, field)  # noqa: B023 - called within this iteration


def test_expired_session_and_foreign_lease(env: tuple[Cluster, Any, Client]) -> None:
    cluster, stub, c = env
    lease = c.acquire(1000)
    with Client(list(cluster.coordinators)[0], agent="agent-b", host="h1") as other:
        ref_b = pb.SessionRef(agent="agent-b", session_id=other.session_id)
        expect_refused(cluster, lambda: stub.Release(pb.ReleaseRequest(session=ref_b, lease_id=lease.id), timeout=10),
                C.PERMISSION_DENIED, "lease_id")
        expect_refused(cluster, lambda: stub.Release(pb.ReleaseRequest(session=ref_b, lease_id="../x"), timeout=10),
                C.INVALID_ARGUMENT, "lease_id")
    # agent-b's session is closed now: anything on it is NOT_FOUND and writes nothing.
    expect_refused(cluster, lambda: stub.Acquire(pb.AcquireRequest(session=ref_b, vram_mb=10), timeout=10),
            C.NOT_FOUND, "session")
    expect_refused(cluster, lambda: stub.Release(pb.ReleaseRequest(session=ref_b, lease_id=lease.id), timeout=10),
            C.NOT_FOUND, "session")
    assert [x.id for x in cluster.leases()] == [lease.id]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(vram=st.integers(min_value=-2**62, max_value=2**62), gpu=st.text(max_size=40),
       priority=st.integers(min_value=-2**31, max_value=2**31 - 1), request_id=st.text(max_size=200),
       wait=st.floats(allow_nan=True, allow_infinity=True, min_value=None, max_value=None))
def test_random_acquires_never_crash_or_leak(env: tuple[Cluster, Any, Client], vram: int, gpu: str, priority: int,
                                            request_id: str, wait: float) -> None:
    """Property: any AcquireRequest gets a status (never INTERNAL), and a refused one changes nothing."""
    cluster, stub, c = env
    me = pb.SessionRef(agent="agent-a", session_id=c.session_id)
    before = cluster.state()
    req = pb.AcquireRequest(session=me, vram_mb=vram, gpu=gpu, priority=priority, request_id=request_id,
                            wait_seconds=min(wait, 0.05) if wait == wait else wait)
    try:
        resp = stub.Acquire(req, timeout=10)
    except grpc.RpcError as e:
        assert e.code() not in (C.INTERNAL, C.UNKNOWN), e.details()
        assert cluster.state() == before
    else:
        stub.Release(pb.ReleaseRequest(session=me, lease_id=resp.lease.id), timeout=10)


def test_a_refused_connect_leaves_no_client_thread_behind(cluster: Cluster) -> None:
    """``with Client(...)`` whose connect is refused (here: no such host) stops the client's event-loop
    thread: an agent that retries connecting (its host not registered yet, its partition not applied yet)
    leaks nothing per attempt. (Review finding R3: __exit__ never ran, and one thread leaked per attempt.)"""
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()

    def leaked() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "gpucoord-leaky" and t.is_alive()]
    for _ in range(3):
        with pytest.raises(errors.NotFound):
            with Client(addr, agent="leaky", host="no-such-host"):
                pass
    wait_for(lambda: leaked() == [], LIVENESS_S, "the loop threads of the refused clients to stop")
