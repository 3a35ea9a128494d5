"""G9 over real mTLS beyond the role x RPC matrix (tests/security/test_matrix.py), on the same kind of ``world``
(tests/support/tls_world.py): an agent cannot use another agent's session under its own name; a plaintext client
cannot talk to a TLS coordinator; operator actions, refusals and session-stream calls are audited; an agent's
GetStatus shows other agents' leases redacted and only the hosts it has a session on."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import uuid
from typing import Any

import grpc
import pytest

from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from tests.support.cluster import writes_since
from tests.support.rpcs import session_call
from tests.support.tls_world import HOST, World

pytestmark = pytest.mark.integration
C = grpc.StatusCode


def test_agent_cannot_use_another_agents_session_under_its_own_name(world: World) -> None:
    """Session ownership: agent-b naming itself with agent-a's session id finds no session of its own."""
    b = world.stubs("other").coord
    ref = pb.SessionRef(agent="agent-b", session_id=world.session_id)
    calls = [lambda: b.Acquire(pb.AcquireRequest(session=ref, vram_mb=64), timeout=10),
             lambda: b.Release(pb.ReleaseRequest(session=ref, lease_id=world.lease.id), timeout=10),
             lambda: b.CloseSession(pb.CloseSessionRequest(session=ref), timeout=10),
             lambda: next(iter(b.KeepAlive(iter([pb.KeepAliveRequest(session=ref)]), timeout=10))),
             lambda: session_call(b, "acquire", pb.AcquireRequest(session=ref, vram_mb=64)),
             lambda: session_call(b, "release", pb.ReleaseRequest(session=ref, lease_id=world.lease.id)),
             lambda: session_call(b, "keepalive", pb.KeepAliveRequest(session=ref))]
    for call in calls:
        before = world.revision()
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == C.NOT_FOUND, info.value.details()
        assert not writes_since(world.cluster, before)
    assert world.stubs("self").coord.Release(pb.ReleaseRequest(session=world.ref(), lease_id="x" * 20),
                                             timeout=10).released is False   # agent-a's session still works


def test_plaintext_client_cannot_talk_to_a_tls_coordinator(world: World) -> None:
    before = world.revision()
    with grpc.insecure_channel(world.addr) as ch:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.CoordinatorStub(ch).OpenSession(pb.OpenSessionRequest(agent="agent-a", host=HOST), timeout=5)
    assert info.value.code() == C.UNAVAILABLE
    assert not writes_since(world.cluster, before)


def test_operator_actions_and_refusals_are_audited(world: World, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gpucoord.audit")
    lease = world.acquire()
    op = world.stubs("operator").coord
    op.EvictLease(pb.EvictLeaseRequest(lease_id=lease.id, grace_seconds=60, reason="maintenance"), timeout=10)
    # The eviction record in etcd names who asked.
    record = json.loads(world.cluster.get_prefix(world.cluster.keys.eviction(lease.id))[0].value)
    assert record["asked_by"] == "gpucoord://operator/ops" and record["requested_by"] == "operator"
    with pytest.raises(grpc.RpcError):
        world.stubs("self").coord.RevokeLease(pb.RevokeLeaseRequest(lease_id=lease.id), timeout=10)
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "gpucoord.audit"]
    assert {"audit": True, "identity": "gpucoord://operator/ops", "action": "EvictLease",
            "target": f"lease {lease.id!r}", "outcome": "ok"} in lines
    denied = [x for x in lines if x["action"] == "RevokeLease" and x["identity"] == "gpucoord://agent/agent-a"]
    assert denied and denied[0]["outcome"].startswith("denied: ") and denied[0]["target"] == f"lease {lease.id!r}"
    op.RevokeLease(pb.RevokeLeaseRequest(lease_id=lease.id), timeout=10)


def test_session_stream_calls_are_audited_as_the_unary_calls(world: World, caplog: pytest.LogCaptureFixture) -> None:
    """An operator's acquire on the stream is audited like its unary acquire; an agent's refused one too."""
    caplog.set_level(logging.INFO, logger="gpucoord.audit")
    lease = session_call(world.stubs("operator").coord, "acquire", pb.AcquireRequest(
        session=world.ref(), vram_mb=64, request_id=uuid.uuid4().hex)).lease
    with pytest.raises(grpc.RpcError):
        session_call(world.stubs("other").coord, "release", pb.ReleaseRequest(session=world.ref(), lease_id=lease.id))
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "gpucoord.audit"]
    target = f"session {world.session_id!r} of agent 'agent-a'"
    assert {"audit": True, "identity": "gpucoord://operator/ops", "action": "Acquire", "target": target,
            "outcome": "ok"} in lines, lines
    denied = [x for x in lines if x["action"] == "Release" and x["identity"] == "gpucoord://agent/agent-b"]
    assert denied and denied[0]["outcome"].startswith("denied: ") and lease.id in denied[0]["target"], lines
    world.stubs("self").coord.Release(pb.ReleaseRequest(session=world.ref(), lease_id=lease.id), timeout=10)


def test_an_agent_sees_other_agents_leases_without_session_request_or_processes(
        world: World, request: pytest.FixtureRequest) -> None:
    """Session ids are no secrets (etcd trusts no agent certificate), but an agent's GetStatus still shows
    other agents' leases without their session id, request id or processes; its own leases in full. The
    operator sees everything."""
    request_id = uuid.uuid4().hex
    lease = world.stubs("self").coord.Acquire(pb.AcquireRequest(session=world.ref(), vram_mb=64, request_id=request_id),
                                              timeout=10).lease
    # Its own processes only (G9): itself, and a group this process started.
    group = subprocess.Popen(["sleep", "120"], start_new_session=True)
    request.addfinalizer(lambda: (group.kill(), group.wait()))
    world.stubs("self").coord.AttachProcesses(pb.AttachProcessesRequest(session=world.ref(), lease_id=lease.id,
                                                                        pids=[os.getpid()], pgid=group.pid),
                                              timeout=10)
    b = world.stubs("other").coord
    b_sid = b.OpenSession(pb.OpenSessionRequest(agent="agent-b", host=HOST, ttl_seconds=30), timeout=10).session_id
    b_ref = pb.SessionRef(agent="agent-b", session_id=b_sid)
    b_lease = b.Acquire(pb.AcquireRequest(session=b_ref, vram_mb=64, request_id="b-request"), timeout=10).lease
    try:
        def seen(role: str) -> dict[str, Any]:
            (host,) = world.stubs(role).coord.GetStatus(pb.GetStatusRequest(host=HOST), timeout=10).hosts
            return {x.id: x for x in host.leases}
        by_b, by_operator = seen("other"), seen("operator")
        assert by_operator[lease.id].session_id == world.session_id and by_operator[lease.id].request_id == request_id
        assert list(by_operator[lease.id].pids) == [os.getpid()]
        other = by_b[lease.id]
        assert (other.agent, other.vram_mb, other.session_id, other.request_id, list(other.pids), other.pgid) == \
            ("agent-a", 64, "", "", [], 0), other
        own = by_b[b_lease.id]
        assert (own.session_id, own.request_id) == (b_sid, "b-request"), own
        assert world.session_id not in str(world.stubs("other").coord.GetStatus(pb.GetStatusRequest(host=HOST),
                                                                                timeout=10))
    finally:
        b.CloseSession(pb.CloseSessionRequest(session=b_ref), timeout=10)
        world.stubs("self").coord.Release(pb.ReleaseRequest(session=world.ref(), lease_id=lease.id), timeout=10)


def test_an_agent_asks_for_every_host_and_gets_its_own_view(world: World) -> None:
    """``gpucoord status`` as an agent (issue 29): GetStatus without a host answers with the hosts the agent has
    a live session on, redacted as for one host, and no teams (their use is the fleet's) nor etcd's members; an
    agent with no session sees no host. The operator sees every host and etcd's members."""
    mine = world.stubs("self").coord.GetStatus(pb.GetStatusRequest(), timeout=10)
    assert [h.host for h in mine.hosts] == [HOST] and not mine.teams and not mine.etcd_members
    assert not world.stubs("other").coord.GetStatus(pb.GetStatusRequest(), timeout=10).hosts
    theirs = world.stubs("operator").coord.GetStatus(pb.GetStatusRequest(), timeout=10)
    assert HOST in [h.host for h in theirs.hosts] and theirs.etcd_members
