"""G11, a team at its limit (issue 22: "refused ... or waits, as asked"), in the pure planner: a request that its
team's limit holds back waits for its team when it asked to wait (a queue entry, kept round after round) and is
refused at once naming ``team`` and the limit when it did not; while it waits it holds no GPU back from the
requests behind it (G2 with teams), of another team or of its own, and chooses no victims (G3) unless they
free room under its team's limit (issue 28: G3 within the team's limit; then it waits for them). The property
over random rounds is ``test_planner.test_a_round_takes_no_team_above_its_limit``."""
from __future__ import annotations

from coordinator.config import CoordinatorConfig
from coordinator.policy.host import HostView
from coordinator.policy.plan import Context, Plan
from coordinator.policy.planner import plan_round
from coordinator.policy.team_admission import TeamState
from coordinator.policy.teams import Membership, Team
from coordinator.txn import Delete
from tests.support.planner_calls import (
    KEYS,
    NOW,
    WALL,
    Call,
    entry_of,
    one_gpu_host,
    one_gpu_lease,
    waiting_call,
)

LIMIT = 8192


def _round(view: HostView, batch: list[Call], team_used: int, waiting: dict[str, Call] | None = None) -> Plan[Call]:
    """Team t (agents a and b, limit ``LIMIT``) uses ``team_used`` MiB over the fleet, all counted elsewhere."""
    state = TeamState(Membership([Team("t", limit_mb=LIMIT, members=("a", "b"))]), {"t": team_used},
                      frozenset(view.leases), {"t": (77, 5)}, 600)
    ctx = Context(KEYS, CoordinatorConfig().validate(), "r1", frozenset(), NOW, WALL, teams=state)
    return plan_round(view, batch, waiting or {}, {c.session.session_id for c in batch}, ctx)


def _fields(plan: Plan[Call]) -> dict[str, str]:
    return {c.request_id: err.field or "" for c, err in plan.refusals}


def test_a_request_at_its_teams_limit_waits_when_asked_and_is_refused_naming_team_when_not() -> None:
    view = one_gpu_host([])
    waits, now = waiting_call("a", "waits", 4096, 5.0, 1000), waiting_call("b", "now", 4096, 0.0, 1001)
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
    first = waiting_call("a", "first", 4096, 30.0, 10)
    view = one_gpu_host([one_gpu_lease("held", "c", 4096)], (entry_of(first),))
    other = waiting_call("c", "other", 8192, 0.0, 2000)
    plan = _round(view, [other], team_used=LIMIT, waiting={first.lease_id: first})
    assert [x.id for x in plan.new_leases] == [other.lease_id]
    assert not any(isinstance(op, Delete) and b"/queue/" in op.key for op in plan.ops), "the waiter left the queue"
    assert first.lease_id in plan.team_waits and [w.call for w in plan.waits] == [first]
    assert plan.evictions == []


def test_a_request_waiting_for_its_team_chooses_no_victims_that_would_not_let_it_in() -> None:
    """Team t is at its limit and the GPU holds a 2 GiB low-priority preemptible lease of t itself: evicting it
    would leave a high-priority 4 GiB request of t still above the limit, so the request waits for its team
    without a notice."""
    view = one_gpu_host([one_gpu_lease("low", "b", 2048, priority=-1)])
    high = waiting_call("a", "high", 4096, 5.0, 1000, priority=5)
    plan = _round(view, [high], team_used=LIMIT)
    assert plan.evictions == [] and high.lease_id in plan.team_waits


def test_a_higher_priority_request_at_its_teams_limit_evicts_its_teams_lease_that_frees_the_room() -> None:
    """The GPU is full of a low-priority preemptible lease of team t itself (counted in t's use) and t is at its
    limit: evicting that lease frees room on the GPU and under the limit, so a high-priority request of t
    evicts it (G3 within the team's limit, issue 28) and waits for it, not for its team."""
    view = one_gpu_host([one_gpu_lease("low", "b", 16384, priority=-1)])
    high = waiting_call("a", "high", 4096, 5.0, 1000, priority=5)
    plan = _round(view, [high], team_used=LIMIT)
    assert [r.lease_id for r in plan.evictions] == ["low"] and high.lease_id not in plan.team_waits
    # With room in its team, the same request evicts (G3 as before).
    assert [r.lease_id for r in _round(view, [high], team_used=0).evictions] == ["low"]
    # Of the victim's priority, it evicts nothing and waits for its team.
    same = waiting_call("a", "same", 4096, 5.0, 1000, priority=-1)
    plan = _round(view, [same], team_used=LIMIT)
    assert plan.evictions == [] and same.lease_id in plan.team_waits


def test_a_smaller_request_of_the_same_team_behind_a_team_waiter_takes_the_room_left() -> None:
    """Team t has 2048 MiB left under its limit: its 4096 MiB waiter ranked first stays queued, and its 2048 MiB
    request behind it is granted (the team's room goes to whichever of its requests fits first)."""
    first = waiting_call("a", "first", 4096, 30.0, 10)
    view = one_gpu_host([], (entry_of(first),))
    small = waiting_call("b", "small", 2048, 0.0, 2000)
    plan = _round(view, [small], team_used=LIMIT - 2048, waiting={first.lease_id: first})
    assert [x.id for x in plan.new_leases] == [small.lease_id]
    assert first.lease_id in plan.team_waits


def test_a_team_waiter_is_granted_once_its_team_has_room() -> None:
    first = waiting_call("a", "first", 4096, 30.0, 10)
    view = one_gpu_host([], (entry_of(first),))
    plan = _round(view, [], team_used=LIMIT - 4096, waiting={first.lease_id: first})
    assert [x.id for x in plan.new_leases] == [first.lease_id] and plan.team_waits == {}
    assert [c for c, _ in plan.grants] == [first]
