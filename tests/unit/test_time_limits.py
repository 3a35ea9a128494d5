"""Time limits (issue 31, docs/policies.md "Time limits"), the pure parts: what a request's limit becomes
(``policy.time_limits.resolve``: the default, the maximum, the warning capped at the limit), when a lease is warned
(``due``), and the lease and queue records that carry the limit (format 4; records without it, an earlier
release's, have none)."""
from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator import errors
from coordinator.cli.common import duration
from coordinator.cli.render import _time_limit
from coordinator.config import ConfigError, CoordinatorConfig
from coordinator.etcd.types import KV
from coordinator.limits import MAX_TIME_LIMIT_S
from coordinator.policy.team_fields import TeamError
from coordinator.policy.teams import Team
from coordinator.policy.time_limits import (
    MIN_GRACE_S,
    Limited,
    check,
    due,
    resolve,
    team_limits,
)
from coordinator.records import InvalidRecord, QueueEntry, VramLease

pytestmark = pytest.mark.unit

LEASE = VramLease(id="l1", host="h1", gpu_uuid="GPU-1", gpu_index=0, agent="a", session_id="s", vram_mb=1000,
                  priority=0, preemptible=True, request_id="r", token=1, created_at=100.0)
ENTRY = QueueEntry(rank="0001", agent="a", session_id="s", etcd_lease=5, vram_mb=1000, gpu="", priority=0,
                   preemptible=True, request_id="r", lease_id="l1", deadline_unix=200.0, replica="c1")


def kv(doc: dict[str, object]) -> KV:
    return KV(b"/gpucoord/leases/h1/GPU-1/l1", json.dumps(doc).encode(), 3, 3, 1, 0)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), MAX_TIME_LIMIT_S + 1])
def test_a_bad_limit_is_invalid_argument_naming_the_field(bad: float) -> None:
    with pytest.raises(errors.InvalidArgument) as info:
        check(bad)
    assert info.value.field == "time_limit_seconds" and str(info.value).startswith("time_limit_seconds: ")
    with pytest.raises(errors.InvalidArgument) as info:
        check(bad, "time_limit_warning_seconds")
    assert info.value.field == "time_limit_warning_seconds"


def test_resolve_default_maximum_and_warning() -> None:
    assert resolve(0, 0, 0, 0, 120) == (0.0, 0.0)             # no limit, no default: today's behaviour
    assert resolve(0, 0, 3600, 0, 120) == (3600, 120)         # the default
    assert resolve(60, 0, 3600, 0, 120) == (60, 60)           # the warning is capped at the limit
    assert resolve(600, 30, 0, 0, 120) == (600, 30)           # the warning asked wins over the fleet's
    assert resolve(600, 0, 0, 600, 120) == (600, 120)         # at the maximum: allowed
    with pytest.raises(errors.InvalidArgument) as info:
        resolve(601, 0, 0, 600, 120)
    assert info.value.field == "time_limit_seconds" and "maximum" in str(info.value)
    # A minimum runtime (teams) is at most the limit, the default's too.
    assert resolve(600, 0, 0, 0, 120, min_runtime_s=600) == (600, 120)
    assert resolve(0, 0, 0, 0, 120, min_runtime_s=1e6) == (0.0, 0.0)
    for asked, default in ((600, 0), (0, 600)):
        with pytest.raises(errors.InvalidArgument) as info:
            resolve(asked, 0, default, 0, 120, min_runtime_s=601)
        assert info.value.field == "min_runtime_seconds"


@given(st.floats(0, 1e6), st.floats(0, 1e6), st.floats(0, 1e6), st.floats(0, 1e6), st.floats(0, 1e6))
def test_resolve_never_exceeds_the_maximum_and_the_warning_never_exceeds_the_limit(
        asked: float, warn: float, default: float, most: float, fleet_warn: float) -> None:
    if most and default > most:
        default = most   # (the config refuses a default above the maximum)
    try:
        limit, warning = resolve(asked, warn, default, most, fleet_warn)
    except errors.InvalidArgument:
        assert most and asked > most
        return
    assert 0 <= warning <= limit
    assert not most or limit <= most
    assert limit == (asked or default)


def test_due_warns_at_end_minus_warning_with_the_time_left_as_grace() -> None:
    a = Limited("a", ends_at=100.0, warning_s=10.0, noticed=False)
    b = Limited("b", ends_at=200.0, warning_s=50.0, noticed=False)
    assert due([a, b], 89.0) == ([], 90.0)
    assert due([a, b], 90.0) == ([("a", 10.0)], 150.0)
    assert due([a, b], 150.0) == ([("a", pytest.approx(MIN_GRACE_S)), ("b", 50.0)], None)
    # Late (a leader that came after the end): the notice still goes, with a deadline at once.
    assert due([a], 500.0) == ([("a", MIN_GRACE_S)], None)
    # A lease under an operator's notice already gets none.
    assert due([dataclasses.replace(a, noticed=True)], 95.0) == ([], None)


@given(st.lists(st.tuples(st.floats(0, 1e5), st.floats(0, 1e5), st.booleans()), max_size=8), st.floats(0, 2e5))
def test_due_never_warns_early_and_never_gives_a_grace_past_the_end(
        specs: list[tuple[float, float, bool]], now: float) -> None:
    leases = [Limited(str(i), end, min(warn, end), noticed) for i, (end, warn, noticed) in enumerate(specs)]
    todo, next_at = due(leases, now)
    by_id = {x.lease_id: x for x in leases}
    for lease_id, grace in todo:
        x = by_id[lease_id]
        assert not x.noticed and now >= x.ends_at - x.warning_s
        assert grace == max(MIN_GRACE_S, x.ends_at - now)
    assert next_at is None or next_at > now


def test_a_lease_with_a_limit_is_stored_in_format_4_and_round_trips() -> None:
    limited = dataclasses.replace(LEASE, time_limit_s=3.0, time_limit_warning_s=1.0)
    doc = limited.to_json()
    assert doc["format"] == 4 and doc["time_limit_s"] == 3.0 and doc["time_limit_warning_s"] == 1.0
    back = VramLease.from_kv(kv(doc))
    assert (back.time_limit_s, back.time_limit_warning_s, back.created_at) == (3.0, 1.0, 100.0)


def test_a_lease_without_a_limit_keeps_its_format_and_an_earlier_releases_record_has_no_limit() -> None:
    doc = LEASE.to_json()
    assert "format" not in doc and "time_limit_s" not in doc
    assert VramLease.from_kv(kv(doc)).time_limit_s == 0.0
    # Format 3 (the previous release) may not carry the new fields; format 4 may.
    v3 = {**dataclasses.replace(LEASE, min_runtime_s=5.0).to_json()}
    assert v3["format"] == 3 and VramLease.from_kv(kv(v3)).time_limit_s == 0.0
    with pytest.raises(InvalidRecord, match="^time_limit_s: unknown field"):
        VramLease.from_kv(kv({**v3, "time_limit_s": 3.0}))
    with pytest.raises(InvalidRecord, match="^time_limit_s: expected seconds"):
        VramLease.from_kv(kv({**dataclasses.replace(LEASE, time_limit_s=3.0).to_json(), "time_limit_s": -1}))


def test_a_queue_entry_carries_the_limit_to_the_replica_that_grants_it() -> None:
    limited = dataclasses.replace(ENTRY, time_limit_s=7200.0, time_limit_warning_s=120.0)
    doc = limited.to_json()
    assert doc["format"] == 4
    back = QueueEntry.from_kv(KV(b"/gpucoord/queue/h1/0001", json.dumps(doc).encode(), 3, 3, 1, 5))
    assert (back.time_limit_s, back.time_limit_warning_s) == (7200.0, 120.0)
    plain = ENTRY.to_json()
    assert "format" not in plain and "time_limit_s" not in plain


@pytest.mark.parametrize("field", ["time_limit_warning_s", "default_time_limit_s", "max_time_limit_s"])
def test_the_fleets_time_limit_settings_are_bounded(field: str) -> None:
    for bad in (-1.0, MAX_TIME_LIMIT_S + 1):
        with pytest.raises(ConfigError) as info:
            CoordinatorConfig(**{field: bad}).validate()
        assert info.value.field == field
    with pytest.raises(ConfigError) as info:
        CoordinatorConfig(default_time_limit_s=7200, max_time_limit_s=3600).validate()
    assert info.value.field == "default_time_limit_s"


@pytest.mark.parametrize(("text", "seconds"), [("90", 90.0), ("90s", 90.0), ("5m", 300.0), ("2h", 7200.0),
                                               ("1.5h", 5400.0), ("1d", 86400.0), ("0", 0.0), (" 2H ", 7200.0)])
def test_durations_of_the_command_line(text: str, seconds: float) -> None:
    assert duration(text) == seconds


@pytest.mark.parametrize("bad", ["", "h", "2x", "-5", "nan", "inf", "5 m m", "1e999"])
def test_a_bad_duration_is_a_value_error(bad: str) -> None:
    with pytest.raises(ValueError, match="is not a duration"):
        duration(bad)


def test_status_marks_a_lease_with_a_limit_and_the_time_left() -> None:
    assert _time_limit({"time_limit_seconds": 60.0, "created_at": 100.0}, 130.0) == " time limit 60s, ends in 30s"
    assert _time_limit({"time_limit_seconds": 60.0, "created_at": 100.0}, 190.0) == " time limit 60s, at its end"
    assert _time_limit({"time_limit_seconds": 0.0, "created_at": 100.0}, 130.0) == ""


def test_a_teams_limits_win_over_the_fleets_and_the_tighter_maximum_applies() -> None:
    assert team_limits(0, 0, 0, 0) == (0, 0.0)
    assert team_limits(600, 0, 0, 0) == (600, 0.0)           # the fleet's default
    assert team_limits(600, 0, 30, 0) == (30, 0.0)           # the team's default wins
    assert team_limits(0, 3600, 0, 60) == (0, 60)            # the tighter maximum
    assert team_limits(0, 60, 0, 3600) == (0, 60)
    # A fleet's default above a team's maximum is capped at it; a request above it is refused.
    assert resolve(0, 0, *team_limits(600, 0, 0, 60), 120) == (60, 60)
    with pytest.raises(errors.InvalidArgument):
        resolve(61, 0, *team_limits(0, 0, 0, 60), 120)


def test_a_teams_time_limits_are_stored_only_when_set_and_checked() -> None:
    plain = Team(name="research")
    assert "max_time_limit_s" not in plain.to_json() and "default_time_limit_s" not in plain.to_json()
    team = plain.changed({"max_time_limit_s": 7200.0, "default_time_limit_s": 3600.0})
    assert (team.max_time_limit_s, team.default_time_limit_s) == (7200.0, 3600.0)
    assert Team.from_json(team.to_json(), "research") == team
    for changes, field in (({"max_time_limit_s": -1}, "max_time_limit_s"),
                           ({"default_time_limit_s": MAX_TIME_LIMIT_S + 1}, "default_time_limit_s"),
                           ({"max_time_limit_s": 60, "default_time_limit_s": 61}, "default_time_limit_s")):
        with pytest.raises(TeamError) as info:
            plain.changed(changes)
        assert info.value.field == field
