"""Gang placement and victim choice over GPU sets (coordinator.policy.placement; issue 21, items 3 and 4).

Plain unit tests for the rule's documented examples and refusals, then Hypothesis properties (500 examples
each, no I/O) checked against brute force written here from the module's documented rule: topology,
exclusive and per-GPU capacity respected; the chosen set optimal; victims minimal, in G3's order and optimal
over the sets; and a one-GPU request choosing as admission.best_fit / admission.plan_eviction do.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from typing import Callable, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.node.fake import parse_fake_gpus
from coordinator.policy.admission import GpuView, best_fit, plan_eviction
from coordinator.policy.gang import holders_from_views, slots_from_views
from coordinator.policy.placement import (
    MAX_CLIQUE_STEPS,
    Chosen,
    GangRequest,
    GpuSlot,
    Refused,
    Wait,
    place,
)
from coordinator.policy.victims import Holder, VictimChoice, choose_gang_victims
from coordinator.records import GpuInfo, GpuLedger, HostInventory, VramLease

GIB = 1024
PROPS = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- builders ---------------------------------------------------------------------------------------

def host(spec: str, free: dict[int, int] | None = None) -> list[GpuSlot]:
    """Slots of a ``--fake-gpus`` spec; ``free``: GPU index -> free GiB (those GPUs hold a lease)."""
    free = free or {}
    return [GpuSlot(g.index, g.uuid, g.vram_total_mb, free.get(g.index, g.vram_total_mb // GIB) * GIB,
                    leased=g.index in free, numa_node=g.numa_node, nvlink_peers=g.nvlink_peers)
            for g in parse_fake_gpus(spec, "h")]


def caps(slots: Sequence[GpuSlot], cap: int | None = None) -> dict[str, int]:
    return {s.uuid: s.usable_mb if cap is None else cap for s in slots}


def gang(slots: Sequence[GpuSlot], count: int, vram_gib: int = 0, *, exclusive: bool = False, topology: str = "any",
         gpus: tuple[int | str, ...] | None = None, caps_mb: dict[str, int] | None = None) -> GangRequest:
    return GangRequest(count, vram_gib * GIB, caps(slots) if caps_mb is None else caps_mb, exclusive=exclusive,
                       topology=topology, gpus=gpus)


def holder(hid: str, priority: int, on: dict[int, int], *, agent: str = "b", preemptible: bool = True,
           created_at: float = 0.0, token: int = 0) -> Holder:
    return Holder(hid, agent, priority, preemptible, created_at, token, tuple((i, mb * GIB) for i, mb in on.items()))


QUADS = "8x80GiB:nvlink=0-3,4-7"


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


# -- victims ---------------------------------------------------------------------------------------------

def test_evicting_a_gang_frees_all_its_gpus() -> None:
    slots = host(QUADS, free={0: 0, 1: 0, 2: 0, 3: 0, 4: 0, 5: 0, 6: 0, 7: 0})
    holders = [holder("gang01", 0, {0: 80, 1: 80}), holder("g23", 0, {2: 80, 3: 80}, created_at=1)] + [
        holder(f"s{i}", 0, {i: 80}) for i in range(4, 8)]
    got = choose_gang_victims(slots, gang(slots, 2, exclusive=True, topology="nvlink"), 5, "a", holders)
    # One victim frees a whole pair: gang01 frees (0, 1), g23 frees (2, 3); any pair of 4-7 takes two
    # victims. Between sets of equal cost the lowest indexes win (as plan_eviction's first GPU does).
    assert got == VictimChoice((0, 1), (holders[0],))
    got = choose_gang_victims(slots, gang(slots, 2, exclusive=True, topology="nvlink"), 5, "a",
                              [dataclasses.replace(holders[0], priority=1), *holders[1:]])
    assert got == VictimChoice((2, 3), (holders[1],))        # then the lower priority: g23


def test_the_set_with_fewest_victims_wins_then_the_lowest_priorities() -> None:
    slots = host("4x80GiB", free={i: 0 for i in range(4)})
    holders = [holder("a", 0, {0: 40}), holder("b", 0, {0: 40}), holder("c", 2, {1: 80}), holder("d", 1, {2: 80}),
               holder("e", 3, {3: 80}, preemptible=False)]
    got = choose_gang_victims(slots, gang(slots, 1, 60), 5, "x", holders)
    assert got == VictimChoice((2,), (holders[3],))


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


# -- properties ------------------------------------------------------------------------------------------

class Case:
    """A random host snapshot (GpuViews with leases, some of them gangs over several GPUs), its topology, and
    a request; with the brute-force oracle of the module's rule."""

    def __init__(self, views: list[GpuView], inventory: HostInventory, agent: str, request: GangRequest,
                 priority: int, unavailable: frozenset[int], evicting: frozenset[str]) -> None:
        self.views, self.inventory, self.agent, self.request = views, inventory, agent, request
        self.priority, self.unavailable, self.evicting = priority, unavailable, evicting
        self.info = {g.index: g for g in inventory.gpus}
        self.n = len(views)

    def __repr__(self) -> str:
        return (f"Case(request={self.request}, priority={self.priority}, agent={self.agent!r}, "
                f"unavailable={set(self.unavailable)}, evicting={set(self.evicting)},\n  gpus=" + "\n    ".join(
                    f"{v.index}: usable={v.usable_mb} free={v.free_mb} numa={self.info[v.index].numa_node} "
                    f"peers={self.info[v.index].nvlink_peers} leases="
                    + str([(x.id, x.agent, x.vram_mb, x.priority, x.preemptible, x.created_at, x.token)
                           for x in v.leases]) for v in self.views))

    def slots(self) -> tuple[GpuSlot, ...]:
        return slots_from_views(self.views, self.agent, self.inventory)

    # the rule, written again from the docstring
    def linked(self, i: int, j: int) -> bool:
        return j in self.info[i].nvlink_peers and i in self.info[j].nvlink_peers

    def topology_ok(self, gpus: Sequence[int]) -> bool:
        t = self.request.topology
        if t == "numa":
            nodes = {self.info[i].numa_node for i in gpus}
            return None not in nodes and len(nodes) == 1
        if t == "nvlink":
            return all(self.linked(i, j) for i, j in itertools.combinations(gpus, 2))
        return True

    def cap(self, v: GpuView) -> int:
        return self.request.caps[v.uuid]

    def holds_now(self, v: GpuView) -> bool:
        r = self.request
        if r.exclusive:
            return not v.leases and v.free_mb == v.usable_mb and self.cap(v) >= v.usable_mb
        return r.vram_mb <= v.free_mb and v.agent_mb(self.agent) + r.vram_mb <= self.cap(v)

    def could_ever(self, v: GpuView) -> bool:
        r = self.request
        return self.cap(v) >= v.usable_mb if r.exclusive else r.vram_mb <= min(v.usable_mb, self.cap(v))

    def allowed(self) -> list[GpuView] | None:
        """The GPUs the request may use, or None when its exact list is malformed."""
        r = self.request
        mine = [v for v in self.views if v.uuid in r.caps]
        if r.gpus is None:
            return mine
        named = sorted({int(i) for i in r.gpus})  # the strategies name GPUs by index
        if len(named) != len(r.gpus) or len(named) != r.gpu_count or any(i >= self.n for i in named):
            return None
        if any(self.views[i].uuid not in r.caps for i in named):
            return None
        return [self.views[i] for i in named]

    def ever_sets(self) -> list[tuple[int, ...]]:
        allowed = self.allowed() or []
        ok = [v.index for v in allowed if self.could_ever(v)]
        return [s for s in itertools.combinations(ok, self.request.gpu_count) if self.topology_ok(s)]

    def now_sets(self) -> list[tuple[int, ...]]:
        return [s for s in self.ever_sets()
                if not set(s) & self.unavailable and all(self.holds_now(self.views[i]) for i in s)]

    def key(self, chosen: tuple[int, ...]) -> tuple[object, ...]:
        r = self.request
        after_free = {v.index: v.free_mb for v in self.views}
        for i in chosen:
            after_free[i] = 0 if r.exclusive else self.views[i].free_mb - r.vram_mb
        idle = [v.index for v in self.views if v.index not in chosen and not v.leases and v.free_mb == v.usable_mb]
        partly = sum(1 for v in self.views if v.index not in idle and after_free[v.index] > 0)
        clique = max((len(c) for size in range(len(idle) + 1) for c in itertools.combinations(idle, size)
                      if all(self.linked(a, b) for a, b in itertools.combinations(c, 2))), default=0)
        numa = max(Counter(self.info[i].numa_node for i in idle if self.info[i].numa_node is not None).values(),
                   default=0)
        return (sum(after_free[i] for i in chosen), partly, -clique, -numa, chosen)

    # victims, written again from the docstring
    def holders(self) -> dict[str, Holder]:
        return {h.id: h for h in holders_from_views(self.views, self.evicting)}

    def after_views(self) -> list[GpuView]:
        return [GpuView(v.uuid, v.index, v.total_mb, v.usable_mb, v.ledger,
                        [x for x in v.leases if x.id not in self.evicting], v.nvml_used_mb) for v in self.views]

    def sufficient(self, chosen: tuple[int, ...], victims: Sequence[Holder]) -> bool:
        r, views = self.request, self.after_views()
        gone = {h.id for h in victims}
        for i in chosen:
            v = views[i]
            freed = sum(x.vram_mb for x in v.leases if x.id in gone)
            own = sum(x.vram_mb for x in v.leases if x.id in gone and x.agent == self.agent)
            if r.exclusive:
                if any(x.id not in gone for x in v.leases) or v.free_mb + freed < v.usable_mb:
                    return False
                if self.cap(v) < v.usable_mb:
                    return False
            elif v.free_mb + freed < r.vram_mb or v.agent_mb(self.agent) - own + r.vram_mb > self.cap(v):
                return False
        return True

    def candidates(self, chosen: tuple[int, ...]) -> list[Holder]:
        """The preemptible holders of lower priority on the set, in G3's order."""
        return sorted((h for h in self.holders().values()
                       if any(i in chosen for i, _ in h.vram) and h.preemptible and h.priority < self.priority),
                      key=lambda h: (h.priority, -h.created_at, -h.token))

    def set_victims(self, chosen: tuple[int, ...]) -> list[Holder] | None:
        """Over every subset: the sufficient one whose last victim in G3 order is earliest, then whose
        indicator vector in that order is smallest (what taking in order, then sparing in order, yields)."""
        cands = self.candidates(chosen)
        best: tuple[tuple[object, ...], list[Holder]] | None = None
        for mask in range(1 << len(cands)):
            vs = [c for n, c in enumerate(cands) if mask >> n & 1]
            if not self.sufficient(chosen, vs):
                continue
            key = (max((n for n in range(len(cands)) if mask >> n & 1), default=-1),
                   tuple(mask >> n & 1 for n in range(len(cands))))
            if best is None or key < best[0]:
                best = (key, vs)
        return None if best is None else best[1]


AGENTS = ("a", "b")


@dataclasses.dataclass(frozen=True)
class Knobs:
    """How a kind of host and request is drawn."""

    gpus: tuple[int, int] = (1, 6)
    sizes: tuple[int, ...] = (1000, 2000, 4000)
    topology_known: tuple[str, ...] = ("none", "numa", "nvlink", "both")
    leases: tuple[int, int] = (0, 6)           # random leases, each over up to ``span`` GPUs
    span: int = 3
    lease_mb: tuple[int, ...] = (250, 500, 1000, 1500, 2000)
    fill: bool = False                         # then fill each GPU up with single leases
    full: bool = False                         # every GPU full of 1, 2 or 4 equal leases
    preemptible_odds: int = 3                  # preemptible unless a draw of 0..odds is 0
    caps_allowed_odds: int = 9                 # a GPU is allowed unless a draw of 0..odds is 0
    caps: tuple[str, ...] = ("u", "u", "u", "u", "half", "big")
    counts: tuple[int, ...] = (1, 1, 2, 2, 3, 4, -1)    # -1: every GPU
    exclusive_odds: int = 2                    # exclusive when a draw of 0..odds is 0 (-1: never)
    vram: tuple[int, ...] = (250, 500, 500, 1000, 1000, 1500, 2000, 3000)
    topologies: tuple[str, ...] = ("any", "numa", "nvlink")
    exact_odds: int = 7                        # an exact GPU list when a draw of 0..odds is 0 (-1: never)
    unavailable_odds: int = 1                  # some GPUs held by earlier waiters when a draw is 0 (-1: never)
    evicting: bool = True
    priority: tuple[int, int] = (0, 5)


MODES = {
    # anything, refusals included
    "mixed": Knobs(),
    # few leases: placement has choices to rank
    "roomy": Knobs(leases=(0, 3), counts=(1, 1, 2, 2, 3, 4), exact_odds=-1, unavailable_odds=4),
    # several partly used GPUs and known topology: the rule's criteria decide between many sets
    "placing": Knobs(gpus=(3, 6), sizes=(4000, 4000, 4000, 2000), topology_known=("none", "numa", "nvlink", "both",
                     "both"), leases=(1, 5), span=2, lease_mb=(250, 500, 1000, 1500), caps_allowed_odds=1000,
                     caps=("u", "u", "u", "half"), counts=(1, 2, 2, 3), exclusive_odds=3, vram=(250, 500, 1000),
                     exact_odds=-1, unavailable_odds=4),
    # idle GPUs of one size joined by NVLink or on NUMA nodes: the blocks left decide
    "blocks": Knobs(gpus=(3, 6), sizes=(4000,), topology_known=("nvlink", "both", "both", "numa"), leases=(0, 2),
                    span=1, lease_mb=(4000, 4000, 250), caps_allowed_odds=1000, caps=("u",), counts=(1, 1, 2, 3),
                    vram=(1000, 2000, 4000), exact_odds=-1, unavailable_odds=4),
    # busy GPUs and a request of high priority: eviction has work to do
    "crowded": Knobs(fill=True, lease_mb=(250, 250, 500, 1000, 1500, 2000), preemptible_odds=7,
                     caps_allowed_odds=1000, caps=("u", "big"), counts=(1, 1, 2, 2, 3, 4), exclusive_odds=4,
                     topologies=("any", "any", "any", "any", "numa", "nvlink"), exact_odds=20, unavailable_odds=4,
                     priority=(3, 5)),
    # every GPU full of equal leases, a request for whole GPUs: the sets' victims differ in count and rank
    "full": Knobs(gpus=(2, 6), sizes=(2000,), leases=(0, 0), full=True, preemptible_odds=7, caps_allowed_odds=1000,
                  caps=("u", "big"), counts=(1, 1, 2), vram=(2000,), exact_odds=-1, unavailable_odds=-1,
                  evicting=False, priority=(5, 5)),
    # one-GPU requests and one-GPU leases, as admission.py knows them
    "single": Knobs(span=1, fill=True, lease_mb=(250, 250, 500, 1000, 1500, 2000), preemptible_odds=7,
                    counts=(1,), exclusive_odds=-1, topologies=("any",), exact_odds=-1, unavailable_odds=4,
                    priority=(3, 5)),
    "single-roomy": Knobs(leases=(0, 3), span=1, counts=(1,), exclusive_odds=-1, topologies=("any",), exact_odds=-1,
                          unavailable_odds=4),
}


def odds(draw: st.DrawFn, n: int) -> bool:
    """True once in n + 1 draws; never for n = -1."""
    return n >= 0 and draw(st.integers(0, n)) == 0


@st.composite
def cases(draw: st.DrawFn, mode: str = "mixed") -> Case:
    """A host snapshot and a request, drawn as ``MODES[mode]`` says."""
    k = MODES[mode]
    n = draw(st.integers(*k.gpus))
    sizes = st.sampled_from(k.sizes)
    usable = [draw(sizes)] * n if draw(st.integers(0, 2)) > 0 else [draw(sizes) for _ in range(n)]
    known = draw(st.sampled_from(k.topology_known))
    numa = [draw(st.sampled_from([None, 0, 0, 1, 1])) if known in ("numa", "both") else None for _ in range(n)]
    peers: dict[int, set[int]] = {i: set() for i in range(n)}
    if known in ("nvlink", "both"):
        for i, j in itertools.combinations(range(n), 2):
            if draw(st.booleans()):
                peers[i].add(j)
                peers[j].add(i)
            elif draw(st.booleans()):
                a, b = draw(st.sampled_from([(i, j), (j, i)]))
                peers[a].add(b)                   # listed by one end only: not a link
    leases: list[list[VramLease]] = [[] for _ in range(n)]
    held = [0] * n
    tokens = itertools.count(1)

    def lease_on(span: list[int], mb: int, h: str) -> None:
        agent = draw(st.sampled_from(AGENTS + ("c",)))
        prio, created = draw(st.integers(-1, 3)), float(draw(st.integers(0, 3)))
        pre = not odds(draw, k.preemptible_odds)
        for i in span:
            held[i] += mb
            leases[i].append(VramLease(id=h, host="h", gpu_uuid=f"GPU-{i}", gpu_index=i, agent=agent, session_id="1",
                                       vram_mb=mb, priority=prio, preemptible=pre, request_id=h, token=next(tokens),
                                       created_at=created))

    for h in range(draw(st.integers(*k.leases))):
        span = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=k.span, unique=True))
        mb = draw(st.sampled_from(k.lease_mb))
        if all(held[i] + mb <= usable[i] for i in span):
            lease_on(span, mb, f"L{h}")
    for i in range(n):
        if k.full:
            m = draw(st.sampled_from([1, 2, 4]))
            for h in range(m):
                lease_on([i], usable[i] // m, f"W{i}.{h}")
        elif k.fill:
            for h in range(draw(st.integers(0, 4))):
                mb = draw(st.sampled_from(k.lease_mb))
                if held[i] + mb <= usable[i]:
                    lease_on([i], mb, f"F{i}.{h}")
    views = []
    for i in range(n):
        nvml = None if draw(st.booleans()) else held[i] + draw(st.sampled_from([0, 0, 250, 500]))
        views.append(GpuView(f"GPU-{i}", i, usable[i] + 100, usable[i], GpuLedger(usable[i], 0, 1), leases[i], nvml))
    inventory = HostInventory("h", "", 1, (0,), 1, "/", 1, tuple(
        GpuInfo(i, f"GPU-{i}", "sim", usable[i] + 100, numa[i], tuple(sorted(peers[i]))) for i in range(n)))
    agent = draw(st.sampled_from(AGENTS))
    cap_of: dict[str, Callable[[int], int]] = {"u": lambda u: u, "half": lambda u: u // 2, "big": lambda u: 10_000}
    capv = {f"GPU-{i}": cap_of[draw(st.sampled_from(k.caps))](usable[i])
            for i in range(n) if not odds(draw, k.caps_allowed_odds)}
    count = draw(st.sampled_from(k.counts))
    count = n if count < 0 else min(n, count)
    exclusive = odds(draw, k.exclusive_odds)
    vram = 0 if exclusive else draw(st.sampled_from(k.vram))
    topology = draw(st.sampled_from(k.topologies))
    exact: tuple[int | str, ...] | None = None
    if odds(draw, k.exact_odds):
        exact = tuple(draw(st.lists(st.integers(0, n - 1), min_size=count, max_size=count,
                                    unique=draw(st.integers(0, 3)) > 0)))
    unavailable = frozenset(draw(st.sets(st.integers(0, n - 1), max_size=2)) if odds(draw, k.unavailable_odds)
                            else ())
    all_ids = sorted({x.id for ls in leases for x in ls})
    evicting = (frozenset(draw(st.sets(st.sampled_from(all_ids), max_size=2))) if all_ids and k.evicting
                else frozenset())
    request = GangRequest(count, vram, capv, exclusive=exclusive, topology=topology, gpus=exact)
    return Case(views, inventory, agent, request, draw(st.integers(*k.priority)), unavailable, evicting)


any_case = st.one_of(cases("mixed"), cases("roomy"), cases("placing"), cases("placing"), cases("blocks"),
                     cases("crowded"))


@PROPS
@given(case=any_case)
def test_prop_the_choice_respects_topology_exclusive_and_capacity_on_every_gpu(case: Case) -> None:
    got = place(case.slots(), case.request, case.unavailable)
    if not isinstance(got, Chosen):
        return
    r = case.request
    assert len(got.gpus) == r.gpu_count == len(set(got.gpus)) and list(got.gpus) == sorted(got.gpus)
    assert case.topology_ok(got.gpus), "topology"
    allowed = case.allowed()
    assert allowed is not None and set(got.gpus) <= {v.index for v in allowed}
    assert not set(got.gpus) & case.unavailable
    for i in got.gpus:
        v = case.views[i]
        if r.exclusive:
            assert not v.leases and v.free_mb == v.usable_mb, "an exclusive gang never shares a GPU"
        else:
            assert r.vram_mb <= v.free_mb, "G1: the GPU's free VRAM"
            assert v.agent_mb(case.agent) + r.vram_mb <= case.cap(v), "G1: the agent's cap on the GPU"


@PROPS
@given(case=any_case)
def test_prop_the_choice_is_the_best_set_under_the_rule_by_brute_force(case: Case) -> None:
    got = place(case.slots(), case.request, case.unavailable)
    if case.allowed() is None:
        assert isinstance(got, Refused) and got.field == "gpus"
        return
    ever, now = case.ever_sets(), case.now_sets()
    if not ever:
        assert isinstance(got, Refused), got
        capacity_ok = sum(case.could_ever(v) for v in case.allowed() or []) >= case.request.gpu_count
        assert (got.field == "topology") == capacity_ok, got    # topology is named exactly when it is the cause
    elif now:
        assert got == Chosen(min(now, key=case.key)), [(s, case.key(s)) for s in now]
    else:
        assert isinstance(got, Wait), got


@PROPS
@given(case=st.one_of(cases("crowded"), cases("crowded"), cases("mixed"), cases("full"), cases("full")))
def test_prop_victims_are_minimal_in_g3_order_and_the_best_over_all_sets(case: Case) -> None:
    holders = case.holders()
    slots = slots_from_views(case.views, case.agent, case.inventory, case.evicting)
    got = choose_gang_victims(slots, case.request, case.priority, case.agent, list(holders.values()),
                              case.unavailable)
    after = Case(case.after_views(), case.inventory, case.agent, case.request, case.priority, case.unavailable,
                 frozenset())
    if case.allowed() is None or not case.ever_sets():
        assert got is None
        return
    if after.now_sets():
        assert got is not None and got.victims == () and got.gpus in after.now_sets()
        return
    best = None
    for s in case.ever_sets():
        if set(s) & case.unavailable:
            continue
        vs = case.set_victims(s)
        if vs is not None:
            cost = (len(vs), max(v.priority for v in vs), s)
            if best is None or cost < best[0]:
                best = (cost, s, vs)
    if best is None:
        assert got is None
        return
    assert got is not None, best
    victims = list(got.victims)
    # Each victim is a preemptible lease of lower priority on the set, and evicting them all (every GPU of
    # a gang victim) makes the request fit on every GPU of the set.
    assert all(v.preemptible and v.priority < case.priority for v in victims)
    assert case.sufficient(got.gpus, victims)
    # Minimal: no victim can be spared.
    for v in victims:
        assert not case.sufficient(got.gpus, [x for x in victims if x is not v]), f"{v.id} could be spared"
    # G3's order: no set of candidates all ranked before the last victim would do, and they come in that order.
    cands = case.candidates(got.gpus)
    rank = {c.id: n for n, c in enumerate(cands)}
    last = max(rank[v.id] for v in victims)
    earlier = cands[:last]
    assert not any(case.sufficient(got.gpus, [c for n, c in enumerate(earlier) if m >> n & 1])
                   for m in range(1 << len(earlier))), "a set of lower-ranked victims would have done"
    assert [rank[v.id] for v in victims] == sorted(rank[v.id] for v in victims)
    # And the set: fewest victims, then the lowest highest priority, then the lowest indexes.
    assert (got.gpus, [v.id for v in victims]) == (best[1], [v.id for v in best[2]])


@PROPS
@given(case=st.one_of(cases("single"), cases("single-roomy")))
def test_prop_one_gpu_chooses_as_admission_best_fit(case: Case) -> None:
    got = place(case.slots(), case.request, case.unavailable)
    free_of_queue = [v for v in case.views if v.index not in case.unavailable]
    old = best_fit(case.request.vram_mb, case.agent, free_of_queue, case.request.caps)
    assert (old.gpu is None) == (not isinstance(got, Chosen)), (old, got)
    if old.gpu is None:
        return
    assert isinstance(got, Chosen)
    (index,) = got.gpus
    assert case.views[index].free_mb == old.gpu.free_mb, "the same least free VRAM left after placing"
    same_size = len({v.usable_mb for v in case.views}) == 1
    unknown = all(g.numa_node is None and not g.nvlink_peers for g in case.inventory.gpus)
    if same_size and unknown:
        assert index == old.gpu.index, "ties too, on hosts of one GPU size without topology"


@PROPS
@given(case=cases("single"))
def test_prop_one_gpu_victims_are_admission_plan_evictions(case: Case) -> None:
    free_of_queue = [v for v in case.views if v.index not in case.unavailable]
    old = plan_eviction(free_of_queue, dict(case.request.caps), case.request.vram_mb, case.priority, case.agent,
                        set(case.evicting))
    slots = slots_from_views(case.views, case.agent, case.inventory, case.evicting)
    got = choose_gang_victims(slots, case.request, case.priority, case.agent,
                              holders_from_views(case.views, case.evicting), case.unavailable)
    assert [v.id for v in old] == ([v.id for v in got.victims] if got is not None else [])
