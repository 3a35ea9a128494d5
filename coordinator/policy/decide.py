"""Decide one request of an admission round (``planner.py`` walks the round): grant, refuse, leave the queue
or wait, as a small typed result. Pure: it reads the round's copy of the snapshot and the round's state so
far, and changes nothing (the planner writes what it decides).

``Request`` holds what is asked, with its types, read once from the queue entry or from the call.
"""
from __future__ import annotations

import dataclasses
from typing import Collection, Generic, Union

from coordinator import errors
from coordinator.config import CoordinatorConfig
from coordinator.policy.admission import GpuView, best_fit, never_fits
from coordinator.policy.gang import could_use, slots_from_views
from coordinator.policy.host import HostView
from coordinator.policy.notices import withdrawable
from coordinator.policy.placement import Chosen, GangRequest, Refused, place
from coordinator.policy.plan import C, Caller, Context
from coordinator.policy.team_admission import team_wait_over
from coordinator.records import QueueEntry, VramLease


@dataclasses.dataclass(frozen=True)
class Request:
    """What is asked, read once from the queue entry (which wins when there is one) or from the call."""

    agent: str
    lease_id: str
    request_id: str
    vram_mb: int
    priority: int
    preemptible: bool
    gpu: str          # the GPU asked for (index or uuid), "" for any
    gpu_count: int = 1
    exclusive: bool = False
    topology: str = "any"
    gpus: tuple[str, ...] = ()   # the exact GPUs (indexes or uuids), () for any
    min_runtime_s: float = 0.0   # teams: before another team may reclaim its lease
    time_limit_s: float = 0.0    # time limits: its lease's limit (0: none) and warning
    time_limit_warning_s: float = 0.0

    @property
    def is_gang(self) -> bool:
        """Placed as a gang (``policy/placement.py``): several GPUs, whole GPUs, a topology or exact GPUs.
        Any other request takes the single-GPU path (``admission.best_fit``), as before gangs."""
        return self.gpu_count != 1 or self.exclusive or self.topology != "any" or bool(self.gpus)

    def gang(self, caps: dict[str, int]) -> GangRequest:
        return GangRequest(self.gpu_count, self.vram_mb, caps, self.exclusive, self.topology,
                           self.gpus or ((self.gpu,) if self.gpu else None))

    @classmethod
    def of_entry(cls, e: QueueEntry) -> Request:
        return cls(e.agent, e.lease_id, e.request_id, int(e.vram_mb), int(e.priority), bool(e.preemptible), e.gpu,
                   e.gpu_count, e.exclusive, e.topology, e.gpus, e.min_runtime_s, e.time_limit_s,
                   e.time_limit_warning_s)

    @classmethod
    def of_call(cls, c: Caller) -> Request:
        return cls(c.session.agent, c.lease_id, c.request_id, int(c.vram_mb), int(c.priority),
                   bool(c.preemptible), c.gpu_ref or "", c.gpu_count, c.exclusive, c.topology, tuple(c.gpus),
                   float(c.min_runtime_s), float(c.time_limit_s), float(c.time_limit_warning_s))


@dataclasses.dataclass
class Item(Generic[C]):
    """One request of a round: a queue entry from etcd, a call of ours, or both (our queued call)."""

    rank: str
    entry: QueueEntry | None
    call: C | None
    req: Request = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        if self.entry is not None:
            self.req = Request.of_entry(self.entry)
        else:
            assert self.call is not None
            self.req = Request.of_call(self.call)

    @property
    def agent(self) -> str:
        return self.req.agent


# -- what ``decide`` answers ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Grant:
    """Granted: the lease it already holds (a retry), or a new one on ``gpu`` (or, for a gang, on each GPU
    of ``gang``, in index order)."""

    existing: VramLease | None = None
    gpu: GpuView | None = None
    gang: tuple[GpuView, ...] = ()


@dataclasses.dataclass(frozen=True)
class Refuse:
    """A new call refused without a write."""

    error: errors.GpucoordError


@dataclasses.dataclass(frozen=True)
class Leave:
    """A queued request that can never be granted any more: its entry leaves the queue."""

    error: errors.GpucoordError


@dataclasses.dataclass(frozen=True)
class Waits:
    """It waits (subject to the queue's bound, for a new call): the GPUs it may use and its caps on them."""

    candidates: list[GpuView]
    free_of_queue: list[GpuView]   # those of the candidates that no request ranked before it waits for
    caps: dict[str, int]
    victims_pending: bool      # a queued request whose victims are not gone yet
    held_by_processes: bool    # ... and only their processes hold it back
    gang: GangRequest | None = None   # a gang request (its victims are chosen over GPU sets)


Decision = Union[Grant, Refuse, Leave, Waits]


def decide(it: Item[C], view: HostView, ctx: Context, departing_held: Collection[str], blocked: Collection[str],
           agent_waiting: int, team_room: int | None = None) -> Decision:
    """What this request gets. ``view``: the round's copy (with the leases granted so far); ``blocked``: the
    GPUs that a request ranked earlier still waits for; ``agent_waiting``: the agent's waiting requests;
    ``team_room``: what its team's limit still allows (None: no limit), for a gang's placement to respect."""
    req = it.req
    existing = view.leases.get(req.lease_id)
    if existing is not None:
        if it.call is not None and it.entry is None and existing.session_id != it.call.session.session_id:
            # The same request from another session of the agent: handing it a lease that it could
            # neither release nor keep (it lives and dies with the other session) would be wrong.
            return Refuse(errors.FailedPrecondition(
                "request_id: already holds a lease in another session of this agent", "request_id"))
        return Grant(existing=existing)
    try:
        candidates, caps = eligible(view, ctx.config, req, count_leases=it.entry is None)
    except errors.GpucoordError as e:
        if it.entry is None:
            return Refuse(e)
        return Leave(left_the_queue(e))   # it can never be granted any more: it leaves the queue
    free_of_queue = [g for g in candidates if g.uuid not in blocked]
    # G3: a request with victims is admitted only once they are gone: their leases, and the processes
    # of those bound to processes, as the node reports them (or the kill margin passed).
    victims = it.entry.victims if it.entry is not None else ()
    pending = any(v in view.leases or v in departing_held for v in victims)
    held_by_processes = pending and all(
        v in departing_held or v not in view.leases
        or (v in ctx.overdue and bool(view.leases[v].pids or view.leases[v].pgid))
        for v in victims)
    # A request whose victims still live takes room it finds free now, its notices withdrawn (``policy/notices``).
    free_now = not pending or (it.entry is not None and withdrawable(it.entry, view, ctx.notices, departing_held))
    gang = req.gang(caps) if req.is_gang else None
    if gang is not None:
        # G2 with gangs: only GPUs no earlier-ranked waiter could use (``blocked``) may be chosen.
        unavailable = {g.index for g in candidates if g.uuid in blocked}
        slots = slots_from_views(view.gpus.values(), req.agent, view.inventory)
        placed = place(slots, gang, unavailable, team_room)
        if team_room is not None and not isinstance(placed, Chosen):
            placed = place(slots, gang, unavailable)   # none within the limit: the planner's limit check says so
        if isinstance(placed, Chosen) and free_now:
            by_index = {g.index: g for g in view.gpus.values()}
            return Grant(gang=tuple(by_index[i] for i in placed.gpus))
        placement = None
    else:
        placement = best_fit(req.vram_mb, req.agent, free_of_queue, caps) if free_now else None
        if placement is not None and placement.gpu is not None:
            return Grant(gpu=placement.gpu)
    if it.call is not None and it.entry is None:
        refusal = _may_not_wait(it.call, view.host, ctx, req.vram_mb, bool(set(blocked) & {g.uuid for g in candidates}),
                                agent_waiting, placement.reason if placement else "")
        if refusal is not None:
            return Refuse(refusal)
    return Waits(candidates, free_of_queue, caps, pending, held_by_processes, gang)


def _may_not_wait(c: Caller, host: str, ctx: Context, vram: int, behind_waiters: bool, agent_waiting: int,
                  no_fit: str) -> errors.GpucoordError | None:
    """Why a new request that does not fit now may not wait, or None (the host's bound is apart)."""
    if c.deadline <= ctx.now:
        if c.wait_s > 0:
            return wait_over(c.vram_mb, c.wait_s, c.gpu_count, c.exclusive)
        return errors.CapacityError(
            f"vram_mb: {vram} MiB does not fit now without overtaking waiting requests" if behind_waiters
            else no_fit or f"vram_mb: {vram} MiB does not fit now on any allowed GPU", "vram_mb")
    return agent_queue_full(c, host, ctx, agent_waiting)


def may_not_wait_for_team(c: Caller, host: str, ctx: Context, reason: str,
                          agent_waiting: int) -> errors.GpucoordError | None:
    """Why a new request that its team's limit holds back (``reason``, naming ``team`` and the limit) may not
    wait for its team, or None: it asked for no wait (refused naming ``team``), or its agent's queue bound
    (the host's is apart)."""
    if c.deadline <= ctx.now:
        return team_wait_over(reason, c.wait_s) if c.wait_s > 0 else errors.CapacityError(reason, "team")
    return agent_queue_full(c, host, ctx, agent_waiting)


def agent_queue_full(c: Caller, host: str, ctx: Context, agent_waiting: int) -> errors.GpucoordError | None:
    limit = ctx.config.max_queue_per_agent
    if agent_waiting >= limit:
        return errors.CapacityError(
            f"queue: agent {c.session.agent!r} already has {agent_waiting} waiting requests on host "
            f"{host!r} (limit {limit} per agent)", "queue")
    return None


def eligible(view: HostView, cfg: CoordinatorConfig, req: Request,
             count_leases: bool) -> tuple[list[GpuView], dict[str, int]]:
    """The GPUs this request may ever use, with the agent's cap on each; raises why there are none.
    ``count_leases``: a new request is also refused when its agent holds its limit of leases."""
    host, agent = view.host, req.agent
    if view.inventory is None or not view.alive:
        raise errors.FailedPrecondition(
            f"host: the node daemon of host {host!r} is gone; no new admissions there", "host")
    partition = view.effective_partition()
    if not partition.allows(agent):
        raise errors.NotOwner(f"agent: {agent!r} is not in the partition of host {host!r}", "agent")
    if count_leases:
        mine = sum(1 for lease in view.leases.values() if lease.agent == agent)
        if mine >= cfg.max_leases_per_agent:
            raise errors.CapacityError(
                f"agent: {agent!r} already holds {mine} leases on {host!r} (limit "
                f"{cfg.max_leases_per_agent})", "agent")
    caps = partition.gpu_caps(agent, view.inventory)
    if req.is_gang:
        usable = could_use(slots_from_views(view.gpus.values(), agent, view.inventory), req.gang(caps))
        if isinstance(usable, Refused):
            raise usable.error
        return [g for g in view.gpus.values() if g.index in usable], caps
    candidates = list(view.gpus.values())
    ref = req.gpu
    if ref:
        info = view.inventory.gpu(ref)
        if info is None:
            raise errors.NotFound(f"gpu: host {host!r} has no GPU {ref!r}", "gpu")
        if info.uuid not in caps:
            raise errors.NotOwner(f"gpu: GPU {ref} of host {host!r} is outside the partition of "
                                  f"agent {agent!r}", "gpu")
        candidates = [view.gpus[info.uuid]]
    reason = never_fits(req.vram_mb, candidates, caps)
    if reason is not None:
        if "cap" in reason or reason == "no GPU is allowed":
            raise errors.FailedPrecondition(reason, "vram_mb")
        raise errors.InvalidArgument(reason, "vram_mb")
    return [g for g in candidates if g.uuid in caps], caps


def wait_over(vram_mb: int, wait_s: float, gpu_count: int = 1, exclusive: bool = False) -> errors.WaitTimeout:
    """The answer to a request whose wait ended before it fit, naming what it asked for."""
    wait_s = round(wait_s, 1)
    if exclusive:
        return errors.WaitTimeout(f"exclusive: {gpu_count} whole GPU{'s' if gpu_count > 1 else ''} did not fit "
                                  f"after waiting {wait_s:g} s", "exclusive")
    each = f" on each of {gpu_count} GPUs" if gpu_count > 1 else ""
    return errors.WaitTimeout(f"vram_mb: {vram_mb} MiB{each} did not fit after waiting {wait_s:g} s", "vram_mb")


def left_the_queue(e: errors.GpucoordError) -> errors.FailedPrecondition:
    """A waiting request that can never be granted on the host any more (the host is gone, the partition
    changed): it leaves the queue, and its caller learns why."""
    return errors.FailedPrecondition(f"{e.message}; the waiting request left the queue", e.field or "queue")
