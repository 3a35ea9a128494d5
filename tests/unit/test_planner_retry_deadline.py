"""G8: a retry that joins its waiting request's queue entry (the client moved to another replica, or sent
again after an attempt timed out) is never answered before the deadline the entry states. The retry's own
deadline is measured from its own, later arrival with the wait the client had left: it may fall before the
entry's, which was measured from the first arrival. The round keeps the later of the two."""
from __future__ import annotations

from coordinator.config import CoordinatorConfig
from coordinator.keys import Keys, lease_id_for
from coordinator.policy.admission import GpuView
from coordinator.policy.host import HostView
from coordinator.policy.partition import Partition, compute_partition, parse_spec
from coordinator.policy.plan import Context
from coordinator.policy.planner import plan_round
from coordinator.records import GpuInfo, GpuLedger, HostInventory, QueueEntry, VramLease
from coordinator.txn import ModRevisionIs
from tests.support.planner_calls import _KV, HOST, KEYS, NOW, WALL, Call, session


def _full_host_with_waiter(entry_deadline_unix: float, replica: str) -> tuple[HostView, QueueEntry]:
    inventory = HostInventory(HOST, "", 8, tuple(range(8)), 1 << 34, "/", 1 << 40, (GpuInfo(0, "GPU-0", "sim", 8192),))
    part = Partition.from_json(compute_partition(inventory, parse_spec({"host": HOST, "mode": "shared"})).to_json())
    c = session("c")
    holder = VramLease(id="held", host=HOST, gpu_uuid="GPU-0", gpu_index=0, agent="c", session_id=c.session_id,
                       vram_mb=8192, priority=9, preemptible=False, request_id="held", token=1, created_at=1.0,
                       etcd_lease=c.etcd_lease, mod_revision=100)
    a = session("a")
    lease_id = lease_id_for("a", "r1", HOST)
    entry = QueueEntry(rank=Keys.queue_rank(0, 10, lease_id), agent="a", session_id=a.session_id,
                       etcd_lease=a.etcd_lease, vram_mb=1024, gpu="", priority=0, preemptible=True, request_id="r1",
                       lease_id=lease_id, deadline_unix=entry_deadline_unix, replica=replica, mod_revision=200)
    gpu = GpuView(uuid="GPU-0", index=0, total_mb=8192, usable_mb=part.usable_mb(inventory.gpus[0]),
                  ledger=GpuLedger(8192, 1, 300), leases=[holder])
    view = HostView(HOST, 500, inventory, _KV(KEYS.host(HOST), b"{}", 40, 0x99), None, None, {"GPU-0": gpu},
                    {"held": holder}, None, (), (entry,))
    return view, entry


def _retry(wait_left: float) -> Call:
    a = session("a")
    return Call(a, 1024, None, 0, True, "r1", lease_id_for("a", "r1", HOST), wait_left, 2000, NOW + wait_left)


def _ctx() -> Context:
    return Context(KEYS, CoordinatorConfig().validate(), "r1", frozenset(), NOW, WALL)


def test_a_retry_that_joins_its_entry_waits_until_the_entrys_later_deadline() -> None:
    for replica in ("r1", "r2"):      # the entry served by this replica, or by another one before
        view, _ = _full_host_with_waiter(WALL + 30, replica)
        retry = _retry(29.6)          # its own deadline: 0.4 s before the entry's
        plan = plan_round(view, [retry], {}, {retry.session.session_id}, _ctx())
        assert [w.call for w in plan.waits] == [retry]
        assert plan.waits[0].deadline == NOW + 30, (replica, plan.waits[0].deadline)


def test_a_retry_with_a_later_deadline_keeps_its_own() -> None:
    view, _ = _full_host_with_waiter(WALL + 30, "r1")
    retry = _retry(31.0)
    plan = plan_round(view, [retry], {}, {retry.session.session_id}, _ctx())
    assert [w.call for w in plan.waits] == [retry]
    assert plan.waits[0].deadline is None


def test_a_retry_that_joins_its_entry_on_the_same_replica_rewrites_it() -> None:
    """A retry through the same replica (the client left a hung attempt, or another replica forwarded the retry
    to the owner) joins the entry its first attempt wrote, which this replica still serves. The first attempt's
    caller is gone: the expiry removes its entry comparing the revision it knows. The retry rewrites the entry,
    so that this removal fails (or, when it commits first, the round fails and the retry is queued again) and the
    entry is never removed from under the live retry, which would then be answered at once (before its wait
    ends) "removed from the queue without a grant"."""
    for gone in (True, False):         # the first attempt answered or cancelled already, or not yet (superseded)
        view, entry = _full_host_with_waiter(WALL + 30, "r1")
        first = _retry(30.0)
        first.gone = gone
        retry = _retry(29.0)
        plan = plan_round(view, [retry], {entry.lease_id: first}, {retry.session.session_id}, _ctx())
        assert [w.call for w in plan.waits] == [retry]
        key = KEYS.queue_entry(HOST, entry.rank)
        assert plan.waits[0].revision == 0, "the retry keeps the revision its first attempt's removal compares"
        assert any(getattr(op, "key", None) == key for op in plan.ops), plan.ops
        assert ModRevisionIs(key, entry.mod_revision) in plan.compares
        assert plan.waits[0].deadline == NOW + 30
