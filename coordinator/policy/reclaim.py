"""Reclaim in an admission round (G11): which leases a request of a team below its quota takes back from other
teams' over-quota leases when it does not fit, and the rule that keeps priority eviction (G3) inside a team.
Pure: the round's copies in, a choice out; no I/O.

With teams stored:

* **G3 stays within a team.** A request may evict by priority only leases of its own team; another team's
  lease is never taken for its priority.
* **Reclaim.** A request that does not fit, for which G3 finds nothing, and whose team stays within its quota
  counting it (``teams.stays_in_quota``), may take other teams' **over-quota** leases (``teams.in_quota``: a
  team's leases fill its quota oldest first, over the whole fleet), whatever their priority: preemptible ones,
  past their minimum runtime (``teams.protected``), taken from the team furthest over its weighted share,
  newest first, until the request fits, and then pruned until none can be spared (``teams.choose_reclaim``).
  Over GPUs (or a gang's GPU sets) the choice with the fewest victims wins, then the one whose victims reclaim's
  order takes first (the team furthest over its fair share, its newest lease), then the lowest indexes. In-quota
  leases are never taken for another team. The victims get the usual notice and grace; the request waits in
  the queue for them to be gone (G3's evict-before-grant ordering, their processes included).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Collection, Mapping, Sequence

from coordinator.policy.admission import GpuView
from coordinator.policy.decide import Request
from coordinator.policy.gang import slots_from_views
from coordinator.policy.host import HostView
from coordinator.policy.team_admission import TeamState, fleet_charges, team_use
from coordinator.policy.teams import (
    Charge,
    choose_reclaim,
    in_quota,
    protected,
    reclaim_order,
    reclaimable,
)
from coordinator.policy.victims import candidate_sets


@dataclasses.dataclass(frozen=True)
class ReclaimChoice:
    team: str                    # the requesting team
    victims: tuple[str, ...]     # lease ids, in reclaim order; () when it fits once pending evictions end
    gpus: tuple[str, ...]        # the GPUs (uuids) the request gets once they are gone


def own_team_only(state: TeamState | None, agent: str, gpus: Sequence[GpuView]) -> Sequence[GpuView]:
    """The GPUs as G3 may see them for ``agent``'s request: other teams' leases made non-preemptible (copies),
    so that priority eviction takes only leases of the agent's own team. Unchanged without teams."""
    if state is None:
        return gpus
    team_of = state.membership.team_of
    team = team_of(agent)
    out = []
    for g in gpus:
        if all(team_of(x.agent) == team or not x.preemptible for x in g.leases):
            out.append(g)
            continue
        copy = dataclasses.replace(g, leases=[x if team_of(x.agent) == team else dataclasses.replace(x, preemptible=False)
                                              for x in g.leases])
        copy.seq = g.seq
        out.append(copy)
    return out


def protected_until(state: TeamState, view: HostView, req: Request, charges: Sequence[Charge], wall: float,
                    exclude: Collection[str] = ()) -> float | None:
    """When the first lease of this host that ``req`` could reclaim but for its minimum runtime comes out of
    it (wall clock): other teams' over-quota, preemptible leases still within their minimum runtime. None when
    there is none (nothing to wait for)."""
    here = set(view.gpus)
    requester = state.membership.team_of(req.agent)
    marks = in_quota(charges, state.membership)
    ends = [c.created_at + min(c.min_runtime_s, state.membership.team(c.team).max_min_runtime_s) for c in charges
            if c.team != requester and not marks[c.id] and c.preemptible and c.id not in exclude
            and set(c.gpus) & here and protected(c, state.membership.team(c.team), wall)]
    return min(ends) if ends else None


def _options(view: HostView, req: Request, candidates: Sequence[GpuView], caps: Mapping[str, int],
             evicting: Collection[str], unavailable: Collection[int]) -> list[tuple[dict[str, int], tuple[str, ...]]]:
    """(what is short on each GPU, the GPUs) for each placement reclaim could make room on; a placement the
    agent's own cap rules out is left out (reclaim frees none of the agent's own VRAM)."""
    out: list[tuple[dict[str, int], tuple[str, ...]]] = []
    if not req.is_gang:
        for g in candidates:
            cap = caps.get(g.uuid)
            if cap is None:
                continue
            after = g.without(evicting)
            if req.vram_mb > cap - after.agent_mb(req.agent):
                continue
            out.append(({g.uuid: req.vram_mb - after.free_mb}, (g.uuid,)))
        return out
    slots = slots_from_views(view.gpus.values(), req.agent, view.inventory, evicting)
    for members in candidate_sets(slots, req.gang(dict(caps)), unavailable):
        need: dict[str, int] = {}
        for s in members:
            cap = caps[s.uuid]
            if req.exclusive:
                if cap < s.usable_mb:
                    break
                need[s.uuid] = s.usable_mb - s.free_mb
            else:
                if req.vram_mb > cap - s.agent_mb:
                    break
                need[s.uuid] = req.vram_mb - s.free_mb
        else:
            out.append((need, tuple(s.uuid for s in members)))
    return out


def choose_reclaim_victims(state: TeamState, view: HostView, req: Request, candidates: Sequence[GpuView],
                           caps: Mapping[str, int], evicting: Collection[str], wall: float,
                           unavailable: Collection[int] = (),
                           charges: Callable[[], list[Charge]] | None = None,
                           fresh: Collection[str] = (), idle: Collection[str] = ()) -> ReclaimChoice | None:
    """What ``req`` reclaims (see the module's docstring), or None when its team may not reclaim or no
    placement can be freed by reclaim. ``candidates``: the single-GPU request's GPUs that no request ranked
    before it waits for; ``unavailable``: for a gang, the indexes of those GPUs that one does; ``evicting``:
    leases already being evicted (they count as gone); ``charges``: gives ``fleet_charges`` (built once a round
    by the caller, only when a request gets that far); ``fresh``: leases granted in this round (not taken); ``idle``:
    the leases judged idle (taken first of their team)."""
    team_name = state.membership.team_of(req.agent)
    team = state.membership.team(team_name)
    usable = {g.uuid: g.usable_mb for g in view.gpus.values()}
    smallest = req.vram_mb * req.gpu_count if not req.exclusive else 0
    if team_use(state, view, team_name) + smallest > team.quota_mb:
        return None          # over its quota with this request: it borrows, and may not reclaim
    models = {g.uuid: g.name for g in view.inventory.gpus} if view.inventory is not None else {}
    best: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ReclaimChoice] | None = None
    fleet: list[Charge] | None = None
    order: dict[str, int] = {}
    for need, gpus in _options(view, req, candidates, caps, evicting, unavailable):
        if fleet is None:
            fleet = charges() if charges is not None else fleet_charges(state, view)
            order = {c.id: n for n, c in enumerate(reclaim_order(team_name, reclaimable(
                team_name, fleet, state.membership, wall), fleet, state.membership, idle, state.fair))}
        by_model: dict[str, int] = {}    # what the request charges each GPU model: per GPU, by its own
        for u in gpus:
            model = models.get(u, "")
            by_model[model] = by_model.get(model, 0) + (usable[u] if req.exclusive else req.vram_mb)
        victims = choose_reclaim(team_name, sum(by_model.values()), need, fleet, state.membership, wall,
                                 exclude={*evicting, *fresh}, by_model=by_model, idle=idle, fair=state.fair)
        if victims is None:
            continue
        choice = ReclaimChoice(team_name, tuple(v.id for v in victims), gpus)
        if not victims:
            return choice    # it fits once the leases already being evicted are gone
        # The fewest victims, then those reclaim's order takes first (the team furthest over its fair share,
        # its newest), then the lowest indexes.
        cost = (len(victims), tuple(sorted(order.get(v.id, len(order)) for v in victims)),
                tuple(view.gpus[u].index for u in gpus))
        if best is None or cost < best[0]:
            best = (cost, choice)
    return best[1] if best is not None else None
