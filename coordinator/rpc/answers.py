"""What a session's stream (KeepAlive or Session) has to send, bounded, and the one loop that sends it.

A client that stops reading its stream makes the server's writes wait (HTTP/2 flow control) while its
requests may still be answered: the answers wait in the stream's ``AnswerQueue``. The queue is bounded in
count and in bytes (``stream_answers_max``, ``stream_answer_bytes_max``); past either bound the stream stops
reading requests and is closed with RESOURCE_EXHAUSTED naming ``stream`` (the client reads it after the
answers already on their way). Memory per stream is thereby bounded whatever the client does.

A client that cancels or drops its stream in any state ends it quietly: a write that fails because the
client has gone ends the call as cancelled (logged at debug level by gRPC), never with a traceback.
"""
from __future__ import annotations

import asyncio
import collections
import logging
from typing import Awaitable, Callable

import grpc

from coordinator import errors, metrics
from coordinator.security.status import abort

log = logging.getLogger(__name__)

# What an item that is not a message counts for in bytes (an eviction record, an error, the end).
_OTHER_BYTES = 256


async def read_requests(out: AnswerQueue, reading: Callable[[], Awaitable[None]], stream: str) -> None:
    """A stream's reader of requests: ``reading()`` reads them and puts their answers into ``out``; then the
    answers end (None). A GpucoordError ends the stream with its status; an unexpected error is logged
    (``reader_ended``) and the stream just ends."""
    try:
        await reading()
        out.put_nowait(None)
    except errors.GpucoordError as e:
        out.put_nowait(e)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - an unexpected error in a stream reader is logged with its stack
        reader_ended(stream, e)   # the stream just ends
        out.put_nowait(None)


def reader_ended(stream: str, e: Exception) -> None:
    """Log what ended a stream's reader of requests: at debug level when the caller left (CANCELLED) or when
    the stream's writer had ended it with a status (``_end``: gRPC's AbortError, "Locally aborted", to a read
    after it), at warning with the stack for anything else, which is not expected.

    The second is a race of every stream that ends with an error while its caller still sends, not a fault:
    a replica that loses etcd ends every stream with UNAVAILABLE at once (``replica/follow.py``), and a reader
    that a request (or the end of the call) wakes before the handler has cancelled it reads the abort."""
    if isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.CANCELLED:
        log.debug("%s stream ended: the caller left (%r)", stream, e)
    elif isinstance(e, grpc.aio.AbortError):
        log.debug("%s stream ended: its status was sent (%r)", stream, e)
    else:
        log.warning("%s stream ended by an unexpected error: %r", stream, e, exc_info=e)


def _size(item: object) -> int:
    byte_size = getattr(item, "ByteSize", None)
    return int(byte_size()) if callable(byte_size) else _OTHER_BYTES


class AnswerQueue:
    """A FIFO of a stream's answers, bounded in count and bytes. ``put`` never blocks: past a bound the
    queue drops what it holds, remembers why in ``overflow`` and wakes ``overflowed``, and the stream ends."""

    def __init__(self, max_items: int, max_bytes: int) -> None:
        self.max_items, self.max_bytes = max_items, max_bytes
        self._items: collections.deque[tuple[object, int]] = collections.deque()
        self._bytes = 0
        self._ready = asyncio.Event()
        self.overflowed = asyncio.Event()
        self.overflow = ""

    def put_nowait(self, item: object) -> None:
        if self.overflow:
            return
        size = _size(item)
        if len(self._items) + 1 > self.max_items or self._bytes + size > self.max_bytes:
            self.overflow = (f"stream: the client left {len(self._items)} answers ({self._bytes} bytes) unread, "
                             f"the most one stream may hold ({self.max_items} answers, {self.max_bytes} bytes); "
                             "read the stream's answers")
            self._items.clear()
            self._bytes = 0
            self.overflowed.set()
            return
        self._items.append((item, size))
        self._bytes += size
        self._ready.set()

    async def get(self) -> object:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item, size = self._items.popleft()
        self._bytes -= size
        return item

    def __len__(self) -> int:
        return len(self._items)


async def send_answers(out: AnswerQueue, context: grpc.aio.ServicerContext, rpc_name: str,
                       convert: Callable[[object], object]) -> None:
    """Write the items of ``out`` until None. An error item ends the stream with its status; every other item
    goes out as ``convert(item)``. An overflow of ``out`` ends the stream with RESOURCE_EXHAUSTED."""
    writer = asyncio.get_running_loop().create_task(_write_loop(out, context, rpc_name, convert))
    overflowed = asyncio.get_running_loop().create_task(out.overflowed.wait())
    try:
        # Not ``aio.first_of``: that would cancel the writer at once, and on an overflow the writer must stay
        # where it is until the status has gone out (it is cancelled in ``finally``, after ``_end``).
        await asyncio.wait({writer, overflowed}, return_when=asyncio.FIRST_COMPLETED)
        if writer.done():
            writer.result()   # its status (an abort) or the client going away, raised here
            return
        # The client does not read: whatever the writer is blocked on stays as it is (the status follows
        # it), and the handler ends with the refusal.
        error = errors.CapacityError(out.overflow, "stream")
        metrics.count_refusal(rpc_name, error)
        await _end(context, error)
    finally:
        overflowed.cancel()
        if not writer.done():
            writer.cancel()
        writer.add_done_callback(_quiet)


async def _write_loop(out: AnswerQueue, context: grpc.aio.ServicerContext, rpc_name: str,
                      convert: Callable[[object], object]) -> None:
    while True:
        item = await out.get()
        if item is None:
            return
        if isinstance(item, errors.GpucoordError):
            metrics.count_refusal(rpc_name, item)
            await _end(context, item)
        try:
            await context.write(convert(item))
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:   # noqa: BLE001 - the write failed: the client has gone
            log.debug("%s stream: the client went away mid-write: %r", rpc_name, e)
            raise asyncio.CancelledError() from None


async def _end(context: grpc.aio.ServicerContext, error: errors.GpucoordError) -> None:
    """End the stream with ``error``'s status; a client that has gone meanwhile ends it as cancelled."""
    try:
        await abort(context, error)
    except (asyncio.CancelledError, grpc.aio.AbortError):
        raise
    except Exception as e:   # noqa: BLE001 - the status could not be sent: the client has gone
        log.debug("stream: could not send the status %s, the client went away: %r", error.code, e)
        raise asyncio.CancelledError() from None


def _quiet(task: asyncio.Task[None]) -> None:
    """A writer left behind after the stream ended: its outcome is of no interest (nor a log line)."""
    if not task.cancelled():
        task.exception()
