"""Review of tests/history.check_history for multi-host gangs (G12): what its rules let through."""
from __future__ import annotations

import pytest

from coordinator.keys import Keys, lease_id_for
from coordinator.records import QueueEntry
from tests.support.history_builder import G0, HOST, History, K, check


@pytest.mark.xfail(strict=True, reason="the history checker has no rule for G12's reservation (G2 across hosts): a "
                   "lease of lower priority than a waiting multi-host gang, created without a time limit on a GPU "
                   "its queue/<host>/<rank> entry reserves, passes (tests/history.py lists no G2/reserve rule)")
def test_a_lower_priority_grant_on_a_reserved_gpu_is_flagged() -> None:
    h = History()
    h.ledger(G0)
    rank = Keys.queue_rank(5, 1, "gang")
    entry = QueueEntry(rank=rank, agent="big", session_id="1", etcd_lease=1, vram_mb=0, gpu="", priority=5,
                       preemptible=True, request_id="g", lease_id=lease_id_for("big", "g", "h0"),
                       deadline_unix=2e9, replica="r1", wait_s=60.0, gpu_count=1, exclusive=True, hosts=2,
                       reserve=(G0,))
    h.put(K.queue_entry(HOST, rank), entry.to_json())
    h.lease("small", "later", 1024, G0, priority=1)      # later-ranked (lower priority), no time limit
    rep = check(h)
    assert rep.violations, "a later-ranked grant on a reserved GPU went unnoticed"
