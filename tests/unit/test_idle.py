"""Idle GPUs (issue 31, docs/policies.md "Idle GPUs"), the pure parts (``coordinator/policy/idle.py``): the utilization
history, which leases are idle, which get a notice, the policy's bounds, the team's fields and the fleet's config.

The property: the leases chosen for eviction are exactly those whose every GPU reported a known utilization below
the threshold over the whole window, and that were seen at least a window ago, checked against a brute-force
reading of the samples; with a history cut short (fewer points kept) a lease is never chosen early."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator import errors
from coordinator.config import ConfigError, CoordinatorConfig
from coordinator.policy.idle import (
    UNKNOWN,
    IdlePolicy,
    UtilizationHistory,
    below_since,
    check_policy,
    judge,
    team_policy,
    to_evict,
)
from coordinator.policy.team_fields import TeamError
from coordinator.policy.teams import Team

pytestmark = pytest.mark.unit

EVICT = IdlePolicy(after_s=10.0, below_pct=5.0, action="evict")


def history(points: dict[str, list[tuple[float, int]]], max_points: int = 256) -> UtilizationHistory:
    h = UtilizationHistory(max_points)
    for uuid, samples in points.items():
        for at, pct in samples:
            h.observe(uuid, at, pct)
    return h


def test_a_gpu_below_the_threshold_for_the_window_makes_its_lease_idle() -> None:
    h = history({"g": [(0.0, 50), (5.0, 0)]})
    assert below_since(h.points("g"), 5.0) == 5.0
    assert not judge("l", 0.0, ["g"], h, EVICT, 14.9).idle
    j = judge("l", 0.0, ["g"], h, EVICT, 15.0)
    assert j.idle and j.idle_since == 5.0 and j.action == "evict"


def test_the_threshold_is_strict_and_unknown_is_never_idle() -> None:
    assert not judge("l", 0.0, ["g"], history({"g": [(0.0, 5)]}), EVICT, 100.0).idle      # 5 is not below 5
    assert not judge("l", 0.0, ["g"], history({"g": [(0.0, UNKNOWN)]}), EVICT, 100.0).idle
    assert not judge("l", 0.0, ["g"], history({}), EVICT, 100.0).idle                      # never reported
    # Unknown in the middle of the window breaks it: the stretch starts again after it.
    h = history({"g": [(0.0, 0), (20.0, UNKNOWN), (21.0, 0)]})
    assert judge("l", 0.0, ["g"], h, EVICT, 30.0).idle_since == 21.0
    assert not judge("l", 0.0, ["g"], h, EVICT, 30.0).idle and judge("l", 0.0, ["g"], h, EVICT, 31.0).idle


def test_a_fresh_lease_is_not_idle_before_its_window_and_every_gpu_counts() -> None:
    h = history({"a": [(0.0, 0)], "b": [(0.0, 1)], "busy": [(0.0, 90)]})
    assert not judge("l", 100.0, ["a"], h, EVICT, 109.0).idle and judge("l", 100.0, ["a"], h, EVICT, 110.0).idle
    assert judge("l", 0.0, ["a", "b"], h, EVICT, 10.0).idle
    assert not judge("l", 0.0, ["a", "busy"], h, EVICT, 1000.0).idle


def test_a_policy_that_is_off_judges_nothing_and_warn_is_never_evicted() -> None:
    h = history({"g": [(0.0, 0)]})
    assert not judge("l", 0.0, ["g"], h, IdlePolicy(), 1e9).idle
    warned = judge("l", 0.0, ["g"], h, IdlePolicy(10.0, 5.0, "warn"), 100.0)
    assert warned.idle and to_evict([warned], []) == []
    evicted = judge("m", 0.0, ["g"], h, EVICT, 100.0)
    assert to_evict([evicted, warned], []) == ["m"] and to_evict([evicted], ["m"]) == []   # noticed already


def test_the_history_keeps_change_points_only_and_times_never_go_back() -> None:
    h = history({"g": [(0.0, 0), (1.0, 0), (2.0, 0), (3.0, 7), (2.5, 0)]})
    assert h.points("g") == ((0.0, 0), (3.0, 7), (3.0, 0))
    h.keep_only([])
    assert h.points("g") == () and h.current("g") == UNKNOWN
    h.observe("g", 0.0, 250)   # out of range: unknown
    assert h.current("g") == UNKNOWN


def test_policy_bounds_and_the_teams_override() -> None:
    for args, field in (((-1.0, 5.0, "warn"), "idle_after_seconds"), ((1e12, 5.0, "warn"), "idle_after_seconds"),
                        ((1.0, 101.0, "warn"), "idle_below_percent"), ((1.0, float("nan"), "warn"), "idle_below_percent"),
                        ((1.0, 5.0, "kill"), "idle_action")):
        with pytest.raises(errors.InvalidArgument) as info:
            check_policy(*args)
        assert info.value.field == field
    fleet = IdlePolicy(1800.0, 5.0, "warn")
    assert team_policy(fleet, 0.0, 0.0, "") == fleet
    assert team_policy(fleet, 60.0, 0.0, "evict") == IdlePolicy(60.0, 5.0, "evict")


def test_a_team_stores_its_idle_policy_only_when_set() -> None:
    team = Team.from_json({"idle_after_s": 600, "idle_action": "evict"}, "research")
    assert (team.idle_after_s, team.idle_below_pct, team.idle_action) == (600.0, 0.0, "evict")
    assert team.to_json()["idle_action"] == "evict" and "idle_below_pct" not in team.to_json()
    assert "idle_after_s" not in Team(name="plain").to_json()
    for doc, field in (({"idle_action": "kill"}, "idle_action"), ({"idle_after_s": -1}, "idle_after_s"),
                       ({"idle_below_pct": 200}, "idle_below_pct")):
        with pytest.raises(TeamError) as info:
            Team.from_json(doc, "t")
        assert info.value.field == field


def test_the_fleets_config_is_checked_at_start() -> None:
    assert CoordinatorConfig().idle_after_s == 0.0   # off by default
    bads: tuple[tuple[str, object], ...] = (("idle_after_s", -1.0), ("idle_below_pct", 101.0), ("idle_action", "kill"))
    for field, bad in bads:
        with pytest.raises(ConfigError) as info:
            CoordinatorConfig(**{field: bad}).validate()   # type: ignore[arg-type]
        assert info.value.field == field


# ------------------------------------------------------------------------------------------------ property

def reference_idle(samples: dict[str, list[tuple[float, int]]], gpus: list[str], seen: float, policy: IdlePolicy,
                   now: float) -> bool:
    """Brute force: the signal of each GPU is the latest sample at or before t (unknown before the first); idle
    when it is known and below the threshold at every t in [now - window, now], and the lease was seen by then."""
    start = now - policy.after_s
    if seen > start:
        return False

    def value(uuid: str, t: float) -> int:
        before = [pct for at, pct in samples.get(uuid, []) if at <= t]
        return before[-1] if before else UNKNOWN

    for uuid in gpus:
        times = [start] + [at for at, _ in samples.get(uuid, []) if start < at <= now]
        if any(not 0 <= value(uuid, t) < policy.below_pct for t in times):
            return False
    return True


PCT = st.sampled_from([UNKNOWN, 0, 1, 4, 5, 6, 50, 100])
SAMPLES = st.lists(st.tuples(st.integers(0, 40), PCT), max_size=12).map(
    lambda xs: [(float(t), p) for t, p in sorted(set(xs), key=lambda x: x[0])])


@settings(max_examples=400, deadline=None)
@given(per_gpu=st.dictionaries(st.sampled_from(["g0", "g1", "g2"]), SAMPLES, max_size=3),
       leases=st.lists(st.tuples(st.lists(st.sampled_from(["g0", "g1", "g2"]), min_size=1, max_size=3, unique=True),
                                 st.integers(0, 40), st.booleans(), st.booleans()), min_size=1, max_size=5),
       after=st.integers(1, 30), below=st.sampled_from([1.0, 5.0, 6.0, 51.0]), now=st.integers(40, 80),
       cut=st.integers(1, 4))
def test_only_leases_idle_for_the_whole_window_are_chosen(per_gpu: dict[str, list[tuple[float, int]]],
                                                          leases: list[tuple[list[str], int, bool, bool]], after: int,
                                                          below: float, now: int, cut: int) -> None:
    # (One sample per time per GPU: two at one instant would make the signal's value there ambiguous.)
    per_gpu = {u: list({t: p for t, p in xs}.items()) for u, xs in per_gpu.items()}
    full, short = history(per_gpu), history(per_gpu, max_points=cut)
    judged, judged_short, expected, noticed = [], [], set(), []
    for i, (gpus, seen, evict, has_notice) in enumerate(leases):
        policy = IdlePolicy(float(after), below, "evict" if evict else "warn")
        lease_id = f"l{i}"
        j = judge(lease_id, float(seen), gpus, full, policy, float(now))
        truth = reference_idle(per_gpu, gpus, float(seen), policy, float(now))
        assert j.idle == truth, (lease_id, gpus, seen, full.points(gpus[0]))
        judged.append(j)
        judged_short.append(judge(lease_id, float(seen), gpus, short, policy, float(now)))
        if has_notice:
            noticed.append(lease_id)
        elif truth and evict:
            expected.add(lease_id)
    assert set(to_evict(judged, noticed)) == expected
    # A history cut short never chooses a lease early: what it chooses is idle in truth.
    assert set(to_evict(judged_short, noticed)) <= expected


def test_status_marks_an_idle_lease_and_team_show_describes_the_policy() -> None:
    from coordinator.cli.render import _idle
    from coordinator.cli.teams import describe

    assert _idle({"idle": False}, 100.0) == ""
    assert _idle({"idle": True, "idle_since": 5.0, "idle_action": "evict"}, 100.0) == " IDLE for 95s (evict)"
    line = describe({"quota_mb": 0, "members": [], "idle_after_seconds": 600.0, "idle_action": "warn"})
    assert "idle warn after 600s below 0%" in line
    assert "idle" not in describe({"quota_mb": 0, "members": []})
