"""Backfill against a multi-host gang's reservation (issue 31 point 3, G12/G13). Pure, no I/O.

A waiting multi-host gang reserves GPUs on each host of the set it will get (``replica/fleet.py``): no request
ranked after it is granted on them (G2 across hosts), except a **backfill**: a request with a time limit whose
lease is gone by the reservation's earliest start. The gang's replica writes that start on each reservation entry
(``QueueEntry.start_after``, unix seconds): the latest known end of the leases on the GPUs it reserves, over all
its hosts (``earliest_start``; a lease's known end is ``replica/waits.lease_ends``': its time limit or its notice's
deadline, plus the kill margin). It is 0, and nothing is backfilled, while any lease in the way has no known end.

A request may take a reserved GPU when ``wall + time_limit + kill margin <= start_after`` (the leader revokes it
by then at the latest) and no request ranked before it waits for that GPU for another reason. The estimate is an
upper bound of when the gang can start: a holder that releases early brings the start forward, and a backfill
granted before may then hold the gang back until its own end, as in every backfilling scheduler (Slurm's too).
The rule's cost is that bound: without time limits nothing is backfilled and reserved GPUs idle.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Protocol

from coordinator.policy.admission import GpuView
from coordinator.records import QueueEntry


class _Round(Protocol):
    blocked: set[str]
    backfill: dict[str, float]
    waited: set[str]


def hold_for_gang(rnd: _Round, entry: QueueEntry) -> None:
    """A reservation entry in a host round: its GPUs are held back from every later request, but for backfill."""
    for uuid_ in entry.reserve:
        rnd.blocked.add(uuid_)
        if entry.start_after > 0 and uuid_ not in rnd.waited:
            rnd.backfill[uuid_] = min(rnd.backfill.get(uuid_, entry.start_after), entry.start_after)
        else:
            rnd.backfill[uuid_] = 0.0


def blocked_for(rnd: _Round, time_limit_s: float, wall: float, margin_s: float) -> set[str]:
    """The GPUs a request of ``time_limit_s`` may not take: what requests ranked before it wait for, less the
    reserved GPUs it may backfill."""
    if not time_limit_s or not rnd.backfill:
        return rnd.blocked
    ends = wall + time_limit_s + margin_s
    return rnd.blocked - {u for u, start in rnd.backfill.items() if start > 0 and ends <= start and u not in rnd.waited}


def earliest_start(gpus: Iterable[GpuView], ends: Mapping[str, float], now: float) -> float:
    """When GPUs are free at the latest, from their leases' known ends (unix seconds; ``now`` when none holds
    one); 0 when some lease on them, or some ended lease's processes, has no known end."""
    start = now
    for g in gpus:
        if g.departing:
            return 0.0
        for lease in g.leases:
            end = ends.get(lease.id)
            if end is None:
                return 0.0
            start = max(start, end)
    return start
