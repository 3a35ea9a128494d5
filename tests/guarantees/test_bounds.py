"""Everything the coordinator stores in etcd is bounded, every request is bounded, and an over-bound value
changes nothing.

docs/guarantees.md "Limits" lists the bounds; ``coordinator/limits.py`` holds them. These tests check them against a
real etcd of the module's own (``own_etcd``: "nothing was written" compares etcd's revision):

* 1,000 sessions opened with every string at its bound grow etcd's database (Maintenance Status dbSize)
  by less than the documented figure (``DB_GROWTH_PER_1000_SESSIONS``);
* a value one past its bound (or a megabyte past it) gets INVALID_ARGUMENT naming the field, with a short
  message, before any etcd call: no key is written and no etcd_lease is granted (LeaseLeases before and
  after);
* bytes that are no valid message, a message past gRPC's receive limit, a partition spec of too many
  agents or nested too deep, an oversized CheckToken to the node: the right status, no write, no traceback;
* 10,000 OpenSession calls of one agent leave at most its cap of open sessions.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Awaitable, Callable, Iterator

import grpc
import pytest

from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from agent_client.api import node_pb2
from coordinator.config import CoordinatorConfig
from coordinator.limits import (
    MAX_CLIENT_VERSION_BYTES,
    MAX_PID,
    MAX_REASON_BYTES,
    MAX_REQUEST_ID_LEN,
    MAX_SPEC_BYTES,
    MAX_TTL_S,
)
from tests.support.cluster import Cluster, events_since, revision, writes_since
from tests.support.patching import is_put, patch_commit
from tests.support.waiting import LoopThread

pytestmark = pytest.mark.integration
C = grpc.StatusCode


@pytest.fixture
def cluster(own_etcd: list[str], prefix: str) -> Iterator[Cluster]:
    c = Cluster(own_etcd, prefix)
    try:
        yield c
    finally:
        c.close()

# docs/guarantees.md "Limits": what 1,000 sessions with every string at its bound may add to etcd's database.
DB_GROWTH_PER_1000_SESSIONS = 8 << 20
MB = 1 << 20


def _name(i: int, n: int = 128) -> str:
    """A valid name of exactly ``n`` characters, distinct per ``i``."""
    head = f"a{i:05d}-"
    return head + "x" * (n - len(head))


def _db_size(cluster: Cluster) -> int:
    async def status() -> int:
        return await cluster.store.db_size()
    return cluster.lt.run(status())


def _etcd_leases(cluster: Cluster) -> set[int]:
    async def leases() -> set[int]:
        return await cluster.store.lease_ids()
    return cluster.lt.run(leases())


def test_a_thousand_sessions_at_every_bound_keep_etcd_small(cluster: Cluster) -> None:
    host = _name(0)
    cluster.start_node(host, "1x16GiB")
    addr = cluster.start_coordinator()
    # The worst case for stored bytes: control characters are stored JSON-escaped (\u0001: 6 bytes each).
    client_version = "\x01" * MAX_CLIENT_VERSION_BYTES
    lt = LoopThread()
    try:
        async def open_all() -> list[tuple[str, str]]:
            async with grpc.aio.insecure_channel(addr) as channel:
                stub = pb_grpc.CoordinatorStub(channel)
                sem = asyncio.Semaphore(32)

                async def one(i: int) -> tuple[str, str]:
                    agent = _name(i + 1)
                    async with sem:
                        resp = await stub.OpenSession(pb.OpenSessionRequest(
                            agent=agent, host=host, ttl_seconds=MAX_TTL_S, pid=MAX_PID,
                            client_version=client_version), timeout=30)
                    return agent, resp.session_id
                return list(await asyncio.gather(*(one(i) for i in range(1000))))

        async def close_all(sessions: list[tuple[str, str]]) -> None:
            async with grpc.aio.insecure_channel(addr) as channel:
                stub = pb_grpc.CoordinatorStub(channel)
                for i in range(0, len(sessions), 50):
                    await asyncio.gather(*(stub.CloseSession(pb.CloseSessionRequest(
                        session=pb.SessionRef(agent=a, session_id=s)), timeout=30) for a, s in sessions[i:i + 50]))

        before = _db_size(cluster)
        sessions = lt.run(open_all(), timeout=300)
        grown = _db_size(cluster) - before
        stored = cluster.get_prefix(cluster.keys.sessions())
        assert len(stored) == 1000
        value = json.loads(stored[0].value)
        assert value["client_version"] == client_version and len(value["agent"]) == 128
        lt.run(close_all(sessions), timeout=300)
    finally:
        lt.close()
    assert grown < DB_GROWTH_PER_1000_SESSIONS, f"etcd's database grew by {grown} bytes"
    print(f"1,000 sessions at every bound grew etcd's database by {grown} bytes")


def _refused(cluster: Cluster, call: Callable[[], Any], field: str) -> None:
    keys_before, leases_before = cluster.state(), _etcd_leases(cluster)
    with pytest.raises(grpc.RpcError) as info:
        call()
    details = info.value.details() or ""
    assert info.value.code() == C.INVALID_ARGUMENT, (field, info.value.code(), details[:200])
    assert details.startswith(field), (field, details[:200])
    assert len(details) < 300, f"{field}: the message echoes too much of the value ({len(details)} characters)"
    assert cluster.state() == keys_before, f"{field}: a refused request wrote to etcd"
    assert not _etcd_leases(cluster) - leases_before, f"{field}: a refused request left an etcd_lease behind"


def test_over_bound_values_are_refused_naming_the_field_and_leave_nothing(env: Any) -> None:
    cluster, stub, c = env
    me = pb.SessionRef(agent="agent-a", session_id=c.session_id)
    lease = c.acquire(1000)
    # Huge, yet inside the servers' 1 MiB message limit (a bigger message is refused by gRPC itself, with
    # RESOURCE_EXHAUSTED, before any handler runs).
    huge = "x" * (MB // 2)
    over = {"client_version": "v" * (MAX_CLIENT_VERSION_BYTES + 1), "reason": "r" * (MAX_REASON_BYTES + 1)}

    def open_session(**kw: Any) -> Callable[[], Any]:
        req = pb.OpenSessionRequest(**{"agent": "agent-x", "host": "h1", **kw})
        return lambda: stub.OpenSession(req, timeout=10)

    def acquire(session: pb.SessionRef = me, **kw: Any) -> Callable[[], Any]:
        req = pb.AcquireRequest(session=session, **{"vram_mb": 1000, **kw})
        return lambda: stub.Acquire(req, timeout=10)

    def keepalive(session: pb.SessionRef) -> Callable[[], Any]:
        return lambda: list(stub.KeepAlive(iter([pb.KeepAliveRequest(session=session)]), timeout=10))

    cases: list[tuple[str, Callable[[], Any]]] = [
        ("agent", open_session(agent="a" * 129)),
        ("agent", open_session(agent=huge)),
        ("host", open_session(host="h" * 129)),
        ("host", open_session(host=huge)),
        ("client_version", open_session(client_version=over["client_version"])),
        ("client_version", open_session(client_version="\u00e9" * (MAX_CLIENT_VERSION_BYTES // 2 + 1))),
        ("client_version", open_session(client_version="v" * (MB // 2))),
        ("pid", open_session(pid=-1)),
        ("request_id", acquire(request_id="r" * (MAX_REQUEST_ID_LEN + 1))),
        ("request_id", acquire(request_id=huge)),
        ("gpu", acquire(gpu="g" * 129)),
        ("gpu", acquire(gpu=huge)),
        # Fields are checked before the session is looked up: a bad field on an unknown session is still
        # INVALID_ARGUMENT about the field.
        ("request_id", acquire(session=pb.SessionRef(agent="agent-a", session_id="123abc"),
                               request_id="r" * (MAX_REQUEST_ID_LEN + 1))),
        ("session.agent", acquire(session=pb.SessionRef(agent=huge, session_id=c.session_id))),
        ("session.session_id", acquire(session=pb.SessionRef(agent="agent-a", session_id="f" * 17))),
        ("session.session_id", acquire(session=pb.SessionRef(agent="agent-a", session_id=huge))),
        ("session.session_id", acquire(session=pb.SessionRef(agent="agent-a", session_id="1_0"))),
        ("session.session_id", keepalive(pb.SessionRef(agent="agent-a", session_id=huge))),
        ("lease_id", lambda: stub.Release(pb.ReleaseRequest(session=me, lease_id=huge), timeout=10)),
        ("lease_id", lambda: stub.Release(pb.ReleaseRequest(
            session=pb.SessionRef(agent="agent-a", session_id="123abc"), lease_id=huge), timeout=10)),
        ("lease_id", lambda: stub.AttachProcesses(pb.AttachProcessesRequest(
            session=pb.SessionRef(agent="agent-a", session_id="123abc"), lease_id=huge, pids=[1]), timeout=10)),
        ("pids", lambda: stub.AttachProcesses(pb.AttachProcessesRequest(
            session=pb.SessionRef(agent="agent-a", session_id="123abc"), lease_id=lease.id, pids=[1] * 65),
            timeout=10)),
        ("reason", lambda: stub.EvictLease(pb.EvictLeaseRequest(lease_id=lease.id, reason=over["reason"]),
                                           timeout=10)),
        ("reason", lambda: stub.EvictLease(pb.EvictLeaseRequest(lease_id=lease.id, reason=huge), timeout=10)),
        ("lease_id", lambda: stub.EvictLease(pb.EvictLeaseRequest(lease_id=huge), timeout=10)),
        ("lease_id", lambda: stub.RevokeLease(pb.RevokeLeaseRequest(lease_id=huge), timeout=10)),
        ("spec", lambda: stub.ApplyPartition(pb.ApplyPartitionRequest(spec_json=json.dumps(
            {"host": "h1", "mode": "auto-split", "agents": [_name(i) for i in range(MAX_SPEC_BYTES // 128)]}),
            dry_run=False), timeout=10)),
        ("host", lambda: stub.GetStatus(pb.GetStatusRequest(host=huge), timeout=10)),
        ("host", lambda: stub.GetPartition(pb.GetPartitionRequest(host=huge), timeout=10)),
    ]
    for field, call in cases:
        _refused(cluster, call, field)
    assert [x.id for x in cluster.leases()] == [lease.id]
    # At the bound, the same fields are accepted.
    resp = stub.OpenSession(pb.OpenSessionRequest(agent="agent-x", host="h1", pid=MAX_PID,
                                                  client_version="\u00e9" * (MAX_CLIENT_VERSION_BYTES // 2)),
                            timeout=10)
    stub.CloseSession(pb.CloseSessionRequest(session=pb.SessionRef(agent="agent-x", session_id=resp.session_id)),
                      timeout=10)
    deadline = stub.EvictLease(pb.EvictLeaseRequest(lease_id=lease.id, reason="r" * MAX_REASON_BYTES,
                                                    grace_seconds=60), timeout=10).deadline_unix
    assert deadline > 0


def test_a_session_whose_write_fails_leaves_no_etcd_lease(env: Any) -> None:
    """The session's etcd_lease is granted after validation, and revoked when its write fails, whatever the
    failure (here an etcd error, injected by wrapping the replica's Store)."""
    from coordinator import errors as cerrors
    cluster, stub, _ = env
    failures = [cerrors.Unavailable("etcd unavailable: injected"), cerrors.OutcomeUnknown("etcd write: injected")]

    async def hook(compares: Any, success: Any, commit: Callable[[], Awaitable[Any]]) -> Any:
        if failures and any(is_put(op, b"/sessions/") for op in success):
            raise failures.pop(0)
        return await commit()

    undo = patch_commit(cluster, next(iter(cluster.coordinators.values()))[1], hook)
    try:
        for _ in range(2):
            leases_before = _etcd_leases(cluster)
            with pytest.raises(grpc.RpcError) as info:
                stub.OpenSession(pb.OpenSessionRequest(agent="agent-x", host="h1"), timeout=10)
            assert info.value.code() == C.UNAVAILABLE
            assert not _etcd_leases(cluster) - leases_before, "the failed session left its etcd_lease behind"
        assert not failures
    finally:
        undo()


def _addresses(cluster: Cluster) -> tuple[str, str]:
    """The coordinator's and h1's node daemon's addresses (of ``env``)."""
    return next(iter(cluster.coordinators)), cluster.nodes["h1"][0].address


def test_malformed_bytes_are_invalid_argument_without_a_traceback(env: Any, caplog: pytest.LogCaptureFixture) -> None:
    cluster, stub, _ = env
    addr, node_addr = _addresses(cluster)
    caplog.set_level(logging.INFO)
    before = revision(cluster)
    ch = grpc.insecure_channel(addr)
    garbage = [b"\xff\xff\xff\xff", b"\x0a\xff\x01abc", b"\x08" + b"\xff" * 11, b"\x12\x05ab"]
    methods = ["OpenSession", "Acquire", "Release", "CloseSession", "GetStatus", "ApplyPartition", "GetPartition",
               "EvictLease", "RevokeLease", "Ping"]
    for method in methods:
        raw = ch.unary_unary(f"/gpucoord.v1.Coordinator/{method}")
        for g in garbage:
            with pytest.raises(grpc.RpcError) as info:
                raw(g, timeout=10)
            assert info.value.code() == C.INVALID_ARGUMENT, (method, g, info.value.code(), info.value.details())
            assert info.value.details().startswith("request: not a valid message"), info.value.details()
    stream = ch.stream_stream("/gpucoord.v1.Coordinator/KeepAlive")
    with pytest.raises(grpc.RpcError) as info:
        list(stream(iter([b"\xff\xff\xff"]), timeout=10))
    assert info.value.code() == C.INVALID_ARGUMENT and "request" in info.value.details()
    with grpc.insecure_channel(node_addr) as nch:
        with pytest.raises(grpc.RpcError) as info:
            nch.unary_unary("/gpucoord.v1.Node/CheckToken")(b"\xff\xff", timeout=10)
        assert info.value.code() == C.INVALID_ARGUMENT
    assert not writes_since(cluster, before)
    assert not [r for r in caplog.records if r.exc_info], "a malformed request logged a traceback"
    ch.close()
    assert stub.Ping(pb.PingRequest(), timeout=5) is not None


def test_message_size_agent_count_and_nesting_of_a_spec(env: Any) -> None:
    """(The size of a spec is among the over-bound values above.)"""
    cluster, stub, _ = env
    before = revision(cluster)
    with pytest.raises(grpc.RpcError) as info:   # over gRPC's max receive size (1 MiB)
        stub.ApplyPartition(pb.ApplyPartitionRequest(spec_json="x" * (1 << 20 + 1)), timeout=10)
    assert info.value.code() == C.RESOURCE_EXHAUSTED
    many = json.dumps({"host": "h1", "mode": "auto-split", "agents": [f"a{i}" for i in range(257)]})
    with pytest.raises(grpc.RpcError) as info:
        stub.ApplyPartition(pb.ApplyPartitionRequest(spec_json=many), timeout=10)
    assert info.value.code() == C.INVALID_ARGUMENT and "agents" in info.value.details()
    # Nested deeper than the JSON parser recurses, balanced or not: INVALID_ARGUMENT like any malformed
    # spec (review finding F13: the RecursionError escaped as INTERNAL).
    for deep in ("[" * 100_000 + "]" * 100_000, "[" * 100_000):
        with pytest.raises(grpc.RpcError) as info:
            stub.ApplyPartition(pb.ApplyPartitionRequest(spec_json=deep), timeout=10)
        assert info.value.code() == C.INVALID_ARGUMENT and "spec_json" in info.value.details(), info.value.details()
    assert not writes_since(cluster, before)


def _session_counts(cluster: Cluster, agent: str, after: int) -> tuple[int, int, int]:
    """From etcd's history of ``sessions/<agent>/`` since revision ``after``: the sessions created, the sessions
    ended, and the most that were open at once (at any revision)."""
    prefix = cluster.keys.sessions(agent)
    events = [(kind, rev) for kind, key, rev in events_since(cluster, after) if key.startswith(prefix)]
    open_now = most = created = ended = 0
    for kind, _ in events:
        if kind == "PUT":
            created += 1
            open_now += 1
        else:
            ended += 1
            open_now -= 1
        most = max(most, open_now)
    return created, ended, most


def test_ten_thousand_open_sessions_leave_at_most_the_cap(env: Any) -> None:
    """At no revision has the agent more than the cap open, every session answered OK is one that etcd created,
    and the cap is reached. Judged over etcd's history, not only the end: a flood that a loaded machine makes
    last longer than the sessions' TTL sees early sessions expire and later ones take their place (which is
    right), so the end state alone cannot tell the OKs from the cap."""
    cluster, stub, _ = env
    addr, _ = _addresses(cluster)
    cap = CoordinatorConfig().max_sessions_per_agent
    assert cap == 64
    before = revision(cluster)

    async def flood() -> dict[str, int]:
        codes: dict[str, int] = {}
        async with grpc.aio.insecure_channel(addr) as ch:
            stub = pb_grpc.CoordinatorStub(ch)
            sem = asyncio.Semaphore(64)

            async def one() -> None:
                async with sem:
                    try:
                        await stub.OpenSession(pb.OpenSessionRequest(agent="flood", host="h1", ttl_seconds=MAX_TTL_S),
                                               timeout=30)
                        code = "OK"
                    except grpc.aio.AioRpcError as e:
                        code = e.code().name
                        assert e.code() in (C.RESOURCE_EXHAUSTED, C.UNAVAILABLE), (e.code(), e.details())
                        if e.code() == C.RESOURCE_EXHAUSTED:
                            assert e.details().startswith("sessions:"), e.details()
                    codes[code] = codes.get(code, 0) + 1
            await asyncio.gather(*(one() for _ in range(10_000)))
        return codes

    codes = asyncio.run(flood())
    sessions = cluster.get_prefix(cluster.keys.sessions("flood"))
    created, ended, most = _session_counts(cluster, "flood", before)
    assert most <= cap, (most, codes)
    # No OK without its session; a session created beyond the OKs is one whose answer was UNAVAILABLE (its commit's
    # outcome unknown to the replica, which then revoked its etcd_lease: ended in the history too).
    assert codes.get("OK", 0) <= created <= codes.get("OK", 0) + codes.get("UNAVAILABLE", 0), (created, codes)
    assert len(sessions) == created - ended <= cap, (len(sessions), created, ended, codes)
    assert most == cap, (most, codes)   # the cap is reached, not undershot
    print(f"10,000 OpenSession calls: {codes}; {created} sessions created, {ended} ended, at most {most} open "
          f"at once, {len(sessions)} in etcd at the end (cap {cap})")
    # Another agent is not affected by this one's cap.
    assert stub.OpenSession(pb.OpenSessionRequest(agent="calm", host="h1"), timeout=10)


def test_node_check_token_bounds(env: Any) -> None:
    _, node_addr = _addresses(env[0])
    from agent_client.api import node_pb2_grpc
    with grpc.insecure_channel(node_addr) as ch:
        stub: Any = node_pb2_grpc.NodeStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            stub.CheckToken(node_pb2.CheckTokenRequest(gpu_uuid="G" * 100_000, token=1), timeout=10)
        assert info.value.code() == C.INVALID_ARGUMENT and info.value.details().startswith("gpu_uuid:")
        assert len(info.value.details()) < 200
