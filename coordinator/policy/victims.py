"""Victims for a gang, as pure policy: which leases to evict so that a request for N GPUs fits (G3 over GPU
sets). Plain data in, a decision out; no I/O.

Victims (G3 over GPU sets)
==========================
``choose_gang_victims`` picks what to evict for a request that does not fit now. A ``Holder`` is one lease,
possibly a gang over several GPUs: evicting it frees its VRAM on every one of them. For one candidate set
it is exactly ``admission.choose_victims`` over the set: the preemptible holders of lower priority that touch
the set, taken lowest priority first, then newest first (``created_at``, then ``token``), until the request
would fit on every GPU of the set (its VRAM and the agent's cap there; exclusive: every holder on the set
goes and the GPU comes free whole); then every victim that can be spared is dropped, in that same order.
The order rule wins over the smallest count within a set; the result is minimal (no victim can be spared).
Over the candidate sets (every set of allowed, available GPUs that could ever hold the request and
satisfies the topology), as ``admission.plan_eviction`` does over GPUs, the set with the fewest victims
wins, then the lowest highest victim priority, then the lowest indexes. A request that fits now, or will
once the leases already being evicted are gone, needs no victims (the caller passes the slots and
holders with those leases removed); None when no set can be freed.
"""
from __future__ import annotations

import dataclasses
from typing import Collection, Iterable, Iterator, Sequence

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

    def on(self, index: int) -> int:
        return sum(mb for i, mb in self.vram if i == index)


@dataclasses.dataclass(frozen=True)
class VictimChoice:
    gpus: tuple[int, ...]              # the set the request gets once the victims are gone
    victims: tuple[Holder, ...]        # in G3 order; () when it fits now or once pending evictions end


# -- victims -----------------------------------------------------------------------------------------------

def g3_order(h: Holder) -> tuple[int, float, int]:
    """G3's order: lowest priority first, then newest first."""
    return (h.priority, -h.created_at, -h.token)


def choose_gang_victims(slots: Sequence[GpuSlot], request: GangRequest, priority: int, agent: str,
                        holders: Sequence[Holder], unavailable: Collection[int] = ()) -> VictimChoice | None:
    """What to evict so that ``request`` (of ``priority``, by ``agent``) fits (see the module's docstring).

    ``slots`` and ``holders`` leave out the leases already being evicted (they count as gone)."""
    placed = place(slots, request, unavailable)
    if isinstance(placed, Chosen):
        return VictimChoice(placed.gpus, ())
    if isinstance(placed, Refused):
        return None
    best: tuple[tuple[int, int, tuple[int, ...]], VictimChoice] | None = None
    for members in candidate_sets(slots, request, unavailable):
        victims = set_victims(members, request, priority, agent, holders)
        if victims is None:
            continue
        indexes = tuple(s.index for s in members)
        cost = (len(victims), max((v.priority for v in victims), default=priority), indexes)
        if best is None or cost < best[0]:
            best = (cost, VictimChoice(indexes, tuple(victims)))
    return best[1] if best is not None else None


def candidate_sets(slots: Sequence[GpuSlot], request: GangRequest,
                   unavailable: Collection[int] = ()) -> Iterator[tuple[GpuSlot, ...]]:
    """Every set of GPUs that could ever hold ``request`` (allowed, available, of its topology), lowest
    indexes first; none when the request can never be placed."""
    host = HostShape(slots)
    checked = check_request(host, request, unavailable)
    if isinstance(checked, Refused):
        return
    blocks, _ = host.blocks(checked, request.topology)
    order = {n: (host.slots[n].index,) for n in range(len(host.slots))}
    for mask in gpu_sets(host, blocks, request.gpu_count, order):
        yield tuple(host.slots[n] for n in bits(mask))


def set_victims(members: Sequence[GpuSlot], request: GangRequest, priority: int, agent: str,
                holders: Iterable[Holder]) -> list[Holder] | None:
    """``admission.choose_victims`` over a set of GPUs: the victims that make ``request`` fit on every GPU of
    ``members``, taken in G3 order, then pruned in that order until none can be spared; [] when it fits
    already, None when evicting every candidate would not make it fit."""
    on_set = {s.index for s in members}
    touching = [h for h in holders if any(i in on_set for i, mb in h.vram)]
    evictable = [h for h in touching if h.preemptible and h.priority < priority]
    if request.exclusive:
        if len(evictable) != len(touching) or any(request.caps[s.uuid] < s.usable_mb for s in members):
            return None
        need_gpu = {s.index: s.usable_mb - s.free_mb for s in members}
        need_own = {s.index: 0 for s in members}
    else:
        need_gpu = {s.index: request.vram_mb - s.free_mb for s in members}
        need_own = {s.index: request.vram_mb - (request.caps[s.uuid] - s.agent_mb) for s in members}
    must_go = {h.id for h in touching} if request.exclusive else set()

    def enough(victims: Sequence[Holder]) -> bool:
        if not must_go <= {v.id for v in victims}:
            return False
        for i in on_set:
            freed = sum(v.on(i) for v in victims)
            own = sum(v.on(i) for v in victims if v.agent == agent)
            if freed < need_gpu[i] or own < need_own[i]:
                return False
        return True

    if enough([]):
        return []
    victims: list[Holder] = []
    for h in sorted(evictable, key=g3_order):
        if enough(victims):
            break
        victims.append(h)
    if not enough(victims):
        return None
    for h in list(victims):       # drop the victims that turned out unnecessary, in the same order
        rest = [v for v in victims if v is not h]
        if enough(rest):
            victims = rest
    return victims
