"""Full garbage collections that do not stop a large coordinator for most of a second (issue 32).

CPython's cyclic collector traverses every object it tracks in a full (generation 2) collection, and runs one
each time the objects surviving younger collections reach a quarter of those that survived the last one. A
replica's mirror, sessions and host views are long-lived: with 10,000 sessions a replica tracked 1.4 million
objects, and each full collection stopped its event loop (every call, keepalive and expiry) for 0.6-0.8 s,
once per quarter of growth.

The policy here freezes (``gc.freeze``) what survives a full collection: the next ones traverse only what was
allocated since, so their pauses follow the recent growth, not the heap. A frozen object that later becomes
part of unreachable cycle is not reclaimed while frozen, so everything is thawed (``gc.unfreeze``) once every
``THAW_EVERY_S``: the full collection after that traverses it all once, and frees such cycles. Objects freed by
their reference count (almost all of them) are freed at once either way.

Installed by the coordinator's process (``gpucoord coordinator``), not by a library user's.
"""
from __future__ import annotations

import contextlib
import gc
import time
from typing import Any, Callable, Iterator

THAW_EVERY_S = 600.0


class FreezingCollector:
    """The policy above, as a ``gc.callbacks`` entry. ``freeze``, ``unfreeze`` and ``now`` are injectable (tests)."""

    def __init__(self, thaw_every_s: float = THAW_EVERY_S, freeze: Callable[[], None] = gc.freeze,
                 unfreeze: Callable[[], None] = gc.unfreeze, now: Callable[[], float] = time.monotonic) -> None:
        self.thaw_every_s = thaw_every_s
        self._freeze, self._unfreeze, self._now = freeze, unfreeze, now
        self._thawed_at = now()
        self.frozen = 0     # full collections whose survivors were frozen
        self.thawed = 0     # times everything was thawed

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase != "stop" or info.get("generation") != 2:
            return
        now = self._now()
        if now - self._thawed_at >= self.thaw_every_s:
            # Thawed: the next full collection (soon: what survived this one was few) traverses everything.
            self._thawed_at = now
            self._unfreeze()
            self.thawed += 1
        else:
            self._freeze()
            self.frozen += 1

    def install(self) -> None:
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def uninstall(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)
        self._unfreeze()


@contextlib.contextmanager
def collections_paused() -> Iterator[None]:
    """No cyclic collection while a large structure without cycles is built in one piece (a replica's mirror: 200,000
    keys at 100,000 leases, whose load took 0.14 s of collections in a restart of 2 s). Reference counting frees
    what it frees meanwhile; the collector runs again after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


__all__ = ["THAW_EVERY_S", "FreezingCollector", "collections_paused"]
