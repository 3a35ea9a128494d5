"""G11 with gangs (issue 22 over issue 21): a team is charged VRAM x GPUs, so a gang is charged the
``vram_mb`` of every GPU record it holds or asks for (an exclusive gang: each GPU's whole usable VRAM, as its
records say), both in the planner's limit check and in the usage ``status`` shows."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.config import CoordinatorConfig
from coordinator.keys import lease_id_for
from coordinator.node.fake import parse_fake_gpus
from coordinator.policy.host import HostView
from coordinator.policy.plan import Context
from coordinator.policy.planner import plan_round
from coordinator.policy.team_admission import TeamState
from coordinator.policy.teams import Membership, Team
from coordinator.records import VramLease
from coordinator.replica.teams import charges_from_views
from coordinator.txn import ModRevisionIs, Put
from tests.support.gang_scenarios import scenarios, wants
from tests.support.planner_calls import HOST, KEYS, NOW, WALL, Call, session
from tests.support.planner_calls import host_view as _host

TEAM = Membership([Team("t", limit_mb=1 << 40, members=("a", "b"))])


def _records(view: HostView, agents: tuple[str, ...] = ("a", "b")) -> int:
    """The VRAM of every GPU record of ``agents`` on the host (a gang: each of its GPUs)."""
    return sum(x.vram_mb for g in view.gpus.values() for x in g.leases if x.agent in agents)


def _state(view: HostView, limit: int, elsewhere: int) -> TeamState:
    membership = Membership([Team("t", limit_mb=limit, members=("a", "b"))])
    return TeamState(membership, {"t": _records(view) + elsewhere}, frozenset(view.leases), {"t": (77, 5)}, 600)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.integers(-1000, 40000), st.integers(0, 20000))
def test_a_round_with_gangs_takes_no_team_above_its_limit_counting_every_gpu(
        s: dict[str, Any], headroom: int, elsewhere: int) -> None:
    """Team t (agents a and b) holds its records here (every GPU's) and ``elsewhere`` MiB on other hosts. Whatever mix of
    single-GPU requests, gangs and exclusive gangs the round decides, what it grants t (every GPU record of
    every new lease) stays within what t's limit leaves, and no GPU is over-committed (G1)."""
    view: HostView = s["view"]
    limit = max(0, _records(view) + elsewhere + headroom)   # what the team may still take: about ``headroom``
    ctx = dataclasses.replace(s["ctx"], teams=_state(view, limit, elsewhere))
    plan = plan_round(view, s["batch"], s["waiting"], {c.session.session_id for c in s["batch"]}, ctx)
    after = [*s["leases"], *plan.new_leases]
    for u, usable in s["usable"].items():
        assert sum(x.vram_mb for x in after if x.gpu_uuid == u) <= usable, f"GPU {u} over-committed"
    charged = sum(x.vram_mb for x in plan.new_leases if x.agent in ("a", "b"))
    assert charged == 0 or _records(view) + elsewhere + charged <= limit, "a round took team t above its limit"
    if charged:
        puts = {op.key: op for op in plan.ops if isinstance(op, Put)}
        assert json.loads(puts[KEYS.team_ledger("t")].value) == {"seq": 6}
        assert ModRevisionIs(KEYS.team_ledger("t"), 77) in plan.compares


def _gang_call(rid: str, vram_mb: int, count: int, exclusive: bool = False) -> Call:
    return Call(session("a"), vram_mb, None, 0, True, rid, lease_id_for("a", rid, HOST), 0.0, 1000, NOW,
                **wants(count, exclusive, "any", ()))


def _decide(view: HostView, call: Call, limit: int) -> tuple[list[VramLease], list[str]]:
    ctx = Context(KEYS, CoordinatorConfig().validate(), "r1", frozenset(), NOW, WALL, teams=_state(view, limit, 0))
    plan = plan_round(view, [call], {}, {call.session.session_id}, ctx)
    return plan.new_leases, [err.field for _, err in plan.refusals]


def test_a_gang_is_charged_its_vram_on_every_gpu() -> None:
    """3 GPUs x 8000 MiB is 24000 MiB: refused under a limit of 23999 (naming the team), granted at 24000."""
    view = _host("4x16GiB", [])
    assert _decide(view, _gang_call("g", 8000, 3), 23_999) == ([], ["team"])
    leases, refused = _decide(view, _gang_call("g", 8000, 3), 24_000)
    assert refused == [] and len(leases) == 3


def test_an_exclusive_gang_is_charged_every_gpus_usable_vram() -> None:
    """Two whole 16 GiB GPUs are 32768 MiB: refused under 32767, granted at 32768."""
    view = _host("4x16GiB", [])
    assert _decide(view, _gang_call("x", 0, 2, exclusive=True), 32_767) == ([], ["team"])
    leases, refused = _decide(view, _gang_call("x", 0, 2, exclusive=True), 32_768)
    assert refused == [] and [x.vram_mb for x in leases] == [16384, 16384]


def _gang(lease_id: str, sizes: list[int], spec: str) -> list[VramLease]:
    gpus = parse_fake_gpus(spec, HOST)
    uuids = tuple(g.uuid for g in gpus[:len(sizes)])
    return [VramLease(id=lease_id, host=HOST, gpu_uuid=g.uuid, gpu_index=g.index, agent="a", session_id="s",
                      vram_mb=mb, priority=0, preemptible=True, request_id=lease_id, token=1, created_at=1.0,
                      gang=uuids, exclusive=True) for g, mb in zip(gpus, sizes)]


def test_a_held_gang_counts_every_gpu_record_against_the_limit_and_in_status() -> None:
    """A held exclusive gang on a 16 GiB and an 8 GiB GPU counts 24576 MiB: in the limit check of a later
    grant on this host (its records not yet in the teams' copy) and in the usage ``status`` shows."""
    spec = "1x16GiB,2x8GiB"
    held = _gang("held", [16384, 8192], spec)
    view = _host(spec, held)
    (charge,), _ = charges_from_views([view], TEAM)
    assert charge.charge_mb == 24_576 and len(charge.gpus) == 2
    uncounted = TeamState(Membership([Team("t", limit_mb=24_576 + 999, members=("a",))]), {}, frozenset(), {}, 1)
    call = Call(session("a"), 1000, None, 0, True, "one", lease_id_for("a", "one", HOST), 0.0, 1000, NOW)
    ctx = Context(KEYS, CoordinatorConfig().validate(), "r1", frozenset(), NOW, WALL, teams=uncounted)
    plan = plan_round(view, [call], {}, {call.session.session_id}, ctx)
    assert [err.field for _, err in plan.refusals] == ["team"]
