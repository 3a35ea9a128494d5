"""Gang placement (coordinator.policy.placement): requests refused naming the field or the topology, waits
behind earlier waiters, and the bounds of the search."""
from __future__ import annotations

import pytest

from coordinator.policy.placement import (
    MAX_CLIQUE_STEPS,
    Chosen,
    GangRequest,
    GpuSlot,
    Refused,
    Wait,
    place,
)
from tests.support.placement_cases import GIB, QUADS, caps, gang, host

# -- refusals and waits ----------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, topology, why", [
    ("4x80GiB", "numa", "NUMA nodes of this host's GPUs are unknown"),
    ("4x80GiB", "nvlink", "no NVLink peers are known"),
    ("4x80GiB:numa=0-1,2-3", "numa", "on one NUMA node"),        # 3 asked, at most 2 per node
])
def test_unknown_or_insufficient_topology_is_refused_naming_topology(spec: str, topology: str, why: str) -> None:
    slots = host(spec)
    got = place(slots, gang(slots, 3, 1, topology=topology))
    assert isinstance(got, Refused) and got.field == "topology" and why in got.reason, got
    assert got.error.code == "FAILED_PRECONDITION"


def test_a_single_gpu_on_an_unknown_numa_host_is_refused_but_nvlink_has_no_pair_to_check() -> None:
    slots = host("2x80GiB")
    assert isinstance(place(slots, gang(slots, 1, 1, topology="numa")), Refused)
    assert place(slots, gang(slots, 1, 1, topology="nvlink")) == Chosen((0,))


def test_a_link_listed_by_one_end_only_does_not_join_the_pair() -> None:
    a, b = host("2x80GiB")
    slots = [GpuSlot(a.index, a.uuid, a.usable_mb, a.free_mb, nvlink_peers=(1,)), b]
    assert isinstance(place(slots, gang(slots, 2, 1, topology="nvlink")), Refused)


@pytest.mark.parametrize("request_kw, field, code", [
    (dict(count=0, vram_gib=1), "gpu_count", "INVALID_ARGUMENT"),
    (dict(count=9, vram_gib=1), "gpu_count", "INVALID_ARGUMENT"),
    (dict(count=1, vram_gib=0), "vram_mb", "INVALID_ARGUMENT"),
    (dict(count=1, vram_gib=1, exclusive=True), "vram_mb", "INVALID_ARGUMENT"),
    (dict(count=1, vram_gib=1, topology="ring"), "topology", "INVALID_ARGUMENT"),
    (dict(count=2, vram_gib=81), "vram_mb", "INVALID_ARGUMENT"),
    (dict(count=1, vram_gib=1, gpus=(9,)), "gpus", "NOT_FOUND"),
    (dict(count=2, vram_gib=1, gpus=(1, "1")), "gpus", "INVALID_ARGUMENT"),
    (dict(count=2, vram_gib=1, gpus=(1,)), "gpus", "INVALID_ARGUMENT"),
    (dict(count=2, vram_gib=1, gpus=(0, 4), topology="nvlink"), "topology", "FAILED_PRECONDITION"),
])
def test_requests_that_can_never_be_placed_are_refused_naming_the_field(request_kw: dict[str, object], field: str,
                                                                          code: str) -> None:
    slots = host(QUADS)
    count, vram = request_kw.pop("count"), request_kw.pop("vram_gib")
    got = place(slots, gang(slots, int(count), int(vram), **request_kw))  # type: ignore[call-overload, arg-type]
    assert isinstance(got, Refused) and got.field == field and got.error.code == code, got
    assert got.reason.startswith(f"{field}: ")


def test_the_partition_bounds_count_caps_and_whole_gpus() -> None:
    slots = host(QUADS)
    two = {s.uuid: s.usable_mb for s in slots[:2]}
    got = place(slots, gang(slots, 3, 1, caps_mb=two))
    assert isinstance(got, Refused) and got.field == "gpu_count" and got.error.code == "FAILED_PRECONDITION"
    got = place(slots, gang(slots, 2, 50, caps_mb=caps(slots, 40 * GIB)))
    assert isinstance(got, Refused) and got.field == "vram_mb" and got.error.code == "FAILED_PRECONDITION"
    got = place(slots, gang(slots, 1, exclusive=True, caps_mb=caps(slots, 40 * GIB)))
    assert isinstance(got, Refused) and got.field == "exclusive"
    got = place(slots, gang(slots, 1, 1, gpus=(slots[7].uuid,), caps_mb=two))
    assert isinstance(got, Refused) and got.field == "gpus" and got.error.code == "PERMISSION_DENIED"


def test_exact_gpus_by_index_or_uuid() -> None:
    slots = host(QUADS)
    assert place(slots, gang(slots, 2, 1, gpus=(5, slots[4].uuid), topology="nvlink")) == Chosen((4, 5))


def test_gpus_an_earlier_waiter_holds_make_it_wait_not_refuse() -> None:
    slots = host(QUADS)
    assert isinstance(place(slots, gang(slots, 4, 1, topology="nvlink"), unavailable={0, 4}), Wait)
    assert place(slots, gang(slots, 4, 1, topology="nvlink"), unavailable={0}) == Chosen((4, 5, 6, 7))


def test_a_large_host_is_searched_within_the_bound() -> None:
    spec = "64x80GiB:numa=0-31,32-63:nvlink=" + ",".join(f"{i}-{i + 7}" for i in range(0, 64, 8))
    slots = host(spec, free={i: 40 + i % 5 for i in range(0, 64, 3)})
    got = place(slots, gang(slots, 24, 30, topology="numa"))
    assert isinstance(got, Chosen) and len(got.gpus) == 24
    assert len({slots[i].numa_node for i in got.gpus}) == 1
    # Criterion 1 is exact past the bound: the 24 least-free GPUs of the best node.
    for node in (0, 1):
        pick = sorted((s for s in slots if s.numa_node == node), key=lambda s: (s.free_mb, s.index))[:24]
        assert sum(slots[i].free_mb for i in got.gpus) <= sum(s.free_mb for s in pick)
    got = place(slots, gang(slots, 8, 1, topology="nvlink", exclusive=False))
    assert isinstance(got, Chosen) and got.gpus[-1] - got.gpus[0] == 7


def test_an_nvlink_graph_past_the_clique_bound_is_refused_naming_the_bound() -> None:
    # The complement of 14 disjoint triangles: 3^14 maximal cliques (Moon and Moser), past any search bound.
    n = 42
    peers = [tuple(j for j in range(n) if j != i and j // 3 != i // 3) for i in range(n)]
    slots = [GpuSlot(i, f"G{i}", 1000, 1000, nvlink_peers=peers[i]) for i in range(n)]
    got = place(slots, GangRequest(15, 1, caps(slots), topology="nvlink"))
    assert isinstance(got, Refused) and got.field == "topology" and str(MAX_CLIQUE_STEPS) in got.reason
