"""G11, charges and frees per GPU (issue 28, point 3): a gang is charged, on each of its GPUs, that GPU's own
record, to that GPU's own model (per-model quotas), and reclaiming it frees on each GPU what it holds there
(an exclusive gang over GPUs of different sizes)."""
from __future__ import annotations

from coordinator.config import CoordinatorConfig
from coordinator.keys import lease_id_for
from coordinator.node.fake import parse_fake_gpus
from coordinator.policy.host import HostView
from coordinator.policy.plan import Context, Plan
from coordinator.policy.planner import plan_round
from coordinator.policy.team_admission import TeamState, fleet_charges
from coordinator.policy.teams import Membership, Team, in_quota
from coordinator.records import VramLease
from tests.support.gang_scenarios import wants
from tests.support.planner_calls import HOST, KEYS, NOW, WALL, Call, session
from tests.support.planner_calls import host_view as _host

M32, M16 = "Simulated GPU 32GiB", "Simulated GPU 16GiB"


def _exclusive_gang(spec: str, agent: str = "a") -> list[VramLease]:
    """An exclusive gang of ``agent`` over every GPU of ``spec``: each record the whole GPU."""
    gpus = parse_fake_gpus(spec, HOST)
    s = session(agent)
    return [VramLease(id="gang", host=HOST, gpu_uuid=g.uuid, gpu_index=g.index, agent=agent, session_id=s.session_id,
                      vram_mb=g.vram_total_mb, priority=5, preemptible=True, request_id="gang", token=3,
                      created_at=100.0, gang=tuple(x.uuid for x in gpus), exclusive=True, over_quota=False,
                      etcd_lease=s.etcd_lease, mod_revision=100 + g.index) for g in gpus]


def _state(view: HostView, x: Team, y: Team) -> TeamState:
    records = tuple(x for g in view.gpus.values() for x in g.leases)
    used = {"x": sum(r.vram_mb for r in records if r.agent == "a")}
    models = {g.uuid: g.name for g in view.inventory.gpus} if view.inventory else {}
    return TeamState(Membership([x, y]), used, frozenset(view.leases), {}, 600, lambda: records, models)


def _ask(view: HostView, state: TeamState, vram_mb: int) -> Plan[Call]:
    b = session("b")
    call = Call(b, vram_mb, None, 0, True, "r", lease_id_for("b", "r", HOST), 30.0, 2000, NOW + 30.0)
    ctx = Context(KEYS, CoordinatorConfig().validate(), "r1", frozenset(), NOW, WALL, teams=state)
    return plan_round(view, [call], {}, {b.session_id}, ctx)


def test_a_gang_over_two_models_is_charged_each_gpu_to_its_own_models_quota() -> None:
    """Team x's quota is 48 GiB: 32 GiB of the 32 GiB model and 16 GiB of the 16 GiB model. Its exclusive gang
    over one GPU of each uses exactly that: it is in quota (its grant was marked so), and team y's request for
    room on the host reclaims nothing. Charged by its first GPU's model alone (48 GiB of the 32 GiB model) it
    was over quota and reclaimed."""
    view = _host("1x32GiB,1x16GiB", _exclusive_gang("1x32GiB,1x16GiB"))
    x = Team("x", quota_mb=49152, quota_by_model=((M16, 16384), (M32, 32768)), members=("a",))
    y = Team("y", quota_mb=16384, members=("b",))
    state = _state(view, x, y)
    (charge,) = fleet_charges(state, view)
    assert charge.charge_mb == 49152 and charge.by_model() == {M32: 32768, M16: 16384}
    assert in_quota([charge], state.membership) == {"gang": True}
    plan = _ask(view, state, 8192)
    assert plan.evictions == [], "an in-quota gang was reclaimed"
    assert len(plan.waits) == 1
    # With 8 GiB of the 16 GiB model only, the gang is over quota (its 16 GiB GPU): y reclaims it.
    tight = Team("x", quota_mb=49152, quota_by_model=((M16, 8192), (M32, 32768)), members=("a",))
    plan = _ask(view, _state(view, tight, y), 8192)
    assert [(r.lease_id, r.reclaim) for r in plan.evictions] == [("gang", "y")]


def test_reclaiming_an_exclusive_gang_frees_each_gpus_own_record() -> None:
    """Team x (no quota) holds an exclusive gang over a 16 GiB and a 32 GiB GPU; team y (quota 32 GiB) asks for
    20 GiB, which only the 32 GiB GPU can hold: reclaiming the gang frees 32 GiB there, so y reclaims it.
    Counting the first record's 16 GiB on every GPU, reclaim found it too small and y got nothing."""
    view = _host("1x16GiB,1x32GiB", _exclusive_gang("1x16GiB,1x32GiB"))
    state = _state(view, Team("x", members=("a",)), Team("y", quota_mb=32768, members=("b",)))
    (charge,) = fleet_charges(state, view)
    assert [charge.on(u) for u in charge.gpus] == [16384, 32768]
    plan = _ask(view, state, 20480)
    assert [(r.lease_id, r.reclaim) for r in plan.evictions] == [("gang", "y")]


def _grant_marks(spec: str, held: list[VramLease], team: Team, vram_mb: int, count: int = 1,
                 exclusive: bool = False) -> list[bool | None]:
    """The quota marks of the records a round grants agent a (of ``team``) on a host of ``spec``."""
    view = _host(spec, held)
    state = _state(view, team, Team("y", members=("b",)))
    a = session("a")
    call = Call(a, vram_mb, None, 0, True, "new", lease_id_for("a", "new", HOST), 0.0, 2000, NOW,
                **wants(count, exclusive, "any", ()))
    ctx = Context(KEYS, CoordinatorConfig().validate(), "r1", frozenset(), NOW, WALL, teams=state)
    plan = plan_round(view, [call], {}, {a.session_id}, ctx)
    assert plan.new_leases, plan.refusals
    return [x.over_quota for x in plan.new_leases]


def test_a_grant_past_its_teams_quota_of_its_gpus_model_is_marked_over_quota() -> None:
    """Team x has 48 GiB over the fleet but 8 GiB of the 16 GiB model: 12 GiB on the 16 GiB GPU is within the
    first and past the second, so the lease is over quota (what reclaim and ``team list`` say of it), and
    ``lease.over_quota`` says so; 4 GiB there is in quota. Before, the mark counted the fleet's quota alone."""
    x = Team("x", quota_mb=49152, quota_by_model=((M16, 8192),), members=("a",))
    assert _grant_marks("1x16GiB", [], x, 12288) == [True]
    assert _grant_marks("1x16GiB", [], x, 4096) == [False]


def test_an_exclusive_gang_over_two_models_is_marked_by_each_gpus_own_model() -> None:
    """An exclusive gang over a 32 GiB and a 16 GiB GPU charges 32 GiB to the first model and 16 GiB to the
    second: in quota with quotas of exactly that, over quota when the 16 GiB model's quota is 8 GiB."""
    both = ((M16, 16384), (M32, 32768))
    x = Team("x", quota_mb=49152, quota_by_model=both, members=("a",))
    assert _grant_marks("1x32GiB,1x16GiB", [], x, 0, count=2, exclusive=True) == [False, False]
    tight = Team("x", quota_mb=49152, quota_by_model=((M16, 8192), (M32, 32768)), members=("a",))
    assert _grant_marks("1x32GiB,1x16GiB", [], tight, 0, count=2, exclusive=True) == [True, True]
