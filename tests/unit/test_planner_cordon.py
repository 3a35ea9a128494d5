"""A round on a cordoned host (issue 31, ``policy/cordon.py``): no new grant, whatever the scenario; a call that
asked for no wait is refused FAILED_PRECONDITION naming ``host`` and the reason; one that waits is queued
without victims; a retry of a granted request keeps its lease; every transaction compares the cordon key."""
from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import HealthCheck, given, settings

from coordinator import errors
from coordinator.config import CoordinatorConfig
from coordinator.host_records import CordonRecord
from coordinator.keys import lease_id_for
from coordinator.policy.plan import Context
from coordinator.policy.planner import plan_round
from coordinator.records import VramLease
from coordinator.txn import ModRevisionIs, Put
from tests.support.planner_calls import (
    _KV,
    HOST,
    KEYS,
    NOW,
    WALL,
    Call,
    host_view,
    session,
)
from tests.support.planner_scenarios import scenarios

CORDON = CordonRecord(HOST, "driver upgrade", drain=True, grace_s=2.0, asked_by="ops", created_at=WALL)
CORDON_KV = _KV(KEYS.cordon(HOST), b"{}", 77)


def _cordoned(view: Any) -> Any:
    return dataclasses.replace(view, cordon=CORDON, cordon_kv=CORDON_KV)


def _new_leases(plan: Any) -> list[bytes]:
    return [op.key for op in plan.ops if isinstance(op, Put) and op.key.startswith(KEYS.leases())]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_a_round_on_a_cordoned_host_grants_nothing_new_and_compares_the_cordon(s: dict[str, Any]) -> None:
    view = _cordoned(s["view"])
    plan = plan_round(view, s["batch"], s["waiting"], {c.session.session_id for c in s["batch"]}, s["ctx"])
    assert plan.new_leases == [] and _new_leases(plan) == []
    assert all(lease.id in view.leases for _, lease in plan.grants), "only leases granted before the cordon"
    if plan.ops:
        assert ModRevisionIs(KEYS.cordon(HOST), 77) in plan.compares
    for _, err in plan.refusals:
        assert not isinstance(err, errors.CapacityError) or "queue" in err.message, err


def _ctx() -> Context:
    return Context(KEYS, CoordinatorConfig().validate(), "r1", frozenset(), NOW, WALL)


def _call(agent: str, rid: str, wait_s: float, vram_mb: int = 1024) -> Call:
    return Call(session(agent), vram_mb, None, 0, True, rid, lease_id_for(agent, rid, HOST), wait_s, 1000,
                NOW + wait_s)


def test_no_wait_is_refused_naming_host_and_the_reason_and_a_waiter_is_queued_without_victims() -> None:
    holder = VramLease(id=lease_id_for("b", "held", HOST), host=HOST, gpu_uuid=f"GPU-sim-{HOST}-0", gpu_index=0,
                       agent="b", session_id=session("b").session_id, etcd_lease=session("b").etcd_lease,
                       vram_mb=16384, priority=0, preemptible=True, request_id="held", token=1, created_at=WALL,
                       mod_revision=10)
    view = _cordoned(host_view("1x16GiB", [holder]))
    now, later, big = _call("a", "now", 0.0), _call("a", "later", 30.0), _call("c", "big", 30.0, 16384)
    big = dataclasses.replace(big, priority=10)        # would evict b's lease anywhere else
    plan = plan_round(view, [now, later, big], {}, {x.session.session_id for x in (now, later, big)}, _ctx())
    (refused, err), = plan.refusals
    assert refused is now and isinstance(err, errors.FailedPrecondition) and err.field == "host"
    assert "'h' is draining: 'driver upgrade'" in err.message and "uncordon" in err.message
    assert {w.call.request_id for w in plan.waits} == {"later", "big"}
    assert plan.evictions == [] and plan.new_leases == []
    assert set(plan.cordon_waits) == {later.lease_id, big.lease_id}
    # The same round without the cordon evicts b's lease for ``big``.
    free = plan_round(dataclasses.replace(view, cordon=None, cordon_kv=None), [later, big], {},
                      {x.session.session_id for x in (later, big)}, _ctx())
    assert [e.lease_id for e in free.evictions] == [holder.id]


def test_a_retry_of_a_request_granted_before_the_cordon_gets_its_lease() -> None:
    call = _call("a", "r1", 0.0)
    lease = VramLease(id=call.lease_id, host=HOST, gpu_uuid=f"GPU-sim-{HOST}-0", gpu_index=0, agent="a",
                      session_id=call.session.session_id, etcd_lease=call.session.etcd_lease, vram_mb=1024,
                      priority=0, preemptible=True, request_id="r1", token=1, created_at=WALL, mod_revision=10)
    plan = plan_round(_cordoned(host_view("1x16GiB", [lease])), [call], {}, {call.session.session_id}, _ctx())
    assert plan.refusals == [] and [(c, x.id) for c, x in plan.grants] == [(call, lease.id)]
