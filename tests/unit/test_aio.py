"""Background tasks (``coordinator.aio``): started with a reference kept and their failure logged, and
stopped at shutdown. Pure asyncio, no I/O."""
from __future__ import annotations

import asyncio
import gc
import logging
import weakref

import pytest

from coordinator.aio import cancel_and_wait, drain, first_of, spawn


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


def test_first_of_returns_the_first_to_end_once_the_others_have_finished() -> None:
    """The losers are cancelled AND finished when ``first_of`` returns: their clean-up has run."""
    cleaned: list[str] = []

    async def slow(name: str) -> str:
        try:
            await asyncio.sleep(10)
            return name
        finally:
            await asyncio.sleep(0)      # a clean-up that itself awaits
            cleaned.append(name)

    async def quick() -> str:
        await asyncio.sleep(0)
        return "quick"

    async def main() -> None:
        loser = asyncio.ensure_future(slow("loser"))
        first = await first_of(loser, quick(), slow("other"))
        assert first is not None and first is not loser and first.result() == "quick"
        assert sorted(cleaned) == ["loser", "other"] and loser.cancelled()
    asyncio.run(main())


def test_first_of_reports_which_one_ended_even_when_it_failed() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    async def main() -> None:
        never = asyncio.Event()
        failing = asyncio.ensure_future(fails())
        assert await first_of(never.wait(), failing) is failing
        with pytest.raises(RuntimeError):
            failing.result()
    asyncio.run(main())


def test_first_of_after_its_timeout_is_none_and_leaves_nothing_running() -> None:
    async def main() -> None:
        a, b = asyncio.Event(), asyncio.Event()
        tasks = [asyncio.ensure_future(a.wait()), asyncio.ensure_future(b.wait())]
        assert await first_of(*tasks, timeout=0.01) is None
        assert all(t.cancelled() for t in tasks)
    asyncio.run(main())


def test_a_cancelled_first_of_cancels_what_it_waits_on() -> None:
    async def main() -> None:
        inner = asyncio.ensure_future(asyncio.Event().wait())
        outer = asyncio.ensure_future(first_of(inner))
        await asyncio.sleep(0)
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
        assert inner.cancelled()
    asyncio.run(main())


def test_first_of_cancelled_as_one_of_its_awaitables_fails_retrieves_that_failure() -> None:
    """The caller of ``first_of`` is cancelled in the very turn of the loop in which one of the tasks it waits
    on fails (a replica's RPC handler cancelled by its client as an etcd call under it breaks): nobody will read
    that failure, and asyncio must not report it as "Task exception was never retrieved"."""
    unretrieved: list[str] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: unretrieved.append(ctx["message"]))
        fail = asyncio.Event()

        async def fails() -> None:
            await fail.wait()
            raise RuntimeError("the link was reset")

        failing = asyncio.ensure_future(fails())
        waiting = asyncio.ensure_future(first_of(failing, asyncio.Event().wait()))
        await asyncio.sleep(0)                                  # first_of waits on both now
        failing.add_done_callback(lambda _: waiting.cancel())   # after first_of's own callback: the same turn
        fail.set()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(main())
    gc.collect()     # the failed task, unread, is collected with main's frame at the latest now
    assert not unretrieved, unretrieved


def test_drain_yields_the_queue_in_order_until_none() -> None:
    async def main() -> list[int]:
        q: asyncio.Queue[int | None] = asyncio.Queue()
        for x in (1, 2, 0, 3):
            q.put_nowait(x)        # 0 is an item like any other: only None ends the stream
        q.put_nowait(None)
        q.put_nowait(4)            # after the end: never read
        return [x async for x in drain(q)]
    assert asyncio.run(main()) == [1, 2, 0, 3]
