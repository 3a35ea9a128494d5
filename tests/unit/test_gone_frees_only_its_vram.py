"""G3 with the node's report: a victim counted as gone frees its VRAM, and its processes' memory that NVML
reports does not turn into untracked VRAM (which would make every eviction look useless while the node
reports the victim's processes: its notice was withdrawn and written again, restarting the victim's grace).

Every hypothetical "once these leases are gone" goes through ``GpuView.without``: the re-check of a queued
request's notices (``notices.fits_with_gone``), the gang slots (``gang.slots_from_views``), the eviction plan
(``admission.plan_eviction``) and reclaim."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from coordinator.policy.admission import plan_eviction, room_for
from coordinator.policy.gang import slots_from_views
from coordinator.policy.notices import fits_with_gone
from tests.support.admission_views import mk_gpu, mk_lease


def test_a_victim_whose_processes_nvml_reports_frees_the_gpu_for_the_request() -> None:
    victim = mk_lease(16384, agent="low")
    g = mk_gpu(0, 16384, [victim], nvml_used_mb=15000)      # its process uses 15000 MiB, as NVML says
    view = type("V", (), {"gpus": {g.uuid: g}, "inventory": None})()
    assert fits_with_gone(view, "high", 16384, [g], {g.uuid: 16384}, None, (), {victim.id})  # type: ignore[arg-type]
    assert room_for(g.without({victim.id}), "high", 16384) == 16384


def test_memory_used_beside_the_leases_stays_untracked_once_a_victim_is_gone() -> None:
    victim = mk_lease(8000, agent="low")
    g = mk_gpu(0, 16384, [victim], nvml_used_mb=8000 + 3000)   # 3000 MiB used by a process without a lease
    after = g.without({victim.id})
    assert after.untracked_mb == g.untracked_mb == 3000
    assert after.free_mb == 16384 - 3000


def test_the_gang_slots_count_a_gone_victims_gpu_as_free() -> None:
    victim = mk_lease(16384, agent="low")
    g = mk_gpu(0, 16384, [victim], nvml_used_mb=16000)
    (slot,) = slots_from_views([g], "high", None, {victim.id})
    assert slot.free_mb == 16384 and not slot.leased


def test_the_eviction_plan_chooses_the_victim_whose_processes_nvml_reports() -> None:
    victim = mk_lease(16384, agent="low", priority=0)
    g = mk_gpu(0, 16384, [victim], nvml_used_mb=15000)
    assert plan_eviction([g], {g.uuid: 16384}, 16384, 9, "high", set()) == [victim]


@given(st.lists(st.integers(1, 8000), min_size=1, max_size=5), st.integers(0, 40_000), st.data())
def test_without_keeps_untracked_and_frees_exactly_the_gone_leases(sizes: list[int], nvml: int,
                                                                     data: st.DataObject) -> None:
    leases = [mk_lease(mb, agent=f"a{n}") for n, mb in enumerate(sizes)]
    g = mk_gpu(0, 48_000, leases, nvml_used_mb=nvml)
    gone = {x.id for x in data.draw(st.lists(st.sampled_from(leases), unique_by=lambda x: x.id))}
    after = g.without(gone)
    assert after.untracked_mb == g.untracked_mb
    assert after.free_mb == g.free_mb + sum(x.vram_mb for x in leases if x.id in gone)
    assert {x.id for x in after.leases} == {x.id for x in leases} - gone
    assert g.without(set()).free_mb == g.free_mb
