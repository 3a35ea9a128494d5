"""The coordinator's garbage-collection policy (coordinator/heap.py): what survives a full collection is frozen,
and everything is thawed once per ``thaw_every_s`` so that cycles among frozen objects are freed."""
from __future__ import annotations

import gc

from coordinator.heap import FreezingCollector, collections_paused


class Calls:
    def __init__(self) -> None:
        self.log: list[str] = []
        self.t = 0.0


def collector(calls: Calls, thaw_every_s: float = 600.0) -> FreezingCollector:
    return FreezingCollector(thaw_every_s, freeze=lambda: calls.log.append("freeze"),
                             unfreeze=lambda: calls.log.append("unfreeze"), now=lambda: calls.t)


def test_the_survivors_of_a_full_collection_are_frozen_and_younger_collections_change_nothing() -> None:
    calls = Calls()
    c = collector(calls)
    for generation in (0, 1, 0):
        c("start", {"generation": generation})
        c("stop", {"generation": generation, "collected": 0, "uncollectable": 0})
    assert calls.log == []
    c("start", {"generation": 2})
    assert calls.log == []          # only once the collection is over
    c("stop", {"generation": 2, "collected": 5, "uncollectable": 0})
    assert calls.log == ["freeze"]


def test_everything_is_thawed_once_per_period_so_that_frozen_cycles_are_freed() -> None:
    calls = Calls()
    c = collector(calls, thaw_every_s=600.0)
    stops = [10.0, 300.0, 599.0, 600.0, 601.0, 1199.0, 1200.0]
    for t in stops:
        calls.t = t
        c("stop", {"generation": 2})
    assert calls.log == ["freeze", "freeze", "freeze", "unfreeze", "freeze", "freeze", "unfreeze"]
    assert (c.frozen, c.thawed) == (5, 2)


def test_installed_it_freezes_what_a_real_full_collection_leaves_and_uninstalled_it_thaws_it() -> None:
    c = FreezingCollector()
    c.install()
    try:
        c.install()                      # once only
        assert gc.callbacks.count(c) == 1
        kept = [[i] for i in range(1000)]   # tracked objects that survive
        gc.collect()
        assert gc.get_freeze_count() >= len(kept)
    finally:
        c.uninstall()
    assert c not in gc.callbacks
    assert gc.get_freeze_count() == 0


def test_collections_paused_disables_the_collector_for_its_block_only_and_leaves_a_disabled_one_disabled() -> None:
    assert gc.isenabled()
    with collections_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collections_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
