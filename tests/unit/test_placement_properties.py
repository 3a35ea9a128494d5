"""Gang placement and victim choice, Hypothesis properties (500 examples each, no I/O) checked against the
brute-force oracle of ``tests.support.placement_cases.Case``: topology, exclusive and per-GPU capacity
respected; the chosen set optimal; victims minimal, in G3's order and optimal over the sets; and a one-GPU
request choosing as admission.best_fit / admission.plan_eviction do."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.policy.admission import best_fit, plan_eviction
from coordinator.policy.gang import holders_from_views, slots_from_views
from coordinator.policy.placement import (
    Chosen,
    Refused,
    Wait,
    place,
)
from coordinator.policy.victims import choose_gang_victims
from tests.support.placement_cases import Case, any_case, cases

PROPS = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


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
def test_prop_victims_are_minimal_in_g3_order_over_all_candidates(case: Case) -> None:
    holders = case.holders()
    slots = slots_from_views(case.views, case.agent, case.inventory, case.evicting)
    got = choose_gang_victims(slots, case.request, case.priority, case.agent, list(holders.values()),
                              case.unavailable)
    after = Case(case.after_views(), case.inventory, case.agent, case.request, case.priority, case.unavailable,
                 frozenset(), case.idle)
    if case.allowed() is None or not case.ever_sets():
        assert got is None
        return
    if after.now_sets():
        assert got is not None and got.victims == () and got.gpus in after.now_sets()
        return
    best = case.g3_victims()
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
    # And G3 over all candidates (every GPU): taken in G3's order until it fits on some set, spared in that
    # order; the set of lowest indexes they free.
    assert (got.gpus, [v.id for v in victims]) == (best[0], [v.id for v in best[1]])


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
                        set(case.evicting), case.idle)
    slots = slots_from_views(case.views, case.agent, case.inventory, case.evicting)
    got = choose_gang_victims(slots, case.request, case.priority, case.agent,
                              holders_from_views(case.views, case.evicting, case.idle), case.unavailable)
    assert [v.id for v in old] == ([v.id for v in got.victims] if got is not None else [])
