"""Fair share over time (``policy/fair_share.py``, docs/teams.md "Fair share"): F = 2^(-(U/ΣU)/(w/Σw)), 1 for every
team without usage (a half-life of 0: weight alone), and reclaim's order taking first from the team furthest over
its fair share; Hypothesis properties for the factor."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.policy.fair_share import fair_factors
from coordinator.policy.teams import Charge, Membership, Team, reclaim_order

TEAMS = Membership([Team("a", quota_mb=10, members=("a-*",)), Team("b", quota_mb=10, members=("b-*",)),
                    Team("r", quota_mb=40, members=("r-*",))])


def test_without_usage_every_factor_is_one_and_weight_alone_orders() -> None:
    assert fair_factors({}, TEAMS) == {"a": 1.0, "b": 1.0, "r": 1.0}
    assert fair_factors({"a": 0.0, "b": 0.0}, TEAMS) == {"a": 1.0, "b": 1.0, "r": 1.0}


def test_a_team_with_all_the_usage_at_an_equal_weight_gets_a_quarter_of_the_others_factor() -> None:
    two = Membership([Team("a"), Team("b")])
    assert fair_factors({"a": 3600.0 * 24 * 7}, two) == {"a": 0.25, "b": 1.0}   # 2^-(1 / (1/2)) = 1/4


def test_reclaim_takes_first_from_the_team_furthest_over_its_fair_share() -> None:
    """a and b each borrow 10 MiB; by weight alone the tie goes to the name (a first); with b's factor a
    quarter of a's (b used the fleet all week), b's lease is taken first."""
    charges = [Charge("a0", "a", 10, ("g0",), 0.0), Charge("a1", "a", 10, ("g1",), 1.0),
               Charge("b0", "b", 10, ("g2",), 0.0), Charge("b1", "b", 10, ("g3",), 1.0)]
    over = [c for c in charges if c.id in ("a1", "b1")]
    assert [c.id for c in reclaim_order("r", over, charges, TEAMS)] == ["a1", "b1"]
    fair = fair_factors({"b": 1e6}, TEAMS)
    assert [c.id for c in reclaim_order("r", over, charges, TEAMS, fair=fair)] == ["b1", "a1"]


USAGE = st.dictionaries(st.sampled_from(["a", "b", "r"]), st.one_of(st.just(0.0), st.floats(1e-3, 1e9)), max_size=3)


@settings(max_examples=300, deadline=None)
@given(USAGE, st.sampled_from(["a", "b", "r"]), st.floats(1.0, 1e6))
def test_more_usage_never_raises_a_teams_factor_and_every_factor_is_in_0_1(used: dict[str, float], team: str,
                                                                          more: float) -> None:
    before = fair_factors(used, TEAMS)
    after = fair_factors({**used, team: used.get(team, 0.0) + more}, TEAMS)
    assert all(0.0 < f <= 1.0 for f in (*before.values(), *after.values()))
    assert after[team] <= before[team] + 1e-12


@settings(max_examples=300, deadline=None)
@given(USAGE, st.floats(0.001, 1000.0))
def test_scaling_every_teams_usage_leaves_the_factors_alone(used: dict[str, float], scale: float) -> None:
    a, b = fair_factors(used, TEAMS), fair_factors({t: u * scale for t, u in used.items()}, TEAMS)
    assert all(abs(a[t] - b[t]) <= 1e-9 for t in a)
