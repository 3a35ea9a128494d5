"""Tests of coordinator.policy.admission: best fit, never_fits, room_for and untracked VRAM."""
from __future__ import annotations

import dataclasses
import json

import pytest

from coordinator.etcd.store import KV
from coordinator.policy.admission import Placement, best_fit, never_fits, room_for
from coordinator.records import GpuLedger, VramLease
from tests.support.admission_views import mk_gpu, mk_lease

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
