"""The fault link itself (tests/faultlink.py), against a plain echo server on loopback: what each fault does to a
connection through it, so that the fault tests can rely on it."""
from __future__ import annotations

import gc
import socket
import struct
import threading
import time
from typing import Iterator

import pytest

from tests.faultlink import FaultLink, _Net
from tests.support.waiting import LIVENESS_S, wait_for


@pytest.fixture
def received() -> list[bytes]:
    """What the echo server behind the link has received, in order."""
    return []


@pytest.fixture
def link(received: list[bytes]) -> Iterator[FaultLink]:
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return

            def echo(conn: socket.socket = conn) -> None:
                try:
                    while data := conn.recv(65536):
                        received.append(data)
                        conn.sendall(data)
                except OSError:
                    pass
                conn.close()
            threading.Thread(target=echo, daemon=True).start()
    threading.Thread(target=serve, daemon=True).start()
    link = FaultLink(f"127.0.0.1:{server.getsockname()[1]}")
    try:
        yield link
    finally:
        link.close()
        server.close()


def connect(link: FaultLink) -> socket.socket:
    host, _, port = link.endpoint.rpartition(":")
    s = socket.create_connection((host, int(port)), timeout=5)
    s.settimeout(0.5)
    return s


def quiet(s: socket.socket) -> bool:
    try:
        return not s.recv(64)
    except socket.timeout:
        return True


def test_a_silent_cut_holds_both_ways_and_delivers_when_healed(link: FaultLink) -> None:
    s = connect(link)
    s.sendall(b"before")
    assert s.recv(64) == b"before"
    link.cut()
    s.sendall(b"held")
    assert quiet(s)                                  # nothing comes back, and the connection stays open
    late = connect(link)                             # a new connection is accepted, and hangs as well
    late.sendall(b"new")
    assert quiet(late)
    link.heal()
    s.settimeout(5)
    late.settimeout(5)
    assert s.recv(64) == b"held"
    assert late.recv(64) == b"new"


def test_a_loud_cut_resets_connections_and_refuses_new_ones_until_healed(link: FaultLink) -> None:
    s = connect(link)
    link.cut(loud=True)
    with pytest.raises(ConnectionResetError):
        s.recv(64)
    with pytest.raises(ConnectionResetError):
        connect(link).recv(64)
    link.heal()
    fresh = connect(link)
    fresh.sendall(b"back")
    assert fresh.recv(64) == b"back"


def established(link: FaultLink) -> socket.socket:
    """A connection through the link to the upstream, used once: a connection that the link accepted during a
    cut, one-way or not, hangs before it dials the upstream (a real one-way partition drops the handshake too)."""
    s = connect(link)
    s.sendall(b"hi")
    assert s.recv(64) == b"hi"
    return s


def test_a_one_way_cut_lets_requests_through_and_holds_the_answers(link: FaultLink, received: list[bytes]) -> None:
    s = established(link)
    link.cut_one_way("answers")
    s.sendall(b"ping")
    wait_for(lambda: b"".join(received) == b"hiping", LIVENESS_S, "the request to arrive")
    assert quiet(s)
    link.heal()
    s.settimeout(5)
    assert s.recv(64) == b"ping"


def test_a_one_way_cut_of_requests_holds_them_until_healed(link: FaultLink, received: list[bytes]) -> None:
    s = established(link)
    link.cut_one_way("requests")
    s.sendall(b"ping")
    assert quiet(s) and received == [b"hi"]
    link.heal()
    s.settimeout(5)
    assert s.recv(64) == b"ping"
    assert received == [b"hi", b"ping"]


def test_latency_is_added_each_way(link: FaultLink) -> None:
    s = connect(link)
    link.delay(0.1)
    s.settimeout(5)
    t0 = time.monotonic()
    s.sendall(b"slow")
    assert s.recv(64) == b"slow"
    assert time.monotonic() - t0 >= 0.2


def _rst(s: socket.socket) -> None:
    """Close with an RST: the other end's next read fails with ECONNRESET."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def test_both_ends_reset_at_once_leave_no_task_error_unretrieved() -> None:
    """Both ends of a connection reset it at the same moment (a replica killed while etcd's side of its link
    breaks): each of the relay's two reads fails, and whichever pump sees its failure first resets the relay,
    cancelling the other pump. The other pump's failed read is still its to retrieve: asyncio logged "Task
    exception was never retrieved" for it (ConnectionResetError in StreamReader.read) in the nemesis."""
    upstream = socket.create_server(("127.0.0.1", 0))
    link = FaultLink(f"127.0.0.1:{upstream.getsockname()[1]}")
    # The link's own loop reports what its tasks left unread (other tests' leftovers go to their own loops).
    loop = _Net.get().loop
    unretrieved: list[str] = []
    loop.set_exception_handler(lambda _, ctx: unretrieved.append(f"{ctx['message']}: {ctx.get('exception')!r}"))
    try:
        client = connect(link)
        upstream.settimeout(5)
        server, _ = upstream.accept()
        client.sendall(b"up")
        server.settimeout(5)
        assert server.recv(64) == b"up"          # both pumps run: each reads its end
        held, release = threading.Event(), threading.Event()

        def hold() -> None:                      # the link's loop sees both resets in one turn
            held.set()
            release.wait(5)
        _Net.get().loop.call_soon_threadsafe(hold)
        assert held.wait(LIVENESS_S)
        _rst(client)
        _rst(server)
        release.set()
        wait_for(lambda: link.connections == 0, LIVENESS_S, "the relay to end")
        gc.collect()
    finally:
        link.close()
        upstream.close()
        loop.set_exception_handler(None)
    assert not unretrieved, unretrieved
