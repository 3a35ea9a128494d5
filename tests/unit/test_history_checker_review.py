"""Review of tests/history.check_history for multi-host gangs (G12): what its rules let through."""
from __future__ import annotations

from coordinator.keys import Keys, lease_id_for
from coordinator.records import QueueEntry
from tests.support.history_builder import G0, HOST, History, K, check


def _reserving(h: History, start_after: float = 0.0) -> bytes:
    h.ledger(G0)
    rank = Keys.queue_rank(5, 1, "gang")
    entry = QueueEntry(rank=rank, agent="big", session_id="1", etcd_lease=1, vram_mb=0, gpu="", priority=5,
                       preemptible=True, request_id="g", lease_id=lease_id_for("big", "g", "h0"),
                       deadline_unix=2e9, replica="r1", wait_s=60.0, gpu_count=1, exclusive=True, hosts=2,
                       reserve=(G0,), start_after=start_after)
    h.put(K.queue_entry(HOST, rank), entry.to_json())
    return K.queue_entry(HOST, rank)


def test_a_lower_priority_grant_on_a_reserved_gpu_is_flagged() -> None:
    h = History()
    _reserving(h)
    h.lease("small", "later", 1024, G0, priority=1)      # later-ranked (lower priority), no time limit
    rep = check(h)
    assert any("G12" in v and "reserves" in v for v in rep.violations), rep.violations


def test_a_backfill_that_ends_by_the_reservations_start_passes() -> None:
    h = History()
    _reserving(h, start_after=1000.0)
    h.lease("small", "fill", 1024, G0, priority=1, extra={"time_limit_s": 100.0, "created_at": 800.0})
    check(h).assert_ok()


def test_a_backfill_that_would_end_after_the_reservations_start_is_flagged() -> None:
    h = History()
    _reserving(h, start_after=1000.0)
    h.lease("small", "fill", 1024, G0, priority=1, extra={"time_limit_s": 300.0, "created_at": 800.0})
    assert any("G12" in v for v in check(h).violations)


def test_grants_of_higher_priority_or_after_the_reservation_left_pass() -> None:
    h = History()
    key = _reserving(h)
    h.lease("urgent", "first", 1024, G0, priority=7)
    h.delete(key)
    h.lease("small", "after", 1024, G0, priority=1)
    check(h).assert_ok()
