"""Fair share over time (``policy/fair_share.py``, docs/teams.md "Fair share"): F = 2^(-(U/ΣU)/(w/Σw)), 1 for every
team without usage (a half-life of 0: weight alone), and reclaim's order taking first from the team furthest over
its fair share; Hypothesis properties for the factor."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.policy.fair_share import borrow_shares, fair_factors
from coordinator.policy.team_admission import TeamState, share_refusal
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


# -- the idle capacity beyond the quotas, shared by fair share (``team_admission.share_refusal``) ---------------
TWO = Membership([Team("light", members=("light-*",)), Team("heavy", members=("heavy-*",))])
GPU = 16384


def _state(used: dict[str, int], fair: dict[str, float], borrowable: int | None = 10 * GPU) -> TeamState:
    return TeamState(TWO, used, frozenset(), {}, 1, fair=fair, borrowable_mb=borrowable)


def test_with_a_week_of_heavy_use_the_idle_capacity_splits_one_to_four_while_both_wait() -> None:
    """Equal weights; heavy used everything (F = 1/4, light's F = 1): shares 1/5 and 4/5 of 10 GPUs."""
    fair = fair_factors({"heavy": 3600.0 * 24 * 7}, TWO)
    assert borrow_shares(TWO, fair, ["light", "heavy"]) == {"heavy": 0.2, "light": 0.8}
    used = {"heavy": 2 * GPU, "light": 3 * GPU}
    state = _state(used, fair)
    waiting = {"light": GPU, "heavy": GPU}
    held = share_refusal(state, "heavy", lambda t: used.get(t, 0), GPU, waiting)
    assert held is not None and "heavy" in held and "light" in held and "32768 of 163840" in held
    assert share_refusal(state, "light", lambda t: used.get(t, 0), GPU, waiting) is None   # 4 <= 8 GPUs
    used8 = {"heavy": 1 * GPU, "light": 8 * GPU}       # light at its 8; heavy, below its 2, waits: light waits
    assert share_refusal(_state(used8, fair), "light", lambda t: used8.get(t, 0), GPU, waiting) is not None
    used8 = {"heavy": 2 * GPU, "light": 8 * GPU}       # heavy at its share: it holds nobody back
    assert share_refusal(_state(used8, fair), "light", lambda t: used8.get(t, 0), GPU, waiting) is None


def test_the_share_holds_nobody_back_without_another_team_that_waits_below_its_own_share() -> None:
    fair = fair_factors({"heavy": 3600.0 * 24 * 7}, TWO)
    used = {"heavy": 5 * GPU}
    state = _state(used, fair)
    assert share_refusal(state, "heavy", lambda t: used.get(t, 0), GPU, {}) is None                # nobody waits
    assert share_refusal(state, "heavy", lambda t: used.get(t, 0), GPU, {"heavy": GPU}) is None    # only itself
    over = {"heavy": 5 * GPU, "light": 9 * GPU}                                                     # light past 4/5
    assert share_refusal(_state(over, fair), "heavy", lambda t: over.get(t, 0), GPU, {"light": GPU}) is None
    assert share_refusal(_state(used, fair, None), "heavy", lambda t: used.get(t, 0), GPU, {"light": GPU}) is None


def test_two_teams_each_a_gpu_short_of_their_shares_never_both_wait_while_a_gpu_idles() -> None:
    """3 GPUs beyond the quotas, equal shares of 1.5 GPUs: each holds 1, one GPU is free. Neither waiter fits
    within its own share, so neither holds the other back: the GPU goes to whichever is decided first."""
    used = {"heavy": GPU, "light": GPU}
    state = _state(used, {}, 3 * GPU)
    for team in ("heavy", "light"):
        assert share_refusal(state, team, lambda t: used.get(t, 0), GPU, {"heavy": GPU, "light": GPU}) is None


def test_what_a_quota_guarantees_is_never_held_back_by_the_share() -> None:
    quotas = Membership([Team("light", quota_mb=4 * GPU, members=("light-*",)),
                         Team("heavy", quota_mb=4 * GPU, members=("heavy-*",))])
    used = {"heavy": 3 * GPU, "light": 4 * GPU}
    state = TeamState(quotas, used, frozenset(), {}, 1, fair={"heavy": 0.25, "light": 1.0}, borrowable_mb=2 * GPU)
    assert share_refusal(state, "heavy", lambda t: used.get(t, 0), GPU, {"light": GPU}) is None      # 4 <= quota 4


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["a", "b", "r"]), st.floats(0.0, 1.0).filter(lambda f: f > 0), min_size=1),
       st.lists(st.sampled_from(["a", "b", "r"]), min_size=1))
def test_the_shares_of_the_contenders_sum_to_one_and_follow_weight_times_factor(fair: dict[str, float],
                                                                                contenders: list[str]) -> None:
    shares = borrow_shares(TEAMS, fair, contenders)
    assert set(shares) == set(contenders)
    assert abs(sum(shares.values()) - 1.0) <= 1e-9
    for x in shares:
        for y in shares:
            wx, wy = TEAMS.team(x).weight * fair.get(x, 1.0), TEAMS.team(y).weight * fair.get(y, 1.0)
            assert (shares[x] <= shares[y] + 1e-12) == (wx <= wy + 1e-12) or abs(wx - wy) < 1e-9
