"""The bench's one event loop: the asyncio work of every phase runs on it, from the first phase to the last.

gRPC's asyncio layer finishes a cancelled call (a closed client's keepalive stream, say) a moment after its
owner let go of it. With a loop per ``asyncio.run``, that completion can arrive after its loop was closed,
and gRPC prints "RuntimeError: Event loop is closed" from whichever loop runs next (P3's second replica
count, P4's lock baseline). One loop, closed once when the command ends, takes those completions like any
other.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Coroutine, Iterator, TypeVar

T = TypeVar("T")

_runner: asyncio.Runner | None = None


@contextlib.contextmanager
def one_loop() -> Iterator[None]:
    """Every ``run`` inside uses the same event loop, closed (as ``asyncio.run`` closes its own) on exit."""
    global _runner
    with asyncio.Runner() as runner:
        previous, _runner = _runner, runner
        try:
            yield
        finally:
            _runner = previous


def run(coro: Coroutine[object, None, T]) -> T:
    """Runs ``coro`` to completion, then cancels what it left running, as ``asyncio.run`` does, but on the
    loop of the enclosing ``one_loop`` (outside one, it is ``asyncio.run``)."""
    if _runner is None:
        return asyncio.run(coro)

    async def main() -> T:
        try:
            return await coro
        finally:
            me = asyncio.current_task()
            rest = [t for t in asyncio.all_tasks() if t is not me]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)
    return _runner.run(main())
