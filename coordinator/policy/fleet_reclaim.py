"""Reclaim (G11) for a multi-host gang (issue 30 point 4): which other teams' over-quota leases a gang of a team
below its quota takes back, over which set of hosts, when it does not fit and G3 (within its own team) finds
nothing. Pure: the snapshot's copies in, a choice out; no I/O.

As for a request of one host (``policy/reclaim.py``), with the whole gang as the request:

* **Charged whole.** The gang is charged VRAM x GPUs x hosts (each GPU its usable VRAM when exclusive, to its own
  model); its team may reclaim only while that whole charge keeps it within its quota (``teams.stays_in_quota``).
* **Each host's part.** On each host that could hold its part (not cordoned, free of what requests ranked before
  it wait for), every GPU set the part could use (``victims.candidate_sets``) is scored by the victims reclaim
  alone would take for it there (``teams.choose_reclaim``); a host keeps its set with the fewest, then those
  reclaim's order takes first (the newest of the team furthest over its share), then the lowest indexes. A host
  where reclaim cannot free a set takes no part.
* **The set of hosts.** Over every set of ``hosts`` of those hosts of one group (``same``; the best ``hosts`` + 8
  of each by their own count, up to ``fleet.MAX_EVICTION_SETS`` sets), reclaim is chosen once for the whole
  gang (the union of what its parts lack, its whole charge): the set with ``prefer``'s one value first, then the
  fewest victims, then the victims reclaim's order takes first (as a host's own round breaks a tie of GPU sets),
  then the names. Victims are other teams' over-quota, preemptible leases past their minimum
  runtime, in reclaim's order (weighted share, idle, newest); a victim holding parts on two hosts of the set
  counts once. In-quota leases are never taken.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Collection, Mapping, Sequence

from coordinator.policy.fleet import (
    MAX_EVICTION_SETS,
    FleetHost,
    FleetRequest,
    Parts,
    host_groups,
)
from coordinator.policy.placement import GpuSlot
from coordinator.policy.teams import (
    Charge,
    Membership,
    choose_reclaim,
    reclaim_order,
    reclaimable,
)
from coordinator.policy.victims import candidate_sets


@dataclasses.dataclass(frozen=True)
class FleetReclaim:
    reserve: Parts                 # the hosts it reserves, with the GPUs (indexes) it gets on each
    victims: tuple[str, ...]       # lease ids, in reclaim order; () when it fits once leases already going end


@dataclasses.dataclass(frozen=True)
class _Part:
    host: str
    gpus: tuple[int, ...]
    need: Mapping[str, int]        # GPU uuid -> MiB short
    by_model: Mapping[str, int]    # what the part charges each GPU model
    alone: tuple[int, ...]         # the victims reclaim alone takes for it, as positions in reclaim's order


def _need(req: FleetRequest, h: FleetHost, members: Sequence[GpuSlot]) -> dict[str, int] | None:
    need: dict[str, int] = {}
    for s in members:
        cap = h.caps.get(s.uuid)
        if cap is None or (req.exclusive and cap < s.usable_mb) or (not req.exclusive and req.vram_mb > cap - s.agent_mb):
            return None     # its agent's own cap rules the set out: reclaim frees none of the agent's own VRAM
        need[s.uuid] = (s.usable_mb if req.exclusive else req.vram_mb) - s.free_mb
    return need


def plan_gang_reclaim(req: FleetRequest, hosts: Sequence[FleetHost], team: str, charges: Sequence[Charge],
                      membership: Membership, models: Mapping[str, str], now: float,
                      exclude: Collection[str] = (), idle: Collection[str] = (),
                      fair: Mapping[str, float] | None = None) -> FleetReclaim | None:
    """What the gang of team ``team`` reclaims (see the module's docstring), or None. ``hosts``: as G3 sees them
    (leases already going count as gone); ``charges``: every live lease of the fleet; ``models``: GPU uuid ->
    model; ``exclude``: leases already going; ``idle``: leases judged idle (taken first of their team); ``fair``:
    each team's fair-share factor (``teams.fair_factors``)."""
    order = {c.id: n for n, c in enumerate(reclaim_order(team, reclaimable(team, charges, membership, now), charges,
                                                         membership, idle, fair))}

    def positions(victims: Sequence[Charge]) -> tuple[int, ...]:
        return tuple(sorted(order.get(v.id, len(order)) for v in victims))
    parts: dict[str, _Part] = {}
    for h in hosts:
        if h.never or h.cordoned:
            continue
        best: _Part | None = None
        for members in candidate_sets(h.slots, req.on(h), h.blocked):
            need = _need(req, h, members)
            if need is None:
                continue
            per_model: dict[str, int] = {}
            for s in members:
                model = models.get(s.uuid, "")
                per_model[model] = per_model.get(model, 0) + (s.usable_mb if req.exclusive else req.vram_mb)
            alone = choose_reclaim(team, 0, need, charges, membership, now, exclude=exclude, idle=idle, fair=fair)
            if alone is None:
                continue
            part = _Part(h.host, tuple(s.index for s in members), need, per_model, positions(alone))
            if best is None or (len(part.alone), part.alone, part.gpus) < (len(best.alone), best.alone, best.gpus):
                best = part
        if best is not None:
            parts[h.host] = best
    k = req.hosts
    chosen: tuple[tuple[int, int, tuple[int, ...], tuple[str, ...]], FleetReclaim] | None = None
    tried = 0
    labels = {h.host: h.labels for h in hosts}
    for group in host_groups(req, [h for h in hosts if h.host in parts]):
        names = sorted((h.host for h in group), key=lambda x: (len(parts[x].alone), parts[x].alone, x))[:k + 8]
        for combo in itertools.combinations(sorted(names), k):
            tried += 1
            if tried > MAX_EVICTION_SETS:
                break
            short: dict[str, int] = {}
            by_model: dict[str, int] = {}
            for x in combo:
                short.update(parts[x].need)
                for model, mb in parts[x].by_model.items():
                    by_model[model] = by_model.get(model, 0) + mb
            victims = choose_reclaim(team, sum(by_model.values()), short, charges, membership, now,
                                     exclude=exclude, by_model=by_model, idle=idle, fair=fair)
            if victims is None:
                continue
            values = {labels[x].get(req.prefer) for x in combo} if req.prefer else {None}
            cost = (0 if len(values) == 1 and None not in values else 1, len(victims), positions(victims), combo)
            if chosen is None or cost < chosen[0]:
                chosen = (cost, FleetReclaim(tuple((x, parts[x].gpus) for x in combo), tuple(v.id for v in victims)))
    return chosen[1] if chosen is not None else None
