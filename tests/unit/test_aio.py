"""Background tasks (``coordinator.aio``): started with a reference kept and their failure logged, and
stopped at shutdown. Pure asyncio, no I/O."""
from __future__ import annotations

import asyncio
import gc
import logging
import weakref

import pytest

from coordinator.aio import cancel_and_wait, spawn


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



def test_a_spawned_task_nobody_holds_is_not_collected_while_it_waits() -> None:
    """The event loop holds tasks weakly: a task that waits on a future only it can reach, and whose creator
    dropped it, is garbage that ``gc`` collects mid-flight ("Task was destroyed but it is pending").
    ``spawn`` holds it until it ends."""
    async def waits() -> None:
        await asyncio.get_running_loop().create_future()     # nothing else refers to this future

    async def main() -> bool:
        task = weakref.ref(spawn(waits(), "the test's waiting task"))   # the reference is dropped at once
        await asyncio.sleep(0)
        gc.collect()
        held = task() is not None
        if held:
            await cancel_and_wait([task()])   # type: ignore[list-item]
        return held

    assert asyncio.run(main())


def test_a_spawned_task_logs_its_failure_when_it_happens(caplog: pytest.LogCaptureFixture) -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    async def main() -> None:
        spawn(fails(), "the test's background task")
        for _ in range(3):
            await asyncio.sleep(0)

    with caplog.at_level(logging.ERROR, logger="coordinator.aio"):
        asyncio.run(main())
    assert any("the test's background task died" in r.getMessage() for r in caplog.records), caplog.text
