"""tests/history.check_history on synthetic etcd histories with teams (G11, issue 22): no grant takes a team above
its limit; quota marks agree with the team's usage; reclaim notices take only other teams' over-quota leases
whatever the priorities; with teams stored, eviction by priority stays within the requester's team."""
from __future__ import annotations

from typing import Any

from tests.history import SENTINEL
from tests.support.history_builder import (
    G0,
    G1,
    HOST,
    SESSION,
    History,
    K,
    assert_one_violation,
    check,
)


def _format3(over_quota: bool, **more: Any) -> dict[str, Any]:
    return {"format": 3, "gang": [], "exclusive": False, "topology": "any", "min_runtime_s": 0.0,
            "over_quota": over_quota} | more


def _fleet(quota_mb: int = 0, limit_mb: int | None = None) -> History:
    """Two GPUs; team a (agents a-*) with that quota and limit, team b (agents b-*) with quota 8000."""
    h = History()
    h.ledger(G0)
    h.ledger(G1)
    h.team("a", ["a-*"], quota_mb=quota_mb, limit_mb=limit_mb)
    h.team("b", ["b-*"], quota_mb=8000)
    return h


def _evict(h: History, lease_id: str, requested_by: str, requester_priority: int | None, reclaim: str = "",
           gpu: str = G0) -> None:
    h.put(K.eviction(lease_id), {"lease_id": lease_id, "host": HOST, "gpu_uuid": gpu, "agent": "x",
                                 "session_id": "1f", "victim_priority": 0, "requested_by": requested_by,
                                 "requester_priority": requester_priority, "reason": "test",
                                 "deadline_unix": 1.0, "created_at": 0.0} | ({"reclaim": reclaim} if reclaim else {}),
          etcd_lease=SESSION)


# -- the limit --------------------------------------------------------------------------------------------------

def test_grants_within_a_teams_limit_pass_and_a_limit_lowered_below_its_use_is_not_a_violation() -> None:
    h = _fleet(limit_mb=8000)
    first = h.lease("a-1", "r1", 4000)
    h.lease("a-2", "r1", 4000, G1)
    h.lease("bob", "r1", 8000)               # team default: no limit, and not a's
    h.release(first)
    h.lease("a-1", "r2", 4000)               # back at the limit
    h.team("a", ["a-*"], limit_mb=2000)      # the operator lowers it below the use: revokes nothing
    rep = check(h)
    assert rep.violations == [] and rep.leases_created == 4


def test_a_grant_that_takes_a_team_above_its_limit_is_detected() -> None:
    h = _fleet(limit_mb=8000)
    h.lease("a-1", "r1", 4000)
    h.lease("a-2", "r1", 4000, G1)
    h.lease("a-3", "r1", 1000)
    assert_one_violation(check(h), "G11 team 'a' holds 9000 MiB", "above its limit of 8000 MiB")


def test_a_gang_is_charged_its_vram_on_every_gpu_against_the_limit() -> None:
    h = _fleet(limit_mb=8000)
    h.lease("a-1", "r1", 2000)
    with h.txn():                            # 2 x 3000 MiB: 8000 in all, at the limit
        for gpu in (G0, G1):
            h.lease("a-2", "g", 3000, gpu, extra={"format": 2, "gang": [G0, G1], "exclusive": False,
                                                  "topology": "any"})
    assert check(h).violations == []
    with h.txn():
        for gpu in (G0, G1):
            h.lease("a-3", "g", 1, gpu, extra={"format": 2, "gang": [G0, G1], "exclusive": False,
                                               "topology": "any"})
    assert_one_violation(check(h), "holds 8002 MiB")


# -- quota marks ----------------------------------------------------------------------------------------------------

def test_quota_marks_that_agree_with_the_teams_usage_pass() -> None:
    h = _fleet(quota_mb=8000)
    h.lease("a-1", "r1", 4000, extra=_format3(False))
    second = h.lease("a-1", "r2", 4000, G1, extra=_format3(False))   # 8000: exactly the quota
    h.lease("a-1", "r3", 4000, extra=_format3(True))
    h.lease("a-1", "r4", 100, G1)            # no mark (format 2 or older): not checked
    h.release(second, G1)
    h.lease("a-1", "r5", 4000, G1, extra=_format3(True))    # its copy may predate the release
    assert check(h).violations == []


def test_a_mark_counting_leases_released_since_the_teams_previous_grant_passes() -> None:
    """The grant counted its team's use from a copy that saw the previous grant, not the releases after it."""
    h = _fleet(quota_mb=8000)
    first = h.lease("a-1", "r1", 4000, extra=_format3(False))
    second = h.lease("a-1", "r2", 4000, G1, extra=_format3(False))
    h.release(first)
    h.release(second, G1)
    h.lease("a-1", "r3", 4000, extra=_format3(True))        # 8000 counted + 4000: over, from its copy
    assert check(h).violations == []


def test_a_lease_marked_in_quota_above_the_quota_is_detected() -> None:
    h = _fleet(quota_mb=8000)
    h.lease("a-1", "r1", 4000, extra=_format3(False))
    h.lease("a-1", "r2", 4000, G1, extra=_format3(False))
    h.lease("a-2", "r1", 1000, extra=_format3(False))
    assert_one_violation(check(h), "marked in quota", "held 8000 MiB + 1000 MiB > its quota of 8000 MiB")


def test_a_lease_marked_over_quota_within_the_quota_is_detected() -> None:
    h = _fleet(quota_mb=8000)
    h.lease("a-1", "r1", 4000, extra=_format3(False))
    h.lease("a-1", "r2", 4000, G1, extra=_format3(True))
    assert_one_violation(check(h), "marked over quota", "held at most 4000 MiB", "<= its quota of 8000 MiB")


def test_marks_written_while_no_team_is_stored_are_not_checked() -> None:
    h = History()
    h.ledger(G0)
    h.lease("a-1", "r1", 4000, extra=_format3(False, min_runtime_s=30.0))   # no teams: marked false, quota 0
    assert check(h).violations == []


# -- reclaim notices --------------------------------------------------------------------------------------------

def _borrowing_team_a() -> tuple[History, list[str]]:
    """Team a (quota 8000) holds four 4000 MiB leases of priority 10, oldest first: two in quota, two over."""
    h = _fleet(quota_mb=8000)
    held = [h.lease("a-1", f"r{i}", 4000, gpu, priority=10, extra={"created_at": 1_700_000_000.0 + i})
            for i, gpu in enumerate((G0, G1, G0, G1))]
    return h, held


def test_a_reclaim_of_another_teams_over_quota_lease_passes_whatever_the_priorities() -> None:
    h, held = _borrowing_team_a()
    _evict(h, held[3], "b-1/r1", requester_priority=0, reclaim="b", gpu=G1)
    _evict(h, held[2], "b-1/r1", requester_priority=0, reclaim="b")
    rep = check(h)
    assert rep.violations == [] and rep.evictions == 2


def test_a_reclaim_of_an_in_quota_lease_is_detected() -> None:
    h, held = _borrowing_team_a()
    _evict(h, held[1], "b-1/r1", requester_priority=0, reclaim="b", gpu=G1)
    assert_one_violation(check(h), f"G11 in-quota lease {held[1]} of team 'a' reclaimed for team 'b'")


def test_a_lease_that_moved_into_quota_when_an_older_one_ended_is_not_reclaimable() -> None:
    h, held = _borrowing_team_a()
    h.release(held[0])                       # held[2] now fills the quota with held[1]
    _evict(h, held[2], "b-1/r1", requester_priority=0, reclaim="b")
    assert_one_violation(check(h), f"in-quota lease {held[2]}")


def test_a_reclaim_of_a_non_preemptible_lease_is_detected() -> None:
    h = _fleet(quota_mb=8000)
    held = [h.lease("a-1", f"r{i}", 4000, gpu, extra={"created_at": 1_700_000_000.0 + i, "preemptible": i != 2})
            for i, gpu in enumerate((G0, G1, G0))]
    _evict(h, held[2], "b-1/r1", requester_priority=0, reclaim="b")
    assert_one_violation(check(h), f"G11 non-preemptible lease {held[2]} reclaimed for team 'b'")


def test_a_team_reclaiming_its_own_lease_is_detected() -> None:
    h, held = _borrowing_team_a()
    _evict(h, held[3], "a-2/r1", requester_priority=0, reclaim="a", gpu=G1)
    assert_one_violation(check(h), "G11 team 'a' reclaims its own lease")


# -- G3 within a team -------------------------------------------------------------------------------------------

def test_eviction_by_priority_within_a_team_and_an_operators_eviction_pass() -> None:
    h, held = _borrowing_team_a()
    _evict(h, held[3], "a-2/r1", requester_priority=20, gpu=G1)
    _evict(h, held[0], "operator", requester_priority=None)
    assert check(h).violations == []


def test_eviction_by_priority_across_teams_is_detected() -> None:
    h, held = _borrowing_team_a()
    _evict(h, held[3], "b-1/r1", requester_priority=20, gpu=G1)
    assert_one_violation(check(h), f"G3 lease {held[3]} of team 'a' evicted by priority for b-1/r1 of team 'b'")


def test_without_teams_eviction_by_priority_crosses_agents_freely() -> None:
    h = History()
    h.ledger(G0)
    victim = h.lease("a-1", "r1", 4000, priority=1)
    _evict(h, victim, "b-1/r1", requester_priority=20)
    assert check(h).violations == []


def test_the_marks_of_earlier_history_reads_under_leases_and_teams_are_not_state() -> None:
    """A test that reads the history of ``leases/`` or ``teams/`` alone leaves its sentinel key there."""
    h = History()
    h.ledger(G0)
    h.put(K.leases() + SENTINEL, {})
    h.put(K.teams() + SENTINEL, {})
    victim = h.lease("a-1", "r1", 4000, priority=1)
    _evict(h, victim, "b-1/r1", requester_priority=20)     # no team is stored: G3 crosses agents freely
    assert check(h).violations == []


def _two_models(quota_mb: int, model_quota_mb: int) -> History:
    """GPU-0 of model S16, GPU-1 of model S32 (the host's registration); team a with a quota of S16."""
    h = History()
    h.ledger(G0)
    h.ledger(G1)
    gpus = [{"index": i, "uuid": u, "name": m, "vram_total_mb": mb, "numa_node": None, "nvlink_peers": []}
            for i, (u, m, mb) in enumerate(((G0, "S16", 16384), (G1, "S32", 32768)))]
    h.put(K.host(HOST), {"address": "127.0.0.1:7071", "inventory": {
        "host": HOST, "address": "", "cpu_count": 8, "core_ids": list(range(8)), "mem_bytes": 1 << 34,
        "disk_path": "/", "disk_bytes": 1 << 40, "gpus": gpus, "version": "", "simulated": True, "labels": {}}})
    h.put(K.team("a"), {"name": "a", "quota_mb": quota_mb, "limit_mb": None, "weight": 1.0, "members": ["a-*"],
                        "quota_by_model": {"S16": model_quota_mb}, "max_min_runtime_s": 0.0})
    return h


def test_a_lease_marked_over_its_models_quota_within_the_fleets_quota_passes() -> None:
    """Team a: 64 GiB over the fleet, 8 GiB of model S16. 4 GiB then 8 GiB on the S16 GPU: the second passes the
    model's quota (12 > 8), so its mark ``true`` is right though the fleet's quota is far."""
    h = _two_models(65536, 8192)
    h.lease("a-1", "r1", 4096, G0, extra=_format3(False))
    h.lease("a-1", "r2", 8192, G0, extra=_format3(True))
    assert check(h).violations == []


def test_a_lease_marked_over_quota_within_both_quotas_is_detected() -> None:
    h = _two_models(65536, 8192)
    h.lease("a-1", "r1", 4096, G0, extra=_format3(False))
    h.lease("a-1", "r2", 8192, G1, extra=_format3(True))      # on S32: no model quota there
    assert_one_violation(check(h), "marked over quota", "<= its quota of 65536 MiB")
