"""Tests of coordinator.policy.admission's G3 victim choice (choose_victims): examples, then Hypothesis
properties of best fit, never_fits and the victims."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.policy.admission import (
    GpuView,
    best_fit,
    choose_victims,
    never_fits,
    room_for,
)
from coordinator.records import VramLease
from tests.support.admission_views import mk_gpu, mk_lease, without

# -- choose_victims: examples ------------------------------------------------------------------

def test_victims_empty_when_it_fits_already() -> None:
    g = mk_gpu(0, 1000, [mk_lease(500, agent="b")])
    assert choose_victims(500, 10, "a", g, 1000) == []


def test_victims_lowest_priority_first() -> None:
    lo = mk_lease(500, agent="b", priority=1)
    lower = mk_lease(500, agent="c", priority=0)
    g = mk_gpu(0, 1000, [lo, lower])
    assert choose_victims(500, 5, "a", g, 1000) == [lower]


def test_victims_newest_first_within_a_priority() -> None:
    old = mk_lease(500, agent="b", created_at=1.0)
    new = mk_lease(500, agent="c", created_at=2.0)
    g = mk_gpu(0, 1000, [new, old])
    assert choose_victims(500, 5, "a", g, 1000) == [new]


def test_victims_equal_created_at_newest_token_first() -> None:
    first = mk_lease(500, agent="b", created_at=1.0, token=1)
    second = mk_lease(500, agent="c", created_at=1.0, token=2)
    g = mk_gpu(0, 1000, [first, second])
    assert choose_victims(500, 5, "a", g, 1000) == [second]


def test_victims_only_preemptible_and_strictly_lower_priority() -> None:
    pinned = mk_lease(400, agent="b", priority=0, preemptible=False)
    same = mk_lease(400, agent="c", priority=5)
    higher = mk_lease(200, agent="d", priority=9)
    g = mk_gpu(0, 1000, [pinned, same, higher])
    assert choose_victims(300, 5, "a", g, 1000) is None
    ok = mk_lease(100, agent="e", priority=4)
    g = mk_gpu(0, 1100, [pinned, same, higher, ok])
    assert choose_victims(200, 5, "a", g, 1000) is None             # ok frees only 100
    assert choose_victims(100, 5, "a", g, 1000) == [ok]


def test_victims_several_needed() -> None:
    a = mk_lease(300, agent="b", priority=0, created_at=1.0)
    b = mk_lease(300, agent="c", priority=0, created_at=2.0)
    c = mk_lease(300, agent="d", priority=1, created_at=3.0)
    g = mk_gpu(0, 1000, [a, b, c])                    # free 100
    assert choose_victims(650, 5, "a", g, 10_000) == [b, a]


def test_victims_none_when_all_candidates_are_not_enough() -> None:
    g = mk_gpu(0, 1000, [mk_lease(300, agent="b"), mk_lease(600, agent="c", preemptible=False)])
    assert choose_victims(500, 5, "a", g, 10_000) is None


def test_victims_cap_bound_needs_own_leases() -> None:
    # The GPU has room, but agent a is at its cap: only a's own leases free cap room.
    own = mk_lease(300, agent="a", priority=0)
    other = mk_lease(300, agent="b", priority=0, created_at=9.0)   # newer, but useless for the cap
    g = mk_gpu(0, 2000, [own, other])
    assert choose_victims(200, 5, "a", g, 400) == [own]
    pinned_own = mk_lease(300, agent="a", preemptible=False)
    g = mk_gpu(0, 2000, [pinned_own, other])
    assert choose_victims(200, 5, "a", g, 400) is None


def test_victims_need_both_gpu_and_cap() -> None:
    own = mk_lease(200, agent="a", priority=0, created_at=1.0)
    other = mk_lease(700, agent="b", priority=0, created_at=2.0)
    g = mk_gpu(0, 900, [own, other])                  # free 0; a's cap room 300 - 200 = 100
    v = choose_victims(300, 5, "a", g, 300)
    assert v is not None and set(map(id, v)) == {id(own), id(other)}


def test_victims_drop_the_unneeded() -> None:
    # Greedy takes the 100 MiB lease first, then the 500 MiB one covers the need alone.
    small = mk_lease(100, agent="b", priority=0)
    big = mk_lease(500, agent="c", priority=1)
    g = mk_gpu(0, 600, [small, big])
    assert choose_victims(500, 5, "a", g, 10_000) == [big]


def test_victims_with_untracked_vram() -> None:
    # 300 MiB untracked, free 100: the 200 MiB lease is not enough for 500, the 400 MiB one is.
    lease = mk_lease(400, agent="b", priority=0)
    small = mk_lease(200, agent="c", priority=0)
    g = mk_gpu(0, 1000, [lease, small], nvml_used_mb=900)   # untracked 300, free 100
    v = choose_victims(500, 5, "a", g, 10_000)
    assert v == [lease]
    assert room_for(without(g, v), "a", 10_000) >= 500


# -- properties --------------------------------------------------------------------------------

AGENTS = ("a", "b", "c")


@st.composite
def leases_st(draw: st.DrawFn, max_size: int = 6) -> list[VramLease]:
    n = draw(st.integers(0, max_size))
    out = []
    for _ in range(n):
        out.append(mk_lease(
            draw(st.integers(1, 40)), agent=draw(st.sampled_from(AGENTS)), priority=draw(st.integers(-2, 3)),
            preemptible=draw(st.booleans() | st.just(True)), created_at=float(draw(st.integers(0, 5))),
            token=draw(st.integers(1, 50))))
    return out


@st.composite
def gpu_st(draw: st.DrawFn, index: int = 0, max_leases: int = 6) -> GpuView:
    leases = draw(leases_st(max_leases))
    leased = sum(x.vram_mb for x in leases)
    # Mostly not over-committed by leases, sometimes so; NVML unknown, or around the leased total.
    usable = draw(st.integers(max(0, leased - 20), leased + 120) | st.integers(0, 200))
    nvml = draw(st.none() | st.integers(max(0, leased - 30), leased + 60))
    return mk_gpu(index, usable, leases, total_mb=usable + draw(st.integers(0, 20)), nvml_used_mb=nvml)


@st.composite
def host_st(draw: st.DrawFn) -> tuple[list[GpuView], dict[str, int]]:
    n = draw(st.integers(1, 5))
    indexes = draw(st.permutations(range(n)))
    gpus = [draw(gpu_st(index=i, max_leases=3)) for i in indexes]
    caps = {g.uuid: draw(st.integers(0, 250) | st.just(10_000)) for g in gpus if draw(st.integers(0, 3)) > 0}
    return gpus, caps


PROPS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(host=host_st(), vram=st.integers(1, 100), agent=st.sampled_from(AGENTS))
def test_prop_best_fit(host: tuple[list[GpuView], dict[str, int]], vram: int, agent: str) -> None:
    gpus, caps = host
    fitting = [g for g in gpus if g.uuid in caps and room_for(g, agent, caps[g.uuid]) >= vram]
    p = best_fit(vram, agent, gpus, caps)
    if not fitting:
        assert p.gpu is None and p.reason
        return
    chosen = p.gpu
    assert chosen is not None
    assert chosen.uuid in caps
    assert room_for(chosen, agent, caps[chosen.uuid]) >= vram
    for g in fitting:
        assert g.free_mb - vram >= chosen.free_mb - vram
        if g.free_mb == chosen.free_mb:
            assert chosen.index <= g.index


@PROPS
@given(host=host_st(), vram=st.integers(1, 300), agent=st.sampled_from(AGENTS))
def test_prop_never_fits_agrees_with_best_fit_on_empty_gpus(
        host: tuple[list[GpuView], dict[str, int]], vram: int, agent: str) -> None:
    gpus, caps = host
    empty = [mk_gpu(g.index, g.usable_mb, uuid=g.uuid) for g in gpus]
    reason = never_fits(vram, gpus, caps)
    placed = best_fit(vram, agent, empty, caps).gpu
    assert (reason is None) == (placed is not None)
    if reason is not None and caps.keys() & {g.uuid for g in gpus}:
        assert reason.startswith("vram_mb:")


@PROPS
@given(gpu=gpu_st(max_leases=8), vram=st.integers(1, 100), priority=st.integers(-1, 5),
       agent=st.sampled_from(AGENTS), cap=st.integers(0, 250) | st.just(10_000))
def test_prop_choose_victims(gpu: GpuView, vram: int, priority: int, agent: str, cap: int) -> None:
    eligible = [x for x in gpu.leases if x.preemptible and x.priority < priority]
    victims = choose_victims(vram, priority, agent, gpu, cap)
    if victims is None:
        assert room_for(without(gpu, eligible), agent, cap) < vram
        return
    if room_for(gpu, agent, cap) >= vram:
        assert victims == []
        return
    assert victims
    assert len({id(x) for x in victims}) == len(victims)
    assert all(any(x is y for y in eligible) for x in victims)
    assert room_for(without(gpu, victims), agent, cap) >= vram
    for x in victims:
        rest = [v for v in victims if v is not x]
        assert room_for(without(gpu, rest), agent, cap) < vram


@PROPS
@given(gpu=gpu_st(), vram=st.integers(1, 150), priority=st.integers(-2, 4), agent=st.sampled_from(AGENTS),
       cap=st.integers(0, 250))
def test_prop_choose_victims_does_not_mutate(gpu: GpuView, vram: int, priority: int, agent: str, cap: int) -> None:
    before = (list(gpu.leases), gpu.free_mb, gpu.seq)
    choose_victims(vram, priority, agent, gpu, cap)
    assert (list(gpu.leases), gpu.free_mb, gpu.seq) == before
