"""G3 and placement under a team's limit (issue 28, point 4): an exclusive gang takes GPUs whose charge fits
its team's limit rather than the lowest indexes that do not, and a request of a team at its limit evicts, by
priority (G3 within the team), its own team's lower-priority preemptible leases to free room under the limit,
as it frees room on a GPU. Another team's lease is never taken for it, and without a higher priority nothing is
evicted (the request waits for its team, as before)."""
from __future__ import annotations

from coordinator.config import CoordinatorConfig
from coordinator.keys import lease_id_for
from coordinator.policy.host import HostView
from coordinator.policy.plan import Context, Plan
from coordinator.policy.planner import plan_round
from coordinator.policy.team_admission import TeamState
from coordinator.policy.teams import Membership, Team
from coordinator.records import VramLease
from tests.support.gang_scenarios import wants
from tests.support.planner_calls import HOST, KEYS, NOW, WALL, Call, session
from tests.support.planner_calls import host_view as _host


def _lease(lid: str, agent: str, gpu: int, vram_mb: int, priority: int, created_at: float,
           preemptible: bool = True) -> VramLease:
    s = session(agent)
    return VramLease(id=lid, host=HOST, gpu_uuid=f"GPU-sim-{HOST}-{gpu}", gpu_index=gpu, agent=agent,
                     session_id=s.session_id, vram_mb=vram_mb, priority=priority, preemptible=preemptible,
                     request_id=lid, token=int(created_at), created_at=created_at, etcd_lease=s.etcd_lease,
                     mod_revision=100 + int(created_at))


def _round(view: HostView, call: Call, limit_mb: int) -> Plan[Call]:
    """One round with team t (agents a and b) limited to ``limit_mb``; agent c is in no team (no limit)."""
    used = sum(x.vram_mb for g in view.gpus.values() for x in g.leases if x.agent in ("a", "b"))
    state = TeamState(Membership([Team("t", limit_mb=limit_mb, members=("a", "b"))]), {"t": used},
                      frozenset(view.leases), {"t": (77, 5)}, 600)
    ctx = Context(KEYS, CoordinatorConfig().validate(), "r1", frozenset(), NOW, WALL, teams=state)
    return plan_round(view, [call], {}, {call.session.session_id}, ctx)


def _call(agent: str, vram_mb: int, priority: int, wait_s: float = 30.0, count: int = 1,
          exclusive: bool = False) -> Call:
    return Call(session(agent), vram_mb, None, priority, True, "r", lease_id_for(agent, "r", HOST), wait_s, 2000,
                NOW + wait_s, **wants(count, exclusive, "any", ()))


def test_an_exclusive_gang_takes_the_gpus_that_fit_its_teams_limit() -> None:
    """Two 32 GiB and two 16 GiB GPUs, all idle; team t may take 32 GiB: two whole GPUs exclusive are granted
    on the two 16 GiB GPUs (32 GiB), not on the two 32 GiB GPUs of the lowest indexes (64 GiB, refused)."""
    view = _host("2x32GiB,2x16GiB", [])
    plan = _round(view, _call("a", 0, 0, wait_s=0.0, count=2, exclusive=True), 32768)
    assert plan.refusals == []
    assert sorted(x.gpu_index for x in plan.new_leases) == [2, 3]
    assert [x.vram_mb for x in plan.new_leases] == [16384, 16384]
    # Under 32767 MiB no two whole GPUs fit the limit: refused naming the team.
    plan = _round(view, _call("a", 0, 0, wait_s=0.0, count=2, exclusive=True), 32767)
    assert [err.field for _, err in plan.refusals] == ["team"] and plan.new_leases == []


def test_a_higher_priority_request_of_a_team_at_its_limit_evicts_its_teams_newest_lower_priority_lease() -> None:
    """Team t (agents a and b, limit 20 GiB) holds 20 GiB, all of priority 0: on GPU 0 t-old (8 GiB, oldest) and
    t-new (4 GiB, newest of t), on GPU 1 t-mid (8 GiB); agent c (no team) holds the newest lease, on GPU 0. A
    priority-10 request of t for 4 GiB fits on GPU 1 but not under t's limit: it evicts t's newest lease, t-new
    (freeing 4 GiB under the limit), never c's (another team's), and waits for it (holding no other victim)."""
    view = _host("2x16GiB", [_lease("t-old", "a", 0, 8192, 0, 1.0), _lease("t-new", "b", 0, 4096, 0, 3.0),
                             _lease("c-newest", "c", 0, 4096, 0, 4.0), _lease("t-mid", "b", 1, 8192, 0, 2.0)])
    plan = _round(view, _call("a", 4096, 10), 20480)
    assert [r.lease_id for r in plan.evictions] == ["t-new"], plan.evictions
    assert plan.team_waits == {} and [w.call.request_id for w in plan.waits] == ["r"] and plan.new_leases == []
    # 8 GiB: t-new frees too little under the limit, t-mid (next in G3's order) enough alone: t-new is spared.
    plan = _round(view, _call("a", 8192, 10), 20480)
    assert [r.lease_id for r in plan.evictions] == ["t-mid"], plan.evictions


def test_without_a_higher_priority_a_request_at_its_teams_limit_waits_for_its_team() -> None:
    view = _host("2x16GiB", [_lease("t-old", "a", 0, 8192, 0, 1.0), _lease("t-new", "b", 0, 8192, 0, 2.0)])
    plan = _round(view, _call("a", 4096, 0), 16384)
    assert plan.evictions == [] and list(plan.team_waits) == [lease_id_for("a", "r", HOST)]
    # Asked for no wait: refused at once naming the team, victims or not.
    plan = _round(view, _call("a", 4096, 10, wait_s=0.0), 16384)
    assert plan.evictions == [] and [err.field for _, err in plan.refusals] == ["team"]
