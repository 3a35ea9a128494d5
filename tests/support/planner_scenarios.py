"""The host scenarios of the planner's Hypothesis tests (``scenarios``: a host, its partition, live leases,
some under eviction, a queue, new calls) and the guarantees every plan keeps (``check``: G1, G2, G3, G5 and
etcd's limits over the snapshot once the plan is applied), shared by tests/unit/test_planner.py and the teams'
tests of the planner."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from hypothesis import strategies as st

from coordinator.config import CoordinatorConfig
from coordinator.keys import Keys, lease_id_for
from coordinator.policy.admission import Departing, GpuView, room_for
from coordinator.policy.host import HostView
from coordinator.policy.partition import Partition, compute_partition, parse_spec
from coordinator.policy.plan import Context, Plan
from coordinator.records import GpuInfo, GpuLedger, HostInventory, QueueEntry, VramLease
from coordinator.txn import Delete, Put
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


@st.composite
def scenarios(draw: Any) -> dict[str, Any]:
    sizes = draw(st.lists(st.sampled_from([4096, 8192, 16384]), min_size=1, max_size=3))
    inventory = HostInventory(HOST, "", 8, tuple(range(8)), 1 << 34, "/", 1 << 40,
                              tuple(GpuInfo(i, f"GPU-{i}", "sim", s) for i, s in enumerate(sizes)))
    partition = None
    if draw(st.booleans()):
        partition = compute_partition(inventory, parse_spec({"host": HOST, "mode": "auto-split",
                                                             "agents": list(AGENTS)}))
    part = partition or Partition.from_json(
        compute_partition(inventory, parse_spec({"host": HOST, "mode": "shared"})).to_json())
    caps = {a: part.gpu_caps(a, inventory) for a in AGENTS}
    revision = 500
    # Live leases that respect G1 (each added only while it fits).
    leases: dict[str, VramLease] = {}
    used = {g.uuid: 0 for g in inventory.gpus}
    held: dict[tuple[str, str], int] = {}
    for n in range(draw(st.integers(0, 8))):
        agent = draw(st.sampled_from(AGENTS))
        gpu = draw(st.sampled_from(inventory.gpus))
        vram = draw(st.sampled_from([512, 1024, 2048, 4096]))
        cap = caps[agent].get(gpu.uuid)
        if cap is None or used[gpu.uuid] + vram > gpu.vram_total_mb or held.get((agent, gpu.uuid), 0) + vram > cap:
            continue
        used[gpu.uuid] += vram
        held[(agent, gpu.uuid)] = held.get((agent, gpu.uuid), 0) + vram
        s = session(agent)
        lease = VramLease(id=f"old{n}", host=HOST, gpu_uuid=gpu.uuid, gpu_index=gpu.index, agent=agent,
                          session_id=s.session_id, vram_mb=vram, priority=draw(st.integers(-2, 3)),
                          preemptible=draw(st.booleans()), request_id=f"old{n}", token=n + 1,
                          created_at=float(n), etcd_lease=s.etcd_lease, mod_revision=100 + n)
        leases[lease.id] = lease
    evicting = frozenset(x for x in leases if draw(st.booleans()) and draw(st.booleans()))
    # Ended leases whose processes the node still reports (they count as held), within G1 too.
    departing: dict[str, list[Departing]] = {}
    for n in range(draw(st.integers(0, 3))):
        agent = draw(st.sampled_from(AGENTS))
        gpu = draw(st.sampled_from(inventory.gpus))
        vram = draw(st.sampled_from([512, 2048, 4096]))
        cap = caps[agent].get(gpu.uuid)
        if cap is None or used[gpu.uuid] + vram > gpu.vram_total_mb or held.get((agent, gpu.uuid), 0) + vram > cap:
            continue
        used[gpu.uuid] += vram
        held[(agent, gpu.uuid)] = held.get((agent, gpu.uuid), 0) + vram
        departing.setdefault(gpu.uuid, []).append(Departing(f"gone{n}", agent, vram))
    victim_pool = [*leases, *(d.lease_id for ds in departing.values() for d in ds), "long-gone"]
    # The queue; some entries are this replica's waiting calls.
    entries: list[QueueEntry] = []
    waiting: dict[str, Call] = {}
    for n in range(draw(st.integers(0, 6))):
        agent = draw(st.sampled_from(AGENTS))
        s = session(agent)
        prio = draw(st.integers(-2, 5))
        vram = draw(st.sampled_from([512, 2048, 4096, 8192, 20000]))
        gpu = draw(st.sampled_from(["", "0", "1"]))
        lease_id = lease_id_for(agent, f"q{n}", HOST)
        rank = Keys.queue_rank(prio, 10 + n, lease_id)
        victims = tuple(draw(st.lists(st.sampled_from(victim_pool), max_size=2, unique=True)))
        entry = QueueEntry(rank=rank, agent=agent, session_id=s.session_id, etcd_lease=s.etcd_lease,
                           vram_mb=vram, gpu=gpu, priority=prio, preemptible=True, request_id=f"q{n}",
                           lease_id=lease_id, deadline_unix=WALL + 30, replica="r1", victims=victims,
                           mod_revision=200 + n)
        entries.append(entry)
        if draw(st.booleans()):
            waiting[lease_id] = Call(s, vram, gpu or None, prio, True, f"q{n}", lease_id, 30.0, 10 + n, NOW + 30,
                                     rank=rank)
    entries.sort(key=lambda e: e.rank)
    batch = []
    for n in range(draw(st.integers(0, 8))):
        agent = draw(st.sampled_from(AGENTS))
        wait = draw(st.sampled_from([0.0, 0.0, 5.0]))
        rid = f"new{n}"
        batch.append(Call(session(agent), draw(st.sampled_from([512, 1024, 4096, 8192, 16384, 30000])),
                          draw(st.sampled_from([None, None, "0", "1", "9"])), draw(st.integers(-2, 6)),
                          draw(st.booleans()), rid, lease_id_for(agent, rid, HOST), wait, 1000 + n, NOW + wait))
    gpus = {g.uuid: GpuView(uuid=g.uuid, index=g.index, total_mb=g.vram_total_mb, usable_mb=part.usable_mb(g),
                            ledger=GpuLedger(g.vram_total_mb, 7 + g.index, 300 + g.index),
                            leases=[x for x in leases.values() if x.gpu_uuid == g.uuid],
                            departing=departing.get(g.uuid, []))
            for g in inventory.gpus}
    part_kv = _KV(KEYS.partition(HOST), b"{}", 50) if partition is not None else None
    view = HostView(HOST, revision, inventory, _KV(KEYS.host(HOST), b"{}", 40, 0x99), partition, part_kv, gpus,
                    leases, None, (), tuple(entries))
    config = CoordinatorConfig(max_queue_per_host=draw(st.integers(1, 8)),
                               max_queue_per_agent=draw(st.integers(1, 4))).validate()
    ctx = Context(KEYS, config, "r1", evicting, NOW, WALL)
    return {"view": view, "batch": batch, "waiting": waiting, "ctx": ctx, "caps": caps}


def _candidates(view: HostView, caps: dict[str, dict[str, int]], agent: str, gpu_ref: str) -> set[str]:
    allowed = set(caps[agent])
    if gpu_ref:
        info = view.inventory.gpu(gpu_ref) if view.inventory else None
        return {info.uuid} & allowed if info else set()
    return allowed


def check(s: dict[str, Any], plan: Plan[Call], team: tuple[frozenset[str], int] | None = None) -> None:
    """Every guarantee of the round over the state after ``plan``. A request that waits for its team's limit
    alone (``plan.team_waits``) holds no GPU back (G2 with teams). ``team``: the agents of a limited team and
    what its limit leaves before the round; then a member's victims make it fit on a GPU and under the limit
    (G3 within the team's limit), and none can be spared."""
    view: HostView = s["view"]
    caps = s["caps"]
    assert len(plan.compares) <= 128 and len(plan.ops) <= 128
    puts = {op.key: op for op in plan.ops if isinstance(op, Put)}
    deleted = {op.key for op in plan.ops if isinstance(op, Delete)}
    # G1 over the state after the plan
    after = {lease.id: lease for lease in view.leases.values()}
    after.update({lease.id: lease for lease in plan.new_leases})
    for g in view.gpus.values():
        on = [x for x in after.values() if x.gpu_uuid == g.uuid]
        assert sum(x.vram_mb for x in on) + g.departing_mb <= g.usable_mb
        for agent in AGENTS:
            mine = sum(x.vram_mb for x in on if x.agent == agent) + sum(d.vram_mb for d in g.departing
                                                                         if d.agent == agent)
            if mine:
                assert mine <= caps[agent].get(g.uuid, 0)
    # G3: a queued request is not granted while a victim's lease, or its processes, are still there.
    still = set(view.leases) | view.departing_held
    granted = {x.id for x in plan.new_leases}
    for e in view.entries:
        if e.lease_id in granted:
            assert not still & set(e.victims), f"{e.lease_id} granted while its victims {e.victims} are there"
    # G5: tokens continue the ledger, strictly increasing, and the ledger records the last
    for g in view.gpus.values():
        new = [x.token for x in plan.new_leases if x.gpu_uuid == g.uuid]
        assert new == list(range(g.ledger.seq + 1, g.ledger.seq + 1 + len(new)))
        if new:
            assert json.loads(puts[KEYS.gpu(HOST, g.uuid)].value)["seq"] == new[-1]
    # G2: who still waits after the plan, and with which rank
    still = [e for e in view.entries if KEYS.queue_entry(HOST, e.rank) not in deleted]
    new_entries = [QueueEntry.from_kv(_KV(k, op.value, 0)) for k, op in puts.items()
                   if KEYS.parse(k)[0] == "queue" and all(e.rank != KEYS.parse(k)[1][-1] for e in still)]
    waiters = [(e.rank, _candidates(view, caps, e.agent, e.gpu)) for e in [*still, *new_entries]
               if e.lease_id not in plan.team_waits]
    ranks = {c.lease_id: c for c in s["batch"]}
    for lease in plan.new_leases:
        call = ranks.get(lease.id)
        rank = Keys.queue_rank(call.priority, call.arrival_ns, call.lease_id) if call else next(
            e.rank for e in view.entries if e.lease_id == lease.id)
        for wrank, gpus in waiters:
            assert not (wrank < rank and lease.gpu_uuid in gpus), "a grant overtook a waiting request"
    # G3
    evicting = set(s["ctx"].evicting)
    by_requester: dict[str, list[VramLease]] = {}
    for record in plan.evictions:
        assert record.lease_id in view.leases, "a victim must be a live lease of the snapshot"
        victim = view.leases[record.lease_id]
        assert victim.preemptible and victim.priority < record.requester_priority
        assert victim.id not in evicting
        by_requester.setdefault(record.requested_by, []).append(victim)
    ranks = {c.lease_id: Keys.queue_rank(c.priority, c.arrival_ns, c.lease_id) for c in s["batch"]}
    ranks.update({e.lease_id: e.rank for e in view.entries})
    members, room0 = team if team is not None else (frozenset(), 0)
    chosen_before: set[str] = set()
    for requested_by, victims in by_requester.items():
        agent, rid = requested_by.split("/", 1)
        req = next((c for c in s["batch"] if c.session.agent == agent and c.request_id == rid), None)
        entry = next((e for e in view.entries if e.agent == agent and e.request_id == rid), None)
        vram = req.vram_mb if req else entry.vram_mb  # type: ignore[union-attr]
        rank = ranks[req.lease_id if req else entry.lease_id]  # type: ignore[union-attr]
        blocked = {u for wrank, gpus in waiters if wrank < rank for u in gpus}
        gpus = _candidates(view, caps, agent, (req.gpu_ref or "") if req else entry.gpu) - blocked  # type: ignore[union-attr]
        gone = evicting | chosen_before
        # What the request saw: the snapshot and the grants of the round ranked before it.
        seen = [x for x in after.values() if x.id not in gone and (x.id in view.leases or ranks[x.id] < rank)]
        room = None
        if agent in members:
            room = room0 - sum(x.vram_mb for x in plan.new_leases if x.agent in members and ranks[x.id] < rank) + sum(
                x.vram_mb for x in view.leases.values() if x.agent in members and x.id in gone)

        def fits(removed: list[VramLease], room: int | None = room, seen: list[VramLease] = seen,
                 gpus: set[str] = gpus, vram: int = vram, agent: str = agent) -> bool:
            out = {x.id for x in removed}
            if room is not None and room + sum(x.vram_mb for x in removed if x.agent in members) < vram:
                return False
            return any(room_for(dataclasses.replace(view.gpus[u], leases=[
                x for x in seen if x.gpu_uuid == u and x.id not in out]), agent, caps[agent][u]) >= vram for u in gpus)
        assert fits(victims), "the victims do not make the request fit"
        for v in victims:
            assert not fits([x for x in victims if x is not v]), "a victim could have been spared"
        assert not any(x.id == (req.lease_id if req else "") for x in plan.new_leases)
        chosen_before |= {v.id for v in victims}
