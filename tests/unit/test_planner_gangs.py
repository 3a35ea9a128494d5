"""Property tests of the planner with gangs (issue 21): one round over a host whose leases, queue and new
calls mix single-GPU requests and gangs (several GPUs, whole GPUs, a topology, exact GPUs). The plan is
applied to the snapshot and checked against an oracle written here, apart from the placement code:

* G1 per GPU: no GPU holds more than its usable VRAM, no agent more than its cap there;
* all or nothing: a granted gang has one record on each of ``gpu_count`` distinct GPUs, all in this one
  transaction, each listing the whole gang;
* topology: a gang's GPUs are on one known NUMA node (``numa``) or every pair joined by NVLink (``nvlink``);
* exclusive: a GPU held exclusively holds no other lease, and the lease takes its whole usable VRAM;
* G5 per GPU: each GPU's new tokens continue its ledger;
* G2 with gangs: no grant lands on a GPU that a request ranked before it, and still waiting, could use;
* G3 over sets: victims are preemptible and of lower priority; on some set of GPUs the request could use,
  evicting them makes it fit and none of them can be spared.
"""
from __future__ import annotations

import itertools
import json
from typing import Any, Sequence

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.config import CoordinatorConfig
from coordinator.keys import Keys, lease_id_for
from coordinator.node.fake import parse_fake_gpus
from coordinator.policy.admission import GpuView
from coordinator.policy.host import HostView
from coordinator.policy.partition import Partition, compute_partition, parse_spec
from coordinator.policy.plan import Context, Plan
from coordinator.policy.planner import plan_round
from coordinator.records import (
    GpuLedger,
    HostInventory,
    QueueEntry,
    VramLease,
)
from coordinator.txn import Delete, Put
from tests.support.gang_scenarios import scenarios, wants
from tests.support.planner_calls import (
    _KV,
    AGENTS,
    HOST,
    KEYS,
    NOW,
    WALL,
    Call,
    session,
)

# -- the oracle ---------------------------------------------------------------------------------------------

def joined(inventory: HostInventory, uuids: Sequence[str], topology: str) -> bool:
    gs = [g for g in inventory.gpus if g.uuid in uuids]
    if topology == "numa":
        return all(g.numa_node is not None for g in gs) and len({g.numa_node for g in gs}) == 1
    if topology == "nvlink":
        return all(b.index in a.nvlink_peers and a.index in b.nvlink_peers for a, b in itertools.combinations(gs, 2))
    return True


def req_of(s: dict[str, Any], requested_by: str) -> tuple[dict[str, Any], str, int]:
    """What ``agent/request_id`` asked: its request fields, its rank and priority."""
    agent, rid = requested_by.split("/", 1)
    for c in s["batch"]:
        if c.session.agent == agent and c.request_id == rid:
            return ({"vram_mb": c.vram_mb, **wants(c.gpu_count, c.exclusive, c.topology, c.gpus)},
                    Keys.queue_rank(c.priority, c.arrival_ns, c.lease_id), c.priority)
    e = next(e for e in s["view"].entries if e.agent == agent and e.request_id == rid)
    return {"vram_mb": e.vram_mb, **wants(e.gpu_count, e.exclusive, e.topology, e.gpus)}, e.rank, e.priority


def usable_sets(s: dict[str, Any], agent: str, r: dict[str, Any]) -> list[tuple[str, ...]]:
    """Every set of GPUs the request could ever hold (each GPU big enough and allowed, the topology met)."""
    inv: HostInventory = s["view"].inventory
    caps = s["caps"][agent]
    named = {g.uuid for g in inv.gpus if str(g.index) in r["gpus"] or g.uuid in r["gpus"]}
    ok = [g.uuid for g in inv.gpus if g.uuid in caps and (not r["gpus"] or g.uuid in named)
          and (caps[g.uuid] >= s["usable"][g.uuid] if r["exclusive"] else r["vram_mb"] <= min(caps[g.uuid],
                                                                                             s["usable"][g.uuid]))]
    return [c for c in itertools.combinations(ok, r["gpu_count"]) if joined(inv, c, r["topology"])]


def fits(s: dict[str, Any], held: list[VramLease], gpus: Sequence[str], agent: str, r: dict[str, Any]) -> bool:
    for u in gpus:
        on = [x for x in held if x.gpu_uuid == u]
        if r["exclusive"]:
            if on:
                return False
        elif (s["usable"][u] - sum(x.vram_mb for x in on) < r["vram_mb"]
              or s["caps"][agent][u] - sum(x.vram_mb for x in on if x.agent == agent) < r["vram_mb"]):
            return False
    return True


def check(s: dict[str, Any], plan: Plan[Call], prop: str) -> None:
    """Check property ``prop`` of the module's docstring (each test checks one, over its own examples)."""
    view: HostView = s["view"]
    inv = view.inventory
    assert inv is not None
    assert len(plan.compares) <= 128 and len(plan.ops) <= 128
    puts = {op.key: op for op in plan.ops if isinstance(op, Put)}
    deleted = {op.key for op in plan.ops if isinstance(op, Delete)}
    after: list[VramLease] = [*s["leases"], *plan.new_leases]
    # G1 per GPU, and exclusive GPUs hold nothing else
    for u, usable in s["usable"].items():
        on = [x for x in after if x.gpu_uuid == u]
        if prop == "g1":
            assert sum(x.vram_mb for x in on) <= usable, f"GPU {u} over-committed"
            for a in AGENTS:
                mine = sum(x.vram_mb for x in on if x.agent == a)
                assert not mine or mine <= s["caps"][a].get(u, 0)
        if prop == "exclusive" and any(x.exclusive for x in on):
            assert len({x.id for x in on}) == 1, f"exclusive GPU {u} shared by {sorted({x.id for x in on})}"
            assert all(x.vram_mb == usable for x in on if x.exclusive)
    # all or nothing, topology, exclusive, every record in this transaction
    asked = {c.lease_id: c for c in s["batch"]} | {e.lease_id: e for e in view.entries}
    new_ids = {x.id for x in plan.new_leases}
    for lid in new_ids:
        parts = [x for x in plan.new_leases if x.id == lid]
        r = asked[lid]
        uuids = tuple(x.gpu_uuid for x in sorted(parts, key=lambda x: x.gpu_index))
        if prop == "all_or_nothing":
            assert len(parts) == r.gpu_count == len({x.gpu_uuid for x in parts}), f"{lid}: a partial gang"
            assert all(x.gang == (uuids if len(uuids) > 1 else ()) for x in parts)
            assert all(KEYS.lease(HOST, x.gpu_uuid, lid) in puts for x in parts)
            if r.gpus:
                assert {str(x.gpu_index) for x in parts} == set(r.gpus)
        if prop == "topology":
            assert joined(inv, uuids, r.topology), f"{lid}: GPUs {uuids} do not meet {r.topology}"
        if prop == "exclusive" and r.exclusive:
            assert all(not any(y.gpu_uuid == x.gpu_uuid for y in s["leases"]) for x in parts)
    # G5 per GPU
    for g in view.gpus.values() if prop == "g5" else ():
        new = [x.token for x in plan.new_leases if x.gpu_uuid == g.uuid]
        assert new == list(range(g.ledger.seq + 1, g.ledger.seq + 1 + len(new)))
        if new:
            assert json.loads(puts[KEYS.gpu(HOST, g.uuid)].value)["seq"] == new[-1]
    # G2 with gangs: the waiters after the plan, and every GPU each could use
    still = [e for e in view.entries if KEYS.queue_entry(HOST, e.rank) not in deleted]
    new_entries = [QueueEntry.from_kv(_KV(k, op.value, 0)) for k, op in puts.items()
                   if KEYS.parse(k)[0] == "queue" and all(e.rank != KEYS.parse(k)[1][-1] for e in still)]
    waiters = []
    for e in [*still, *new_entries]:
        r = {"vram_mb": e.vram_mb, **wants(e.gpu_count, e.exclusive, e.topology, e.gpus)}
        waiters.append((e.rank, {u for c in usable_sets(s, e.agent, r) for u in c}))
    for x in plan.new_leases:
        c = next((c for c in s["batch"] if c.lease_id == x.id), None)
        rank = Keys.queue_rank(c.priority, c.arrival_ns, c.lease_id) if c else next(
            e.rank for e in view.entries if e.lease_id == x.id)
        for wrank, gpus in waiters:
            assert prop != "g2" or not (wrank < rank and x.gpu_uuid in gpus), (
                f"{x.id} on {x.gpu_uuid} overtook waiter {wrank}")
    # G3 over sets
    evicting = set(s["ctx"].evicting)
    victims_of: dict[str, list[str]] = {}
    for record in plan.evictions if prop == "g3" else ():
        victim = [x for x in s["leases"] if x.id == record.lease_id]
        assert victim and record.lease_id not in evicting
        assert victim[0].preemptible and victim[0].priority < (record.requester_priority or 0)
        victims_of.setdefault(record.requested_by, []).append(record.lease_id)
    for requested_by, victims in victims_of.items():
        r, rank, _ = req_of(s, requested_by)
        agent = requested_by.split("/", 1)[0]
        blocked = {u for wrank, gpus in waiters if wrank < rank for u in gpus}
        base = [x for x in after if x.id not in evicting]

        def held(gone: set[str]) -> list[VramLease]:
            return [x for x in base if x.id not in gone]  # noqa: B023 - called within this iteration
        sets = [c for c in usable_sets(s, agent, r) if not blocked & set(c)]
        minimal = [c for c in sets if fits(s, held(set(victims)), c, agent, r)
                   and not any(fits(s, held(set(victims) - {v}), c, agent, r) for v in victims)]
        assert minimal, f"victims {victims} of {requested_by} make it fit on no set, or one can be spared"


def check_g3_order(s: dict[str, Any], plan: Plan[Call]) -> None:
    """G3 over all candidates (singles and gangs, every GPU): each requester's victims are exactly what taking
    the preemptible leases of lower priority in G3's order over all of them (lowest priority first, then
    newest: ``created_at``, then token; a gang is one lease of its own priority and age) until the request fits
    on some set of GPUs free of earlier waiters, then sparing each that can be in that order, yields. The
    leases that earlier requesters of the round chose count as gone, as those already being evicted do."""
    gone = set(s["ctx"].evicting)
    after: list[VramLease] = [*s["leases"], *plan.new_leases]
    deleted = {op.key for op in plan.ops if isinstance(op, Delete)}
    puts = {op.key: op for op in plan.ops if isinstance(op, Put)}
    still = [e for e in s["view"].entries if KEYS.queue_entry(HOST, e.rank) not in deleted]
    new_entries = [QueueEntry.from_kv(_KV(k, op.value, 0)) for k, op in puts.items()
                   if KEYS.parse(k)[0] == "queue" and all(e.rank != KEYS.parse(k)[1][-1] for e in still)]
    waiters = [(e.rank, {u for c in usable_sets(s, e.agent, {"vram_mb": e.vram_mb, **wants(
        e.gpu_count, e.exclusive, e.topology, e.gpus)}) for u in c}) for e in [*still, *new_entries]]
    chosen: dict[str, list[str]] = {}
    for record in plan.evictions:
        chosen.setdefault(record.requested_by, []).append(record.lease_id)
    for requested_by, victims in chosen.items():
        r, rank, priority = req_of(s, requested_by)
        agent = requested_by.split("/", 1)[0]
        blocked = {u for wrank, gpus in waiters if wrank < rank for u in gpus}
        sets = [c for c in usable_sets(s, agent, r) if not blocked & set(c)]
        leases: dict[str, tuple[int, float, int]] = {}
        for x in s["leases"]:
            if x.id not in gone and x.preemptible and x.priority < priority:
                p, c, t = leases.get(x.id, (x.priority, x.created_at, x.token))
                leases[x.id] = (p, c, max(t, x.token))
        order = sorted(leases, key=lambda i: (leases[i][0], -leases[i][1], -leases[i][2]))

        def somewhere(vs: list[str]) -> bool:
            held = [x for x in after if x.id not in gone and x.id not in vs]  # noqa: B023 - called in this iteration
            return any(fits(s, held, c, agent, r) for c in sets)  # noqa: B023 - called in this iteration
        want: list[str] = []
        for v in order:
            if somewhere(want):
                break
            want.append(v)
        for v in list(want):
            if somewhere([w for w in want if w != v]):
                want = [w for w in want if w != v]
        assert sorted(victims) == sorted(want), (
            f"{requested_by} (rank {rank}) chose {victims}; G3's order over all candidates takes {want}")
        gone |= set(victims)


def one_round(s: dict[str, Any], prop: str) -> None:
    plan = plan_round(s["view"], s["batch"], s["waiting"], {c.session.session_id for c in s["batch"]}, s["ctx"])
    if prop == "g3_order":
        check_g3_order(s, plan)
        return
    check(s, plan, prop)


PROPERTY = settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(scenarios())
def test_g1_no_gpu_is_over_committed_by_gangs(s: dict[str, Any]) -> None:
    one_round(s, "g1")


@PROPERTY
@given(scenarios())
def test_a_gang_is_granted_whole_or_not_at_all(s: dict[str, Any]) -> None:
    one_round(s, "all_or_nothing")


@PROPERTY
@given(scenarios())
def test_a_gangs_gpus_meet_its_topology(s: dict[str, Any]) -> None:
    one_round(s, "topology")


@PROPERTY
@given(scenarios())
def test_an_exclusive_gpu_is_never_shared(s: dict[str, Any]) -> None:
    one_round(s, "exclusive")


@PROPERTY
@given(scenarios())
def test_g5_each_gpu_of_a_gang_takes_its_own_next_token(s: dict[str, Any]) -> None:
    one_round(s, "g5")


@PROPERTY
@given(scenarios())
def test_g2_no_grant_lands_on_a_gpu_an_earlier_waiting_gang_could_use(s: dict[str, Any]) -> None:
    one_round(s, "g2")


@PROPERTY
@given(scenarios())
def test_g3_gang_victims_make_it_fit_on_a_set_and_none_can_be_spared(s: dict[str, Any]) -> None:
    one_round(s, "g3")


@PROPERTY
@given(st.one_of(scenarios(), scenarios(crowded=True), scenarios(singles=True)))
def test_g3_victims_follow_the_order_over_all_candidates(s: dict[str, Any]) -> None:
    one_round(s, "g3_order")


def test_g3_a_gang_spares_the_victims_it_turns_out_not_to_need() -> None:
    """Taken in G3 order (lowest priority first) the small leases come first, but the big ones alone make
    room: the small ones are spared (the property above, on the case that needs the pruning)."""
    inventory = HostInventory(HOST, "", 8, tuple(range(8)), 1 << 34, "/", 1 << 40, parse_fake_gpus("2x16GiB", HOST))
    part = Partition.from_json(compute_partition(inventory, parse_spec({"host": HOST, "mode": "shared"})).to_json())
    caps = {a: part.gpu_caps(a, inventory) for a in AGENTS}
    usable = {g.uuid: part.usable_mb(g) for g in inventory.gpus}
    s_b = session("b")
    leases = [VramLease(id=f"{size}-{g.index}", host=HOST, gpu_uuid=g.uuid, gpu_index=g.index, agent="b",
                        session_id=s_b.session_id, vram_mb=mb, priority=prio, preemptible=True, request_id=f"r{n}",
                        token=n + 1, created_at=float(n), etcd_lease=s_b.etcd_lease, mod_revision=100 + n)
              for n, (size, mb, prio, g) in enumerate(
                  (size, mb, prio, g) for g in inventory.gpus for size, mb, prio in (("big", 8192, 0),
                                                                                   ("small", 2048, -2)))]
    gpus = {g.uuid: GpuView(uuid=g.uuid, index=g.index, total_mb=g.vram_total_mb, usable_mb=usable[g.uuid],
                            ledger=GpuLedger(g.vram_total_mb, 2, 300 + g.index),
                            leases=[x for x in leases if x.gpu_uuid == g.uuid]) for g in inventory.gpus}
    view = HostView(HOST, 500, inventory, _KV(KEYS.host(HOST), b"{}", 40, 0x99), None, None, gpus,
                    {x.id: x for x in leases}, None, (), ())
    call = Call(session("a"), 12_000, None, 5, True, "g", lease_id_for("a", "g", HOST), 5.0, 1000, NOW + 5,
                **wants(2, False, "any", ()))
    s = {"view": view, "batch": [call], "waiting": {}, "caps": caps, "usable": usable, "leases": leases,
         "ctx": Context(KEYS, CoordinatorConfig().validate(), "r1", frozenset(), NOW, WALL)}
    plan = plan_round(view, [call], {}, {call.session.session_id}, s["ctx"])
    check(s, plan, "g3")
    assert sorted(e.lease_id for e in plan.evictions) == ["big-0", "big-1"]
