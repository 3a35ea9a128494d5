"""G11, a team at its limit (issue 22: "refused ... or waits, as asked"), in the pure planner: a request that its
team's limit holds back waits for its team when it asked to wait (a queue entry, kept round after round) and is
refused at once naming ``team`` and the limit when it did not; while it waits it holds no GPU back from the
requests behind it (G2 with teams), of another team or of its own, and chooses no victims (G3) unless they
free room under its team's limit (issue 28: G3 within the team's limit; then it waits for them). The property
over random rounds is ``test_planner.test_a_round_takes_no_team_above_its_limit``."""
from __future__ import annotations

from coordinator.config import CoordinatorConfig
from coordinator.keys import Keys, lease_id_for
from coordinator.node.fake import parse_fake_gpus
from coordinator.policy.admission import GpuView
from coordinator.policy.host import HostView
from coordinator.policy.plan import Context, Plan
from coordinator.policy.planner import plan_round
from coordinator.policy.team_admission import TeamState
from coordinator.policy.teams import Membership, Team
from coordinator.records import GpuLedger, HostInventory, QueueEntry, VramLease
from coordinator.txn import Delete
from tests.support.planner_calls import _KV, HOST, KEYS, NOW, WALL, Call, session

LIMIT = 8192


def _host(leases: list[VramLease], entries: tuple[QueueEntry, ...] = ()) -> HostView:
    """One 16 GiB GPU."""
    inventory = HostInventory(HOST, "", 8, tuple(range(8)), 1 << 34, "/", 1 << 40, parse_fake_gpus("1x16GiB", HOST))
    gpus = {g.uuid: GpuView(uuid=g.uuid, index=g.index, total_mb=g.vram_total_mb, usable_mb=g.vram_total_mb,
                            ledger=GpuLedger(g.vram_total_mb, 2, 300), leases=list(leases)) for g in inventory.gpus}
    return HostView(HOST, 500, inventory, _KV(KEYS.host(HOST), b"{}", 40, 0x99), None, None, gpus,
                    {x.id: x for x in leases}, None, (), entries)


def _lease(lease_id: str, agent: str, vram_mb: int, priority: int = 0) -> VramLease:
    s = session(agent)
    return VramLease(id=lease_id, host=HOST, gpu_uuid=f"GPU-sim-{HOST}-0", gpu_index=0, agent=agent,
                     session_id=s.session_id, vram_mb=vram_mb, priority=priority, preemptible=True,
                     request_id=lease_id, token=1, created_at=1.0, etcd_lease=s.etcd_lease)


def _call(agent: str, rid: str, vram_mb: int, wait_s: float, arrival: int, priority: int = 0) -> Call:
    return Call(session(agent), vram_mb, None, priority, True, rid, lease_id_for(agent, rid, HOST), wait_s, arrival,
                NOW + wait_s)


def _entry(call: Call) -> QueueEntry:
    """``call`` as its queue entry (written by an earlier round)."""
    s = call.session
    return QueueEntry(rank=Keys.queue_rank(call.priority, call.arrival_ns, call.lease_id), agent=s.agent,
                      session_id=s.session_id, etcd_lease=s.etcd_lease, vram_mb=call.vram_mb, gpu="",
                      priority=call.priority, preemptible=True, request_id=call.request_id, lease_id=call.lease_id,
                      deadline_unix=WALL + call.wait_s, replica="r1", mod_revision=450, wait_s=call.wait_s)


def _round(view: HostView, batch: list[Call], team_used: int, waiting: dict[str, Call] | None = None) -> Plan[Call]:
    """Team t (agents a and b, limit ``LIMIT``) uses ``team_used`` MiB over the fleet, all counted elsewhere."""
    state = TeamState(Membership([Team("t", limit_mb=LIMIT, members=("a", "b"))]), {"t": team_used},
                      frozenset(view.leases), {"t": (77, 5)}, 600)
    ctx = Context(KEYS, CoordinatorConfig().validate(), "r1", frozenset(), NOW, WALL, teams=state)
    return plan_round(view, batch, waiting or {}, {c.session.session_id for c in batch}, ctx)


def _fields(plan: Plan[Call]) -> dict[str, str]:
    return {c.request_id: err.field or "" for c, err in plan.refusals}


def test_a_request_at_its_teams_limit_waits_when_asked_and_is_refused_naming_team_when_not() -> None:
    view = _host([])
    waits, now = _call("a", "waits", 4096, 5.0, 1000), _call("b", "now", 4096, 0.0, 1001)
    plan = _round(view, [waits, now], team_used=LIMIT)
    assert plan.new_leases == []
    assert [w.call.request_id for w in plan.waits] == ["waits"]
    assert plan.team_waits[waits.lease_id].startswith("team: team 't' uses 8192 MiB; 4096 MiB more would pass "
                                                      "its limit of 8192 MiB")
    assert _fields(plan) == {"now": "team"}
    (err,) = [e for c, e in plan.refusals]
    assert "its limit of 8192 MiB" in err.message


def test_a_request_waiting_for_its_team_holds_no_gpu_back_from_other_teams_behind_it() -> None:
    """A queued request of team t (at its limit) ranked first; a request of another team behind it fits on the
    same GPU and is granted; the waiter keeps its entry and is not granted."""
    first = _call("a", "first", 4096, 30.0, 10)
    view = _host([_lease("held", "c", 4096)], (_entry(first),))
    other = _call("c", "other", 8192, 0.0, 2000)
    plan = _round(view, [other], team_used=LIMIT, waiting={first.lease_id: first})
    assert [x.id for x in plan.new_leases] == [other.lease_id]
    assert not any(isinstance(op, Delete) and b"/queue/" in op.key for op in plan.ops), "the waiter left the queue"
    assert first.lease_id in plan.team_waits and [w.call for w in plan.waits] == [first]
    assert plan.evictions == []


def test_a_request_waiting_for_its_team_chooses_no_victims_that_would_not_let_it_in() -> None:
    """Team t is at its limit and the GPU holds a 2 GiB low-priority preemptible lease of t itself: evicting it
    would leave a high-priority 4 GiB request of t still above the limit, so the request waits for its team
    without a notice."""
    view = _host([_lease("low", "b", 2048, priority=-1)])
    high = _call("a", "high", 4096, 5.0, 1000, priority=5)
    plan = _round(view, [high], team_used=LIMIT)
    assert plan.evictions == [] and high.lease_id in plan.team_waits


def test_a_higher_priority_request_at_its_teams_limit_evicts_its_teams_lease_that_frees_the_room() -> None:
    """The GPU is full of a low-priority preemptible lease of team t itself (counted in t's use) and t is at its
    limit: evicting that lease frees room on the GPU and under the limit, so a high-priority request of t
    evicts it (G3 within the team's limit, issue 28) and waits for it, not for its team."""
    view = _host([_lease("low", "b", 16384, priority=-1)])
    high = _call("a", "high", 4096, 5.0, 1000, priority=5)
    plan = _round(view, [high], team_used=LIMIT)
    assert [r.lease_id for r in plan.evictions] == ["low"] and high.lease_id not in plan.team_waits
    # With room in its team, the same request evicts (G3 as before).
    assert [r.lease_id for r in _round(view, [high], team_used=0).evictions] == ["low"]
    # Of the victim's priority, it evicts nothing and waits for its team.
    same = _call("a", "same", 4096, 5.0, 1000, priority=-1)
    plan = _round(view, [same], team_used=LIMIT)
    assert plan.evictions == [] and same.lease_id in plan.team_waits


def test_a_smaller_request_of_the_same_team_behind_a_team_waiter_takes_the_room_left() -> None:
    """Team t has 2048 MiB left under its limit: its 4096 MiB waiter ranked first stays queued, and its 2048 MiB
    request behind it is granted (the team's room goes to whichever of its requests fits first)."""
    first = _call("a", "first", 4096, 30.0, 10)
    view = _host([], (_entry(first),))
    small = _call("b", "small", 2048, 0.0, 2000)
    plan = _round(view, [small], team_used=LIMIT - 2048, waiting={first.lease_id: first})
    assert [x.id for x in plan.new_leases] == [small.lease_id]
    assert first.lease_id in plan.team_waits


def test_a_team_waiter_is_granted_once_its_team_has_room() -> None:
    first = _call("a", "first", 4096, 30.0, 10)
    view = _host([], (_entry(first),))
    plan = _round(view, [], team_used=LIMIT - 4096, waiting={first.lease_id: first})
    assert [x.id for x in plan.new_leases] == [first.lease_id] and plan.team_waits == {}
    assert [c for c, _ in plan.grants] == [first]
