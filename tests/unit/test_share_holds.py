"""The fair share of the idle capacity in a host's round (``policy/team_holds.over_share``, docs/teams.md "Fair
share"): only a waiter that could be granted holds another team back, and a request past its share chooses no
victims. One 16 GiB GPU; teams light (agents a, b) and heavy (c), heavy's factor 1/4 against light's 1, the whole
GPU beyond the quotas (heavy's share 1/5 of it, 3276 MiB; light's 4/5)."""
from __future__ import annotations

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.policy.host import HostView
from coordinator.policy.plan import Context
from coordinator.policy.planner import plan_round
from coordinator.policy.team_admission import TeamState
from coordinator.policy.teams import Membership, Team
from tests.support.planner_calls import (
    KEYS,
    NOW,
    WALL,
    entry_of,
    one_gpu_host,
    one_gpu_lease,
    waiting_call,
)

FAIR = {"heavy": 0.25, "light": 1.0}


def _ctx(view: HostView, used: dict[str, int], members: Membership) -> Context:
    state = TeamState(members, used, frozenset(view.leases), {"light": (77, 5)}, 600, fair=FAIR, borrowable_mb=16384)
    return Context(KEYS, CoordinatorConfig().validate(), "r1", frozenset(), NOW, WALL, teams=state)


@pytest.mark.parametrize("arrival", [10, 3000], ids=["ranked-before", "ranked-after"])
def test_a_waiter_its_own_limit_holds_back_does_not_hold_another_team_past_its_share(arrival: int) -> None:
    """Light is at its 4096 MiB limit with a 2048 MiB waiter (ranked before heavy's request, or after it): it
    cannot be granted, so heavy (3000 MiB, past its share once granted 2048 more) is granted the idle room rather
    than both waiting beside 9 GiB of free VRAM."""
    members = Membership([Team("light", limit_mb=4096, members=("a", "b")), Team("heavy", members=("c",))])
    light_waits = waiting_call("b", "lw", 2048, 30.0, arrival)
    view = one_gpu_host([one_gpu_lease("l1", "a", 4096), one_gpu_lease("h1", "c", 3000)], (entry_of(light_waits),))
    heavy = waiting_call("c", "hv", 2048, 30.0, 2000)
    plan = plan_round(view, [heavy], {light_waits.lease_id: light_waits},
                      {heavy.session.session_id, light_waits.session.session_id},
                      _ctx(view, {"light": 4096, "heavy": 3000}, members))
    assert [x.id for x in plan.new_leases] == [heavy.lease_id], plan.team_waits
    assert heavy.lease_id not in plan.team_waits


def test_a_waiter_that_could_be_granted_holds_the_other_team_at_its_share() -> None:
    """The same without light's limit: light's waiter could take the room, so heavy's grant past its share waits
    for its team, naming the fair share, and light's waiter is granted."""
    members = Membership([Team("light", members=("a", "b")), Team("heavy", members=("c",))])
    light_waits = waiting_call("b", "lw", 2048, 30.0, 3000)     # ranked after heavy's call
    view = one_gpu_host([one_gpu_lease("l1", "a", 4096), one_gpu_lease("h1", "c", 3000)], (entry_of(light_waits),))
    heavy = waiting_call("c", "hv", 2048, 30.0, 2000)
    plan = plan_round(view, [heavy], {light_waits.lease_id: light_waits},
                      {heavy.session.session_id, light_waits.session.session_id},
                      _ctx(view, {"light": 4096, "heavy": 3000}, members))
    assert "fair share of the idle capacity" in plan.team_waits[heavy.lease_id]
    assert [x.id for x in plan.new_leases] == [light_waits.lease_id]


def test_a_request_past_its_share_evicts_nothing_for_it() -> None:
    """Heavy's priority-5 request does not fit (heavy's own 8 GiB lease and light's fill the GPU): evicting heavy's
    lease would make room, but the request would take heavy past its share while light waits, so it waits for its
    team and no lease is ended for it."""
    members = Membership([Team("light", members=("a", "b")), Team("heavy", members=("c",))])
    light_waits = waiting_call("b", "lw", 2048, 30.0, 3000)
    view = one_gpu_host([one_gpu_lease("l1", "a", 8192), one_gpu_lease("h1", "c", 8192, priority=-1)],
                        (entry_of(light_waits),))
    heavy = waiting_call("c", "hv", 4096, 30.0, 2000, priority=5)
    plan = plan_round(view, [heavy], {light_waits.lease_id: light_waits},
                      {heavy.session.session_id, light_waits.session.session_id},
                      _ctx(view, {"light": 8192, "heavy": 8192}, members))
    assert plan.evictions == [] and heavy.lease_id in plan.team_waits
