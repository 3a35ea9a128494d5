"""Victims, as pure policy: which leases to evict so that a request (one GPU, or a gang of N) fits (G3 over
every candidate). Plain data in, a decision out; no I/O.

Victims (G3 over all candidates)
================================
``choose_gang_victims`` picks what to evict for a request that does not fit now. A ``Holder`` is one lease,
possibly a gang over several GPUs: it is one victim, of its own priority and age, and evicting it frees its
VRAM on every one of them (each GPU's own record). The candidates are the preemptible holders of lower
priority, over every GPU of the host; they are taken in G3's order over all of them, lowest priority first,
then the leases this replica judges idle (``Holder.idle``, docs/policies.md "Idle GPUs") before the others, then newest
first (``created_at``, then ``token``), until the request would fit on some candidate set (every
set of allowed, available GPUs that could ever hold it and satisfies the topology): its VRAM and the agent's
cap on every GPU of the set (exclusive: every holder on the set goes and each GPU comes free whole); then
every victim that can be spared is dropped, in that same order. The result is minimal (no victim can be
spared), and the order rule wins over the smallest count, across GPUs as within one: a newer lease of the
lowest priority is taken before an older one of that priority on another GPU, and a gang is never passed
over for its size. The set the request gets is the one of lowest indexes that the victims free.

With a team limit (``team_room``: what the requester's team may still be charged, the leases already being
evicted counted as gone), a set fits only once its charge (``placement.set_charge``) is within that room plus
what the victims free under the limit (every GPU record of each; the caller passes holders of the requester's
team alone as evictable, ``reclaim.own_team_only``): G3 within the team frees room under its limit as it frees
room on a GPU. A request that fits now (within the room), or will once the leases already being evicted are
gone, needs no victims (the caller passes the slots and holders with those leases removed); None when no
candidate set can be freed.
"""
from __future__ import annotations

import dataclasses
from typing import Collection, Iterator, Sequence

from coordinator.policy.placement import (
    Chosen,
    GangRequest,
    GpuSlot,
    HostShape,
    Refused,
    bits,
    check_request,
    gpu_sets,
    place,
    set_charge,
)


@dataclasses.dataclass(frozen=True)
class Holder:
    """A lease that holds VRAM on one or more GPUs of the host (a gang holds several)."""

    id: str
    agent: str
    priority: int
    preemptible: bool
    created_at: float
    token: int                         # the highest fencing token among its GPUs: newer is larger
    vram: tuple[tuple[int, int], ...]  # (GPU index, MiB) per GPU it holds
    idle: bool = False                 # judged idle by this replica (docs/policies.md "Idle GPUs"): taken first of its priority

    def on(self, index: int) -> int:
        return sum(mb for i, mb in self.vram if i == index)


@dataclasses.dataclass(frozen=True)
class VictimChoice:
    gpus: tuple[int, ...]              # the set the request gets once the victims are gone
    victims: tuple[Holder, ...]        # in G3 order; () when it fits now or once pending evictions end


# -- victims -----------------------------------------------------------------------------------------------

def g3_order(h: Holder) -> tuple[int, bool, float, int]:
    """G3's order: lowest priority first, then idle leases before busy ones, then newest first."""
    return (h.priority, not h.idle, -h.created_at, -h.token)


def choose_gang_victims(slots: Sequence[GpuSlot], request: GangRequest, priority: int, agent: str,
                        holders: Sequence[Holder], unavailable: Collection[int] = (),
                        team_room: int | None = None) -> VictimChoice | None:
    """What to evict so that ``request`` (of ``priority``, by ``agent``) fits (see the module's docstring).

    ``slots`` and ``holders`` leave out the leases already being evicted (they count as gone)."""
    placed = place(slots, request, unavailable, team_room)
    if isinstance(placed, Chosen):
        return VictimChoice(placed.gpus, ())
    if isinstance(placed, Refused):
        return None
    host = HostShape(slots)
    sets = [(mask, set_charge(host, mask, request)) for mask in _candidate_masks(host, request, unavailable)]
    on_sets = 0
    for mask, _ in sets:
        on_sets |= mask
    touching: dict[int, list[Holder]] = {n: [] for n in bits(on_sets)}
    for h in holders:
        for i, _ in h.vram:
            if host.pos.get(i) in touching:
                touching[host.pos[i]].append(h)
    evictable = sorted((h for h in holders if h.preemptible and h.priority < priority
                        and (team_room is not None or any(host.pos.get(i, -1) in touching for i, _ in h.vram))),
                       key=g3_order)

    def fitting(victims: Sequence[Holder]) -> list[int]:
        """The candidate sets on which the request fits once ``victims`` are gone."""
        gone = {v.id for v in victims}
        ok = 0
        for n in touching:
            s = host.slots[n]
            freed = sum(v.on(s.index) for v in victims)
            own = sum(v.on(s.index) for v in victims if v.agent == agent)
            if request.exclusive:
                fits = (all(h.id in gone for h in touching[n]) and s.free_mb + freed >= s.usable_mb
                        and request.caps[s.uuid] >= s.usable_mb)
            else:
                fits = (s.free_mb + freed >= request.vram_mb
                        and request.vram_mb <= request.caps[s.uuid] - (s.agent_mb - own))
            ok |= fits << n
        room = None if team_room is None else team_room + sum(mb for v in victims for _, mb in v.vram)
        return [mask for mask, charge in sets if mask & ~ok == 0 and (room is None or charge <= room)]

    if fitting([]):
        return VictimChoice(_indexes(host, min(fitting([]), key=lambda m: _indexes(host, m))), ())
    victims: list[Holder] = []
    for h in evictable:
        if fitting(victims):
            break
        victims.append(h)
    if not fitting(victims):
        return None
    for h in list(victims):       # drop the victims that turned out unnecessary, in the same order
        rest = [v for v in victims if v is not h]
        if fitting(rest):
            victims = rest
    return VictimChoice(_indexes(host, min(fitting(victims), key=lambda m: _indexes(host, m))), tuple(victims))


def _indexes(host: HostShape, mask: int) -> tuple[int, ...]:
    return tuple(host.slots[n].index for n in bits(mask))


def _candidate_masks(host: HostShape, request: GangRequest, unavailable: Collection[int]) -> Iterator[int]:
    checked = check_request(host, request, unavailable)
    if isinstance(checked, Refused):
        return
    blocks, _ = host.blocks(checked, request.topology)
    order = {n: (host.slots[n].index,) for n in range(len(host.slots))}
    yield from gpu_sets(host, blocks, request.gpu_count, order)


def candidate_sets(slots: Sequence[GpuSlot], request: GangRequest,
                   unavailable: Collection[int] = ()) -> Iterator[tuple[GpuSlot, ...]]:
    """Every set of GPUs that could ever hold ``request`` (allowed, available, of its topology), lowest
    indexes first; none when the request can never be placed."""
    host = HostShape(slots)
    for mask in _candidate_masks(host, request, unavailable):
        yield tuple(host.slots[n] for n in bits(mask))
