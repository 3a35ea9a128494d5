"""Small asyncio helpers shared by the coordinator and the node daemon."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, Coroutine, Iterable

log = logging.getLogger(__name__)


def log_failure(task: asyncio.Task[Any], name: str) -> asyncio.Task[Any]:
    """A background task whose failure is logged when it happens, not found at shutdown."""
    def done(t: asyncio.Task[Any]) -> None:
        if not t.cancelled() and t.exception() is not None:
            log.error("background task %s died: %r", name, t.exception(), exc_info=t.exception())
    task.add_done_callback(done)
    return task


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
