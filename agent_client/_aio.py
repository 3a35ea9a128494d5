"""Small asyncio helpers of the client (``agent_client`` imports nothing of ``coordinator``, whose
``coordinator.aio`` has the same for the servers).

* ``spawn``: a task nobody awaits. The event loop keeps only a weak reference to a task, so one whose
  creator drops it may be collected mid-flight; it is held here until it ends, and its failure is logged
  when it happens rather than found (or lost) at exit.
* ``first_of``: the first of several awaitables to finish; the others are cancelled and awaited, so no
  task is left pending behind the caller.
* ``drain``: a queue as an async iterator, up to a ``None``.
"""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Awaitable, Coroutine, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

_RUNNING: set[object] = set()   # the tasks ``spawn`` started that have not ended


def _log_failure(task: asyncio.Task[T]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background task %s died: %r", task.get_name(), task.exception(), exc_info=task.exception())


def spawn(coro: Coroutine[object, object, T], name: str) -> asyncio.Task[T]:
    """Start ``coro`` as a task that is held until it ends; a failure (not a cancellation) is logged."""
    task = asyncio.get_running_loop().create_task(coro, name=name)
    _RUNNING.add(task)
    task.add_done_callback(_RUNNING.discard)
    task.add_done_callback(_log_failure)
    return task


async def first_of(*awaitables: Awaitable[T]) -> tuple[int, T]:
    """Which of ``awaitables`` finished first (its position) and its result; its exception if it raised.
    The others are cancelled and awaited before this returns, whatever they raise then; so are all of them
    when the caller is cancelled."""
    if not awaitables:
        raise ValueError("first_of: at least one awaitable is needed")
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        first = next(i for i, t in enumerate(tasks) if t in done)
        return first, tasks[first].result()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def drain(queue: asyncio.Queue[T | None]) -> AsyncIterator[T]:
    """The items of ``queue`` as they come, until a ``None``."""
    while True:
        item = await queue.get()
        if item is None:
            return
        yield item
