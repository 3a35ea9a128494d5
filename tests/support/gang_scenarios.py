"""Hypothesis scenarios of one admission round over a host whose leases, queue and new calls mix single-GPU
requests and gangs (issue 21): shared by the planner's gang properties and the teams' gang properties."""
from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from coordinator.config import CoordinatorConfig
from coordinator.keys import Keys, lease_id_for
from coordinator.node.fake import parse_fake_gpus
from coordinator.policy.admission import GpuView
from coordinator.policy.host import HostView
from coordinator.policy.partition import Partition, compute_partition, parse_spec
from coordinator.policy.plan import Context
from coordinator.records import (
    GpuLedger,
    HostInventory,
    QueueEntry,
    VramLease,
)
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

SPECS = ("4x16GiB:numa=0-1,2-3:nvlink=0-1,2-3", "4x16GiB", "2x16GiB,2x8GiB:nvlink=0-3")
MB = 16384


def wants(count: int, exclusive: bool, topology: str, gpus: tuple[str, ...]) -> dict[str, Any]:
    return {"gpu_count": count, "exclusive": exclusive, "topology": topology, "gpus": gpus}


@st.composite
def requests(draw: Any, crowded: bool = False, singles: bool = False) -> dict[str, Any]:
    if singles:
        return {"vram_mb": draw(st.sampled_from([4096, 8192, 12000])), **wants(1, False, "any", ())}
    count = draw(st.sampled_from([1, 1, 1, 1, 1, 2, 3] if crowded else [1, 1, 2, 2, 3, 4]))
    exclusive = draw(st.integers(0, 3)) == 0 if crowded else draw(st.booleans())
    topology = draw(st.sampled_from(["any", "any", "any", "numa"] if crowded else ["any", "any", "numa", "nvlink"]))
    gpus: tuple[str, ...] = ()
    if draw(st.integers(0, 5)) == 0 and not crowded:
        gpus = tuple(str(i) for i in sorted(draw(st.sets(st.integers(0, 3), min_size=count, max_size=count))))
    vram = 0 if exclusive else draw(st.sampled_from([4096, 8192, 12000] if crowded else [1024, 4096, 8192, 12000]))
    return {"vram_mb": vram, **wants(count, exclusive, topology, gpus)}


@st.composite
def scenarios(draw: Any, crowded: bool = False, singles: bool = False) -> dict[str, Any]:
    """A host and a round. ``crowded``: GPUs packed with leases (singles and gangs) of few priorities, and
    requests of higher priorities, mostly single-GPU ones (``singles``: only those): G3 then has many candidates
    to order."""
    crowded = crowded or singles
    spec = draw(st.sampled_from(SPECS))
    inventory = HostInventory(HOST, "", 8, tuple(range(8)), 1 << 34, "/", 1 << 40, parse_fake_gpus(spec, HOST))
    part = compute_partition(inventory, parse_spec({"host": HOST, "mode": "shared"}))
    part = Partition.from_json(part.to_json())
    caps = {a: part.gpu_caps(a, inventory) for a in AGENTS}
    usable = {g.uuid: part.usable_mb(g) for g in inventory.gpus}
    by_index = {g.index: g for g in inventory.gpus}
    leases: list[VramLease] = []
    used = dict.fromkeys(usable, 0)
    exclusive_on: set[str] = set()
    for n in range(draw(st.integers(4, 14) if crowded else st.integers(0, 8))):
        agent = draw(st.sampled_from(AGENTS))
        on = sorted(draw(st.sets(st.integers(0, 3), min_size=1, max_size=2 if crowded else 3)))
        exclusive = draw(st.integers(0, 3 if not crowded else 6)) == 0
        vram = draw(st.sampled_from([2048, 4096, 8192] if crowded else [1024, 2048, 4096, 8192, 12000]))
        gpus = [by_index[i] for i in on]
        if any(g.uuid in exclusive_on or (exclusive and used[g.uuid]) or used[g.uuid] + vram > usable[g.uuid]
               for g in gpus):
            continue
        s = session(agent)
        gang = tuple(g.uuid for g in gpus) if len(gpus) > 1 else ()
        prio = draw(st.integers(0, 1) if crowded else st.integers(-2, 3))
        pre = draw(st.integers(0, 4)) > 0 if crowded else draw(st.booleans())
        for g in gpus:
            take = usable[g.uuid] if exclusive else vram
            used[g.uuid] += take
            if exclusive:
                exclusive_on.add(g.uuid)
            leases.append(VramLease(id=f"old{n}", host=HOST, gpu_uuid=g.uuid, gpu_index=g.index, agent=agent,
                                    session_id=s.session_id, vram_mb=take, priority=prio, preemptible=pre,
                                    request_id=f"old{n}", token=n + 1, created_at=float(n), gang=gang,
                                    exclusive=exclusive, etcd_lease=s.etcd_lease, mod_revision=100 + n))
    ids = sorted({x.id for x in leases})
    evicting = frozenset(x for x in ids if draw(st.integers(0, 3)) == 0)
    entries: list[QueueEntry] = []
    waiting: dict[str, Call] = {}
    for n in range(draw(st.integers(0, 4))):
        agent = draw(st.sampled_from(AGENTS))
        s = session(agent)
        prio = draw(st.integers(-2, 0) if crowded else st.integers(-2, 5))   # crowded: the new calls rank first
        r = draw(requests(crowded, singles))
        lease_id = lease_id_for(agent, f"q{n}", HOST)
        rank = Keys.queue_rank(prio, 10 + n, lease_id)
        victims = tuple(draw(st.lists(st.sampled_from([*ids, "long-gone"]), max_size=1)))
        entries.append(QueueEntry(rank=rank, agent=agent, session_id=s.session_id, etcd_lease=s.etcd_lease,
                                  vram_mb=r["vram_mb"], gpu="", priority=prio, preemptible=True,
                                  request_id=f"q{n}", lease_id=lease_id, deadline_unix=WALL + 30, replica="r1",
                                  victims=victims, mod_revision=200 + n, gpu_count=r["gpu_count"],
                                  exclusive=r["exclusive"], topology=r["topology"], gpus=r["gpus"]))
        if draw(st.booleans()):
            waiting[lease_id] = Call(s, r["vram_mb"], None, prio, True, f"q{n}", lease_id, 30.0, 10 + n, NOW + 30,
                                     rank=rank, **wants(r["gpu_count"], r["exclusive"], r["topology"], r["gpus"]))
    entries.sort(key=lambda e: e.rank)
    batch = []
    for n in range(draw(st.integers(1, 6))):
        agent = draw(st.sampled_from(AGENTS))
        wait = draw(st.sampled_from([0.0, 5.0, 5.0] if crowded else [0.0, 5.0]))
        r = draw(requests(crowded, singles))
        rid = f"new{n}"
        prio = draw(st.integers(1, 6) if crowded else st.integers(-2, 6))
        batch.append(Call(session(agent), r["vram_mb"], None, prio, draw(st.booleans()), rid,
                          lease_id_for(agent, rid, HOST), wait, 1000 + n, NOW + wait,
                          **wants(r["gpu_count"], r["exclusive"], r["topology"], r["gpus"])))
    gpus = {g.uuid: GpuView(uuid=g.uuid, index=g.index, total_mb=g.vram_total_mb, usable_mb=usable[g.uuid],
                            ledger=GpuLedger(g.vram_total_mb, 7 + g.index, 300 + g.index),
                            leases=[x for x in leases if x.gpu_uuid == g.uuid])
            for g in inventory.gpus}
    view = HostView(HOST, 500, inventory, _KV(KEYS.host(HOST), b"{}", 40, 0x99), None, None, gpus,
                    {x.id: x for x in leases}, None, (), tuple(entries))
    config = CoordinatorConfig(max_queue_per_host=draw(st.integers(2, 8)), max_queue_per_agent=4).validate()
    return {"view": view, "batch": batch, "waiting": waiting, "caps": caps, "usable": usable, "leases": leases,
            "ctx": Context(KEYS, config, "r1", evicting, NOW, WALL)}
