"""G4 and G7 with the sessions of one process kept alive together (``KeepAliveSessions``, issue 32): one stream
and one message per interval for every session of the process; each session past its TTL while the stream
keeps it, a session found gone ending alone, its notices coming to it alone, the stream moving to another
replica with every session when its replica stops; and the stream's bad input refused. The history checker
ends each test."""
from __future__ import annotations

from typing import Any

import grpc
import pytest

from agent_client import AsyncClient, kept_together
from agent_client.api import coordinator_pb2 as pb
from coordinator.rpc.keepalive_sessions import MAX_SESSIONS
from tests.support.cluster import Cluster, revision, writes_since
from tests.support.rpcs import coordinator_stub
from tests.support.waiting import LIVENESS_S, pass_time, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]
TTL = 3


def _clients(cluster: Cluster, addrs: list[str], n: int, ttl: int = TTL) -> list[AsyncClient]:
    async def open_all() -> list[AsyncClient]:
        clients = [AsyncClient(addrs, agent=f"together-{i}", host="h1", ttl=ttl) for i in range(n)]
        for c in clients:
            await c.connect()
        return clients
    return cluster.lt.run(open_all())


def _close(cluster: Cluster, clients: list[AsyncClient]) -> None:
    async def close_all() -> None:
        for c in clients:
            await c.close()
    cluster.lt.run(close_all())


def _stream_of(cluster: Cluster, addr: str, session_id: str) -> set[int]:
    """The streams (their answer queues) through which replica ``addr`` sends ``session_id`` its notices."""
    return {id(getattr(q, "out", q)) for q in cluster.service(addr)._streams.get(session_id, ())}


def _alive(cluster: Cluster, c: AsyncClient) -> bool:
    return bool(cluster.get_prefix(cluster.keys.session(c.agent, c.session_id))) and not c.done.is_set()


def test_the_sessions_of_one_process_share_one_stream_and_outlive_their_ttl(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    clients = _clients(cluster, [addr], 12)
    try:
        assert len({id(c._kept) for c in clients}) == 1, "the sessions of one process should share one group"
        wait_for(lambda: all(_stream_of(cluster, addr, c.session_id) for c in clients), LIVENESS_S,
                 "every session kept alive through the group's stream")
        streams = set().union(*(_stream_of(cluster, addr, c.session_id) for c in clients))
        assert len(streams) == 1, f"12 sessions of one process used {len(streams)} keepalive streams"
        pass_time(3 * TTL, "three TTLs of keepalives, one message per interval for all twelve")
        assert all(_alive(cluster, c) for c in clients), "a session kept alive by its group was lost"
    finally:
        _close(cluster, clients)
    assert not cluster.get_prefix(cluster.keys.sessions()), "closed sessions left their records"


def test_sessions_over_several_requests_per_interval_all_stay_kept_and_a_closed_one_is_let_go(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kept_together, "CHUNK", 3)   # 7 sessions: three requests per interval
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    clients = _clients(cluster, [addr], 7)
    try:
        wait_for(lambda: all(_stream_of(cluster, addr, c.session_id) for c in clients), LIVENESS_S,
                 "every session kept alive through the group's stream")
        pass_time(3 * TTL, "three TTLs of keepalives in three requests each")
        assert all(_alive(cluster, c) for c in clients), "a session named in another request of the interval was lost"
        assert all(_stream_of(cluster, addr, c.session_id) for c in clients), \
            "a session named in another request lost its notices"
        closed, *rest = clients
        cluster.lt.run(closed.close())
        wait_for(lambda: not _stream_of(cluster, addr, closed.session_id), LIVENESS_S,
                 "the replica to let the closed session go from the stream (named in left)")
        assert all(_stream_of(cluster, addr, c.session_id) for c in rest)
    finally:
        _close(cluster, clients)


def test_a_session_found_gone_ends_alone_and_the_others_stay_kept(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    # A TTL longer than the wait below: the session ends because the answer says it is gone, not because
    # no replica refreshed it for its TTL.
    clients = _clients(cluster, [addr], 4, ttl=300)
    try:
        gone, *kept = clients
        # Closed behind its client's back: the group's next request finds it gone.
        coordinator_stub(addr).CloseSession(pb.CloseSessionRequest(session=gone._ref()), timeout=30)
        wait_for(gone.done.is_set, LIVENESS_S, "the group to find the closed session gone")
        assert gone.expired
        pass_time(2 * TTL, "a few keepalive intervals for the other sessions")
        assert all(_alive(cluster, c) for c in kept), "a session went with another one of its group"
    finally:
        _close(cluster, clients)


def test_a_notice_comes_to_its_own_session_on_the_shared_stream(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    clients = _clients(cluster, [addr], 3)
    try:
        leases = [cluster.lt.run(c.acquire(1000)) for c in clients]
        wait_for(lambda: all(_stream_of(cluster, addr, c.session_id) for c in clients), LIVENESS_S,
                 "every session kept alive through the group's stream")
        coordinator_stub(addr).EvictLease(pb.EvictLeaseRequest(lease_id=leases[1].id, grace_seconds=60), timeout=30)
        wait_for(leases[1].evicting.is_set, LIVENESS_S, "the notice to reach the lease's holder")
        assert leases[1].notice is not None and leases[1].notice.lease_id == leases[1].id
        others = (clients[0], clients[2])
        assert not any(c._early_notices for c in others) and not leases[0].evicting.is_set() \
            and not leases[2].evicting.is_set(), "a notice reached a session whose lease it is not"
    finally:
        _close(cluster, clients)


def test_the_stream_moves_every_session_to_the_other_replica_when_its_replica_stops(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    a, b = cluster.start_coordinator(), cluster.start_coordinator()
    clients = _clients(cluster, [a, b], 6)
    try:
        leases = [cluster.lt.run(c.acquire(500)) for c in clients]
        wait_for(lambda: all(_stream_of(cluster, a, c.session_id) for c in clients), LIVENESS_S,
                 "the group's stream at replica a")
        cluster.stop_coordinator(a)
        b_id = cluster.service(b).replica_id
        wait_for(lambda: all(c.session_id in cluster.service(b).liveness.table for c in clients), LIVENESS_S,
                 "replica b to keep every session of the group")
        pass_time(2 * TTL, "two TTLs through replica b")
        assert all(_alive(cluster, c) for c in clients), "a live session was lost when its replica stopped"
        held = {kv.key for kv in cluster.get_prefix(cluster.keys.leases("h1"))}
        assert all(any(lease.id in k.decode() for k in held) for lease in leases), "a live session's lease was lost"
        assert all(cluster.get_prefix(cluster.keys.session(c.agent, c.session_id))[0].json()["coordinator"] == b_id
                   for c in clients)
    finally:
        _close(cluster, clients)


def _one_answer(addr: str, request: pb.KeepAliveSessionsRequest) -> Any:
    return next(iter(coordinator_stub(addr).KeepAliveSessions(iter([request]), timeout=30)))


def test_bad_requests_are_refused_naming_sessions_and_change_nothing(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    (client,) = _clients(cluster, [addr], 1)
    try:
        ref = client._ref()
        before = revision(cluster)
        too_many = pb.KeepAliveSessionsRequest(seq=1, sessions=[pb.SessionRef(agent="a", session_id=f"{i:016x}")
                                                                for i in range(MAX_SESSIONS + 1)])
        twice = pb.KeepAliveSessionsRequest(seq=2, sessions=[ref, ref])
        for request in (too_many, twice):
            with pytest.raises(grpc.RpcError) as info:
                _one_answer(addr, request)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
            assert info.value.details().startswith("sessions:"), info.value.details()
        # A malformed or unknown session is answered on its own; the others are kept.
        malformed = pb.SessionRef(agent="", session_id="zz")
        unknown = pb.SessionRef(agent=client.agent, session_id="00000000000000ff")
        answer = _one_answer(addr, pb.KeepAliveSessionsRequest(seq=3, sessions=[malformed, ref, unknown]))
        assert answer.seq == 3
        by_id = {n.session_id: n for n in answer.not_kept}
        assert set(by_id) == {"zz", "00000000000000ff"}, answer
        assert by_id["zz"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert by_id["00000000000000ff"].code == grpc.StatusCode.NOT_FOUND.value[0]
        assert by_id["00000000000000ff"].reason == "SESSION_GONE"
        assert not writes_since(cluster, before), "a refused keepalive wrote to etcd"
    finally:
        _close(cluster, [client])


def test_a_group_whose_sessions_all_ended_keeps_the_next_session_alive(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    a, b = cluster.start_coordinator(), cluster.start_coordinator()
    (first,) = _clients(cluster, [a, b], 1, ttl=300)
    group = first._kept
    assert group is not None
    coordinator_stub(a).CloseSession(pb.CloseSessionRequest(session=first._ref()), timeout=30)
    wait_for(first.done.is_set, LIVENESS_S, "the group to find its only session gone")
    # Its stream breaks with no session left: the group's task ends.
    cluster.stop_coordinator(a)
    wait_for(lambda: group._task is not None and group._task.done(), LIVENESS_S, "the empty group's task to end")

    async def second_client() -> AsyncClient:
        c = AsyncClient([a, b], agent="together-next", host="h1", ttl=300)
        return await c.connect()
    second = cluster.lt.run(second_client())
    try:
        assert second._kept is group, "the same process, addresses and interval: the same group"
        wait_for(lambda: _stream_of(cluster, b, second.session_id), LIVENESS_S,
                 "the group to keep its new session alive on a stream again")
    finally:
        _close(cluster, [first, second])
