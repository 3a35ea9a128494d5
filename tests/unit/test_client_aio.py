"""The client's asyncio helpers (``agent_client._aio``): a background task is held and its failure logged;
the first of several awaitables wins and the rest are cancelled and awaited; a queue drains up to a None.
Pure asyncio, no I/O."""
from __future__ import annotations

import asyncio
import gc
import logging
import weakref

import pytest

from agent_client._aio import drain, first_of, spawn

pytestmark = pytest.mark.unit


def test_a_spawned_task_nobody_holds_is_not_collected_while_it_waits() -> None:
    async def waits() -> None:
        await asyncio.get_running_loop().create_future()     # nothing else refers to this future

    async def main() -> bool:
        task = weakref.ref(spawn(waits(), "the test's waiting task"))   # the reference is dropped at once
        await asyncio.sleep(0)
        gc.collect()
        held = task()
        if held is not None:
            held.cancel()
            await asyncio.gather(held, return_exceptions=True)
        return held is not None

    assert asyncio.run(main())


def test_a_spawned_task_logs_its_failure_and_not_its_cancellation(caplog: pytest.LogCaptureFixture) -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    async def main() -> None:
        spawn(fails(), "the failing task")
        cancelled = spawn(asyncio.sleep(10), "the cancelled task")
        await asyncio.sleep(0)
        cancelled.cancel()
        for _ in range(3):
            await asyncio.sleep(0)

    with caplog.at_level(logging.ERROR, logger="agent_client._aio"):
        asyncio.run(main())
    messages = [r.getMessage() for r in caplog.records]
    assert any("the failing task died" in m and "boom" in m for m in messages), caplog.text
    assert not any("the cancelled task" in m for m in messages), caplog.text


def test_first_of_answers_the_first_to_finish_and_leaves_no_other_running() -> None:
    async def main() -> None:
        slow_ended = asyncio.Event()
        slow_cancelled = []

        async def slow() -> str:
            try:
                await asyncio.sleep(10)
                return "slow"
            except asyncio.CancelledError:
                slow_cancelled.append(True)
                raise
            finally:
                slow_ended.set()

        async def fast() -> str:
            await asyncio.sleep(0)
            return "fast"

        assert await first_of(slow(), fast()) == (1, "fast")
        # Cancelled and awaited before first_of returned: nothing is left pending behind the caller.
        assert slow_ended.is_set() and slow_cancelled == [True]

    asyncio.run(main())


def test_first_of_raises_what_the_first_raised_and_still_stops_the_rest() -> None:
    async def main() -> None:
        other = asyncio.get_running_loop().create_future()

        async def fails() -> None:
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError, match="boom"):
            await first_of(other, fails())
        assert other.cancelled()

    asyncio.run(main())


def test_first_of_cancelled_by_its_caller_cancels_what_it_waits_on() -> None:
    async def main() -> None:
        a = asyncio.get_running_loop().create_future()
        b = asyncio.get_running_loop().create_future()
        waiting = asyncio.create_task(first_of(a, b))
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert waiting.cancelled() and a.cancelled() and b.cancelled()

    asyncio.run(main())


def test_drain_yields_the_items_in_order_up_to_none() -> None:
    async def main() -> list[int]:
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        for item in (3, 1, 2, None, 7):
            queue.put_nowait(item)
        got = [item async for item in drain(queue)]
        assert queue.get_nowait() == 7    # what follows the None stays in the queue
        return got

    assert asyncio.run(main()) == [3, 1, 2]
