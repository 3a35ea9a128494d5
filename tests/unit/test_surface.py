"""One surface (issue 28's smaller points, issue 29 point 5), the pure parts: one size grammar (a number
without a unit is bytes; 0 is 0; anything else under 1 MiB is refused naming the field, never rounded to 0),
one display rule (binary units, at most 4 significant digits), a team's fields checked on their own before
anything is sent, an exclusive waiter's charge, the answer to a wait that ends, and a request that its team's
limit could never let in refused at once."""
from __future__ import annotations

import argparse
import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator import errors
from coordinator.cli.common import UsageError
from coordinator.cli.main import build_parser
from coordinator.cli.queue import render_queue
from coordinator.cli.render import render_status
from coordinator.cli.teams import describe, render_teams, set_request
from coordinator.config import CoordinatorConfig
from coordinator.policy.decide import wait_over
from coordinator.policy.host import HostView
from coordinator.policy.partition import (
    PartitionError,
    parse_mib,
    parse_spec,
    show_bytes,
    show_mib,
)
from coordinator.policy.plan import Context, Plan
from coordinator.policy.planner import plan_round
from coordinator.policy.team_admission import TeamState
from coordinator.policy.teams import (
    MAX_TEAM_MB,
    MIN_WEIGHT,
    Membership,
    Team,
    TeamError,
    check_changes,
    over_share,
)
from coordinator.replica.teams import waiting_charge_mb
from tests.support.planner_calls import (
    KEYS,
    NOW,
    WALL,
    Call,
    entry_of,
    one_gpu_host,
    waiting_call,
)

pytestmark = pytest.mark.unit

MIB = 1 << 20
LIMIT = 8192


def _round(view: HostView, batch: list[Call], team_used: int, waiting: dict[str, Call] | None = None) -> Plan[Call]:
    """Team t (agents a and b, limit ``LIMIT``, no maximum minimum runtime) uses ``team_used`` MiB elsewhere."""
    state = TeamState(Membership([Team("t", limit_mb=LIMIT, members=("a", "b"))]), {"t": team_used},
                      frozenset(view.leases), {"t": (77, 5)}, 600)
    ctx = Context(KEYS, CoordinatorConfig().validate(), "r1", frozenset(), NOW, WALL, teams=state)
    return plan_round(view, batch, waiting or {}, {c.session.session_id for c in batch}, ctx)


# -- sizes -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,mib", [("0", 0), (0, 0), ("1MiB", 1), ("1048576", 1), (1048576, 1), ("1.5GiB", 1536),
                                      ("1PiB", 1 << 30), ("1048577", 1)])
def test_a_size_is_bytes_without_a_unit_and_whole_mib_rounded_down(text: object, mib: int) -> None:
    assert parse_mib(text, "f") == mib


@pytest.mark.parametrize("text", ["100KiB", "1", 100000, "1048575", "0.5MiB", "1KB"])
def test_a_size_under_one_mib_is_refused_naming_the_field_never_rounded_to_0(text: object) -> None:
    with pytest.raises(PartitionError) as e:
        parse_mib(text, "reserved.vram_headroom")
    assert e.value.field == "reserved.vram_headroom" and "less than 1 MiB" in e.value.message


def test_a_spec_whose_headroom_is_under_one_mib_is_refused_naming_it() -> None:
    with pytest.raises(PartitionError) as e:
        parse_spec({"host": "h", "mode": "shared", "reserved": {"vram_headroom": 100000}})
    assert e.value.field == "reserved.vram_headroom"
    ok = parse_spec({"host": "h", "mode": "shared", "reserved": {"vram_headroom": 1 << 30}})
    assert ok.reserved.vram_headroom_mb == 1024      # bytes, as on the command line


@pytest.mark.parametrize("mb,shown", [(0, "0MiB"), (512, "512MiB"), (1000, "1000MiB"), (1024, "1GiB"),
                                      (81408, "79.5GiB"), (12345, "12.06GiB"), (1 << 30, "1PiB"),
                                      (MAX_TEAM_MB, "1ZiB")])
def test_the_display_rule_examples(mb: int, shown: str) -> None:
    assert show_mib(mb) == shown


@given(st.integers(0, 1 << 62))
def test_a_size_is_shown_in_binary_units_with_at_most_4_significant_digits_close_to_its_value(n: int) -> None:
    text = show_bytes(n)
    m = re.fullmatch(r"([0-9.]+)(B|KiB|MiB|GiB|TiB|PiB|EiB|ZiB)", text)
    assert m is not None, text
    digits = m.group(1).replace(".", "").lstrip("0")
    assert len(digits) <= 4, text
    scale = 1024 ** ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB"].index(m.group(2))
    value = float(m.group(1)) * scale
    assert math.isclose(value, n, rel_tol=5e-4, abs_tol=0.5), (n, text)
    assert float(m.group(1)) < 1024 or m.group(2) == "EiB", text


# -- teams -----------------------------------------------------------------------------------------------------

def _team_set(*argv: str) -> object:
    args = build_parser().parse_args(["team", "set", "t", *argv])
    assert isinstance(args, argparse.Namespace)
    return set_request(args)


@pytest.mark.parametrize("argv,flag", [
    (["--members", "a,,b"], "--members"), (["--members", "a,"], "--members"),
    (["--model-quota", "A100=1GiB", "--model-quota", "A100=2GiB"], "--model-quota"),
    (["--model-quota", "none", "--model-quota", "A100=1GiB"], "--model-quota"),
    (["--weight", "1e-300"], "--weight"), (["--weight", "0"], "--weight"), (["--weight", "inf"], "--weight"),
    (["--quota", "100KiB"], "--quota"), (["--limit", "12"], "--limit"), (["--quota", "10000PiB"], "--quota"),
    (["--max-min-runtime", "-1"], "--max-min-runtime"), (["--members", "a b"], "--members"),
])
def test_team_set_refuses_a_bad_field_before_sending_naming_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(UsageError) as e:
        _team_set(*argv)
    assert e.value.code == 2 and e.value.message.startswith(f"{flag}: "), e.value.message


def test_team_set_takes_zero_and_bytes_and_prints_a_petabyte_as_such() -> None:
    req = _team_set("--quota", "0", "--limit", "1PiB", "--members", "a, research-*", "--model-quota", "A100=0")
    assert req.quota_mb == 0 and req.limit_mb == 1 << 30 and list(req.members.patterns) == ["a", "research-*"]
    assert dict(req.quota_by_model.mb) == {"A100": 0}
    assert _team_set("--quota", str(1 << 30)).quota_mb == 1024
    assert describe({"quota_mb": 0, "limit_mb": 1 << 30, "has_limit": True}).startswith("quota 0MiB, limit 1PiB")


def test_a_weight_too_small_to_divide_by_is_refused_and_the_smallest_allowed_keeps_shares_finite() -> None:
    with pytest.raises(TeamError) as e:
        Team.from_json({"weight": 1e-300}, "t")
    assert e.value.field == "weight"
    with pytest.raises(TeamError):
        check_changes({"weight": 1e-300})
    assert math.isfinite(over_share(Team("t", weight=MIN_WEIGHT), MAX_TEAM_MB))


def test_an_exclusive_waiter_counts_as_the_least_its_grant_could_be_charged() -> None:
    assert waiting_charge_mb(0, 2, True, [32768, 16384, 16384]) == 32768
    assert waiting_charge_mb(4096, 2, False, [32768]) == 8192
    row = {"team": {"name": "t"}, "usage": {"waiting_mb": 32768, "waiting": 1}, "stored": True}
    assert "32GiB (1)" in render_teams([row])


# -- waits, shapes and the team limit -------------------------------------------------------------------------

def test_a_wait_that_ends_names_what_was_asked() -> None:
    assert wait_over(0, 3, 2, True).message == "exclusive: 2 whole GPUs did not fit after waiting 3 s"
    assert wait_over(0, 3, 2, True).field == "exclusive"
    assert wait_over(4096, 3, 2).message == "vram_mb: 4096 MiB on each of 2 GPUs did not fit after waiting 3 s"
    assert wait_over(4096, 3).message == "vram_mb: 4096 MiB did not fit after waiting 3 s"


def test_a_waiting_gang_shows_its_shape() -> None:
    doc = {"hosts": [{"host": "h", "alive": True, "gpus": [], "queue": [
        {"agent": "a", "vram_mb": 0, "priority": 0, "gpu_count": 2, "exclusive": True, "gpus": [], "topology": "nvlink"},
        {"agent": "b", "vram_mb": 4096, "priority": 1, "gpu_count": 2, "gpus": ["0", "1"]},
        {"agent": "c", "vram_mb": 1024, "priority": 2, "gpu": "1"}]}]}
    table = render_status(doc)
    assert "waiting: a 2 whole GPUs gpus=any topology=nvlink priority 0" in table
    assert "waiting: b 4GiB x 2 GPUs gpus=0,1 priority 1" in table
    assert "waiting: c 1GiB gpu=1 priority 2" in table
    assert "0M" not in table


def test_the_queue_table_shows_sizes_by_the_display_rule_and_a_gangs_shape() -> None:
    doc = {"revision": 1, "waiting": [
        {"host": "h", "position": 1, "agent": "a", "vram_mb": 16384, "priority": 0, "reason": "r"},
        {"host": "h", "position": 2, "agent": "b", "vram_mb": 4096, "gpu_count": 2, "priority": 0, "reason": "r"},
        {"host": "h", "position": 3, "agent": "c", "vram_mb": 0, "gpu_count": 2, "exclusive": True, "priority": 0,
         "reason": "r"}]}
    rows = render_queue(doc, 0.0).splitlines()[1::2]    # the reason lines between them left out
    assert " 16GiB " in rows[0] and " 4GiB x 2 " in rows[1] and " 2 whole GPUs " in rows[2], rows
    assert "MiB" not in "".join(rows), rows


def test_a_request_its_teams_limit_could_never_let_in_is_refused_at_once_even_with_a_wait() -> None:
    view = one_gpu_host([])
    big, fits = waiting_call("a", "big", LIMIT + 4096, 30.0, 1000), waiting_call("b", "fits", 4096, 30.0, 1001)
    plan = _round(view, [big, fits], team_used=0)
    ((call, err),) = plan.refusals
    assert call.request_id == "big" and isinstance(err, errors.FailedPrecondition) and err.field == "team"
    assert f"limit of team 't' ({LIMIT} MiB)" in err.message and "even with nothing of it in use" in err.message
    assert [x.request_id for x in plan.new_leases] == ["fits"]
    # One already queued (its team's limit lowered while it waited) leaves the queue with that answer.
    queued = waiting_call("a", "queued", LIMIT + 4096, 30.0, 900)
    plan = _round(one_gpu_host([], (entry_of(queued),)), [], team_used=0, waiting={queued.lease_id: queued})
    assert [e.request_id for e in plan.left] == ["queued"]
    ((call, err),) = plan.failures
    assert call is queued and err.field == "team"


def test_a_lease_records_its_minimum_runtime_capped_by_its_teams_maximum() -> None:
    """``run --min-runtime 600`` under a team maximum of 0: the lease says 0, what reclaim applies."""
    import dataclasses

    asked = dataclasses.replace(waiting_call("a", "long", 1024, 0.0, 1000), min_runtime_s=600.0)
    (lease,) = _round(one_gpu_host([]), [asked], team_used=0).new_leases
    assert lease.min_runtime_s == 0.0
