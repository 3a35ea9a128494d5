"""Notices serve their requester until the deadline (G3, G11). Pure: the round's copies in, a choice out.

Every round that decides a queued request with victims whose leases still live decides again which of them it
needs, and its transaction withdraws (deletes, comparing each) the notices it no longer needs, together with
the rewrite of the request's queue entry that no longer lists them:

* the request fits now without them (room freed elsewhere, on GPUs no request ranked before it waits for):
  it is granted in that transaction, and every notice it made is withdrawn there;
* its team's limit now holds it back (``planner._wait_for_team``): every notice it made is withdrawn;
* a reclaim victim (G11) went back into its team's quota (an older lease of its team ended), or the requesting
  team would no longer stay within its quota counting the request: that notice is withdrawn;
* a victim can be spared (the others, with what was freed since, make it fit): that one is withdrawn, the
  last chosen first; and when those left do not make it fit, none of them is needed: all are withdrawn (the
  next round chooses again).

A request whose wait ends, or whose caller or session goes, leaves the queue; its notices are withdrawn after
(``Leases.withdraw_evictions``) and, at the latest, by the leader at the deadline, which revokes a lease only
while its requester's queue entry still lists it (its revoke compares that entry). Only notices the request
made are withdrawn: an operator's (``requested_by`` = ``operator``) stands. While a victim's processes are still
departing (its lease gone, the node still reports them), nothing is spared for room: that room is not free yet.
"""
from __future__ import annotations

from typing import Callable, Collection, Mapping, Sequence

from coordinator.policy.admission import GpuView, room_for
from coordinator.policy.gang import slots_from_views
from coordinator.policy.host import HostView
from coordinator.policy.placement import Chosen, GangRequest, place
from coordinator.records import EvictionRecord, QueueEntry


def requested_by(entry: QueueEntry) -> str:
    return f"{entry.agent}/{entry.request_id}"


def own_notices(entry: QueueEntry, view: HostView, notices: Mapping[str, tuple[int, EvictionRecord]]) -> list[str]:
    """The victims of ``entry`` whose lease still lives and whose notice, as the round knows it, the request
    made (so the round may withdraw it)."""
    me = requested_by(entry)
    return [v for v in entry.victims if v in view.leases and v in notices and notices[v][1].requested_by == me]


def withdrawable(entry: QueueEntry, view: HostView, notices: Mapping[str, tuple[int, EvictionRecord]],
                 departing: Collection[str]) -> bool:
    """Whether every victim of ``entry`` that still holds anything is one whose notice the round may withdraw:
    then the request may be granted now on room it finds free, its notices withdrawn in that transaction."""
    own = set(own_notices(entry, view, notices))
    return not any(v in departing for v in entry.victims) and all(v in own for v in entry.victims
                                                                    if v in view.leases)


def fits_with_gone(view: HostView, agent: str, vram_mb: int, free_of_queue: Sequence[GpuView],
                   caps: Mapping[str, int], gang: GangRequest | None, unavailable: Collection[int],
                   gone: Collection[str]) -> bool:
    """Whether the request fits on GPUs no request ranked before it waits for, once the leases ``gone`` are."""
    if gang is None:
        return any(vram_mb <= room_for(g.without(gone),
                                       agent, caps[g.uuid]) for g in free_of_queue if g.uuid in caps)
    placed = place(slots_from_views(view.gpus.values(), agent, view.inventory, gone), gang, unavailable)
    return isinstance(placed, Chosen)


def unneeded(entry: QueueEntry, own: Sequence[str], invalid: Collection[str], departing: Collection[str],
             fits: Callable[[Collection[str]], bool]) -> list[str]:
    """Which of ``own`` (the victims whose notice the request made) the request no longer needs (see the
    module's docstring): ``invalid`` ones (a reclaim no longer allowed), then those that can be spared, the last
    chosen first, or all of them when those left would not make it fit. ``fits(gone)``: whether the request
    fits once the leases ``gone`` are."""
    drop = [v for v in own if v in invalid]
    if any(v in departing for v in entry.victims):
        return drop
    others = {v for v in entry.victims if v not in own}   # gone already, or under an operator's notice
    keep = [v for v in own if v not in invalid]
    for v in reversed(list(keep)):
        rest = [x for x in keep if x != v]
        if fits(others | set(rest)):
            keep = rest
            drop.append(v)
    if keep and not fits(others | set(keep)):
        drop += keep
    return drop
