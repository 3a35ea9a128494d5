"""The Session stream answers each Acquire, Release and KeepAlive message exactly as the unary call of that name
would (same answer, same status code and message, nothing written when refused), keeps going after a refused
message, drops a call whose deadline passes or that its caller cancels; and the client uses it where it is
served and falls back to unary calls where it is not, or reconnects when it breaks."""
from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
import uuid
from typing import Any, AsyncIterator, Iterator

import grpc
import pytest

from agent_client import AsyncClient, Client, errors
from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from coordinator.limits import MAX_STREAM_CALLS
from tests.support.cluster import Cluster, queue
from tests.support.patching import patch_method
from tests.support.rpcs import StreamCallError, acquire_req, session_call
from tests.support.waiting import LIVENESS_S, wait_for

pytestmark = pytest.mark.integration
C = grpc.StatusCode


def _outcome(fn: Any) -> tuple[Any, ...]:
    """(code, message) of a refused call, or ("OK", answer)."""
    try:
        return "OK", fn()
    except grpc.RpcError as e:
        return e.code(), e.details()


def test_stream_answers_as_the_unary_calls(env: tuple[Cluster, Any, Client]) -> None:
    cluster, stub, c = env
    sid = c.session_id

    def both(field: str, request: Any, unary: Any) -> tuple[Any, Any]:
        return _outcome(lambda: unary(request, timeout=10)), _outcome(lambda: session_call(stub, field, request))

    # A grant: the stream's retry of the unary call's request_id is the same lease (G6), answered alike.
    req = acquire_req("agent-a", sid, 4096, uuid.uuid4().hex)
    unary, stream = both("acquire", req, stub.Acquire)
    assert unary[0] == "OK" and unary == stream
    held = unary[1].lease

    # Refusals that write nothing: bad fields (the message names the field), no such session, does not fit.
    for request, code, field in [
        (acquire_req("agent-a", sid, 0, "r1"), C.INVALID_ARGUMENT, "vram_mb"),
        (acquire_req("agent-a", sid, 16, "r2", priority=10**9), C.INVALID_ARGUMENT, "priority"),
        (acquire_req("agent-a", sid, 16, "r3", gpu="a/b"), C.INVALID_ARGUMENT, "gpu"),
        (acquire_req("agent-a", sid, 16, "x" * 500), C.INVALID_ARGUMENT, "request_id"),
        (acquire_req("agent-a", "zz", 16, "r4"), C.INVALID_ARGUMENT, "session_id"),
        (acquire_req("agent-a", "123abc", 16, "r5"), C.NOT_FOUND, "session"),
        (acquire_req("agent-a", sid, 14000, "r6"), C.RESOURCE_EXHAUSTED, ""),
    ]:
        before = cluster.state()
        unary, stream = both("acquire", request, stub.Acquire)
        assert unary == stream, (unary, stream)
        assert stream[0] == code and field in stream[1], stream
        assert cluster.state() == before, f"a refused acquire ({field}) wrote to etcd"

    # A wait that ends without a grant: refused alike, and the queue entry is gone before the answer.
    for field_, call in (("unary", lambda r: stub.Acquire(r, timeout=10)), ("stream", None)):
        request = acquire_req("agent-a", sid, 14000, uuid.uuid4().hex, wait=0.3)
        got = _outcome(lambda: call(request)) if call else _outcome(lambda: session_call(stub, "acquire", request))  # noqa: B023 - called within this iteration
        assert got[0] == C.RESOURCE_EXHAUSTED, (field_, got)
        assert not queue(cluster), f"{field_}: the waiter's queue entry outlived its answer"

    # Releases: a bad lease id, a held lease, the same lease again (gone: released=false).
    before = cluster.state()
    unary, stream = both("release", pb.ReleaseRequest(session=req.session, lease_id="a/b"), stub.Release)
    assert unary == stream and stream[0] == C.INVALID_ARGUMENT and "lease_id" in stream[1], stream
    assert cluster.state() == before
    first = _outcome(lambda: session_call(stub, "release", pb.ReleaseRequest(session=req.session, lease_id=held.id)))
    assert first == ("OK", pb.ReleaseResponse(released=True))
    unary, stream = both("release", pb.ReleaseRequest(session=req.session, lease_id=held.id), stub.Release)
    assert unary == stream == ("OK", pb.ReleaseResponse(released=False))

    # A keepalive answers the session's TTL; an unknown session is NOT_FOUND naming it.
    ttl = session_call(stub, "keepalive", pb.KeepAliveRequest(session=req.session))
    assert ttl.ttl_seconds > 0
    with pytest.raises(StreamCallError) as info:
        session_call(stub, "keepalive", pb.KeepAliveRequest(session=pb.SessionRef(agent="agent-a",
                                                                                  session_id="123abc")))
    assert info.value.code() == C.NOT_FOUND and "session" in info.value.details()


def test_a_refused_message_leaves_the_stream_open(env: tuple[Cluster, Any, Client]) -> None:
    _, stub, c = env
    ref = pb.SessionRef(agent="agent-a", session_id=c.session_id)
    bad = [pb.SessionRequest(call_id=7, acquire=acquire_req("agent-a", c.session_id, -1, "b")),
           pb.SessionRequest(call_id=8),     # no call at all
           pb.SessionRequest(call_id=0, release=pb.ReleaseRequest(session=ref, lease_id="x" * 20))]
    answer = session_call(stub, "acquire", acquire_req("agent-a", c.session_id, 64, uuid.uuid4().hex), call_id=9,
                          before=bad)
    assert answer.lease.vram_mb == 64
    responses = list(stub.Session(iter(bad), timeout=10))
    by_id = {r.call_id: r for r in responses}
    assert C.INVALID_ARGUMENT.value[0] == by_id[7].code and "vram_mb" in by_id[7].message
    assert C.INVALID_ARGUMENT.value[0] == by_id[8].code and "call" in by_id[8].message
    assert C.INVALID_ARGUMENT.value[0] == by_id[0].code and "call_id" in by_id[0].message


def test_a_call_is_dropped_at_its_deadline_or_when_cancelled(env: tuple[Cluster, Any, Client]) -> None:
    cluster, stub, c = env
    c.acquire(15000)     # the GPU is nearly full: the next acquire waits
    request = acquire_req("agent-a", c.session_id, 8000, uuid.uuid4().hex, wait=30)
    with pytest.raises(StreamCallError) as info:
        session_call(stub, "acquire", request, timeout=0.5)
    assert info.value.code() == C.DEADLINE_EXCEEDED
    wait_for(lambda: not queue(cluster), 10, "the timed-out waiter to leave the queue")

    # A cancel: the waiter leaves the queue and its call is never answered.
    sent: list[pb.SessionRequest] = []

    def requests() -> Iterator[pb.SessionRequest]:
        yield pb.SessionRequest(call_id=1, timeout_seconds=30, acquire=request)
        wait_for(lambda: queue(cluster), 10, "the waiter's queue entry")
        sent.append(pb.SessionRequest(cancel=1))
        yield sent[-1]
        wait_for(lambda: not queue(cluster), 10, "the cancelled waiter to leave the queue")
    assert list(stub.Session(requests(), timeout=30)) == []
    assert sent


def test_calls_in_flight_on_one_stream_are_bounded(env: tuple[Cluster, Any, Client]) -> None:
    """Past MAX_STREAM_CALLS calls in flight, one more is refused RESOURCE_EXHAUSTED naming call_id; the
    calls in flight are all answered once they can finish."""
    cluster, stub, c = env
    svc = cluster.service(next(iter(cluster.coordinators)))
    entered: list[int] = []
    go = asyncio.Event()
    release = svc.release

    async def held_release(info: Any, lease_id: str) -> bool:
        entered.append(1)
        await go.wait()
        return bool(await release(info, lease_id))
    undo = patch_method(cluster, svc, "release", held_release)
    ref = pb.SessionRef(agent="agent-a", session_id=c.session_id)
    n = MAX_STREAM_CALLS + 1
    answers: dict[int, pb.SessionResponse] = {}

    def requests() -> Iterator[pb.SessionRequest]:
        for i in range(1, n + 1):
            yield pb.SessionRequest(call_id=i, timeout_seconds=30,
                                    release=pb.ReleaseRequest(session=ref, lease_id=f"gone-{i}"))
        wait_for(lambda: len(entered) == MAX_STREAM_CALLS and n in answers, 20, "the calls to be in flight")
        cluster.lt.loop.call_soon_threadsafe(go.set)
    try:
        for response in stub.Session(requests(), timeout=30):
            answers[response.call_id] = response
    finally:
        undo()
    assert answers[n].code == C.RESOURCE_EXHAUSTED.value[0] and "call_id" in answers[n].message, answers[n]
    assert sorted(answers) == list(range(1, n + 1))
    assert all(answers[i].code == 0 and answers[i].release.released is False for i in range(1, n))


def test_client_uses_the_stream_and_reconnects_when_it_breaks(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()

    async def run() -> None:
        async with AsyncClient(addr, agent="agent-a", host="h1") as c:
            lease = await c.acquire(1000)
            assert set(c._streams) == {addr} and not c._unary_only
            stream = c._streams[addr]
            await lease.release()
            stream.close()      # as a broken connection leaves it
            lease = await c.acquire(1000)
            assert c._streams[addr] is not stream
            await lease.release()
    cluster.lt.run(run())


def test_a_cancelled_acquire_leaves_the_queue(cluster: Cluster) -> None:
    """The caller cancels a waiting acquire (as asyncio.wait_for does): its queue entry goes at once, as when
    a unary call is cancelled, not when its wait would have ended."""
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()

    async def until(predicate: Any, what: str) -> None:
        deadline = time.monotonic() + 10
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.02)

    async def run() -> None:
        async with AsyncClient(addr, agent="agent-a", host="h1") as c:
            await c.acquire(15000)
            waiter = asyncio.ensure_future(c.acquire(8000, wait=60))
            await until(lambda: queue(cluster), "the waiter's queue entry")
            assert set(c._streams) == {addr}
            waiter.cancel()
            await until(lambda: not queue(cluster), "the cancelled waiter to leave the queue")
    asyncio.run(run())


class _OldServer:
    """A coordinator from before the Session stream (the method is unknown to it): the unary calls and
    KeepAlive, relayed to a real one, which it stands for as the owner of every host."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.stub = pb_grpc.CoordinatorStub(channel)
        self.unary_calls: list[str] = []

    def handler(self) -> grpc.GenericRpcHandler:
        def unary(name: str, request_type: Any) -> Any:
            async def relay(request: Any, context: Any) -> Any:
                self.unary_calls.append(name)
                try:
                    response = await getattr(self.stub, name)(request, timeout=context.time_remaining())
                except grpc.aio.AioRpcError as e:
                    await context.abort(e.code(), e.details())
                if name == "Acquire":
                    response.owner = ""
                return response
            return grpc.unary_unary_rpc_method_handler(relay, request_deserializer=request_type.FromString,
                                                       response_serializer=lambda m: m.SerializeToString())

        async def keepalive(request_iterator: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
            async for response in self.stub.KeepAlive(request_iterator):
                yield response
        handlers = {name: unary(name, getattr(pb, f"{name}Request"))
                    for name in ("OpenSession", "CloseSession", "Acquire", "Release")}
        handlers["KeepAlive"] = grpc.stream_stream_rpc_method_handler(
            keepalive, request_deserializer=pb.KeepAliveRequest.FromString,
            response_serializer=lambda m: m.SerializeToString())
        return grpc.method_handlers_generic_handler("gpucoord.v1.Coordinator", handlers)


def test_client_falls_back_to_unary_calls_on_a_server_without_the_stream(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    real = cluster.start_coordinator()

    async def start_old() -> tuple[grpc.aio.Server, int, _OldServer, grpc.aio.Channel]:
        channel = grpc.aio.insecure_channel(real)
        old = _OldServer(channel)
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((old.handler(),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port, old, channel
    server, port, old, channel = cluster.lt.run(start_old())
    addr = f"127.0.0.1:{port}"

    async def run() -> None:
        async with AsyncClient(addr, agent="agent-a", host="h1") as c:
            lease = await c.acquire(1000)
            assert c._unary_only == {addr}
            # No KeepAliveSessions there either: the session is kept alive on a KeepAlive stream of its own.
            deadline = time.monotonic() + LIVENESS_S
            while not (c._kept is not None and c._kept.legacy) and time.monotonic() < deadline:  # noqa: ASYNC110 - polled with a deadline: the group's state, no event to wait on
                await asyncio.sleep(0.05)
            assert c._kept is not None and c._kept.legacy is not None and c.session_id in c._kept.legacy
            assert lease.vram_mb == 1000 and await c.release(lease.id)
            with pytest.raises(errors.NotFound) as info:
                await c.acquire(1000, gpu="7")      # a refusal comes back typed, through the unary call
            assert "gpu" in info.value.message
    try:
        cluster.lt.run(run())
        assert old.unary_calls.count("Acquire") == 2 and old.unary_calls.count("Release") == 1
        assert not cluster.leases()
    finally:
        cluster.lt.run(server.stop(0))
        cluster.lt.run(channel.close())


def test_many_calls_in_flight_on_one_stream(cluster: Cluster) -> None:
    """Concurrent acquires and releases of one client: the first ones share its stream (past 8 in flight the
    rest go unary); each gets its own answer."""
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()

    async def run() -> None:
        async with AsyncClient(addr, agent="agent-a", host="h1") as c:
            leases = await asyncio.gather(*(c.acquire(100 + i) for i in range(20)))
            assert sorted(x.vram_mb for x in leases) == [100 + i for i in range(20)]
            assert len({x.id for x in leases}) == 20 and set(c._streams) == {addr}
            assert all(await asyncio.gather(*(x.release() for x in leases)) or [True])
    cluster.lt.run(run())
    assert not cluster.leases()


def test_streams_a_replica_ends_when_it_loses_etcd_end_unavailable_without_a_traceback(
        env: tuple[Cluster, Any, Client], caplog: pytest.LogCaptureFixture) -> None:
    """A replica that cannot reach etcd ends every KeepAlive stream with UNAVAILABLE at once, while its callers
    keep sending: a reader that a request wakes after the writer's abort reads gRPC's "Locally aborted". That is
    how such a stream ends, logged at debug, never as an unexpected error with a traceback (the nemesis found
    those in a replica's log). Several streams, several times: the race takes about a third of them."""
    cluster, stub, c = env
    svc = cluster.service(next(iter(cluster.coordinators)))
    ref = pb.SessionRef(agent="agent-a", session_id=c.session_id)
    caplog.set_level(logging.DEBUG, logger="coordinator")

    def reach(ok: bool) -> None:
        async def do() -> None:
            svc.reach.set(ok, "" if ok else "the test says so")
        cluster.lt.run(do())

    def one_round(streams: int = 8) -> list[Any]:
        """``streams`` KeepAlive streams that keep sending; etcd lost, then back: how each stream ended."""
        stop = threading.Event()
        ended: list[Any] = []

        def keepalives() -> Iterator[pb.KeepAliveRequest]:
            while not stop.is_set():
                yield pb.KeepAliveRequest(session=ref)

        def read(call: Any) -> None:
            try:
                for _ in call:
                    pass
                ended.append("OK")
            except grpc.RpcError as e:
                ended.append(e.code())
        calls = [stub.KeepAlive(keepalives(), timeout=30) for _ in range(streams)]
        for call in calls:
            threading.Thread(target=read, args=(call,), daemon=True).start()
        try:
            wait_for(lambda: len(svc._streams.get(c.session_id, ())) >= streams, 10, "the streams to be kept alive")
            reach(False)
            wait_for(lambda: len(ended) == streams, 10, "every stream to end")
        finally:
            stop.set()
            for call in calls:
                call.cancel()
            reach(True)
        return ended

    for _ in range(3):
        ended = one_round()
        assert ended == [C.UNAVAILABLE] * len(ended), ended
    bad = [r for r in caplog.records if r.levelno >= logging.WARNING and (r.exc_info or "stream ended" in r.getMessage())]
    assert not bad, [r.getMessage()[:200] for r in bad[:3]]


def test_a_stream_that_breaks_under_a_call_leaves_no_error_unread() -> None:
    """A call whose write fails (the replica is gone: nothing listens on its port) raises the stream's
    ``StreamBroken``; the call's own future, failed with it too, is not left for asyncio to report as "Future
    exception was never retrieved" (seen in the fault tests' output after a replica was killed)."""
    from agent_client.stream import SessionStream
    from coordinator.etcd.process import free_port
    unretrieved: list[str] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: unretrieved.append(ctx["message"]))
        address = f"127.0.0.1:{free_port()}"
        channel = grpc.aio.insecure_channel(address)
        stream = SessionStream(channel, address)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as broke:
                await stream.call("release", pb.ReleaseRequest(lease_id="x"), timeout=10)
            assert broke.value.code() == C.UNAVAILABLE, broke.value
        finally:
            stream.close()
            await channel.close()

    asyncio.run(main())
    gc.collect()
    assert not unretrieved, unretrieved
