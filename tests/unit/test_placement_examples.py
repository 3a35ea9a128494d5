"""Gang placement over GPU sets (coordinator.policy.placement; issue 21, items 3 and 4): the rule's documented
examples."""
from __future__ import annotations

import itertools

from coordinator.policy.placement import Chosen, GpuSlot, Refused, Wait, place
from tests.support.placement_cases import QUADS, gang, host

# -- the documented examples -------------------------------------------------------------------------

def test_a_pair_goes_inside_one_quad_and_leaves_the_other_whole() -> None:
    assert place(host(QUADS), gang(host(QUADS), 2, 40, topology="nvlink")) == Chosen((0, 1))


def test_an_exclusive_pair_goes_where_it_leaves_a_whole_quad() -> None:
    slots = host(QUADS, free={4: 79})
    assert place(slots, gang(slots, 2, exclusive=True)) == Chosen((5, 6))     # not (0, 1): 0-3 stays whole


def test_a_single_keeps_an_idle_quad_whole() -> None:
    slots = host(QUADS, free={4: 0, 5: 0})
    assert place(slots, gang(slots, 1, 10)) == Chosen((6,))                  # not 0: 0-3 stays whole


def test_with_no_nvlink_block_at_stake_a_numa_block_is_kept_whole() -> None:
    slots = host("4x80GiB:numa=0-1,2-3", free={2: 0})
    assert place(slots, gang(slots, 1, 10)) == Chosen((3,))                  # not 0: node 0 keeps two idle


def test_best_fit_comes_first_least_free_vram_left() -> None:
    slots = host(QUADS, free={3: 50})
    assert place(slots, gang(slots, 1, 40)) == Chosen((3,))


def test_exclusive_nvlink_quad_avoids_the_leased_quad_and_five_is_refused_naming_topology() -> None:
    slots = host(QUADS, free={5: 79})
    assert place(slots, gang(slots, 4, exclusive=True, topology="nvlink")) == Chosen((0, 1, 2, 3))
    refused = place(host(QUADS), gang(host(QUADS), 5, exclusive=True, topology="nvlink"))
    assert isinstance(refused, Refused) and refused.field == "topology"
    assert refused.error.code == "FAILED_PRECONDITION" and "joined by NVLink" in refused.reason


def test_on_mixed_sizes_the_small_gpu_is_filled_and_the_large_block_kept() -> None:
    slots = host("1x24GiB,1x80GiB", free={1: 60})
    assert place(slots, gang(slots, 1, 20)) == Chosen((0,))


def test_a_gang_of_four_nvlink_gets_one_quad_never_a_mix() -> None:
    for busy in itertools.combinations(range(8), 2):
        slots = host(QUADS, free={i: 79 for i in busy})
        got = place(slots, gang(slots, 4, 1, topology="nvlink"))
        assert isinstance(got, Chosen) and got.gpus in ((0, 1, 2, 3), (4, 5, 6, 7)), (busy, got)


def test_exclusive_never_takes_a_gpu_with_a_lease_it_waits() -> None:
    slots = host(QUADS, free={i: 80 for i in range(8)})          # every GPU holds a (tiny) lease
    slots = [GpuSlot(s.index, s.uuid, s.usable_mb, s.usable_mb, True, 0, None, s.nvlink_peers) for s in slots]
    assert isinstance(place(slots, gang(slots, 1, exclusive=True)), Wait)


def test_numa_sets_stay_on_one_node() -> None:
    slots = host("8x80GiB:numa=0-3,4-7", free={0: 10, 1: 10, 2: 10})
    got = place(slots, gang(slots, 2, 40, topology="numa"))
    assert isinstance(got, Chosen) and got.gpus == (4, 5)      # 3 alone is left on node 0
