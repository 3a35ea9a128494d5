"""Victim choice over GPU sets (coordinator.policy.placement): a gang evicted whole, the set with fewest and
lowest victims, and victims that can be spared dropped."""
from __future__ import annotations

import dataclasses

from coordinator.policy.victims import VictimChoice, choose_gang_victims
from tests.support.placement_cases import QUADS, gang, holder, host

# -- victims ---------------------------------------------------------------------------------------------

def test_evicting_a_gang_frees_all_its_gpus() -> None:
    slots = host(QUADS, free={0: 0, 1: 0, 2: 0, 3: 0, 4: 0, 5: 0, 6: 0, 7: 0})
    holders = [holder("gang01", 0, {0: 80, 1: 80}), holder("g23", 0, {2: 80, 3: 80}, created_at=1)] + [
        holder(f"s{i}", 0, {i: 80}) for i in range(4, 8)]
    got = choose_gang_victims(slots, gang(slots, 2, exclusive=True, topology="nvlink"), 5, "a", holders)
    # One victim frees a whole pair: gang01 frees (0, 1), g23 frees (2, 3). G3's order over all candidates:
    # of the same priority the newest goes first, and a gang is one victim of its own age: g23.
    assert got == VictimChoice((2, 3), (holders[1],))
    got = choose_gang_victims(slots, gang(slots, 2, exclusive=True, topology="nvlink"), 5, "a",
                              [holders[0], dataclasses.replace(holders[1], priority=1), *holders[2:]])
    assert got == VictimChoice((0, 1), (holders[0],))        # then the lower priority: gang01


def test_the_order_rule_wins_over_the_count_across_gpus() -> None:
    """Lowest priority first over every GPU: the two priority-0 leases that together free GPU 0 go, rather
    than the one priority-1 lease that alone would free GPU 2 (G3: the order rule wins over the count)."""
    slots = host("4x80GiB", free={i: 0 for i in range(4)})
    holders = [holder("a", 0, {0: 40}), holder("b", 0, {0: 40}), holder("c", 2, {1: 80}), holder("d", 1, {2: 80}),
               holder("e", 3, {3: 80}, preemptible=False)]
    got = choose_gang_victims(slots, gang(slots, 1, 60), 5, "x", holders)
    assert got is not None and got.gpus == (0,) and {v.id for v in got.victims} == {"a", "b"}


def test_a_newer_single_lease_goes_before_an_older_gang_of_the_same_priority() -> None:
    """Issue 28's scene: a one-GPU request of priority 10 on a host where a 2-GPU gang of priority 0 holds GPUs
    0 and 1 and a newer single lease of priority 0 holds GPU 2: the newer single lease is evicted (newest first
    over all candidates), not the gang of the lower indexes."""
    slots = host("3x80GiB", free={i: 0 for i in range(3)})
    holders = [holder("gang", 0, {0: 80, 1: 80}, created_at=1, token=1), holder("single", 0, {2: 80}, created_at=2,
                                                                               token=2)]
    got = choose_gang_victims(slots, gang(slots, 1, 40), 10, "x", holders)
    assert got == VictimChoice((2,), (holders[1],))


def test_within_a_set_the_order_rule_wins_over_the_count() -> None:
    slots = host("1x80GiB", free={0: 0})
    small = [holder("p0a", 0, {0: 20}), holder("p0b", 0, {0: 20}, created_at=1)]
    big = holder("p1", 1, {0: 40})
    got = choose_gang_victims(slots, gang(slots, 1, 40), 5, "x", [*small, big])
    assert got is not None and {v.id for v in got.victims} == {"p0a", "p0b"}


def test_non_preemptible_or_higher_priority_holders_make_a_set_impossible_for_exclusive() -> None:
    slots = host("2x80GiB", free={0: 70, 1: 70})
    holders = [holder("x", 0, {0: 10}, preemptible=False), holder("y", 9, {1: 10})]
    assert choose_gang_victims(slots, gang(slots, 1, exclusive=True), 5, "a", holders) is None


def test_fits_now_or_once_pending_evictions_end_needs_no_victim() -> None:
    slots = host("2x80GiB", free={0: 50})
    assert choose_gang_victims(slots, gang(slots, 1, 40), 5, "a", [holder("x", 0, {0: 30})]) == VictimChoice((0,), ())


def test_a_victim_that_can_be_spared_is_dropped() -> None:
    slots = host("1x80GiB", free={0: 0})
    holders = [holder("small", 0, {0: 10}), holder("big", 1, {0: 70})]
    got = choose_gang_victims(slots, gang(slots, 1, 60), 5, "a", holders)
    assert got is not None and [v.id for v in got.victims] == ["big"]
