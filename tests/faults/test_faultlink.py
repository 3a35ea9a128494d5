"""The fault link itself (tests/faultlink.py), against a plain echo server on loopback: what each fault does to a
connection through it, so that the fault tests can rely on it."""
from __future__ import annotations

import socket
import threading
import time
from typing import Iterator

import pytest

from tests.faultlink import FaultLink
from tests.support.waiting import wait_for


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
    wait_for(lambda: b"".join(received) == b"hiping", 5, "the request to arrive")
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
