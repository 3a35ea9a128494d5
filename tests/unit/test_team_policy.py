"""G11, the pure team policy: usage (VRAM x GPUs), quota marks, the limit, and reclaim. Hypothesis properties
(500 examples each): no team above its limit, no in-quota lease taken for another team, reclaim minimal, and
taken in weighted order (the team furthest over its weighted share first, newest first)."""
from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.policy.team_admission import limit_refusal
from coordinator.policy.teams import (
    Charge,
    Membership,
    Team,
    choose_reclaim,
    in_quota,
    protected,
    reclaim_order,
    reclaimable,
    stays_in_quota,
    usage_by_team,
    used_by_team,
)

PROPS = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CAPACITY = 100   # MiB per GPU, small so that the fleet fills up
GPUS = ("g0", "g1", "g2", "g3")
TEAMS = ("a", "b", "c")


def _charge(i: int, team: str, vram: int, gpus: tuple[str, ...] = ("g0",), created_at: float | None = None,
            **kw: object) -> Charge:
    return Charge(id=f"l{i}", team=team, vram_mb=vram, gpus=gpus,
                  created_at=float(i) if created_at is None else created_at, token=i, **kw)  # type: ignore[arg-type]


# -- examples -------------------------------------------------------------------------------------------------

def test_a_lease_is_charged_vram_times_gpus() -> None:
    assert _charge(1, "a", 10, ("g0", "g1", "g2")).charge_mb == 30
    assert used_by_team([_charge(1, "a", 10, ("g0", "g1")), _charge(2, "a", 5), _charge(3, "b", 7)]) == {"a": 25,
                                                                                                          "b": 7}


def test_a_team_fills_its_quota_oldest_first() -> None:
    m = Membership([Team("a", quota_mb=50)])
    leases = [_charge(3, "a", 20), _charge(1, "a", 30), _charge(2, "a", 20), _charge(4, "a", 5)]
    assert in_quota(leases, m) == {"l1": True, "l2": True, "l3": False, "l4": False}
    # When an older lease ends, the newer ones move into quota.
    assert in_quota(leases[:1] + leases[2:], m) == {"l2": True, "l3": True, "l4": True}
    u = usage_by_team(leases, m, waiting=[("a", 8), ("b", 4)])
    assert (u["a"].used_mb, u["a"].borrowed_mb, u["a"].leases, u["a"].over_quota_leases, u["a"].waiting_mb) == \
        (75, 25, 4, 2, 8)
    assert u["default"].used_mb == 0 and u["b"].waiting == 1


def test_a_model_quota_narrows_the_guarantee_on_that_model() -> None:
    m = Membership([Team("a", quota_mb=100, quota_by_model=(("H100", 30),))])
    leases = [_charge(1, "a", 20, model="H100"), _charge(2, "a", 20, model="H100"), _charge(3, "a", 20, model="A10")]
    assert in_quota(leases, m) == {"l1": True, "l2": False, "l3": True}
    assert stays_in_quota(m.team("a"), leases, 10, "H100") is False
    assert stays_in_quota(m.team("a"), leases, 10, "A10") is True


def test_the_limit_refusal_names_team_and_limit() -> None:
    team = Team("a", quota_mb=10, limit_mb=40)
    assert limit_refusal(team, 30, 10) is None
    assert limit_refusal(team, 31, 10) == "team: team 'a' uses 31 MiB; 10 MiB more would pass its limit of 40 MiB"
    assert limit_refusal(Team("b"), 1 << 40, 1 << 40) is None


def test_a_team_below_quota_reclaims_exactly_the_over_quota_leases_it_needs() -> None:
    """The acceptance scene in small: A (quota 2 GPUs) fills 4 GPUs; B asks for its quota: A's two newest
    (over-quota) leases go, its in-quota ones stay."""
    m = Membership([Team("a", quota_mb=200, members=("a-*",)), Team("b", quota_mb=200, members=("b-*",))])
    leases = [_charge(i, "a", 100, (g,)) for i, g in enumerate(GPUS)]
    first = choose_reclaim("b", 100, {"g3": 100}, leases, m, now=10)
    assert first is not None and [v.id for v in first] == ["l3"]
    second = choose_reclaim("b", 100, {"g2": 100}, leases[:3] + [_charge(9, "b", 100, ("g3",))], m, now=10)
    assert second is not None and [v.id for v in second] == ["l2"]
    # A's leases left are in quota: nothing more is reclaimed from them, for anyone.
    assert choose_reclaim("c", 100, {"g0": 100}, leases[:2], m, now=10) is None
    # A team that would go over its quota with the request may not reclaim.
    assert choose_reclaim("b", 300, {"g3": 100}, leases, m, now=10) is None


def test_reclaim_spares_young_leases_and_non_preemptible_ones() -> None:
    m = Membership([Team("a", max_min_runtime_s=60), Team("b", quota_mb=100)])
    young = _charge(1, "a", 100, created_at=100.0, min_runtime_s=120)   # protected for 60 s (its team's max)
    assert protected(young, m.team("a"), now=159) and not protected(young, m.team("a"), now=160)
    assert choose_reclaim("b", 100, {"g0": 100}, [young], m, now=159) is None
    assert choose_reclaim("b", 100, {"g0": 100}, [young], m, now=160) == [young]
    pinned = dataclasses.replace(young, preemptible=False)
    assert choose_reclaim("b", 100, {"g0": 100}, [pinned], m, now=1e9) is None


def test_reclaim_takes_first_from_the_team_furthest_over_its_weighted_share() -> None:
    # a borrows 100 at weight 2 (50 per weight), b borrows 60 at weight 1 (60 per weight): b goes first.
    m = Membership([Team("a", weight=2), Team("b", weight=1), Team("c", quota_mb=100)])
    leases = [_charge(1, "a", 50), _charge(2, "a", 50), _charge(3, "b", 30), _charge(4, "b", 30)]
    assert [c.id for c in reclaim_order("c", leases, leases, m)] == ["l4", "l2", "l3", "l1"]
    assert [v.id for v in choose_reclaim("c", 30, {"g0": 30}, leases, m, now=10) or []] == ["l4"]


def test_reclaim_takes_an_idle_lease_of_the_team_before_its_newer_busy_ones() -> None:
    m = Membership([Team("a", weight=2), Team("b", weight=1), Team("c", quota_mb=100)])
    leases = [_charge(1, "a", 50), _charge(2, "a", 50), _charge(3, "b", 30), _charge(4, "b", 30)]
    assert [c.id for c in reclaim_order("c", leases, leases, m, {"l3"})] == ["l3", "l2", "l4", "l1"]
    assert [v.id for v in choose_reclaim("c", 30, {"g0": 30}, leases, m, now=10, idle={"l3"}) or []] == ["l3"]


# -- properties -----------------------------------------------------------------------------------------------

@st.composite
def teams(draw: st.DrawFn) -> Membership:
    out = []
    for name in TEAMS:
        quota = draw(st.sampled_from([0, 30, 50, 100, 150, 200, 300]))
        limit = draw(st.one_of(st.none(), st.none(), st.integers(quota, 5 * CAPACITY)))
        out.append(Team(name, quota_mb=quota, limit_mb=limit, weight=draw(st.sampled_from([0.5, 1.0, 2.0, 3.0])),
                        max_min_runtime_s=draw(st.sampled_from([0.0, 30.0]))))
    return Membership(out)


_REST = (st.sampled_from(GPUS), st.integers(5, CAPACITY * 2 // 3), st.sampled_from([0.0, 20.0, 60.0]), st.booleans())
requests = st.tuples(st.sampled_from(TEAMS), *_REST)
# Requests mostly of the team that often comes last to the fleet (below its quota), so that reclaims are common.
late_requests = st.tuples(st.sampled_from(["c", "c", "c", "a", "b"]), _REST[0], st.integers(20, CAPACITY), *_REST[2:])


@dataclasses.dataclass
class Fleet:
    membership: Membership
    leases: list[Charge]
    clock: float = 0.0

    def free(self, gpu: str) -> int:
        return CAPACITY - sum(c.vram_mb for c in self.leases if gpu in c.gpus)

    def grant(self, team: str, gpu: str, vram: int, min_runtime: float, preemptible: bool,
              reclaim: bool) -> list[Charge] | None:
        """One request through the team rules as admission applies them: the limit, then fit, then (when
        asked) reclaim, its victims gone before the grant. Returns the victims, None when not granted."""
        self.clock += 1
        used = used_by_team(self.leases).get(team, 0)
        if limit_refusal(self.membership.team(team), used, vram) is not None:
            return None
        victims: list[Charge] | None = []
        if self.free(gpu) < vram:
            if not reclaim:
                return None
            victims = choose_reclaim(team, vram, {gpu: vram - self.free(gpu)}, self.leases, self.membership,
                                     self.clock)
            if victims is None:
                return None
        gone = {v.id for v in victims}
        self.leases = [c for c in self.leases if c.id not in gone]
        self.leases.append(Charge(id=f"l{int(self.clock)}", team=team, vram_mb=vram, gpus=(gpu,),
                                  created_at=self.clock, token=int(self.clock), min_runtime_s=min_runtime,
                                  preemptible=preemptible))
        return victims


@st.composite
def fleets(draw: st.DrawFn) -> Fleet:
    fleet = Fleet(draw(teams()), [])
    # Often only some teams fill the fleet first, so that the others come to it below their quota.
    fill = draw(st.sampled_from([TEAMS, TEAMS[:1], TEAMS[:2]]))
    for r in draw(st.lists(st.tuples(st.sampled_from(fill), *_REST), min_size=10, max_size=24)):
        fleet.grant(*r, reclaim=False)
    fleet.clock += draw(st.sampled_from([0.0, 10.0, 100.0]))
    return fleet


def check_limits(fleet: Fleet) -> None:
    for name, used in used_by_team(fleet.leases).items():
        limit = fleet.membership.team(name).limit_mb
        assert limit is None or used <= limit, f"team {name} uses {used} MiB, above its limit {limit}"
    for g in GPUS:
        assert fleet.free(g) >= 0


@PROPS
@given(fleets(), st.lists(late_requests, min_size=1, max_size=10))
def test_no_team_is_above_its_limit_and_no_in_quota_lease_is_taken_for_another_team(
        fleet: Fleet, more: list[tuple[str, str, int, float, bool]]) -> None:
    check_limits(fleet)
    for r in more:
        before = list(fleet.leases)
        marks = in_quota(before, fleet.membership)
        victims = fleet.grant(*r, reclaim=True)
        for v in victims or []:
            assert v.team != r[0], "a team reclaimed its own lease"
            assert not marks[v.id], f"in-quota lease {v} taken for team {r[0]}"
            assert v.preemptible and not protected(v, fleet.membership.team(v.team), fleet.clock)
        if victims:
            assert stays_in_quota(fleet.membership.team(r[0]), before, r[2])
        check_limits(fleet)


@PROPS
@given(fleets(), late_requests)
def test_reclaim_is_minimal_and_found_whenever_one_exists(fleet: Fleet,
                                                          r: tuple[str, str, int, float, bool]) -> None:
    team, gpu, vram = r[:3]
    need = vram - fleet.free(gpu)
    victims = choose_reclaim(team, vram, {gpu: need}, fleet.leases, fleet.membership, fleet.clock)
    if need <= 0:
        assert victims == []
        return
    candidates = [c for c in reclaimable(team, fleet.leases, fleet.membership, fleet.clock) if gpu in c.gpus]
    if victims is None:
        eligible = stays_in_quota(fleet.membership.team(team), fleet.leases, vram)
        assert not eligible or sum(c.vram_mb for c in candidates) < need, "a reclaim existed but none was found"
        return
    assert sum(v.vram_mb for v in victims) >= need
    for v in victims:
        assert sum(x.vram_mb for x in victims if x is not v) < need, f"victim {v.id} could be spared"


@PROPS
@given(fleets(), late_requests, st.sets(st.integers(0, 24)).map(lambda s: frozenset(f"l{i}" for i in s)))
def test_reclaim_takes_the_team_furthest_over_its_weighted_share_first_idle_first_then_newest_first(
        fleet: Fleet, r: tuple[str, str, int, float, bool], idle: frozenset[str]) -> None:
    team, gpu, vram = r[:3]
    m = fleet.membership

    def check_order(candidates: list[Charge]) -> list[Charge]:
        order = reclaim_order(team, candidates, fleet.leases, m, idle)
        assert sorted(c.id for c in order) == sorted(c.id for c in candidates)
        used = used_by_team(fleet.leases)
        for i, c in enumerate(order):
            rest = order[i:]
            # The weighted share, computed here the long way: VRAM borrowed per unit of weight.
            shares = {x.team: max(0, used[x.team] - m.team(x.team).quota_mb) / m.team(x.team).weight for x in rest}
            assert shares[c.team] == max(shares.values()), f"{c.team} taken before a team further over its share"
            assert (c.id in idle, c.age_order()) == max((x.id in idle, x.age_order()) for x in rest
                                                        if x.team == c.team), "not its team's newest (idle first)"
            used[c.team] -= c.charge_mb
        return order

    everywhere = reclaimable(team, fleet.leases, m, fleet.clock)
    check_order(everywhere)
    order = check_order([c for c in everywhere if gpu in c.gpus])
    victims = choose_reclaim(team, vram, {gpu: vram - fleet.free(gpu)}, fleet.leases, m, fleet.clock,
                             idle=idle) or []
    positions = [next(i for i, c in enumerate(order) if c.id == v.id) for v in victims]
    assert positions == sorted(positions), "victims out of the reclaim order"


@PROPS
@given(st.lists(st.tuples(st.sampled_from(TEAMS[:2]), st.integers(1, 60), st.sampled_from(GPUS[:2])),
                min_size=1, max_size=12),
       st.sampled_from([0.5, 1.0, 3.0]), st.integers(1, 200), st.integers(0, 200))
def test_reclaim_over_many_small_borrowed_leases_is_minimal(held: list[tuple[str, int, str]], weight: float,
                                                            need: int, need_g1: int) -> None:
    """Teams a and b borrow everything they hold (no quota); c, with room in its quota, needs ``need`` MiB on
    g0 and ``need_g1`` on g1: the victims free enough on both, and none of them can be spared."""
    m = Membership([Team("a", weight=weight), Team("b"), Team("c", quota_mb=1000)])
    leases = [_charge(i, team, vram, (gpu,)) for i, (team, vram, gpu) in enumerate(held)]
    shortfall = {"g0": need, "g1": need_g1}
    victims = choose_reclaim("c", 10, shortfall, leases, m, now=1e6)
    freed = {g: sum(c.vram_mb for c in leases if g in c.gpus) for g in ("g0", "g1")}
    if victims is None:
        assert any(freed[g] < n for g, n in shortfall.items())
        return
    def frees(vs: list[Charge], g: str) -> int:
        return sum(v.vram_mb for v in vs if g in v.gpus)
    assert all(frees(victims, g) >= n for g, n in shortfall.items())
    for v in victims:
        rest = [x for x in victims if x is not v]
        assert any(frees(rest, g) < n for g, n in shortfall.items()), f"victim {v.id} could be spared"
