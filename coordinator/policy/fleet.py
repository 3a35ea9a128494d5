"""Multi-host gangs as pure policy (issue 30, G12): which hosts, and which GPUs on each, a request for
``gpu_count`` GPUs on each of ``hosts`` hosts gets now, or which it reserves while it waits. No I/O.

Inputs
======
``FleetHost``: one host as a snapshot shows it to the request's agent: its labels, its GPUs as placement slots
(``policy/placement.py``), the agent's caps there (its partition), the GPUs that requests ranked before this
one wait for there (``blocked``, G2: per-host waiters' GPUs, other gangs' reservations), and whether it can
take part at all (``never``: gone, INVALID or outside the agent's partition) or only not now (``cordoned``).

The rules
=========
* **Could ever.** A host can ever hold its part when ``placement.could_use`` finds a set on it once every lease
  goes (cordoned hosts count: a cordon ends). With ``same=KEY`` the hosts are grouped by their value of label
  KEY (a host without it is in no group); without, all hosts are one group. A request no group can ever hold
  ``hosts`` of is refused: naming ``same`` when enough hosts could hold it but no ``hosts`` of them share a
  value, else naming ``hosts``.
* **Grant.** In each group, the hosts not cordoned where ``placement.place`` chooses a set now, free of the
  blocked GPUs. A group with ``hosts`` of them is granted the best ``hosts``: with ``prefer=KEY``, those of one
  value of KEY when some value has enough; then the smallest key of (free VRAM left on the chosen GPUs after
  placing, summed over the hosts; the host names). The reservation the request already holds wins when it can
  be granted whole (a reserved set stays its own). Ranks follow the host names' order.
* **Reserve.** Otherwise the request waits and reserves ``hosts`` hosts of one group, not cordoned: the set it
  reserved before while it is still one it could ever get; else the hosts that free soonest by the rule: those
  it fits on now first, then the least VRAM held on the GPUs it could use there, then the host name (``prefer``
  as for a grant). On each it reserves every GPU it could ever use there (as a waiting gang of one host blocks,
  ``gang.could_use``): no request ranked after it is granted on them (G2 across hosts). The cost: those GPUs'
  free room idles for later requests until the gang is granted.

* **Evict** (G3 over host sets). A gang of priority P that cannot be granted now may evict: on each host that could
  ever hold its part (not cordoned), ``victims.choose_gang_victims`` finds the minimal victims there (preemptible,
  of priority < P, in G3's order over every GPU set of the host; none where it fits now). Over the hosts, the
  set of ``hosts`` hosts of one group whose victims are lowest under G3's order: the smallest highest victim
  priority, then busy before idle, then the oldest: G3's order from its last victim down, each lease once (a
  victim on two hosts of the set counts once), fewer victims winning ties; then the names (``prefer`` first). Their
  notices go with the reservation of that set; the gang is granted once they are gone.

**No two gangs deadlock**: a request's choice depends only on requests ranked before it (``blocked``), so the
highest-ranked waiting gang is blocked by nothing and is granted as soon as leases on some set it could ever
get have gone (``tests/unit/test_fleet_placement.py`` proves it as a property).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Callable, Iterable, Mapping, Sequence

from coordinator import errors
from coordinator.policy.gang import could_use
from coordinator.policy.placement import (
    Chosen,
    GangRequest,
    GpuSlot,
    Placement,
    Refused,
    place,
)
from coordinator.policy.victims import Holder, choose_gang_victims, g3_order

Parts = tuple[tuple[str, tuple[int, ...]], ...]   # (host, GPU indexes), in rank order


@dataclasses.dataclass(frozen=True)
class FleetHost:
    host: str
    labels: Mapping[str, str]
    slots: tuple[GpuSlot, ...]
    caps: Mapping[str, int]                 # the agent's allowed GPUs (uuid) -> its cap there
    blocked: frozenset[int] = frozenset()   # GPU indexes requests ranked before this one wait for (G2)
    cordoned: bool = False
    never: str = ""                         # why the host can never take part ("" when it can)


@dataclasses.dataclass(frozen=True)
class FleetRequest:
    hosts: int
    gpu_count: int
    vram_mb: int                            # per GPU; 0 with exclusive
    exclusive: bool = False
    topology: str = "any"
    same: str = ""
    prefer: str = ""

    def on(self, host: FleetHost) -> GangRequest:
        return GangRequest(self.gpu_count, self.vram_mb, host.caps, self.exclusive, self.topology)

    def could_use(self, host: FleetHost) -> Refused | tuple[int, ...]:
        """``gang.could_use`` of its part on ``host``, remembered (the fleet's hosts mostly stay as they were
        from one decision to the next)."""
        return _could_use(host.slots, self._shape(), _caps(host))

    def place(self, host: FleetHost) -> Placement:
        """``placement.place`` of its part on ``host``, free of the host's blocked GPUs, remembered."""
        return _place(host.slots, self._shape(), _caps(host), frozenset(host.blocked))

    def _shape(self) -> tuple[int, int, bool, str]:
        return self.gpu_count, self.vram_mb, self.exclusive, self.topology


def _caps(host: FleetHost) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(host.caps.items()))


# Placement is pure and a fleet's hosts mostly unchanged between two decisions: each host's answer is kept by
# its exact inputs (the slots, the part's shape, the caps, the blocked GPUs).
@functools.lru_cache(maxsize=4096)
def _place(slots: tuple[GpuSlot, ...], shape: tuple[int, int, bool, str], caps: tuple[tuple[str, int], ...],
           blocked: frozenset[int]) -> Placement:
    return place(slots, GangRequest(shape[0], shape[1], dict(caps), shape[2], shape[3]), blocked)


@functools.lru_cache(maxsize=4096)
def _could_use(slots: tuple[GpuSlot, ...], shape: tuple[int, int, bool, str],
               caps: tuple[tuple[str, int], ...]) -> Refused | tuple[int, ...]:
    return could_use(slots, GangRequest(shape[0], shape[1], dict(caps), shape[2], shape[3]))


@dataclasses.dataclass(frozen=True)
class FleetGrant:
    parts: Parts


@dataclasses.dataclass(frozen=True)
class FleetWait:
    reserve: Parts                          # () when no set can be reserved now (hosts cordoned)
    reason: str


def plan_gang(req: FleetRequest, hosts: Sequence[FleetHost], reserved: Iterable[str] = ()) -> FleetGrant | FleetWait | Refused:
    """The decision for one multi-host gang (see the module's docstring). ``reserved``: the hosts it reserves now."""
    ever: dict[str, tuple[int, ...]] = {}
    why_not: list[str] = []
    for h in hosts:
        if h.never:
            continue
        usable = req.could_use(h)
        if isinstance(usable, Refused):
            why_not.append(f"{h.host}: {usable.reason}")
        elif usable:
            ever[h.host] = usable
    groups = host_groups(req, [h for h in hosts if h.host in ever])
    if not any(len(g) >= req.hosts for g in groups):
        return _impossible(req, len(ever), why_not)
    now: dict[str, tuple[int, ...]] = {}
    leftover: dict[str, int] = {}
    for h in hosts:
        if h.host not in ever or h.cordoned:
            continue
        p = req.place(h)
        if isinstance(p, Chosen):
            now[h.host] = p.gpus
            by_index = {s.index: s for s in h.slots}
            leftover[h.host] = sum(0 if req.exclusive else by_index[i].free_mb - req.vram_mb for i in p.gpus)
    held = {h.host: sum(s.usable_mb - s.free_mb for s in h.slots if s.index in ever[h.host])
            for h in hosts if h.host in ever}
    keep = tuple(sorted(set(reserved)))
    if keep and all(x in now for x in keep) and _one_group(req, hosts, keep) and len(keep) == req.hosts:
        return FleetGrant(tuple((x, now[x]) for x in keep))
    best = _best(req, [[h for h in g if h.host in now] for g in groups], lambda x: (0, leftover[x]))
    if best is not None:
        return FleetGrant(tuple((x, now[x]) for x in best))
    live = [[h for h in g if not h.cordoned] for g in groups]
    if keep and len(keep) == req.hosts and _one_group(req, hosts, keep) and all(
            any(h.host == x for g in live for h in g) for x in keep):
        chosen: tuple[str, ...] | None = keep
    else:
        chosen = _best(req, live, lambda x: (0 if x in now else 1, held[x]))
    if chosen is None:
        return FleetWait((), f"fewer than {req.hosts} hosts that could hold it are open (cordoned)")
    return FleetWait(tuple((x, ever[x]) for x in chosen),
                     f"waits for {req.hosts} hosts x {_shape(req)}; reserves {', '.join(chosen)}")


@dataclasses.dataclass(frozen=True)
class FleetEvict:
    reserve: Parts                          # the hosts it reserves (every GPU it could use on each)
    victims: tuple[tuple[str, Holder], ...]  # (host, victim) in G3's order, each lease once


def plan_gang_eviction(req: FleetRequest, hosts: Sequence[FleetHost], holders: Mapping[str, Sequence[Holder]],
                       priority: int, agent: str) -> FleetEvict | None:
    """The victims over host sets of a gang that cannot be granted now (see the module's docstring); None when
    no set of hosts can be freed by evicting."""
    choices: dict[str, tuple[Holder, ...]] = {}
    ever: dict[str, tuple[int, ...]] = {}
    for h in hosts:
        if h.never or h.cordoned:
            continue
        usable = req.could_use(h)
        if isinstance(usable, Refused) or not usable:
            continue
        choice = choose_gang_victims(h.slots, req.on(h), priority, agent, holders.get(h.host, ()), h.blocked)
        if choice is not None:
            choices[h.host], ever[h.host] = choice.victims, usable
    if not any(choices[x] for x in choices):
        return None

    chosen = _least_victims(req, host_groups(req, [h for h in hosts if h.host in choices]), choices)
    if chosen is None:
        return None
    seen: set[str] = set()
    victims = []
    for host, v in sorted(((x, v) for x in chosen for v in choices[x]), key=lambda p: g3_order(p[1])):
        if v.id not in seen:
            seen.add(v.id)
            victims.append((host, v))
    if not victims:
        return None
    return FleetEvict(tuple((x, ever[x]) for x in chosen), tuple(victims))


# At most this many sets of hosts are compared for one eviction (the hosts whose own victims come first in G3's
# order, then every set of them): C(12, 4) = 495, C(14, 2) = 91.
MAX_EVICTION_SETS = 5000


def _least_victims(req: FleetRequest, groups: Sequence[Sequence[FleetHost]],
                   choices: Mapping[str, tuple[Holder, ...]]) -> tuple[str, ...] | None:
    """The set of ``req.hosts`` hosts of one group (``prefer`` first) whose victims, each lease once (a victim
    holding parts on two hosts of the set counts once), come first under G3's order: compared from the last
    victim G3 would take (the highest priority, then busy before idle, then the oldest) down, and a set that
    takes fewer victims with the same ones first wins; then the names. Hosts are tried in the order of their own
    victims (the best ``req.hosts`` + 8 of each group), every set of them up to ``MAX_EVICTION_SETS``."""
    def order(victims: Iterable[Holder]) -> tuple[tuple[int, bool, float, int], ...]:
        return tuple(sorted((g3_order(v) for v in {v.id: v for v in victims}.values()), reverse=True))
    k = req.hosts
    best: tuple[tuple[int, tuple[tuple[int, bool, float, int], ...], tuple[str, ...]], tuple[str, ...]] | None = None
    for g in groups:
        subgroups: list[tuple[int, list[str]]] = [(1, [h.host for h in g])]
        if req.prefer:
            by: dict[str, list[str]] = {}
            for h in g:
                value = h.labels.get(req.prefer)
                if value is not None:
                    by.setdefault(value, []).append(h.host)
            subgroups += [(0, names) for _, names in sorted(by.items())]
        for rank, names in subgroups:
            if len(names) < k:
                continue
            tried = sorted(names, key=lambda x: (order(choices[x]), x))[:k + 8]
            for combo in itertools.islice(itertools.combinations(sorted(tried), k), MAX_EVICTION_SETS):
                key = (rank, order(v for x in combo for v in choices[x]), combo)
                if best is None or key < best[0]:
                    best = (key, combo)
    return best[1] if best is not None else None


def host_groups(req: FleetRequest, hosts: Sequence[FleetHost]) -> list[list[FleetHost]]:
    if not req.same:
        return [list(hosts)]
    by: dict[str, list[FleetHost]] = {}
    for h in hosts:
        value = h.labels.get(req.same)
        if value is not None:
            by.setdefault(value, []).append(h)
    return [by[v] for v in sorted(by)]


def _one_group(req: FleetRequest, hosts: Sequence[FleetHost], names: Sequence[str]) -> bool:
    if not req.same:
        return True
    labels = {h.host: h.labels.get(req.same) for h in hosts}
    values = {labels.get(x) for x in names}
    return len(values) == 1 and None not in values


def _best(req: FleetRequest, groups: Sequence[Sequence[FleetHost]],
          key: Callable[[str], tuple[int, int]]) -> tuple[str, ...] | None:
    """The best ``req.hosts`` hosts of one group: with ``prefer``, of one value of that label when one has enough;
    then the smallest sums of ``key`` (a host's (class, amount)) over the set, then the names. Sorted by name (the
    ranks); None when no group has enough."""
    k = req.hosts
    options: list[tuple[tuple[int, int, int, tuple[str, ...]], tuple[str, ...]]] = []
    for g in groups:
        if len(g) < k:
            continue
        subgroups: list[tuple[int, list[FleetHost]]] = [(1, list(g))]
        if req.prefer:
            by: dict[str, list[FleetHost]] = {}
            for h in g:
                value = h.labels.get(req.prefer)
                if value is not None:
                    by.setdefault(value, []).append(h)
            subgroups += [(0, hs) for _, hs in sorted(by.items()) if len(hs) >= k]
        for rank, hs in subgroups:
            picked = tuple(sorted(sorted((h.host for h in hs), key=lambda x: (key(x), x))[:k]))
            keys = [key(x) for x in picked]
            options.append(((rank, sum(a for a, _ in keys), sum(b for _, b in keys), picked), picked))
    if not options:
        return None
    return min(options)[1]


def _shape(req: FleetRequest) -> str:
    what = "whole GPUs" if req.exclusive else f"GPUs with {req.vram_mb} MiB each"
    return f"{req.gpu_count} {what}"


def _impossible(req: FleetRequest, could: int, why_not: list[str]) -> Refused:
    if req.same and could >= req.hosts:
        return Refused(errors.FailedPrecondition(
            f"same: no {req.hosts} hosts that could hold {_shape(req)} share a value of label {req.same!r:.34}",
            "same"))
    detail = f" ({'; '.join(why_not[:3])})" if why_not else ""
    return Refused(errors.FailedPrecondition(
        f"hosts: only {could} hosts could ever hold {_shape(req)}, {req.hosts} asked{detail[:300]}", "hosts"))


def slots_of(parts: Parts, hosts: Mapping[str, FleetHost]) -> dict[str, tuple[str, ...]]:
    """The GPU uuids of each host of ``parts`` (indexes to uuids, by the hosts' slots)."""
    out = {}
    for host, indexes in parts:
        by_index = {s.index: s.uuid for s in hosts[host].slots}
        out[host] = tuple(by_index[i] for i in indexes)
    return out
