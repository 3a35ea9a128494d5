"""Small asyncio helpers shared by the coordinator and the node daemon."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Coroutine, Iterable, TypeVar

log = logging.getLogger(__name__)


def log_failure(task: asyncio.Task[Any], name: str) -> asyncio.Task[Any]:
    """A background task whose failure is logged when it happens, not found at shutdown."""
    def done(t: asyncio.Task[Any]) -> None:
        if not t.cancelled() and t.exception() is not None:
            log.error("background task %s died: %r", name, t.exception(), exc_info=t.exception())
    task.add_done_callback(done)
    return task


SLICE_S = 0.005     # a Pacer's work between two pauses
PAUSE_S = 0.005     # ... and its shortest pause


class Pacer:
    """Long work on the event loop in slices: ``await pacer.step()`` before or after each item pauses once ``slice_s``
    of work has passed since the last pause (or ``every`` items have), for as long as that work took (``pause_s`` at
    least), so that whatever else the loop serves gets half of it or more (a fleet's status, the fleet gauges'
    first pass, beside the acquires of the same replica). ``step`` says whether it paused."""

    def __init__(self, slice_s: float | None = None, pause_s: float | None = None, every: int | None = None) -> None:
        self.slice_s = SLICE_S if slice_s is None else slice_s
        self.pause_s = PAUSE_S if pause_s is None else pause_s
        self.every = every
        self._items = 0
        self._began = time.perf_counter()

    async def step(self) -> bool:
        self._items += 1
        worked = time.perf_counter() - self._began
        if worked >= self.slice_s or (self.every is not None and self._items > self.every):
            await asyncio.sleep(max(self.pause_s, worked))
            self._items, self._began = 1, time.perf_counter()
            return True
        return False


_RUNNING: set[asyncio.Task[Any]] = set()


def spawn(coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
    """Start a background task that nobody awaits: the event loop keeps only a weak reference to a task, so
    one whose creator drops it may be collected mid-flight. The task is held here until it ends, and its
    failure is logged when it happens (``log_failure``)."""
    task = log_failure(asyncio.get_running_loop().create_task(coro, name=name), name)
    _RUNNING.add(task)
    task.add_done_callback(_RUNNING.discard)
    return task


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel the tasks and wait until each has finished, whatever it raised.

    A task is cancelled again for as long as it runs: on Python 3.11, ``asyncio.wait_for`` loses a
    cancellation that arrives as its inner future completes (python/cpython#86296), and a loop around it
    would then run on and make a shutdown hang."""
    tasks = list(tasks)
    while True:
        running = [t for t in tasks if not t.done()]
        if not running:
            break
        for t in running:
            t.cancel()
        await asyncio.wait(running, timeout=0.1)
    for t in tasks:
        if not t.cancelled():
            t.exception()    # retrieved: a failure at shutdown is not reported again as never retrieved


async def retry_forever(what: str, body: Callable[[], Awaitable[None]], first_backoff: float = 0.1,
                        max_backoff: float = 5.0, on_error: Callable[[], None] | None = None,
                        stop: Callable[[], bool] = lambda: False) -> None:
    """Run ``body`` again and again until ``stop()``: a pass that raises is logged and retried after a
    growing backoff; a pass that returns resets it. For the watches that must never stay dead."""
    backoff = first_backoff
    while not stop():
        try:
            await body()
            backoff = first_backoff
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a task's failure of any kind is logged with its stack, not lost
            if on_error is not None:
                on_error()
            log.warning("%s failed (%r); starting over in %.1fs", what, e, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, max_backoff)


T = TypeVar("T")


async def first_of(*aws: Awaitable[T], timeout: float | None = None) -> asyncio.Future[T] | None:
    """Run ``aws`` concurrently until the first of them ends (or ``timeout`` passes: None), then cancel the
    others and wait until they have finished (``cancel_and_wait``). Returns the one that ended first (the
    first given, when several ended together); its result or exception is the caller's to read. A task
    passed in is that very task. Cancelling the caller cancels them all."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        done, _ = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        await cancel_and_wait(t for t in tasks if not t.done())
    except BaseException:
        # Cancelled, maybe in the very turn in which one of them failed: nobody reads any outcome now, and a
        # failure left unread is reported as never retrieved.
        await cancel_and_wait(tasks)
        raise
    first = next((t for t in tasks if t in done), None)
    for t in done:
        if t is not first and not t.cancelled():
            t.exception()   # retrieved: only the first one's outcome is the caller's
    return first


async def drain(queue: asyncio.Queue[T | None]) -> AsyncIterator[T]:
    """The items of ``queue`` as they come, until a None: a request stream's iterator (gRPC reads it while
    the caller puts requests, and a None ends the stream)."""
    while True:
        item = await queue.get()
        if item is None:
            return
        yield item
