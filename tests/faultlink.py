"""A controllable network link for tests, on loopback: a TCP relay between two parts of the system that a test
can cut, cut one way, slow down and heal, while both ends keep running.

``FaultLink(upstreams)`` listens on one free loopback port per upstream address (``link.endpoints``, in the same
order; ``link.endpoint`` is the first) and relays every connection made to it. Whoever should talk "over the
link" is given its endpoints instead of the real addresses: a replica its etcd endpoints, a client its replica's
address. All connections of one link share its state:

* ``cut()``: a silent partition, both ways. Nothing crosses; connections stay open and hang, as they do when
  packets are dropped: what a side sends is held (it stops being read, so its sender's buffers fill and it
  blocks, as TCP does), and is delivered if the link heals while the connection still lives, as TCP's
  retransmission would. A new connection is accepted and hangs as well.
* ``cut(loud=True)``: every connection is reset, and new ones are reset as they arrive (a host that is down,
  a firewall that rejects).
* ``cut_one_way("answers")``: requests arrive, answers are held (``"requests"``: the other way round).
* ``delay(seconds)``: added latency, each way, on every byte from then on (order is kept).
* ``heal()``: back to passing everything at once, with no added latency.

Self-contained: it imports nothing of the project, and runs its relays on one asyncio loop in a daemon thread
shared by every link of the process, so a test with many links costs no thread per connection.
"""
from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections import deque
from typing import Any, Callable, Coroutine, Sequence, TypeVar

T = TypeVar("T")

UP, DOWN = "requests", "answers"     # towards the upstream, and back from it
_CHUNK = 65536


class _Net:
    """The one event loop that every link of the process runs on."""

    _instance: _Net | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="faultlink", daemon=True)
        self.thread.start()

    @classmethod
    def get(cls) -> _Net:
        with cls._lock:
            if cls._instance is None:
                cls._instance = _Net()
            return cls._instance

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Any, *args: Any) -> None:
        """Run ``fn(*args)`` on the loop and wait until it has run (the link's state changes at one point)."""
        async def do() -> None:
            fn(*args)
        self.run(do())


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST rather than a FIN: the peer sees ECONNRESET, as from a dead or rejecting host."""
    sock = writer.get_extra_info("socket")
    try:
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    writer.transport.abort()


def _settle(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` if it still runs, else retrieve its outcome: a relay that ends does not wait for its
    reads and writes, and a failed one (the connection was reset) is part of what the link does."""
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()


class _Relay:
    """One connection through the link: the accepted socket and the one to the upstream, two pumps."""

    def __init__(self, link: FaultLink, upstream: tuple[str, int], reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.link, self.upstream = link, upstream
        self.client = (reader, writer)
        self.server: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.closed = False

    async def run(self) -> None:
        try:
            # A new connection hangs while the link is cut (the upstream is not even dialled yet).
            await self.link._passing(UP)
            await self.link._passing(DOWN)
            if self.closed:
                return
            try:
                self.server = await asyncio.wait_for(asyncio.open_connection(*self.upstream), 5.0)
            except (OSError, asyncio.TimeoutError):
                self.reset()      # the upstream refuses: so does the link
                return
            if self.closed:       # reset by a loud cut while dialling
                _reset(self.server[1])
                return
            self.tasks = [asyncio.ensure_future(self._pump(self.client[0], self.server[1], UP)),
                          asyncio.ensure_future(self._pump(self.server[0], self.client[1], DOWN))]
            await asyncio.gather(*self.tasks, return_exceptions=True)
        finally:
            self.close()

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, direction: str) -> None:
        queue: deque[tuple[float, bytes]] = deque()
        ready = asyncio.Event()
        loop = asyncio.get_running_loop()

        async def deliver() -> None:
            while True:
                while not queue:
                    ready.clear()
                    await ready.wait()
                at, data = queue[0]
                if at > loop.time():
                    await asyncio.sleep(at - loop.time())
                await self.link._passing(direction)
                queue.popleft()
                if dst.is_closing():
                    return
                if not data:
                    if dst.can_write_eof():
                        dst.write_eof()
                    return
                dst.write(data)
                await dst.drain()

        sender = asyncio.ensure_future(deliver())
        reading: asyncio.Future[bytes] | None = None
        try:
            while True:
                # Held while the link does not pass this way: nothing is read, so the sender's buffers fill.
                await self.link._passing(direction)
                reading = asyncio.ensure_future(src.read(_CHUNK))
                done, _ = await asyncio.wait({sender, reading}, return_when=asyncio.FIRST_COMPLETED)
                if sender in done:
                    reading.cancel()
                    sender.result()
                    return
                data = reading.result()
                queue.append((loop.time() + self.link._delay[direction], data))
                ready.set()
                if not data:
                    await sender
                    return
        except (OSError, asyncio.IncompleteReadError, ConnectionError):
            self.reset()
        finally:
            # The pump may end cancelled (the other pump reset the relay) just as its read failed too (both
            # ends reset at once): that failure, and the sender's, are the pump's to retrieve, not asyncio's
            # to report as never retrieved.
            if reading is not None:
                _settle(reading)
            if not sender.done():
                if self.closed:
                    sender.cancel()
                else:
                    try:
                        await sender
                    except (OSError, ConnectionError):
                        self.reset()
            _settle(sender)

    def reset(self) -> None:
        """RST both sides now."""
        self.closed = True
        for side in (self.client, self.server):
            if side is not None:
                _reset(side[1])
        for t in self.tasks:
            t.cancel()

    def close(self) -> None:
        self.closed = True
        for side in (self.client, self.server):
            if side is not None and not side[1].is_closing():
                side[1].close()
        self.link._relays.discard(self)


class FaultLink:
    """A link between parts, on loopback: see the module docstring."""

    def __init__(self, upstreams: str | Sequence[str], name: str = "") -> None:
        ups = [upstreams] if isinstance(upstreams, str) else list(upstreams)
        if not ups:
            raise ValueError("upstreams: at least one address is needed")
        self.name = name or ",".join(ups)
        self.upstreams = ups
        self._net = _Net.get()
        self._relays: set[_Relay] = set()
        self._open: dict[str, asyncio.Event] = {}
        self._delay = {UP: 0.0, DOWN: 0.0}
        self._loud = False
        self.accepted = 0       # connections made to the link, for tests of the link itself
        self._servers: list[asyncio.AbstractServer] = []
        self.endpoints: list[str] = self._net.run(self._start(ups))

    @property
    def endpoint(self) -> str:
        return self.endpoints[0]

    async def _start(self, ups: list[str]) -> list[str]:
        self._open = {UP: asyncio.Event(), DOWN: asyncio.Event()}
        for e in self._open.values():
            e.set()
        out = []
        for up in ups:
            host, _, port = up.removeprefix("http://").rpartition(":")
            server = await asyncio.start_server(self._acceptor((host, int(port))), "127.0.0.1", 0)
            self._servers.append(server)
            out.append(f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
        return out

    def _acceptor(self, upstream: tuple[str, int]) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter],
                                                               Coroutine[Any, Any, None]]:
        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._accept(upstream, reader, writer)
        return accept

    async def _accept(self, upstream: tuple[str, int], reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self._loud:
            _reset(writer)
            return
        relay = _Relay(self, upstream, reader, writer)
        self._relays.add(relay)
        await relay.run()

    async def _passing(self, direction: str) -> None:
        await self._open[direction].wait()

    # -- what a test does ------------------------------------------------------------------------
    def cut(self, loud: bool = False) -> None:
        """Cut both ways: silently (held, hanging), or ``loud`` (reset now and refused until healed)."""
        def do() -> None:
            self._open[UP].clear()
            self._open[DOWN].clear()
            if loud:
                self._loud = True
                for relay in list(self._relays):
                    relay.reset()
        self._net.call(do)

    def cut_one_way(self, direction: str = DOWN) -> None:
        """``"answers"``: what the upstream sends back is held, requests still arrive; ``"requests"``: the
        reverse."""
        if direction not in (UP, DOWN):
            raise ValueError(f"direction: {UP!r} or {DOWN!r}, got {direction!r}")
        self._net.call(self._open[direction].clear)

    def delay(self, seconds: float) -> None:
        """Add ``seconds`` of latency each way (so ``2 * seconds`` to a round trip); 0 removes it."""
        def do() -> None:
            self._delay[UP] = self._delay[DOWN] = seconds
        self._net.call(do)

    def heal(self) -> None:
        """Pass everything again, at once and with no added latency; what was held is delivered now."""
        def do() -> None:
            self._loud = False
            self._delay[UP] = self._delay[DOWN] = 0.0
            self._open[UP].set()
            self._open[DOWN].set()
        self._net.call(do)

    @property
    def connections(self) -> int:
        return len(self._relays)

    def close(self) -> None:
        """Stop listening and reset every connection through the link."""
        async def do() -> None:
            for s in self._servers:
                s.close()
            for relay in list(self._relays):
                relay.reset()
            self._open[UP].set()
            self._open[DOWN].set()
        self._net.run(do())

    def __repr__(self) -> str:
        return f"FaultLink({self.name})"
