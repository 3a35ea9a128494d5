"""Waiting without sleeps as synchronisation: ``wait_for`` (poll with a deadline), ``pass_time`` (when the
passing of time is itself the test), ``Background`` (a blocking call in a thread), ``LoopThread``."""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Awaitable, Callable, TypeVar

T = TypeVar("T")

# The deadline of a liveness check ("it happens"), not of how soon: generous enough that no loaded machine
# (a busy neighbour on 2 shared cores) misses it, while a defect that stops it still fails the test. How soon
# it happened is printed by the test and measured, as a ratio, by ``gpucoord bench`` (docs/performance.md "Performance").
LIVENESS_S = 60.0


class LoopThread:
    """An asyncio loop in a daemon thread; ``run`` waits for a coroutine from sync test code."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Awaitable[T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(liveness(timeout))  # type: ignore[arg-type]

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Background:
    """Run a blocking call in a thread; ``result()`` waits for it (with a deadline) and re-raises its error."""

    def __init__(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.finished_at = 0.0

        def run() -> None:
            try:
                self.value = fn(*args, **kw)
            except BaseException as e:  # noqa: BLE001 - handed to the test
                self.error = e
            finally:
                self.finished_at = time.monotonic()
                self.done.set()
        threading.Thread(target=run, daemon=True).start()

    def result(self, timeout: float = 30) -> Any:
        assert self.done.wait(liveness(timeout)), "the background call did not finish"
        if self.error is not None:
            raise self.error
        return self.value


def liveness(timeout: float) -> float:
    """The deadline a test waits with: the one it asked for, and never less than ``LIVENESS_S``. A deadline
    in a test only tells a defect (it never happens) from a pass; on a loaded machine (CI: 2 shared cores,
    busy neighbours) a short one failed tests on nothing but speed. How soon is printed, and measured by
    ``gpucoord bench``."""
    return max(timeout, LIVENESS_S)


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    """Poll ``predicate`` until it is truthy, with a deadline (never a bare sleep as synchronisation): at
    least ``LIVENESS_S`` whatever ``timeout`` says (``liveness``)."""
    timeout = liveness(timeout)
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def pass_time(seconds: float, what: str) -> None:
    """Let wall-clock time pass (a TTL, a grace period) when what happens meanwhile is the thing under test.

    Never to let something finish: wait for that with ``wait_for`` and its condition."""
    until = time.monotonic() + seconds
    wait_for(lambda: time.monotonic() >= until, seconds + 5, what, interval=0.05)
