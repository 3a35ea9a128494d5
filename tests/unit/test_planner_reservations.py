"""A host round and a multi-host gang's reservation on the host (issue 30, G2 across hosts; ``policy/planner.py``):
the round never grants, rewrites or removes the reservation, and grants nothing on the GPUs it reserves to a
request ranked after it, whatever the scenario."""
from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.config import CoordinatorConfig
from coordinator.keys import Keys, lease_id_for
from coordinator.policy.plan import Context
from coordinator.policy.planner import plan_round
from coordinator.records import QueueEntry
from coordinator.txn import Delete, Put
from tests.support.planner_calls import HOST, KEYS, NOW, WALL, Call, host_view, session
from tests.support.planner_scenarios import scenarios


def _reservation(uuids: tuple[str, ...], priority: int) -> QueueEntry:
    s = session("a")
    rank = Keys.queue_rank(priority, 0, "gang-res")
    return QueueEntry(rank=rank, agent="a", session_id=s.session_id, etcd_lease=s.etcd_lease, vram_mb=0, gpu="",
                      priority=priority, preemptible=True, request_id="gang", lease_id="gang-res",
                      deadline_unix=WALL + 30, replica="other", wait_s=30.0, gpu_count=len(uuids), exclusive=True,
                      hosts=2, reserve=uuids, mod_revision=400)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.data())
def test_a_round_grants_nothing_on_reserved_gpus_to_later_requests_and_leaves_the_reservation(
        s: dict[str, Any], data: st.DataObject) -> None:
    view = s["view"]
    uuids = tuple(sorted(data.draw(st.sets(st.sampled_from(sorted(view.gpus)), min_size=1))))
    entry = _reservation(uuids, data.draw(st.sampled_from([1_000_000, 3])))
    view = dataclasses.replace(view, entries=tuple(sorted((*view.entries, entry), key=lambda e: e.rank)))
    plan = plan_round(view, s["batch"], s["waiting"], {c.session.session_id for c in s["batch"]}, s["ctx"])
    key = KEYS.queue_entry(HOST, entry.rank)
    assert not any(isinstance(op, (Put, Delete)) and op.key == key for op in plan.ops), "the reservation is the gang's"
    assert all(lease.id != entry.lease_id for _, lease in plan.grants)
    for lease in plan.new_leases:
        ranked = Keys.queue_rank(lease.priority, 0, "")   # every new request arrived after the reservation
        if ranked > entry.rank or lease.priority <= entry.priority:
            assert lease.gpu_uuid not in uuids, (lease, uuids)


def _call(agent: str, rid: str, time_limit_s: float = 0.0) -> Call:
    return Call(session(agent), 1024, None, 0, True, rid, lease_id_for(agent, rid, HOST), 0.0, 1000, NOW,
                time_limit_s=time_limit_s)


def test_a_request_whose_time_limit_ends_before_the_gangs_earliest_start_backfills_a_reserved_gpu() -> None:
    view = host_view("1x16GiB", [])
    uuid_ = next(iter(view.gpus))
    margin = CoordinatorConfig().validate().eviction_kill_margin_s
    entry = dataclasses.replace(_reservation((uuid_,), 3), start_after=WALL + 100 + margin)
    view = dataclasses.replace(view, entries=(entry,))
    ctx = Context(KEYS, CoordinatorConfig().validate(), "r1", frozenset(), NOW, WALL)
    short, long, none = _call("b", "short", 60.0), _call("c", "long", 200.0), _call("a", "none")
    plan = plan_round(view, [short, long, none], {}, {x.session.session_id for x in (short, long, none)}, ctx)
    assert [c.request_id for c, _ in plan.grants] == ["short"], "only the lease gone before the gang starts"
    # Unknown start (a lease in the way has no known end): nothing is backfilled.
    unknown = dataclasses.replace(view, entries=(dataclasses.replace(entry, start_after=0.0),))
    plan = plan_round(unknown, [short], {}, {short.session.session_id}, ctx)
    assert plan.grants == []


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.data())
def test_a_backfill_never_outlives_the_gangs_earliest_start(s: dict[str, Any], data: st.DataObject) -> None:
    """Whatever the scenario, a lease granted on a reserved GPU is a backfill: its time limit, plus the kill margin
    by which the leader revokes it, ends by the gang's earliest start. So it never delays the gang."""
    view, ctx = s["view"], s["ctx"]
    margin = ctx.config.eviction_kill_margin_s
    uuids = tuple(sorted(data.draw(st.sets(st.sampled_from(sorted(view.gpus)), min_size=1))))
    start = WALL + data.draw(st.sampled_from([0.0, 30.0, 120.0, 600.0]))
    entry = dataclasses.replace(_reservation(uuids, 1_000_000), start_after=start if start > WALL else 0.0)
    view = dataclasses.replace(view, entries=tuple(sorted((*view.entries, entry), key=lambda e: e.rank)))
    batch = [dataclasses.replace(c, time_limit_s=data.draw(st.sampled_from([0.0, 10.0, 100.0, 1000.0])))
             for c in s["batch"]]
    plan = plan_round(view, batch, s["waiting"], {c.session.session_id for c in batch}, ctx)
    for lease in plan.new_leases:
        if lease.gpu_uuid in uuids:
            assert lease.time_limit_s > 0 and ctx.wall + lease.time_limit_s + margin <= entry.start_after, lease
