"""One admission round's decision, as a pure function: a host snapshot and the replica's calls in, a plan out.

``plan_round(view, calls, waiting, ...)`` walks every request of the host in rank order (priority, then
arrival): the host's whole queue in etcd (with the replica's own waiting calls attached to their entries)
and the replica's new calls. It decides, for each:

* a grant (the lease, under the holder's session, and the bumped ledger: the next fencing token);
* a refusal that needs no write (answered at once);
* a wait: a new queue entry under the waiter's session, after choosing eviction victims (G3) if evicting
  makes it fit;
* leaving the queue (its request can never be granted any more, it was displaced by a higher-priority
  arrival, or it was granted).

The plan carries the transaction (``coordinator.txn`` compares and operations) and what to tell each
caller once it has committed. The transaction compares every ledger of the host, the partition, the host's
registration, the new callers' sessions and the queue condition (no entry written since the snapshot), so a
plan made from a stale snapshot fails as a whole and is made again.

Guarantees, checked by the property tests in ``tests/unit/test_planner.py``:
* G1: no GPU and no partition cap is over-committed by the grants.
* G2: a request is only placed on GPUs that no request ranked before it is still waiting for.
* G3: victims are preemptible, of lower priority, chosen by ``admission.choose_victims`` (lowest priority
  first, then newest; no victim can be spared); a request with victims is admitted only once they are gone:
  their leases, and the processes of those bound to processes while the node still reports them and the
  kill margin has not passed (``HostView.departing``, whose VRAM also counts as held for everyone else).
* etcd's limits: at most ``TXN_OPS_BUDGET`` operations and ``TXN_COMPARES_BUDGET`` compares.

It does no I/O and changes nothing it is given: it works on copies of the snapshot's GPUs and leases, and
reads the calls (``Caller``) without touching them. Time comes in as arguments (``now``: the monotonic clock
the callers' deadlines use, ``wall``: seconds since the epoch, for what is stored).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Collection, Generic, Mapping, Sequence

from coordinator import errors
from coordinator.keys import Keys
from coordinator.policy.admission import GpuView, best_fit, never_fits, plan_eviction
from coordinator.policy.host import HostView
from coordinator.policy.plan import C, Context, Plan, Wait
from coordinator.records import EvictionRecord, QueueEntry, SessionInfo, VramLease, dumps
from coordinator.txn import Absent, Compare, Delete, Exists, ModRevisionIs, NothingWrittenSince, Put

# etcd refuses a transaction with more than 128 compares, or 128 operations (--max-txn-ops). A round stops
# deciding before it would pass these budgets; the rest is decided in the next round.
TXN_OPS_BUDGET = 120
TXN_COMPARES_BUDGET = 120


@dataclasses.dataclass
class _Item(Generic[C]):
    """One request of a round: a queue entry from etcd, a call of ours, or both (our queued call)."""

    rank: str
    entry: QueueEntry | None
    call: C | None

    @property
    def agent(self) -> str:
        if self.entry is not None:
            return self.entry.agent
        assert self.call is not None
        return self.call.session.agent

    def field(self, name: str) -> Any:
        if self.entry is not None:
            return getattr(self.entry, name)
        assert self.call is not None
        return (self.call.gpu_ref or "") if name == "gpu" else getattr(self.call, name)


def plan_round(view: HostView, batch: Sequence[C], waiting: Mapping[str, C], live: Collection[str],
               ctx: Context) -> Plan[C]:
    """Decide one round on ``view.host`` (see the module's docstring).

    ``batch``: new calls; ``waiting``: this replica's calls already queued in etcd, by lease id; ``live``: the
    session ids of ``batch`` that the snapshot shows alive.
    """
    planner: _Planner[C] = _Planner(view, ctx)
    return planner.plan(batch, waiting, live)


class _Planner(Generic[C]):
    def __init__(self, view: HostView, ctx: Context) -> None:
        # Copies of what a round changes as it decides (tokens, leases): the snapshot stays as it was given.
        gpus = {}
        for uuid_, g in view.gpus.items():
            copy = dataclasses.replace(g, leases=list(g.leases))
            copy.seq = g.seq
            gpus[uuid_] = copy
        self.view = dataclasses.replace(view, gpus=gpus, leases=dict(view.leases))
        self.ctx = ctx
        self.cfg = ctx.config
        self.keys = ctx.keys
        self.host = view.host

    def plan(self, batch: Sequence[C], waiting: Mapping[str, C], live: Collection[str]) -> Plan[C]:
        view, cfg, now = self.view, self.cfg, self.ctx.now
        plan: Plan[C] = Plan()
        queue = list(view.entries)
        by_lease = {e.lease_id: e for e in queue}
        # Our waiters whose entry vanished: granted (by any replica), or removed by someone else.
        for lease_id, c in waiting.items():
            if lease_id not in by_lease:
                lease = view.leases.get(lease_id)
                if lease is not None:
                    plan.grants.append((c, lease))
                else:
                    plan.refusals.append((c, self._why_removed(c)))
        attached: dict[str, C] = {}
        fresh: list[_Item[C]] = []
        for c in batch:
            if c.session.session_id not in live:
                plan.refusals.append((c, errors.SessionGone(
                    f"session: no live session {c.session.session_id} of agent {c.session.agent!r} "
                    "(unknown or expired)", "session")))
                continue
            entry = by_lease.get(c.lease_id)
            if entry is not None:      # a retry of a request that is already waiting: keep its place
                if entry.session_id != c.session.session_id:
                    plan.refusals.append((c, errors.FailedPrecondition(
                        "request_id: already waiting in another session of this agent", "request_id")))
                    continue
                prior = waiting.get(c.lease_id)
                if prior is not None and prior is not c and not prior.gone:
                    plan.superseded.append(prior)
                attached[c.lease_id] = c
                continue
            fresh.append(_Item(Keys.queue_rank(c.priority, c.arrival_ns, c.lease_id), None, c))
        items: list[_Item[C]] = [_Item(e.rank, e, attached.get(e.lease_id) or waiting.get(e.lease_id))
                                 for e in queue]
        items += fresh
        items.sort(key=lambda it: it.rank)
        attached_calls = {id(c) for c in attached.values()}

        def leaving(it: _Item[C]) -> bool:
            """Our waiter whose caller went away or whose wait is over: the expiry removes its entry, so it
            neither blocks a GPU nor counts against the queue bounds, and it is not granted any more."""
            c = it.call
            return (c is not None and it.entry is not None and id(c) not in attached_calls
                    and (c.gone or now >= c.deadline))

        blocked: set[str] = set()   # GPUs that a request ranked earlier is still waiting for
        staying = [it.entry for it in items if it.entry is not None and not leaving(it)]
        queued = len(staying)
        per_agent = collections.Counter(e.agent for e in staying)
        displaced: set[str] = set()   # ranks of entries this round displaces
        evicting = set(self.ctx.evicting)
        departing_held = view.departing_held

        def fits_budget(ops: int, compares: int) -> bool:
            used_ops = len(plan.ops) + len(plan.new_leases) + len(view.gpus)   # + one ledger put per GPU at most
            # Guards: host, partition, queue, every ledger, and one per caller's session (+1 for this one).
            guards = 3 + len(view.gpus) + len(plan.sessions) + 1
            return (used_ops + ops <= TXN_OPS_BUDGET
                    and len(plan.compares) + guards + compares <= TXN_COMPARES_BUDGET)

        def leaves(entry: QueueEntry, call: C | None, err: errors.GpucoordError | None) -> None:
            """The entry leaves the queue in this transaction; its caller (if ours) is told after the commit."""
            nonlocal queued
            self._remove_entry(plan, entry)
            queued -= 1
            per_agent[entry.agent] -= 1
            if err is not None:
                plan.left.append(entry)
                if call is not None:
                    plan.failures.append((call, err))

        for n, it in enumerate(items):
            if it.rank in displaced or leaving(it):
                continue
            if not fits_budget(3, 2):
                # The rest waits for the next round: new callers go back to the front of the line.
                plan.deferred = [x.call for x in items[n:] if x.call is not None and x.entry is None]
                plan.more = True
                break
            agent = it.agent
            lease_id = it.field("lease_id")
            existing = view.leases.get(lease_id)
            if existing is not None:
                if it.call is not None and it.entry is None and existing.session_id != it.call.session.session_id:
                    # The same request from another session of the agent: handing it a lease that it could
                    # neither release nor keep (it lives and dies with the other session) would be wrong.
                    plan.refusals.append((it.call, errors.FailedPrecondition(
                        "request_id: already holds a lease in another session of this agent", "request_id")))
                    continue
                plan.grants.append((it.call, existing))
                if it.entry is not None:
                    leaves(it.entry, None, None)
                continue
            try:
                candidates, caps = self._candidates(it, count_leases=it.entry is None)
            except errors.GpucoordError as e:
                if it.entry is None:
                    assert it.call is not None
                    plan.refusals.append((it.call, e))
                else:   # it can never be granted any more: it leaves the queue
                    leaves(it.entry, it.call, _left_the_queue(e))
                continue
            vram, priority = int(it.field("vram_mb")), int(it.field("priority"))
            free_of_queue = [g for g in candidates if g.uuid not in blocked]
            # G3: a request with victims is admitted only once they are gone: their leases, and the processes
            # of those bound to processes, as the node reports them (or the kill margin passed).
            victims_pending = it.entry is not None and any(v in view.leases or v in departing_held
                                                           for v in it.entry.victims)
            if victims_pending and it.entry is not None and all(
                    v in departing_held or v not in view.leases
                    or (v in self.ctx.overdue and bool(view.leases[v].pids or view.leases[v].pgid))
                    for v in it.entry.victims):
                plan.held_by_processes.append(it.entry.lease_id)   # only by its victims' processes now
            placement = best_fit(vram, agent, free_of_queue, caps) if not victims_pending else None
            if placement is not None and placement.gpu is not None:
                if it.call is not None and it.entry is None:
                    plan.sessions[it.call.session.session_id] = it.call.session
                lease = self._grant(it, placement.gpu)
                plan.grants.append((it.call, lease))
                plan.new_leases.append(lease)
                if it.entry is not None:
                    leaves(it.entry, None, None)
                continue
            if it.entry is None:
                assert it.call is not None
                refusal = self._may_not_wait(it.call, vram, bool(blocked & {g.uuid for g in candidates}),
                                             per_agent[agent], placement.reason if placement else "")
                if refusal is None and queued >= cfg.max_queue_per_host:
                    # The host's queue is full: an arrival that outranks the lowest-ranked waiter takes its
                    # place (that waiter is told RESOURCE_EXHAUSTED); one that does not is refused.
                    lowest = _lowest_waiter(items, n + 1, displaced, leaving)
                    if lowest is None:
                        refusal = errors.CapacityError(
                            f"queue: host {self.host!r} already has {queued} waiting requests ranked at or above "
                            f"this one (limit {cfg.max_queue_per_host})", "queue")
                    else:
                        assert lowest.entry is not None
                        displaced.add(lowest.rank)
                        leaves(lowest.entry, lowest.call, errors.CapacityError(
                            f"queue: displaced from the full queue of host {self.host!r} (limit "
                            f"{cfg.max_queue_per_host}) by a request of higher priority", "queue"))
                if refusal is not None:
                    plan.refusals.append((it.call, refusal))
                    continue
            # It waits. Before waiting it may evict (G3), if that makes it fit on a GPU nobody ahead waits for.
            victims = list(it.entry.victims) if it.entry else []
            if not victims_pending:
                new = plan_eviction(free_of_queue, caps, vram, priority, agent, evicting)
                if new and not fits_budget(len(new) + 2, 2 * len(new) + 2):
                    new = []              # too many for this transaction: evict in the next round
                    plan.more = True
                for victim in new:
                    record = self._eviction(victim, it, priority)
                    plan.ops.append(Put(self.keys.eviction(victim.id), dumps(record.to_json()), victim.etcd_lease))
                    plan.compares.append(ModRevisionIs(
                        self.keys.lease(self.host, victim.gpu_uuid, victim.id), victim.mod_revision))
                    plan.compares.append(Absent(self.keys.eviction(victim.id)))
                    evicting.add(victim.id)
                    plan.evictions.append(record)
                if new:
                    victims = [v.id for v in new]
            blocked |= {g.uuid for g in candidates}
            if it.entry is None:
                assert it.call is not None
                plan.sessions[it.call.session.session_id] = it.call.session
                entry = self._entry(it.call, it.rank, tuple(victims))
                key = self.keys.queue_entry(self.host, it.rank)
                plan.compares.append(Absent(key))
                plan.ops.append(Put(key, dumps(entry.to_json()), it.call.session.etcd_lease))
                plan.waits.append(Wait(it.call, it.rank, 0))
                plan.new_entries += 1
                queued += 1
                per_agent[agent] += 1
            else:
                updated = it.entry
                if tuple(victims) != it.entry.victims:
                    updated = dataclasses.replace(updated, victims=tuple(victims))
                if it.call is not None and (it.entry.replica != self.ctx.replica_id):
                    # Served by this replica now (a retry through it): the entry says so, and keeps the
                    # later of the two deadlines.
                    updated = dataclasses.replace(
                        updated, replica=self.ctx.replica_id,
                        deadline_unix=max(updated.deadline_unix, self.ctx.wall + max(0.0, it.call.deadline - now)))
                if updated is not it.entry:
                    key = self.keys.queue_entry(self.host, it.entry.rank)
                    plan.compares.append(ModRevisionIs(key, it.entry.mod_revision))
                    plan.ops.append(Put(key, dumps(updated.to_json()), updated.etcd_lease))
                if it.call is not None:
                    plan.waits.append(Wait(it.call, it.entry.rank,
                                           0 if updated is not it.entry else it.entry.mod_revision))
        for lease in plan.new_leases:
            plan.ops.append(Put(self.keys.lease(self.host, lease.gpu_uuid, lease.id), dumps(lease.to_json()),
                                lease.etcd_lease))
        for uuid_ in sorted({lease.gpu_uuid for lease in plan.new_leases}):
            gpu = view.gpus[uuid_]
            plan.ops.append(Put(self.keys.gpu(self.host, uuid_), dumps({"capacity_mb": gpu.total_mb, "seq": gpu.seq})))
        if plan.ops:
            # Admitting or queueing needs a live host; removing entries of a host that is gone does not.
            adds = bool(plan.new_leases) or plan.new_entries > 0
            plan.compares += self._guards(list(plan.sessions.values()), host_must_live=adds)
        return plan

    # -- one request ---------------------------------------------------------------------------------
    def _may_not_wait(self, c: C, vram: int, behind_waiters: bool, agent_waiting: int,
                      no_fit: str) -> errors.GpucoordError | None:
        """Why a new request that does not fit now may not wait, or None (the host's bound is apart)."""
        cfg = self.cfg
        if c.deadline <= self.ctx.now:
            if c.wait_s > 0:
                return wait_over(c.vram_mb, c.wait_s)
            return errors.CapacityError(
                f"vram_mb: {vram} MiB does not fit now without overtaking waiting requests" if behind_waiters
                else no_fit or f"vram_mb: {vram} MiB does not fit now on any allowed GPU", "vram_mb")
        if agent_waiting >= cfg.max_queue_per_agent:
            return errors.CapacityError(
                f"queue: agent {c.session.agent!r} already has {agent_waiting} waiting requests on host "
                f"{self.host!r} (limit {cfg.max_queue_per_agent} per agent)", "queue")
        return None

    def _why_removed(self, c: C) -> errors.GpucoordError:
        """The answer for our waiter whose entry someone else removed without a grant, from the snapshot:
        FAILED_PRECONDITION only when it can never be granted there any more (the host is gone, the
        partition changed); otherwise it was displaced, or removed at the end of its wait."""
        try:
            self._candidates(_Item(c.rank or "", None, c), count_leases=False)
        except errors.GpucoordError as e:
            return _left_the_queue(e)
        if self.ctx.now >= c.deadline:
            return wait_over(c.vram_mb, c.wait_s)
        return errors.CapacityError(
            "queue: the waiting request was removed from the queue without a grant (displaced by a request "
            "of higher priority)", "queue")

    def _candidates(self, it: _Item[C], count_leases: bool) -> tuple[list[GpuView], dict[str, int]]:
        """The GPUs this request may ever use, with the agent's cap on each; raises why there are none.
        ``count_leases``: a new request is also refused when its agent holds its limit of leases."""
        view, agent = self.view, it.agent
        if view.inventory is None or not view.alive:
            raise errors.FailedPrecondition(
                f"host: the node daemon of host {self.host!r} is gone; no new admissions there", "host")
        partition = view.effective_partition()
        if not partition.allows(agent):
            raise errors.NotOwner(f"agent: {agent!r} is not in the partition of host {self.host!r}", "agent")
        if count_leases:
            mine = sum(1 for lease in view.leases.values() if lease.agent == agent)
            if mine >= self.cfg.max_leases_per_agent:
                raise errors.CapacityError(
                    f"agent: {agent!r} already holds {mine} leases on {self.host!r} (limit "
                    f"{self.cfg.max_leases_per_agent})", "agent")
        caps = partition.gpu_caps(agent, view.inventory)
        candidates = list(view.gpus.values())
        ref = it.field("gpu")
        if ref:
            info = view.inventory.gpu(ref)
            if info is None:
                raise errors.NotFound(f"gpu: host {self.host!r} has no GPU {ref!r}", "gpu")
            if info.uuid not in caps:
                raise errors.NotOwner(f"gpu: GPU {ref} of host {self.host!r} is outside the partition of "
                                      f"agent {agent!r}", "gpu")
            candidates = [view.gpus[info.uuid]]
        reason = never_fits(int(it.field("vram_mb")), candidates, caps)
        if reason is not None:
            if "cap" in reason or reason == "no GPU is allowed":
                raise errors.FailedPrecondition(reason, "vram_mb")
            raise errors.InvalidArgument(reason, "vram_mb")
        return [g for g in candidates if g.uuid in caps], caps

    def _grant(self, it: _Item[C], gpu: GpuView) -> VramLease:
        """The lease on ``gpu``, with the GPU's next fencing token (in this round's copies)."""
        gpu.seq += 1
        if it.entry is not None:
            session_id, etcd_lease = it.entry.session_id, it.entry.etcd_lease
        else:
            assert it.call is not None
            session_id, etcd_lease = it.call.session.session_id, it.call.session.etcd_lease
        lease = VramLease(
            id=it.field("lease_id"), host=self.host, gpu_uuid=gpu.uuid, gpu_index=gpu.index, agent=it.agent,
            session_id=session_id, vram_mb=int(it.field("vram_mb")), priority=int(it.field("priority")),
            preemptible=bool(it.field("preemptible")), request_id=it.field("request_id"), token=gpu.seq,
            created_at=self.ctx.wall, etcd_lease=etcd_lease)
        gpu.leases.append(lease)
        self.view.leases[lease.id] = lease
        return lease

    def _eviction(self, victim: VramLease, it: _Item[C], priority: int) -> EvictionRecord:
        wall = self.ctx.wall
        return EvictionRecord(
            lease_id=victim.id, host=self.host, gpu_uuid=victim.gpu_uuid, agent=victim.agent,
            session_id=victim.session_id, victim_priority=victim.priority,
            requested_by=f"{it.agent}/{it.field('request_id')}", requester_priority=priority,
            reason=f"priority {priority} request for {it.field('vram_mb')} MiB needs the room",
            deadline_unix=wall + self.cfg.eviction_grace_s, created_at=wall)

    def _entry(self, c: C, rank: str, victims: tuple[str, ...]) -> QueueEntry:
        return QueueEntry(rank=rank, agent=c.session.agent, session_id=c.session.session_id,
                          etcd_lease=c.session.etcd_lease, vram_mb=c.vram_mb, gpu=c.gpu_ref or "",
                          priority=c.priority, preemptible=c.preemptible, request_id=c.request_id,
                          lease_id=c.lease_id, deadline_unix=self.ctx.wall + max(0.0, c.deadline - self.ctx.now),
                          replica=self.ctx.replica_id, victims=victims, wait_s=max(0.0, c.deadline - self.ctx.now))

    # -- the transaction -------------------------------------------------------------------------------
    def _remove_entry(self, plan: Plan[C], entry: QueueEntry) -> None:
        """The entry leaves the queue in this round's transaction, if nobody changed it since the snapshot."""
        key = self.keys.queue_entry(self.host, entry.rank)
        plan.compares.append(ModRevisionIs(key, entry.mod_revision))
        plan.ops.append(Delete(key))

    def _guards(self, sessions: list[SessionInfo], host_must_live: bool) -> list[Compare]:
        """What must still hold at commit: nothing admitted or queued on the host since the snapshot, and
        the sessions of the new grants and entries still live."""
        keys, view, host = self.keys, self.view, self.host
        out: list[Compare] = [Exists(keys.host(host))] if host_must_live else []
        out.append(ModRevisionIs(keys.partition(host), view.partition_kv.mod_revision if view.partition_kv else 0))
        out += [ModRevisionIs(keys.gpu(host, u), g.ledger.mod_revision) for u, g in sorted(view.gpus.items())]
        # The queue condition: no entry was created or rewritten since the snapshot (G2 across replicas).
        out.append(NothingWrittenSince(keys.queue(host), view.revision))
        out += [Exists(keys.session(x.agent, x.session_id)) for x in sessions]
        return out


def wait_over(vram_mb: int, wait_s: float) -> errors.WaitTimeout:
    return errors.WaitTimeout(f"vram_mb: {vram_mb} MiB did not fit after waiting {wait_s:g} s", "vram_mb")


def _left_the_queue(e: errors.GpucoordError) -> errors.FailedPrecondition:
    """A waiting request that can never be granted on the host any more (the host is gone, the partition
    changed): it leaves the queue, and its caller learns why."""
    return errors.FailedPrecondition(f"{e.message}; the waiting request left the queue", e.field or "queue")


def _lowest_waiter(items: Sequence[_Item[C]], start: int, displaced: set[str],
                   leaving: Callable[[_Item[C]], bool]) -> _Item[C] | None:
    """The lowest-ranked entry of the queue among ``items[start:]`` (which rank below the arrival) that a
    higher-ranked arrival may displace."""
    for it in reversed(items[start:]):
        if it.entry is not None and it.rank not in displaced and not leaving(it):
            return it
    return None
