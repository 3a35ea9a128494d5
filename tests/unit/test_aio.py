"""Shutdown of background tasks (``coordinator.aio.cancel_and_wait``): pure asyncio, no I/O."""
from __future__ import annotations

import asyncio

from coordinator.aio import cancel_and_wait


def test_cancel_and_wait_stops_a_task_that_loses_a_cancellation() -> None:
    """On Python 3.11 ``asyncio.wait_for`` can swallow a cancellation; a loop around it runs on. Such a task
    must still be stopped (it made a coordinator's shutdown hang in a fault test)."""
    async def loses_the_first_cancellation() -> None:
        lost = 0
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                lost += 1
                if lost > 1:
                    raise

    async def main() -> None:
        task = asyncio.create_task(loses_the_first_cancellation())
        await asyncio.sleep(0)
        stopping = asyncio.create_task(cancel_and_wait([task]))
        done, _ = await asyncio.wait({stopping}, timeout=5)    # asyncio.wait cancels nothing at its timeout
        finished = stopping in done and task.done()
        if not finished:
            task.cancel()
            stopping.cancel()
            await asyncio.gather(task, stopping, return_exceptions=True)
        assert finished, "cancel_and_wait did not stop a task that lost one cancellation"
        assert task.cancelled()

    asyncio.run(main())


def test_cancel_and_wait_retrieves_failures() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    async def main() -> None:
        task = asyncio.create_task(fails())
        await asyncio.sleep(0)
        await cancel_and_wait([task])
        assert isinstance(task.exception(), RuntimeError)

    asyncio.run(main())
