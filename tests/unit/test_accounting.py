"""Usage accounting's pure part (coordinator.policy.accounting): records from one revision's deletions, how a
lease ended, hours split exactly, rollups, and commits that never pass etcd's --max-txn-ops."""
from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.keys import Keys
from coordinator.policy.accounting import (
    Deleted,
    UsageRecord,
    charge,
    ended_in,
    hour_of,
    pieces_of,
    plan_commit,
    seconds,
    split_by_hour,
    totals_from_records,
    totals_from_rollups,
)

K = Keys("/t/")
T0 = 1_764_874_800.0   # 2025-12-04T19:00:00Z, an hour boundary


def lease(lid: str = "l1", gpu: str = "GPU-0", index: int = 0, gang: tuple[str, ...] = (), vram: int = 1000,
          created_at: float = T0 + 10, agent: str = "a", session: str = "s1") -> dict[str, object]:
    return {"id": lid, "host": "h1", "gpu_uuid": gpu, "gpu_index": index, "agent": agent, "session_id": session,
            "vram_mb": vram, "priority": 0, "preemptible": True, "request_id": "r", "token": 1,
            "created_at": created_at, "gang": list(gang), "exclusive": bool(gang)}


def deleted(doc: dict[str, object], rev: int = 50, created: int = 10) -> Deleted:
    key = K.lease("h1", str(doc["gpu_uuid"]), str(doc["id"]))
    return Deleted(key, json.dumps(doc).encode(), created, rev)


def records(*dels: Deleted, end: float = T0 + 70) -> list[UsageRecord]:
    return ended_in(list(dels), K, lambda agent: "team-" + agent, end)


def test_a_released_lease_is_one_record_with_its_seconds() -> None:
    (r,) = records(deleted(lease()))
    assert (r.lease_id, r.agent, r.team, r.host, r.gpus, r.vram_mb) == ("l1", "a", "team-a", "h1", ("GPU-0",), 1000)
    assert (r.start_revision, r.end_revision, r.reason) == (10, 50, "release")
    assert (r.gpu_seconds, r.vram_mib_seconds) == (60.0, 60_000.0)


def test_a_gang_is_one_record_over_its_gpus() -> None:
    gang = ("GPU-0", "GPU-1")
    (r,) = records(deleted(lease(gpu="GPU-1", index=1, gang=gang)), deleted(lease(gang=gang)))
    assert r.gpus == gang and r.gpu_indexes == (0, 1) and r.exclusive
    assert r.gpu_seconds == 120.0


def test_a_multi_host_gang_is_one_record_naming_its_rank_0_host_with_gpus_in_rank_order() -> None:
    parts = [["h2", ["GPU-b0"]], ["h1", ["GPU-a0"]]]        # rank 0 on h2, whatever the deletion order says
    docs = [{**lease(gpu=gpu, index=0), "host": host, "hosts": parts} for host, gpu in (("h1", "GPU-a0"), ("h2", "GPU-b0"))]
    dels = [Deleted(K.lease(str(d["host"]), str(d["gpu_uuid"]), "l1"), json.dumps(d).encode(), 10, 50) for d in docs]
    (r,) = records(*dels)
    assert (r.host, r.gpus, r.gpu_seconds) == ("h2", ("GPU-b0", "GPU-a0"), 120.0)


def test_the_end_reason_comes_from_what_else_the_revision_deleted() -> None:
    session = Deleted(K.session("a", "s1"), b"{}", 5, 50)

    def notice(**kw: object) -> Deleted:
        return Deleted(K.eviction("l1"), json.dumps({"lease_id": "l1", **kw}).encode(), 40, 50)
    assert records(deleted(lease()), session)[0].reason == "session"
    assert records(deleted(lease()), session, notice())[0].reason == "session"
    assert records(deleted(lease()), notice())[0].reason == "eviction"
    assert records(deleted(lease()), notice(reclaim="t2"))[0].reason == "reclaim"
    assert records(deleted(lease()), notice(revoke=True))[0].reason == "revoke"
    other = Deleted(K.eviction("l2"), b"{}", 40, 50)
    assert records(deleted(lease()), other)[0].reason == "release"


def test_a_lease_id_that_comes_back_is_another_record() -> None:
    a, b = records(deleted(lease(), created=10), deleted(lease(gpu="GPU-1"), created=30))
    assert {a.key_name, b.key_name} == {"l1@10", "l1@30"}


def test_an_unreadable_lease_value_is_skipped() -> None:
    bad = Deleted(K.lease("h1", "GPU-0", "l9"), b"not json", 3, 50)
    assert records(bad, deleted(lease()))[0].lease_id == "l1" and len(records(bad)) == 0


def test_a_clock_behind_the_grant_counts_zero_not_negative() -> None:
    (r,) = records(deleted(lease(created_at=T0 + 100)), end=T0 + 50)
    assert r.gpu_seconds == 0.0


@given(st.floats(T0, T0 + 86400 * 30), st.floats(0, 86400 * 10))
def test_hours_split_the_time_exactly(start: float, length: float) -> None:
    pieces = split_by_hour(start, start + length)
    assert abs(sum(s for _, s in pieces) - seconds(start, start + length)) < 1e-6
    # The first piece is the hour it started in; a lease of no time (to the millisecond) is one piece of 0 s in
    # the hour it ended, where its count goes (a start 0.4 ms before an hour's end is in the hour before).
    assert pieces[0][0] == (hour_of(start) if seconds(start, start + length) > 0 else hour_of(start + length))
    assert len({h for h, _ in pieces}) == len(pieces)
    assert all(0 <= s <= 3600 for _, s in pieces)


def test_a_lease_of_no_time_across_an_hour_boundary_is_one_piece_in_the_hour_it_ended() -> None:
    hour = 3600.0 * 490_000                      # an hour boundary (2025-11-24T16)
    assert split_by_hour(hour - 0.0004, hour) == [(hour_of(hour), 0.0)]


def record(start: float, end: float, reason: str = "release", agent: str = "a", gpus: int = 1) -> UsageRecord:
    n = gpus
    return UsageRecord("l", agent, "t", "h1", tuple(f"G{i}" for i in range(n)), tuple(range(n)), 1024, False, 1, 2,
                       start, end, reason, n * seconds(start, end), n * 1024 * seconds(start, end))


def test_rollups_charge_each_hour_and_the_eviction_in_the_last() -> None:
    r = record(T0 + 1800, T0 + 3600 + 900, "eviction", gpus=2)
    rollups: dict[tuple[str, str], dict[str, object]] = {}
    charge(rollups, r, pieces_of(r), True)
    first, second = (rollups[(hour_of(T0)), "t"], rollups[(hour_of(T0 + 3600), "t")])
    assert (first["gpu_s"], second["gpu_s"]) == (3600.0, 1800.0)
    assert (first["evictions"], second["evictions"], second["leases"]) == (0, 1, 1)
    totals = totals_from_rollups([(h, t, v) for (h, t), v in rollups.items()], "agent")["a"]
    assert (totals.gpu_s, totals.evictions, totals.leases) == (5400.0, 1, 1)
    assert totals.row()["gpu_hours"] == 1.5


def test_records_sum_by_host_within_a_window() -> None:
    rs = [record(T0, T0 + 3600), record(T0 + 1800, T0 + 2400, "revoke")]
    t = totals_from_records(rs, "host", T0 + 1800, T0 + 3600)["h1"]
    assert (t.gpu_s, t.evictions, t.leases) == (2400.0, 1, 1)


@settings(deadline=None)
@given(st.lists(st.floats(0, 86400 * 6), min_size=1, max_size=30), st.integers(2, 127))
def test_a_commit_never_passes_its_budget_and_every_hour_is_charged_once(lengths: list[float], budget: int) -> None:
    rs = [record(T0 + i, T0 + i + length, agent=f"a{i % 3}") for i, length in enumerate(lengths)]
    i = part = 0
    charged: dict[int, int] = {}
    finals = []
    while i < len(rs):
        units, i, part = plan_commit(rs, i, part, budget)
        assert units, "no progress"
        keys = {(h, u.record.team) for u in units for h, _ in u.pieces}
        assert len(keys) + sum(u.final for u in units) <= budget
        for u in units:
            charged[id(u.record)] = charged.get(id(u.record), 0) + len(u.pieces)
            if u.final:
                finals.append(u.record)
    assert finals == rs
    assert all(charged[id(r)] == len(pieces_of(r)) for r in rs)


def test_usage_windows_read_durations_ago_and_utc_times() -> None:
    import pytest

    from coordinator.cli.common import UsageError
    from coordinator.cli.usage import parse_when
    assert parse_when("7d", "--since", T0) == T0 - 7 * 86400
    assert parse_when("90m", "--since", T0) == T0 - 5400
    assert parse_when("2025-12-04T19", "--since", 0) == T0
    assert parse_when("2025-12-04T19:30Z", "--until", 0) == T0 + 1800
    with pytest.raises(UsageError, match="--since"):
        parse_when("last week", "--since", T0)


def test_decayed_usage_halves_each_half_life_and_a_zero_half_life_forgets_everything() -> None:
    from coordinator.policy.accounting import decayed_gpu_seconds, hour_of
    hour = hour_of(T0)                       # ends at T0 + 3600
    day = 86400.0
    assert decayed_gpu_seconds([(hour, 3600.0)], [], T0 + 3600, day) == 3600.0
    assert abs(decayed_gpu_seconds([(hour, 3600.0)], [], T0 + 3600 + day, day) - 1800.0) < 1e-6
    assert decayed_gpu_seconds([(hour, 3600.0)], [T0], T0 + 3600 + day, 0.0) == 0.0


@settings(max_examples=200, deadline=None)
@given(st.floats(1.0, 1e6), st.floats(0.0, 1e6), st.floats(60.0, 1e7))
def test_a_live_lease_counts_at_most_its_running_time_and_more_the_longer_it_runs(
        ran: float, later: float, half_life: float) -> None:
    from coordinator.policy.accounting import decayed_gpu_seconds
    now = T0 + ran
    d = decayed_gpu_seconds([], [T0], now, half_life)
    assert 0.0 <= d <= ran * (1 + 1e-9)
    assert decayed_gpu_seconds([], [T0], now + later, half_life) >= d - 1e-6
