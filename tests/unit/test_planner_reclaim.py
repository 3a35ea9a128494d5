"""G11 in the planner: with teams stored, priority eviction (G3) stays within a team, and a request of a team
that stays within its quota takes back other teams' over-quota leases (reclaim), never in-quota ones, only as
many as it needs, and never for a team that would pass its quota. The round keeps every other guarantee."""
from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.config import CoordinatorConfig
from coordinator.keys import lease_id_for
from coordinator.policy.admission import GpuView, room_for
from coordinator.policy.host import HostView
from coordinator.policy.plan import Context, Plan
from coordinator.policy.planner import plan_round
from coordinator.policy.team_admission import TeamState, fleet_charges, team_use
from coordinator.policy.teams import Membership, Team, in_quota
from coordinator.records import GpuInfo, GpuLedger, HostInventory, VramLease
from tests.support.planner_calls import _KV, HOST, KEYS, NOW, WALL, Call, session
from tests.support.planner_scenarios import check, scenarios

TEAM = {"a": "x", "b": "y", "c": "y"}


def _state(view: HostView, quota_x: int, quota_y: int, weight_y: float) -> TeamState:
    membership = Membership([Team("x", quota_mb=quota_x, members=("a",), max_min_runtime_s=3600.0),
                             Team("y", quota_mb=quota_y, weight=weight_y, members=("b", "c"))])
    used: dict[str, int] = {}
    for x in view.leases.values():
        used[TEAM[x.agent]] = used.get(TEAM[x.agent], 0) + x.vram_mb
    records = tuple(view.leases.values())
    return TeamState(membership, used, frozenset(view.leases), {}, 600, lambda: records)


@st.composite
def crowded(draw: Any) -> dict[str, Any]:
    """A host whose GPUs team x (agent a) mostly fills, and requests of both teams that wait for room."""
    n_gpus = draw(st.integers(1, 3))
    inventory = HostInventory(HOST, "", 8, tuple(range(8)), 1 << 34, "/", 1 << 40,
                              tuple(GpuInfo(i, f"GPU-{i}", "sim", 8192) for i in range(n_gpus)))
    leases: dict[str, VramLease] = {}
    used = dict.fromkeys(range(n_gpus), 0)
    for n in range(draw(st.integers(1, 8))):
        agent = draw(st.sampled_from(["a", "a", "a", "b"]))
        i = draw(st.integers(0, n_gpus - 1))
        vram = draw(st.sampled_from([1024, 2048, 4096]))
        if used[i] + vram > 8192:
            continue
        used[i] += vram
        sess = session(agent)
        leases[f"old{n}"] = VramLease(
            id=f"old{n}", host=HOST, gpu_uuid=f"GPU-{i}", gpu_index=i, agent=agent, session_id=sess.session_id,
            vram_mb=vram, priority=draw(st.integers(0, 5)), preemptible=draw(st.sampled_from([True, True, False])),
            request_id=f"old{n}", token=n + 1, created_at=WALL - draw(st.integers(0, 7200)),
            min_runtime_s=draw(st.sampled_from([0.0, 0.0, 1e9])), etcd_lease=sess.etcd_lease, mod_revision=100 + n)
    gpus = {f"GPU-{i}": GpuView(uuid=f"GPU-{i}", index=i, total_mb=8192, usable_mb=8192,
                                ledger=GpuLedger(8192, 10 + i, 300 + i),
                                leases=[x for x in leases.values() if x.gpu_index == i]) for i in range(n_gpus)}
    view = HostView(HOST, 500, inventory, _KV(KEYS.host(HOST), b"{}", 40, 0x99), None, None, gpus, leases, None,
                    (), ())
    batch = []
    for n in range(draw(st.integers(1, 4))):
        agent = draw(st.sampled_from(["a", "b", "c"]))
        rid = f"new{n}"
        batch.append(Call(session(agent), draw(st.sampled_from([1024, 2048, 4096, 8192])), None,
                          draw(st.integers(-1, 6)), True, rid, lease_id_for(agent, rid, HOST), 5.0, 1000 + n, NOW + 5))
    evicting = frozenset(x for x in leases if draw(st.integers(0, 5)) == 0)
    caps = {a: {g: 8192 for g in gpus} for a in TEAM}
    ctx = Context(KEYS, CoordinatorConfig().validate(), "r1", evicting, NOW, WALL)
    return {"view": view, "batch": batch, "waiting": {}, "ctx": ctx, "caps": caps}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(scenarios(), crowded()), st.sampled_from([0, 2048, 4096, 1 << 20]),
       st.sampled_from([0, 4096, 8192, 1 << 20]), st.sampled_from([1.0, 3.0]))
def test_reclaim_takes_only_other_teams_over_quota_leases_and_only_what_it_needs(
        s: dict[str, Any], quota_x: int, quota_y: int, weight_y: float) -> None:
    view: HostView = s["view"]
    state = _state(view, quota_x, quota_y, weight_y)
    ctx = dataclasses.replace(s["ctx"], teams=state)
    plan = plan_round(view, s["batch"], s["waiting"], {c.session.session_id for c in s["batch"]}, ctx)
    reclaims = [r for r in plan.evictions if r.reclaim]
    check(s, dataclasses.replace(plan, evictions=[r for r in plan.evictions if not r.reclaim]))
    # G3 within a team
    for r in plan.evictions:
        if not r.reclaim:
            assert TEAM[view.leases[r.lease_id].agent] == TEAM[r.requested_by.split("/")[0]], \
                "a lease was evicted by priority for another team"
    if not reclaims:
        return
    charges = fleet_charges(state, view)
    marks = in_quota(charges, state.membership)
    by_requester: dict[str, list[str]] = {}
    for r in reclaims:
        agent = r.requested_by.split("/")[0]
        victim = view.leases[r.lease_id]
        assert r.reclaim == TEAM[agent]
        assert TEAM[victim.agent] != TEAM[agent], "reclaim took a lease of the requester's own team"
        assert not marks[victim.id], "reclaim took an in-quota lease"
        assert victim.preemptible and victim.id not in s["ctx"].evicting
        assert WALL - victim.created_at >= min(victim.min_runtime_s, 3600.0 if TEAM[victim.agent] == "x" else 0.0), \
            "reclaim took a lease within its minimum runtime"
        by_requester.setdefault(r.requested_by, []).append(victim.id)
    for requested_by, victims in by_requester.items():
        agent, rid = requested_by.split("/", 1)
        call = next((c for c in s["batch"] if c.session.agent == agent and c.request_id == rid), None)
        entry = next((e for e in view.entries if e.agent == agent and e.request_id == rid), None)
        vram = call.vram_mb if call is not None else entry.vram_mb  # type: ignore[union-attr]
        team = state.membership.team(TEAM[agent])
        assert team_use(state, view, team.name) + vram <= team.quota_mb, "a team over its quota reclaimed"
        gpus = {view.leases[v].gpu_uuid for v in victims}
        assert len(gpus) == 1
        g = view.gpus[gpus.pop()]
        # What the request saw: the snapshot's leases and the grants of this round before it (those ranked
        # earlier; a grant ranked later would have been blocked by it, G2).
        on = [x for x in [*g.leases, *plan.new_leases] if x.gpu_uuid == g.uuid and x.id not in s["ctx"].evicting]

        def fits(gone: set[str]) -> bool:
            rest = dataclasses.replace(g, leases=[x for x in on if x.id not in gone])  # noqa: B023 - called in this iteration
            return room_for(rest, agent, s["caps"][agent][g.uuid]) >= vram  # noqa: B023 - called in this iteration
        assert fits(set(victims)), "the reclaimed leases do not make the request fit"
        for v in victims:
            assert not fits(set(victims) - {v}), "a reclaimed lease could have been spared"


def _ctx() -> Context:
    return Context(KEYS, CoordinatorConfig().validate(), "r1", frozenset(), NOW, WALL)


def test_a_team_below_its_quota_reclaims_the_newest_over_quota_lease_of_another_team() -> None:
    """One 8 GiB GPU held by team x's two 4 GiB leases (quota 4 GiB: the newer one borrows); team y (quota 4
    GiB) asks for 4 GiB at a lower priority: the newer lease of x gets a reclaim notice, the older stays."""
    from coordinator.policy.admission import GpuView
    from coordinator.records import GpuInfo, GpuLedger, HostInventory, VramLease
    from tests.support.planner_calls import _KV, KEYS
    inventory = HostInventory(HOST, "", 8, tuple(range(8)), 1 << 34, "/", 1 << 40, (GpuInfo(0, "GPU-0", "sim", 8192),))
    a = session("a")
    leases = [VramLease(id=f"x{n}", host=HOST, gpu_uuid="GPU-0", gpu_index=0, agent="a", session_id=a.session_id,
                        vram_mb=4096, priority=5, preemptible=True, request_id=f"x{n}", token=n + 1,
                        created_at=100.0 + n, etcd_lease=a.etcd_lease, mod_revision=100 + n) for n in range(2)]
    gpu = GpuView(uuid="GPU-0", index=0, total_mb=8192, usable_mb=8192, ledger=GpuLedger(8192, 2, 300), leases=leases)
    view = HostView(HOST, 500, inventory, _KV(KEYS.host(HOST), b"{}", 40, 0x99), None, None, {"GPU-0": gpu},
                    {x.id: x for x in leases}, None, (), ())
    state = _state(view, 4096, 4096, 1.0)
    b = session("b")
    call = Call(b, 4096, None, 0, True, "r", lease_id_for("b", "r", HOST), 30.0, 2000, NOW + 30.0)
    plan: Plan[Call] = plan_round(view, [call], {}, {b.session_id}, dataclasses.replace(_ctx(), teams=state))
    assert [(r.lease_id, r.reclaim) for r in plan.evictions] == [("x1", "y")]
    assert [w.call for w in plan.waits] == [call] and not plan.new_leases
    # Without teams, priority decides: nothing is evicted for a lower-priority request.
    plan = plan_round(view, [call], {}, {b.session_id}, _ctx())
    assert plan.evictions == []
