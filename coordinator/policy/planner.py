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

A round runs in named steps: ``_order`` (the requests in rank order, answering at once the calls that cannot
take part), then for each request ``decide`` (``policy/decide.py``: a small typed result, ``Grant``,
``Refuse``, ``Leave`` or ``Waits``), ``_bound_queue`` (a new waiter on a full queue displaces a lower-ranked
one or is refused), ``_plan_evictions`` (G3), ``_write_wait``/``_write_grant``; and at the end
``_write_transaction`` (the leases, the ledgers and the guards).

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
from typing import Collection, Generic, Mapping, Sequence

from coordinator import errors
from coordinator.keys import Keys
from coordinator.policy.admission import GpuView, plan_eviction
from coordinator.policy.decide import (
    Grant,
    Item,
    Leave,
    Refuse,
    Request,
    Waits,
    decide,
    eligible,
    left_the_queue,
)
from coordinator.policy.decide import (
    wait_over as wait_over,  # the admitter answers a wait that ended with it
)
from coordinator.policy.host import HostView
from coordinator.policy.plan import C, Context, Plan, Wait
from coordinator.policy.teams import limit_refusal
from coordinator.records import (
    EvictionRecord,
    QueueEntry,
    SessionInfo,
    VramLease,
    dumps,
)
from coordinator.txn import (
    Absent,
    Compare,
    Delete,
    Exists,
    ModRevisionIs,
    NothingWrittenSince,
    Put,
)

# etcd refuses a transaction with more than 128 compares, or 128 operations (--max-txn-ops). A round stops
# deciding before it would pass these budgets; the rest is decided in the next round.
TXN_OPS_BUDGET = 120
TXN_COMPARES_BUDGET = 120


def plan_round(view: HostView, batch: Sequence[C], waiting: Mapping[str, C], live: Collection[str],
               ctx: Context) -> Plan[C]:
    """Decide one round on ``view.host`` (see the module's docstring).

    ``batch``: new calls; ``waiting``: this replica's calls already queued in etcd, by lease id; ``live``: the
    session ids of ``batch`` that the snapshot shows alive.
    """
    planner: _Planner[C] = _Planner(view, ctx)
    return planner.plan(batch, waiting, live)


class _Planner(Generic[C]):
    """One round. Made for one ``plan`` call: it holds the round's state as it decides."""

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
        self.now = ctx.now
        self.out: Plan[C] = Plan()
        self.departing_held = self.view.departing_held
        self.evicting = set(ctx.evicting)
        self.items: list[Item[C]] = []
        self.attached_calls: set[int] = set()   # ids of the calls that retry a request already waiting
        self.blocked: set[str] = set()          # GPUs that a request ranked earlier is still waiting for
        self.displaced: set[str] = set()        # ranks of entries this round displaces
        self.queued = 0                         # entries in the queue after what is decided so far
        self.per_agent: collections.Counter[str] = collections.Counter()
        self.team_charged: collections.Counter[str] = collections.Counter()   # by this round's grants (G11)

    def plan(self, batch: Sequence[C], waiting: Mapping[str, C], live: Collection[str]) -> Plan[C]:
        plan = self.out
        self.items = self._order(batch, waiting, live)
        staying = [it.entry for it in self.items if it.entry is not None and not self._leaving(it)]
        self.queued = len(staying)
        self.per_agent.update(e.agent for e in staying)
        for n, it in enumerate(self.items):
            if it.rank in self.displaced or self._leaving(it):
                continue
            if not self._fits_budget(3, 2):
                # The rest waits for the next round: new callers go back to the front of the line.
                plan.deferred = [x.call for x in self.items[n:] if x.call is not None and x.entry is None]
                plan.more = True
                break
            decision = decide(it, self.view, self.ctx, self.departing_held, self.blocked, self.per_agent[it.agent])
            if isinstance(decision, Grant) and decision.existing is None and self.ctx.teams is not None:
                over = self._team_limit(it)
                if over is not None:
                    # G11: not granted, and refused naming the team: a new call at once, a queued request by
                    # leaving the queue (waiting on there, it would hold its GPUs back from everyone behind it).
                    if it.entry is None:
                        assert it.call is not None
                        plan.refusals.append((it.call, errors.CapacityError(over, "team")))
                    else:
                        self._leaves(it.entry, it.call, errors.CapacityError(over, "team"))
                    continue
            if isinstance(decision, Grant):
                self._write_grant(it, decision)
            elif isinstance(decision, Refuse):
                assert it.call is not None
                plan.refusals.append((it.call, decision.error))
            elif isinstance(decision, Leave):
                assert it.entry is not None
                self._leaves(it.entry, it.call, decision.error)
            else:
                if decision.held_by_processes:
                    assert it.entry is not None
                    plan.held_by_processes.append(it.entry.lease_id)
                if it.entry is None:
                    refusal = self._bound_queue(n, it)
                    if refusal is not None:
                        assert it.call is not None
                        plan.refusals.append((it.call, refusal))
                        continue
                victims = self._plan_evictions(it, decision)
                self.blocked |= {g.uuid for g in decision.candidates}
                self._write_wait(it, victims)
        self._write_transaction()
        return plan

    # -- order the calls -------------------------------------------------------------------------------
    def _order(self, batch: Sequence[C], waiting: Mapping[str, C], live: Collection[str]) -> list[Item[C]]:
        """Every request of the host in rank order: the queue's entries (with our calls attached) and the new
        calls. Answers at once what takes no part: our waiters whose entry vanished, calls of dead sessions,
        retries from another session than the one that waits."""
        plan, view = self.out, self.view
        by_lease = {e.lease_id: e for e in view.entries}
        # Our waiters whose entry vanished: granted (by any replica), or removed by someone else.
        for lease_id, c in waiting.items():
            if lease_id not in by_lease:
                lease = view.leases.get(lease_id)
                if lease is not None:
                    plan.grants.append((c, lease))
                else:
                    plan.refusals.append((c, self._why_removed(c)))
        attached: dict[str, C] = {}
        fresh: list[Item[C]] = []
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
            fresh.append(Item(Keys.queue_rank(c.priority, c.arrival_ns, c.lease_id), None, c))
        items: list[Item[C]] = [Item(e.rank, e, attached.get(e.lease_id) or waiting.get(e.lease_id))
                                 for e in view.entries]
        items += fresh
        items.sort(key=lambda it: it.rank)
        self.attached_calls = {id(c) for c in attached.values()}
        return items

    def _leaving(self, it: Item[C]) -> bool:
        """Our waiter whose caller went away or whose wait is over: the expiry removes its entry, so it
        neither blocks a GPU nor counts against the queue bounds, and it is not granted any more."""
        c = it.call
        return (c is not None and it.entry is not None and id(c) not in self.attached_calls
                and (c.gone or self.now >= c.deadline))

    def _fits_budget(self, ops: int, compares: int) -> bool:
        """Whether ``ops`` more operations and ``compares`` more compares stay within etcd's limits."""
        plan, view = self.out, self.view
        used_ops = len(plan.ops) + len(plan.new_leases) + len(view.gpus)   # + one ledger put per GPU at most
        # Guards: host, partition, queue, every ledger, and one per caller's session (+1 for this one).
        guards = 3 + len(view.gpus) + len(plan.sessions) + 1
        if self.ctx.teams is not None:   # teams/ unchanged, and a ledger (compare and put) per charged team
            guards += 1 + len(self.team_charged) + 1
            used_ops += len(self.team_charged) + 1
        return (used_ops + ops <= TXN_OPS_BUDGET
                and len(plan.compares) + guards + compares <= TXN_COMPARES_BUDGET)

    def _why_removed(self, c: C) -> errors.GpucoordError:
        """The answer for our waiter whose entry someone else removed without a grant, from the snapshot:
        FAILED_PRECONDITION only when it can never be granted there any more (the host is gone, the
        partition changed); otherwise it was displaced, or removed at the end of its wait."""
        try:
            eligible(self.view, self.cfg, Request.of_call(c), count_leases=False)
        except errors.GpucoordError as e:
            return left_the_queue(e)
        if self.now >= c.deadline:
            return wait_over(c.vram_mb, c.wait_s)
        return errors.CapacityError(
            "queue: the waiting request was removed from the queue without a grant (displaced by a request "
            "of higher priority)", "queue")

    # -- bound the queue -------------------------------------------------------------------------------
    def _bound_queue(self, n: int, it: Item[C]) -> errors.GpucoordError | None:
        """Room in the host's queue for the new waiter ``items[n]``, or why not. When the queue is full, an
        arrival that outranks the lowest-ranked waiter takes its place (that waiter is told
        RESOURCE_EXHAUSTED); one that does not is refused."""
        limit = self.cfg.max_queue_per_host
        if self.queued < limit:
            return None
        lowest = self._lowest_waiter(n + 1)
        if lowest is None:
            return errors.CapacityError(
                f"queue: host {self.host!r} already has {self.queued} waiting requests ranked at or above "
                f"this one (limit {limit})", "queue")
        assert lowest.entry is not None
        self.displaced.add(lowest.rank)
        self._leaves(lowest.entry, lowest.call, errors.CapacityError(
            f"queue: displaced from the full queue of host {self.host!r} (limit {limit}) by a request of "
            "higher priority", "queue"))
        return None

    def _lowest_waiter(self, start: int) -> Item[C] | None:
        """The lowest-ranked entry of the queue among ``items[start:]`` (which rank below the arrival) that a
        higher-ranked arrival may displace."""
        for it in reversed(self.items[start:]):
            if it.entry is not None and it.rank not in self.displaced and not self._leaving(it):
                return it
        return None

    # -- plan evictions (G3) ---------------------------------------------------------------------------
    def _plan_evictions(self, it: Item[C], w: Waits) -> tuple[str, ...]:
        """The victims this waiter waits for: those it already chose, or new ones if evicting makes it fit on
        a GPU nobody ahead waits for (their notices go into this transaction)."""
        plan, req = self.out, it.req
        victims = it.entry.victims if it.entry is not None else ()
        if w.victims_pending:
            return victims
        new = plan_eviction(w.free_of_queue, w.caps, req.vram_mb, req.priority, req.agent, self.evicting)
        if new and not self._fits_budget(len(new) + 2, 2 * len(new) + 2):
            new = []              # too many for this transaction: evict in the next round
            plan.more = True
        for victim in new:
            record = self._eviction(victim, it)
            plan.ops.append(Put(self.keys.eviction(victim.id), dumps(record.to_json()), victim.etcd_lease))
            plan.compares.append(ModRevisionIs(
                self.keys.lease(self.host, victim.gpu_uuid, victim.id), victim.mod_revision))
            plan.compares.append(Absent(self.keys.eviction(victim.id)))
            self.evicting.add(victim.id)
            plan.evictions.append(record)
        return tuple(v.id for v in new) if new else victims

    def _eviction(self, victim: VramLease, it: Item[C]) -> EvictionRecord:
        wall, req = self.ctx.wall, it.req
        return EvictionRecord(
            lease_id=victim.id, host=self.host, gpu_uuid=victim.gpu_uuid, agent=victim.agent,
            session_id=victim.session_id, victim_priority=victim.priority,
            requested_by=f"{req.agent}/{req.request_id}", requester_priority=req.priority,
            reason=f"priority {req.priority} request for {req.vram_mb} MiB needs the room",
            deadline_unix=wall + self.cfg.eviction_grace_s, created_at=wall)

    # -- teams (G11) -----------------------------------------------------------------------------------
    def _team_limit(self, it: Item[C]) -> str | None:
        """Why granting ``it`` would take its team above its limit, or None: the team's use over the fleet
        (the teams' copy, and this host's leases that copy has not counted: newer ones, this round's grants)."""
        state = self.ctx.teams
        assert state is not None
        team = state.membership.team_of(it.req.agent)
        if not state.limited(team):
            return None
        used = state.used.get(team, 0) + sum(
            x.vram_mb for x in self.view.leases.values()
            if x.id not in state.counted and state.membership.team_of(x.agent) == team)
        return limit_refusal(state.membership.team(team), used, it.req.vram_mb)

    # -- write the ops ---------------------------------------------------------------------------------
    def _write_grant(self, it: Item[C], g: Grant) -> None:
        plan = self.out
        if g.existing is not None:
            lease = g.existing
        else:
            assert g.gpu is not None
            if it.call is not None and it.entry is None:
                plan.sessions[it.call.session.session_id] = it.call.session
            lease = self._grant(it, g.gpu)
            plan.new_leases.append(lease)
            if self.ctx.teams is not None:
                self.team_charged[self.ctx.teams.membership.team_of(lease.agent)] += lease.vram_mb
        plan.grants.append((it.call, lease))
        if it.entry is not None:
            self._leaves(it.entry, None, None)

    def _grant(self, it: Item[C], gpu: GpuView) -> VramLease:
        """The lease on ``gpu``, with the GPU's next fencing token (in this round's copies)."""
        gpu.seq += 1
        if it.entry is not None:
            session_id, etcd_lease = it.entry.session_id, it.entry.etcd_lease
        else:
            assert it.call is not None
            session_id, etcd_lease = it.call.session.session_id, it.call.session.etcd_lease
        req = it.req
        lease = VramLease(
            id=req.lease_id, host=self.host, gpu_uuid=gpu.uuid, gpu_index=gpu.index, agent=req.agent,
            session_id=session_id, vram_mb=req.vram_mb, priority=req.priority, preemptible=req.preemptible,
            request_id=req.request_id, token=gpu.seq, created_at=self.ctx.wall, etcd_lease=etcd_lease)
        gpu.leases.append(lease)
        self.view.leases[lease.id] = lease
        return lease

    def _write_wait(self, it: Item[C], victims: tuple[str, ...]) -> None:
        """A new entry for a new waiter; for a queued one, its entry rewritten if its victims or its serving
        replica changed."""
        plan, ctx = self.out, self.ctx
        if it.entry is None:
            assert it.call is not None
            plan.sessions[it.call.session.session_id] = it.call.session
            entry = self._entry(it.call, it.rank, victims)
            key = self.keys.queue_entry(self.host, it.rank)
            plan.compares.append(Absent(key))
            plan.ops.append(Put(key, dumps(entry.to_json()), it.call.session.etcd_lease))
            plan.waits.append(Wait(it.call, it.rank, 0))
            plan.new_entries += 1
            self.queued += 1
            self.per_agent[it.agent] += 1
            return
        updated = it.entry
        if victims != it.entry.victims:
            updated = dataclasses.replace(updated, victims=victims)
        if it.call is not None and (it.entry.replica != ctx.replica_id):
            # Served by this replica now (a retry through it): the entry says so, and keeps the later of the
            # two deadlines.
            updated = dataclasses.replace(
                updated, replica=ctx.replica_id,
                deadline_unix=max(updated.deadline_unix, ctx.wall + max(0.0, it.call.deadline - self.now)))
        if updated is not it.entry:
            key = self.keys.queue_entry(self.host, it.entry.rank)
            plan.compares.append(ModRevisionIs(key, it.entry.mod_revision))
            plan.ops.append(Put(key, dumps(updated.to_json()), updated.etcd_lease))
        if it.call is not None:
            plan.waits.append(Wait(it.call, it.entry.rank, 0 if updated is not it.entry else it.entry.mod_revision))

    def _entry(self, c: C, rank: str, victims: tuple[str, ...]) -> QueueEntry:
        return QueueEntry(rank=rank, agent=c.session.agent, session_id=c.session.session_id,
                          etcd_lease=c.session.etcd_lease, vram_mb=c.vram_mb, gpu=c.gpu_ref or "",
                          priority=c.priority, preemptible=c.preemptible, request_id=c.request_id,
                          lease_id=c.lease_id, deadline_unix=self.ctx.wall + max(0.0, c.deadline - self.now),
                          replica=self.ctx.replica_id, victims=victims, wait_s=max(0.0, c.deadline - self.now))

    def _leaves(self, entry: QueueEntry, call: C | None, err: errors.GpucoordError | None) -> None:
        """The entry leaves the queue in this transaction (if nobody changed it since the snapshot); its
        caller (if ours) is told after the commit."""
        plan = self.out
        key = self.keys.queue_entry(self.host, entry.rank)
        plan.compares.append(ModRevisionIs(key, entry.mod_revision))
        plan.ops.append(Delete(key))
        self.queued -= 1
        self.per_agent[entry.agent] -= 1
        if err is not None:
            plan.left.append(entry)
            if call is not None:
                plan.failures.append((call, err))

    def _write_transaction(self) -> None:
        """The new leases, the bumped ledgers, and the guards of the whole transaction."""
        plan, view = self.out, self.view
        for lease in plan.new_leases:
            plan.ops.append(Put(self.keys.lease(self.host, lease.gpu_uuid, lease.id), dumps(lease.to_json()),
                                lease.etcd_lease))
        for uuid_ in sorted({lease.gpu_uuid for lease in plan.new_leases}):
            gpu = view.gpus[uuid_]
            plan.ops.append(Put(self.keys.gpu(self.host, uuid_), dumps({"capacity_mb": gpu.total_mb, "seq": gpu.seq})))
        state = self.ctx.teams
        if state is not None and plan.new_leases:
            # G11: the teams this round counted are still the teams, and every limited team it charges takes
            # its ledger's next number (grants for one limited team are serialized across hosts and replicas).
            plan.compares.append(NothingWrittenSince(self.keys.teams(), state.revision))
            for team in sorted(t for t in self.team_charged if state.limited(t)):
                revision, seq = state.ledger(team)
                plan.compares.append(ModRevisionIs(self.keys.team_ledger(team), revision))
                plan.ops.append(Put(self.keys.team_ledger(team), dumps({"seq": seq + 1})))
        if plan.ops:
            # Admitting or queueing needs a live host; removing entries of a host that is gone does not.
            adds = bool(plan.new_leases) or plan.new_entries > 0
            plan.compares += self._guards(list(plan.sessions.values()), host_must_live=adds)

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
