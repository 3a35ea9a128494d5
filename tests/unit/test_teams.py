"""G11, teams as state: the team record (every bad field refused by name) and membership resolution."""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.keys import Keys
from coordinator.policy.teams import (
    DEFAULT_TEAM,
    MAX_TEAM_MEMBERS,
    Membership,
    Team,
    TeamError,
    member_conflicts,
)
from coordinator.records import InvalidRecord, dumps

PROPS = settings(max_examples=300, deadline=None)


@dataclasses.dataclass(frozen=True)
class FakeKV:
    key: bytes
    value: bytes
    mod_revision: int = 7
    etcd_lease: int = 0


def test_team_key_is_under_teams() -> None:
    k = Keys("/t/")
    assert k.team("research") == b"/t/teams/research"
    assert k.teams() == b"/t/teams/"
    assert k.parse(k.team("research")) == ("teams", ["research"])


def test_a_full_team_round_trips_through_its_stored_json() -> None:
    team = Team.from_json({"quota_mb": 327680, "limit_mb": 655360, "weight": 2, "members": ["research-*", "alice"],
                           "quota_by_model": {"NVIDIA H100 80GB HBM3": 163840}, "max_min_runtime_s": 60},
                          "research")
    assert team.members == ("alice", "research-*")
    assert team.model_quota("NVIDIA H100 80GB HBM3") == 163840 and team.model_quota("A10") is None
    stored = Team.from_kv(FakeKV(Keys().team("research"), dumps(team.to_json())))
    assert stored == dataclasses.replace(team, mod_revision=7)


def test_a_missing_field_takes_its_default() -> None:
    team = Team.from_json({}, "t")
    assert (team.quota_mb, team.limit_mb, team.weight, team.members, team.max_min_runtime_s) == (0, None, 1.0, (), 0.0)


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("quota_mb", {"quota_mb": -1}, "outside"),
    ("quota_mb", {"quota_mb": "320GiB"}, "whole number"),
    ("quota_mb", {"quota_mb": True}, "whole number"),
    ("quota_mb", {"quota_mb": 1 << 60}, "outside"),
    ("limit_mb", {"quota_mb": 100, "limit_mb": 99}, "below the team's quota_mb"),
    ("limit_mb", {"limit_mb": 1.5}, "whole number"),
    ("weight", {"weight": 0}, "outside"),
    ("weight", {"weight": -2}, "outside"),
    ("weight", {"weight": float("nan")}, "finite"),
    ("weight", {"weight": "2"}, "finite"),
    ("members", {"members": "research-*"}, "list"),
    ("members", {"members": [""]}, "neither an agent name nor a pattern"),
    ("members", {"members": ["res arch"]}, "neither"),
    ("members", {"members": ["a/b"]}, "neither"),
    ("members", {"members": ["[!a]*"]}, "neither"),
    ("members", {"members": [3]}, "expected agent names"),
    ("members", {"members": ["a", "a"]}, "given twice"),
    ("members", {"members": [f"a{i}" for i in range(MAX_TEAM_MEMBERS + 1)]}, "at most"),
    ("quota_by_model['H100']", {"quota_mb": 10, "quota_by_model": {"H100": 11}}, "above the team's quota_mb"),
    ("quota_by_model['H100']", {"quota_mb": 10, "quota_by_model": {"H100": -1}}, "outside"),
    ("quota_by_model['']", {"quota_by_model": {"": 0}}, "printable name"),
    ("quota_by_model", {"quota_by_model": [1]}, "GPU model: MiB"),
    ("max_min_runtime_s", {"max_min_runtime_s": -1}, "outside"),
    ("max_min_runtime_s", {"max_min_runtime_s": 1e9}, "outside"),
    ("colour", {"colour": "red"}, "unknown field"),
    ("name", {"name": "other"}, "its key"),
]


@pytest.mark.parametrize(("field", "doc", "why"), BAD, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(BAD)])
def test_a_bad_field_is_refused_by_name(field: str, doc: dict[str, Any], why: str) -> None:
    with pytest.raises(TeamError) as e:
        Team.from_json(doc, "research")
    assert e.value.field == field
    assert str(e.value).startswith(f"{field}: ") and why in str(e.value)


@pytest.mark.parametrize("name", ["", "a/b", "-x", "x" * 129])
def test_a_bad_team_name_is_refused(name: str) -> None:
    with pytest.raises(TeamError, match="^name: "):
        Team.from_json({}, name)


def test_the_default_team_takes_no_members() -> None:
    with pytest.raises(TeamError, match="^members: .*every agent no other team names"):
        Team.from_json({"members": ["x"]}, DEFAULT_TEAM)
    assert Team.from_json({"quota_mb": 5}, DEFAULT_TEAM).quota_mb == 5


def test_a_malformed_stored_team_is_an_invalid_record_naming_the_field() -> None:
    with pytest.raises(InvalidRecord, match="^weight: "):
        Team.from_kv(FakeKV(Keys().team("t"), b'{"weight": 0}'))
    with pytest.raises(InvalidRecord, match="^value: not valid JSON"):
        Team.from_kv(FakeKV(Keys().team("t"), b"{"))


def test_changed_keeps_what_is_not_given_and_validates_the_whole() -> None:
    team = Team.from_json({"quota_mb": 100, "limit_mb": 200, "members": ["a-*"]}, "t")
    assert team.changed({"weight": 3}) == dataclasses.replace(team, weight=3.0)
    with pytest.raises(TeamError, match="^limit_mb: "):
        team.changed({"quota_mb": 300})
    assert team.changed({"quota_mb": 300, "limit_mb": None}).limit_mb is None
    with pytest.raises(TeamError, match="^mod_revision: unknown field"):
        team.changed({"mod_revision": 3})


def test_a_pattern_claimed_by_another_team_is_a_conflict() -> None:
    a = Team.from_json({"members": ["research-*", "alice"]}, "a")
    b = Team.from_json({"members": ["research-*", "bob"]}, "b")
    assert member_conflicts(b, [a, b]) == ["'research-*' already belongs to team 'a'"]
    assert member_conflicts(b, [b]) == []
    assert member_conflicts(Team.from_json({"members": ["research-gpu-*"]}, "c"), [a]) == []


# -- membership ---------------------------------------------------------------------------------------------

def test_an_exact_name_beats_any_prefix_and_the_longest_prefix_wins() -> None:
    m = Membership([Team.from_json({"members": ["research-*"]}, "research"),
                    Team.from_json({"members": ["research-gpu-*"]}, "gpu"),
                    Team.from_json({"members": ["research-gpu-7"]}, "seven")])
    assert m.team_of("research-a") == "research"
    assert m.team_of("research-gpu-1") == "gpu"
    assert m.team_of("research-gpu-7") == "seven"
    assert m.team_of("research-gpu-77") == "gpu"
    assert m.team_of("research-") == "research"
    assert m.team_of("research") == DEFAULT_TEAM
    assert m.team_of("bob") == DEFAULT_TEAM


def test_members_take_the_globs_priority_caps_take_and_the_most_specific_pattern_wins() -> None:
    """One pattern syntax (issue 29): fnmatch's ``*``, ``?``, ``[...]`` as in a partition's priority caps; an
    exact name first, then the longest matching pattern, ties to the smallest team name."""
    m = Membership([Team.from_json({"members": ["job-*"]}, "jobs"),
                    Team.from_json({"members": ["job-?-gpu*"]}, "gpu"),
                    Team.from_json({"members": ["*-gpu*"]}, "any-gpu"),
                    Team.from_json({"members": ["job-[0-3]-gpuX"]}, "low"),
                    Team.from_json({"members": ["job-7-gpuX"]}, "seven")])
    assert m.team_of("job-1") == "jobs"
    assert m.team_of("job-1-gpu") == "gpu"            # 'job-?-gpu*' (10) beats 'job-*' (5) and '*-gpu*' (6)
    assert m.team_of("job-1-gpuX") == "low"
    assert m.team_of("job-7-gpuX") == "seven"
    assert m.team_of("x-gpu1") == "any-gpu"
    assert m.team_of("jo") == DEFAULT_TEAM
    tie = Membership([Team.from_json({"members": ["a?c"]}, "b-team"), Team.from_json({"members": ["ab*"]}, "a-team")])
    assert tie.team_of("abc") == "a-team"


@given(st.lists(st.tuples(st.sampled_from(["t1", "t2", "t3"]),
                          st.text(alphabet="ab*?[]-", min_size=1, max_size=5)), max_size=8),
       st.text(alphabet="ab-", max_size=6))
def test_membership_is_the_most_specific_matching_pattern(claims: list[tuple[str, str]], agent: str) -> None:
    import fnmatch

    from coordinator.policy.partition.caps import valid_pattern
    members: dict[str, set[str]] = {}
    seen: set[str] = set()
    for team, pattern in claims:
        if valid_pattern(pattern) and pattern not in seen:   # two teams never claim one pattern
            seen.add(pattern)
            members.setdefault(team, set()).add(pattern)
    m = Membership([Team(t, members=tuple(sorted(ps))) for t, ps in members.items()])
    exact = [t for t, ps in members.items() if agent in ps and not set("*?[]") & set(agent)]
    matches = sorted((-len(p), t) for t, ps in members.items() for p in ps if fnmatch.fnmatchcase(agent, p))
    expected = exact[0] if exact else (matches[0][1] if matches else DEFAULT_TEAM)
    assert m.team_of(agent) == expected
    assert m.team_of(agent) == expected     # and again, from what it kept


def test_a_team_without_a_record_has_no_quota_and_no_limit() -> None:
    m = Membership([Team.from_json({"quota_mb": 5}, DEFAULT_TEAM)])
    assert m.team(DEFAULT_TEAM).quota_mb == 5
    assert m.team("ghost") == Team("ghost")


def test_a_tie_written_by_hand_goes_to_the_smallest_team_name() -> None:
    m = Membership([Team.from_json({"members": ["x-*", "y"]}, "b"), Team.from_json({"members": ["x-*", "y"]}, "a")])
    assert (m.team_of("x-1"), m.team_of("y")) == ("a", "a")


stems = st.from_regex(r"\A[a-c][a-c-]{0,4}\Z", fullmatch=True)
patterns = st.builds(lambda s, star: s + ("*" if star else ""), stems, st.booleans())


def reference_team_of(agent: str, teams: list[Team]) -> str:
    """The documented rule, written the slow way."""
    exact = sorted(t.name for t in teams if agent in t.members)
    if exact:
        return exact[0]
    best: tuple[int, str] | None = None
    for t in teams:
        for p in t.members:
            if p.endswith("*") and agent.startswith(p[:-1]):
                cand = (-len(p), t.name)
                best = cand if best is None or cand < best else best
    return best[1] if best else DEFAULT_TEAM


@PROPS
@given(st.lists(st.lists(patterns, max_size=4, unique=True), max_size=4), st.lists(stems, min_size=1, max_size=8))
def test_membership_follows_the_documented_rule(member_lists: list[list[str]], agents: list[str]) -> None:
    teams = [Team.from_json({"members": ms}, f"t{i}") for i, ms in enumerate(member_lists)]
    m = Membership(teams)
    for agent in agents:
        assert m.team_of(agent) == reference_team_of(agent, teams)


@PROPS
@given(st.fixed_dictionaries({}, optional={
    "quota_mb": st.integers(-5, 1 << 20), "limit_mb": st.one_of(st.none(), st.integers(-5, 1 << 21)),
    "weight": st.one_of(st.floats(allow_nan=True), st.integers(-3, 10)),
    "members": st.lists(st.one_of(patterns, st.text(max_size=5)), max_size=5),
    "max_min_runtime_s": st.floats(-10, 1e6)}))
def test_any_document_is_a_valid_team_or_refused_by_field(doc: dict[str, Any]) -> None:
    try:
        team = Team.from_json(doc, "t")
    except TeamError as e:
        assert e.field in doc
        return
    assert Team.from_json(team.to_json(), "t") == team
    assert team.limit_mb is None or team.limit_mb >= team.quota_mb
    assert team.weight > 0
