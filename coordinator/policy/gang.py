"""Gangs as the planner sees them: a host snapshot's GPUs as placement slots and its leases as holders (the
records of one lease id on several GPUs are one gang), and the GPUs a gang could ever use (what it blocks
while it waits, G2). Pure, no I/O."""
from __future__ import annotations

from typing import Collection, Iterable

from coordinator.policy.admission import GpuView
from coordinator.policy.placement import (
    GangRequest,
    GpuSlot,
    HostShape,
    Refused,
    bits,
    check_request,
)
from coordinator.policy.victims import Holder
from coordinator.records import HostInventory


def slots_from_views(gpus: Iterable[GpuView], agent: str, inventory: HostInventory | None = None,
                     evicting: Collection[str] = ()) -> tuple[GpuSlot, ...]:
    """Slots from the GPUs of a host snapshot, with the leases in ``evicting`` counted as gone (as
    ``admission.plan_eviction`` counts them) and the topology of the node's inventory (unknown without)."""
    topology = {g.uuid: g for g in inventory.gpus} if inventory is not None else {}
    out = []
    for g in gpus:
        if evicting:
            g = g.without(evicting)
        info = topology.get(g.uuid)
        out.append(GpuSlot(index=g.index, uuid=g.uuid, usable_mb=g.usable_mb, free_mb=g.free_mb,
                           leased=bool(g.leases), agent_mb=g.agent_mb(agent),
                           numa_node=info.numa_node if info is not None else None,
                           nvlink_peers=info.nvlink_peers if info is not None else ()))
    return tuple(out)


def holders_from_views(gpus: Iterable[GpuView], evicting: Collection[str] = (),
                       idle: Collection[str] = ()) -> tuple[Holder, ...]:
    """The leases of a host snapshot as holders: the records of one lease id on several GPUs are one gang;
    ``idle``: the lease ids judged idle (G3 takes them first among leases of one priority)."""
    parts: dict[str, list[tuple[GpuView, int]]] = {}
    for g in gpus:
        for n, lease in enumerate(g.leases):
            if lease.id not in evicting:
                parts.setdefault(lease.id, []).append((g, n))
    out = []
    for lease_id, where in parts.items():
        leases = [g.leases[n] for g, n in where]
        first = leases[0]
        out.append(Holder(id=lease_id, agent=first.agent, priority=first.priority, preemptible=first.preemptible,
                          created_at=first.created_at, token=max(x.token for x in leases),
                          vram=tuple((g.index, g.leases[n].vram_mb) for g, n in where), idle=lease_id in idle))
    return tuple(out)


def could_use(slots: Iterable[GpuSlot], request: GangRequest) -> Refused | tuple[int, ...]:
    """The indexes of every GPU that some set able to hold ``request`` once leases go (and satisfying its
    topology) contains: what a waiting gang blocks for the requests ranked after it (G2); or why no set ever
    can."""
    host = HostShape(tuple(slots))
    ever = check_request(host, request, ())
    if isinstance(ever, Refused):
        return ever
    blocks, _ = host.blocks(ever, request.topology)
    used = 0
    for b in blocks:
        if b.bit_count() >= request.gpu_count:
            used |= b
    return tuple(host.slots[n].index for n in bits(used))
