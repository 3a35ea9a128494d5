"""Tests of coordinator.policy.admission: best fit, never_fits, room_for, untracked VRAM and G3 victim choice."""
from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.etcd.store import KV
from coordinator.policy.admission import (
    GpuView,
    Placement,
    best_fit,
    choose_victims,
    never_fits,
    room_for,
)
from coordinator.records import GpuLedger, VramLease

_ids = itertools.count(1)


def mk_lease(vram_mb: int, *, agent: str = "a", priority: int = 0, preemptible: bool = True,
             created_at: float = 0.0, token: int | None = None, gpu_uuid: str = "GPU-0",
             gpu_index: int = 0, lease_id: str | None = None) -> VramLease:
    n = next(_ids)
    return VramLease(
        id=lease_id or f"l{n}", host="h", gpu_uuid=gpu_uuid, gpu_index=gpu_index, agent=agent,
        session_id="1f", vram_mb=vram_mb, priority=priority, preemptible=preemptible,
        request_id=f"r{n}", token=n if token is None else token, created_at=created_at)


def mk_gpu(index: int, usable_mb: int, leases: Sequence[VramLease] = (), *, total_mb: int | None = None,
           nvml_used_mb: int | None = None, uuid: str | None = None, seq: int = 0) -> GpuView:
    return GpuView(
        uuid=uuid or f"GPU-{index}", index=index, total_mb=usable_mb if total_mb is None else total_mb,
        usable_mb=usable_mb, ledger=GpuLedger(capacity_mb=usable_mb, seq=seq, mod_revision=1),
        leases=list(leases), nvml_used_mb=nvml_used_mb)


def without(gpu: GpuView, removed: Sequence[VramLease]) -> GpuView:
    """The GPU once ``removed`` are gone, their holders having freed their memory.

    NVML's used memory drops by what the removed leases held, so the untracked part (memory used by
    processes without a lease) stays what it was: evicting a lease frees its VRAM, nothing more.
    """
    gone = {id(x) for x in removed}
    freed = sum(x.vram_mb for x in removed)
    nvml = None if gpu.nvml_used_mb is None else max(0, gpu.nvml_used_mb - freed)
    return GpuView(uuid=gpu.uuid, index=gpu.index, total_mb=gpu.total_mb, usable_mb=gpu.usable_mb,
                   ledger=gpu.ledger, leases=[x for x in gpu.leases if id(x) not in gone], nvml_used_mb=nvml)


# -- data classes ---------------------------------------------------------------------------------

def test_vram_lease_json_round_trip_through_kv() -> None:
    lease = mk_lease(4096, agent="agent-a", priority=7, preemptible=False, created_at=12.5, token=3)
    d = lease.to_json()
    assert "etcd_lease" not in d and "mod_revision" not in d
    kv = KV(b"/t/leases/h/GPU-0/x", json.dumps(d).encode(), 5, 9, 1, 0xABC)
    back = VramLease.from_kv(kv)
    assert back == dataclasses.replace(lease, etcd_lease=0xABC, mod_revision=9)


def test_ledger_from_kv() -> None:
    assert GpuLedger.from_kv(None) == GpuLedger(0, 0, 0)
    kv = KV(b"/t/gpus/h/GPU-0", b'{"capacity_mb": 16384, "seq": 7}', 2, 11, 3, 0)
    assert GpuLedger.from_kv(kv) == GpuLedger(16384, 7, 11)


def test_gpu_view_takes_seq_from_ledger() -> None:
    assert mk_gpu(0, 100, seq=42).seq == 42


# -- free VRAM, untracked VRAM, room_for ------------------------------------------------------

def test_free_without_nvml_is_usable_minus_leased() -> None:
    g = mk_gpu(0, 1000, [mk_lease(100), mk_lease(250, agent="b")])
    assert g.leased_mb == 350
    assert g.untracked_mb == 0
    assert g.free_mb == 650


@pytest.mark.parametrize(("nvml_used", "untracked"), [
    (None, 0),      # unknown or stale: counts as 0
    (0, 0),
    (200, 0),       # holders use less than they leased: floored at 0
    (300, 0),       # exactly the leases
    (500, 200),     # 200 MiB used by processes without a lease
])
def test_untracked_is_nvml_used_minus_leased_floored(nvml_used: int | None, untracked: int) -> None:
    g = mk_gpu(0, 1000, [mk_lease(300)], nvml_used_mb=nvml_used)
    assert g.untracked_mb == untracked
    assert g.free_mb == 1000 - 300 - untracked


def test_lease_usage_is_not_counted_twice() -> None:
    # NVML sees the holder's 300 MiB; it must not be subtracted once as leased and again as untracked.
    g = mk_gpu(0, 1000, [mk_lease(300)], nvml_used_mb=300)
    assert g.free_mb == 700


def test_agent_mb_counts_only_that_agent() -> None:
    g = mk_gpu(0, 1000, [mk_lease(100, agent="a"), mk_lease(200, agent="a"), mk_lease(50, agent="b")])
    assert g.agent_mb("a") == 300
    assert g.agent_mb("b") == 50
    assert g.agent_mb("c") == 0


def test_room_for_is_min_of_free_and_cap_left() -> None:
    g = mk_gpu(0, 1000, [mk_lease(300, agent="a"), mk_lease(200, agent="b")])
    assert room_for(g, "a", 10_000) == 500           # GPU-bound
    assert room_for(g, "a", 400) == 100              # cap-bound: 400 - own 300
    assert room_for(g, "b", 400) == 200              # other agents' leases do not eat b's cap
    assert room_for(g, "c", 400) == 400
    assert room_for(g, "a", 200) == -100             # already above a lowered cap


def test_room_for_counts_untracked() -> None:
    g = mk_gpu(0, 1000, [mk_lease(300, agent="a")], nvml_used_mb=900)
    assert room_for(g, "b", 10_000) == 100


# -- never_fits --------------------------------------------------------------------------------

def test_never_fits_none_when_some_gpu_could_take_it() -> None:
    gpus = [mk_gpu(0, 1000, [mk_lease(1000)]), mk_gpu(1, 2000)]
    # Full right now does not matter: never_fits looks at empty GPUs.
    assert never_fits(1000, gpus, {"GPU-0": 1000}) is None
    assert never_fits(2000, gpus, {"GPU-0": 1000, "GPU-1": 2000}) is None


def test_never_fits_no_allowed_gpu() -> None:
    assert never_fits(1, [mk_gpu(0, 1000)], {}) == "no GPU is allowed"
    assert never_fits(1, [mk_gpu(0, 1000)], {"GPU-9": 1000}) == "no GPU is allowed"
    assert never_fits(1, [], {"GPU-0": 1000}) == "no GPU is allowed"


def test_never_fits_more_than_usable() -> None:
    gpus = [mk_gpu(0, 1000), mk_gpu(1, 1500), mk_gpu(2, 99_999)]
    msg = never_fits(1501, gpus, {"GPU-0": 1000, "GPU-1": 1500})  # GPU-2 is not allowed
    assert msg is not None
    assert msg.startswith("vram_mb:")
    assert "usable" in msg and "cap" not in msg
    assert "1501" in msg and "1500" in msg


def test_never_fits_more_than_cap() -> None:
    gpus = [mk_gpu(0, 1000), mk_gpu(1, 1500)]
    msg = never_fits(800, gpus, {"GPU-0": 500, "GPU-1": 700})
    assert msg is not None
    assert msg.startswith("vram_mb:")
    assert "cap" in msg and "usable" not in msg
    assert "800" in msg and "700" in msg


def test_never_fits_cap_above_usable_is_clamped() -> None:
    # A cap larger than the GPU does not help: the usable size bounds it, and the message says usable.
    msg = never_fits(1200, [mk_gpu(0, 1000)], {"GPU-0": 5000})
    assert msg is not None and "usable" in msg
    assert never_fits(1000, [mk_gpu(0, 1000)], {"GPU-0": 5000}) is None


def test_never_fits_ignores_current_load_and_untracked() -> None:
    g = mk_gpu(0, 1000, [mk_lease(900, agent="a")], nvml_used_mb=1000)
    assert never_fits(1000, [g], {"GPU-0": 1000}) is None


# -- best_fit -----------------------------------------------------------------------------------

def test_best_fit_picks_least_free_left() -> None:
    gpus = [mk_gpu(0, 1000), mk_gpu(1, 600), mk_gpu(2, 800)]
    p = best_fit(500, "a", gpus, {g.uuid: 10_000 for g in gpus})
    assert p.gpu is gpus[1] and p.reason == ""


def test_best_fit_counts_leases_and_untracked() -> None:
    gpus = [mk_gpu(0, 1000, [mk_lease(300, agent="b")]),   # free 700
            mk_gpu(1, 1000, nvml_used_mb=450),             # free 550
            mk_gpu(2, 1000, [mk_lease(600, agent="b")])]   # free 400: too little
    p = best_fit(500, "a", gpus, {g.uuid: 1000 for g in gpus})
    assert p.gpu is gpus[1]


def test_best_fit_exact_fit() -> None:
    gpus = [mk_gpu(0, 1000), mk_gpu(1, 500)]
    assert best_fit(500, "a", gpus, {"GPU-0": 1000, "GPU-1": 500}).gpu is gpus[1]


def test_best_fit_ties_go_to_lowest_index() -> None:
    gpus = [mk_gpu(3, 1000), mk_gpu(1, 1000), mk_gpu(2, 1000)]
    p = best_fit(100, "a", gpus, {g.uuid: 1000 for g in gpus})
    assert p.gpu is gpus[1]


def test_best_fit_only_gpus_in_caps() -> None:
    gpus = [mk_gpu(0, 600), mk_gpu(1, 1000)]
    assert best_fit(500, "a", gpus, {"GPU-1": 1000}).gpu is gpus[1]
    p = best_fit(500, "a", gpus, {})
    assert p.gpu is None and "vram_mb" in p.reason


def test_best_fit_respects_agent_cap() -> None:
    # GPU-0 would be the best fit by free VRAM, but agent a already holds 300 of its 600 cap there.
    gpus = [mk_gpu(0, 1000, [mk_lease(300, agent="a")]), mk_gpu(1, 2000)]
    caps = {"GPU-0": 600, "GPU-1": 2000}
    assert best_fit(400, "a", gpus, caps).gpu is gpus[1]
    assert best_fit(300, "a", gpus, caps).gpu is gpus[0]
    # Another agent with the same caps has its own room on GPU-0.
    assert best_fit(400, "b", gpus, caps).gpu is gpus[0]


def test_best_fit_nothing_fits_now() -> None:
    gpus = [mk_gpu(0, 1000, [mk_lease(800, agent="b")])]
    p = best_fit(300, "a", gpus, {"GPU-0": 1000})
    assert p == Placement(None, p.reason)
    assert p.reason.startswith("vram_mb:") and "300" in p.reason


def test_best_fit_accepts_an_iterator() -> None:
    gpus = [mk_gpu(0, 1000), mk_gpu(1, 600)]
    assert best_fit(500, "a", iter(gpus), {"GPU-0": 1000, "GPU-1": 1000}).gpu is gpus[1]


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
