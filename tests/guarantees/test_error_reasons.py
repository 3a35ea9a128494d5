"""Every refusal carries a machine-readable reason (a ``google.rpc.ErrorInfo`` in the status's rich details:
``NO_FIT``, ``QUEUE_FULL``, ``SESSION_GONE``, ``INVALID_FIELD`` with the field), the same on a unary call, on
a Session stream message and on an acquire forwarded to another replica; and the client tells an expired
session by that reason, not by the message's text."""
from __future__ import annotations

from typing import Any, Iterator

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from agent_client import Client, errors
from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from coordinator.metrics import REGISTRY
from tests.support.cluster import Cluster
from tests.support.waiting import wait_for

C = grpc.StatusCode
DETAILS_KEY = "grpc-status-details-bin"


def _info(details: bytes, code: grpc.StatusCode, message: str) -> tuple[str, dict[str, str]]:
    """The ErrorInfo of serialized status details, checked against the status it came with."""
    status = status_pb2.Status.FromString(details)
    assert (status.code, status.message) == (code.value[0], message)
    info = error_details_pb2.ErrorInfo()
    assert len(status.details) == 1 and status.details[0].Unpack(info)
    assert info.domain == "gpucoord"
    return info.reason, dict(info.metadata)


def _unary_reason(call: Any) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    e = caught.value
    details = dict(e.trailing_metadata() or ()).get(DETAILS_KEY)
    assert isinstance(details, bytes), f"no rich status details: {e.code()} {e.details()}"
    return (e.code(), *_info(details, e.code(), e.details()))


def _stream_reason(stub: pb_grpc.CoordinatorStub, field: str, request: Any) -> tuple[grpc.StatusCode, str,
                                                                                    dict[str, str]]:
    message = pb.SessionRequest(call_id=1, timeout_seconds=10, **{field: request})
    (answer,) = [r for r in stub.Session(iter([message]), timeout=15) if r.call_id == 1]
    code = next(c for c in C if c.value[0] == answer.code)
    return (code, *_info(answer.details, code, answer.message))


@pytest.fixture
def full_host(cluster: Cluster) -> Iterator[tuple[Cluster, pb_grpc.CoordinatorStub, pb.SessionRef]]:
    """h1's one GPU held whole by a lease nobody may evict; a session of another agent to ask with."""
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator(max_queue_per_agent=1)
    channel = grpc.insecure_channel(addr)
    with Client(addr, agent="holder", host="h1") as holder, Client(addr, agent="asker", host="h1") as asker:
        holder.acquire(8000, preemptible=False)
        yield cluster, pb_grpc.CoordinatorStub(channel), pb.SessionRef(agent="asker", session_id=asker.session_id)
    channel.close()


def test_a_refused_acquire_carries_its_reason_on_a_call_and_on_a_stream_message(
        full_host: tuple[Cluster, pb_grpc.CoordinatorStub, pb.SessionRef]) -> None:
    cluster, stub, me = full_host
    no_fit = pb.AcquireRequest(session=me, vram_mb=1000)
    assert _unary_reason(lambda: stub.Acquire(no_fit, timeout=10)) == (C.RESOURCE_EXHAUSTED, "NO_FIT",
                                                                       {"field": "vram_mb"})
    assert _stream_reason(stub, "acquire", no_fit) == (C.RESOURCE_EXHAUSTED, "NO_FIT", {"field": "vram_mb"})

    bad = pb.AcquireRequest(session=me, vram_mb=0)
    assert _unary_reason(lambda: stub.Acquire(bad, timeout=10)) == (C.INVALID_ARGUMENT, "INVALID_FIELD",
                                                                    {"field": "vram_mb"})
    assert _stream_reason(stub, "acquire", bad) == (C.INVALID_ARGUMENT, "INVALID_FIELD", {"field": "vram_mb"})
    bad_ref = pb.AcquireRequest(session=pb.SessionRef(agent="asker", session_id="zz"), vram_mb=10)
    assert _unary_reason(lambda: stub.Acquire(bad_ref, timeout=10)) == (C.INVALID_ARGUMENT, "INVALID_FIELD",
                                                                        {"field": "session.session_id"})

    # One request of the agent waits; the agent's queue (max_queue_per_agent=1) is full for the next.
    waiting = stub.Acquire.future(pb.AcquireRequest(session=me, vram_mb=1000, wait_seconds=60, request_id="w"),
                                  timeout=70)
    try:
        wait_for(lambda: len(cluster.get_prefix(cluster.keys.queue("h1"))) == 1, 10, "the first request to wait")
        second = pb.AcquireRequest(session=me, vram_mb=1000, wait_seconds=5, request_id="x")
        assert _unary_reason(lambda: stub.Acquire(second, timeout=10)) == (C.RESOURCE_EXHAUSTED, "QUEUE_FULL",
                                                                           {"field": "queue"})
    finally:
        waiting.cancel()


def test_a_gone_session_carries_session_gone_and_the_client_recognises_it_by_that_reason(
        cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    channel = grpc.insecure_channel(addr)
    stub = pb_grpc.CoordinatorStub(channel)
    try:
        for session_stream in (True, False):
            with Client(addr, agent="a", host="h1", session_stream=session_stream) as c:
                ref = pb.SessionRef(agent="a", session_id=c.session_id)
                stub.CloseSession(pb.CloseSessionRequest(session=ref), timeout=10)
                # The client's calls and its keepalive loop read the reason.
                with pytest.raises(errors.SessionExpired) as caught:
                    c.acquire(10)
                assert caught.value.reason == "SESSION_GONE" and caught.value.field == "session"
                wait_for(lambda: c.expired, 15, "the client's keepalive to see its session gone")
                # What they read: the same reason on a call and on a stream message.
                acquire = pb.AcquireRequest(session=ref, vram_mb=10)
                assert _unary_reason(lambda: stub.Acquire(acquire, timeout=10)) == (C.NOT_FOUND, "SESSION_GONE",  # noqa: B023 - called within this iteration
                                                                                    {"field": "session"})
                assert _stream_reason(stub, "acquire", acquire) == (C.NOT_FOUND, "SESSION_GONE",
                                                                    {"field": "session"})
    finally:
        channel.close()


def test_an_acquire_forwarded_to_the_hosts_owner_relays_the_owners_reason(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addrs = [cluster.start_coordinator(), cluster.start_coordinator()]
    services = [cluster.service(a) for a in addrs]
    wait_for(lambda: all(svc.owner("h1") is not None and len(svc.live_replicas()) == 2 for svc in services), 10,
             "both replicas to know h1's owner")
    (owner,) = {svc.owner("h1")[0] for svc in services}
    (other,) = [a for a, svc in zip(addrs, services) if svc.replica_id != owner]

    def forwarded() -> float:
        return REGISTRY.get_sample_value("gpucoord_forwarded_acquires_total", {"outcome": "forwarded"}) or 0.0

    with Client(other, agent="holder", host="h1") as holder, Client(other, agent="asker", host="h1") as asker:
        holder.acquire(8000, preemptible=False)
        me = pb.SessionRef(agent="asker", session_id=asker.session_id)
        channel = grpc.insecure_channel(other)
        try:
            stub = pb_grpc.CoordinatorStub(channel)
            before = forwarded()
            assert _unary_reason(lambda: stub.Acquire(pb.AcquireRequest(session=me, vram_mb=1000), timeout=10)) \
                == (C.RESOURCE_EXHAUSTED, "NO_FIT", {"field": "vram_mb"})
            assert forwarded() == before + 1, "the acquire was not forwarded to the host's owner"
        finally:
            channel.close()
