"""Admission on one host, as one replica runs it: group commit, the wait queue, eviction.

All the acquires a replica receives for a host, and the host's whole queue in etcd, are decided together
in **rounds**. A round reads one snapshot, walks the requests in rank order (priority, then arrival),
and commits everything it decided in one transaction:

* grants (the lease, under the holder's session, and the bumped ledgers);
* new queue entries, under the waiter's session;
* eviction notices for the victims of waiting requests, under the victims' sessions;
* deletes of the queue entries it granted.

The transaction compares every ledger of the host, the partition, the host's registration, the new
callers' sessions and the **queue condition** (no queue entry written since the snapshot). Any replica may
grant any entry of the queue; the replica serving the waiting RPC learns it from its own next round.

G2: a request is only placed on GPUs that no request ranked before it is still waiting for.
G3: victims are chosen by ``admission.choose_victims``; a request with victims is admitted only once
they are all gone.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import random
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from coordinator import errors, metrics, clock
from coordinator.aio import cancel_and_wait, log_failure
from coordinator.policy.admission import GpuView, best_fit, choose_victims, never_fits
from coordinator.records import EvictionRecord, QueueEntry, SessionInfo, VramLease, dumps
from coordinator.keys import Keys
from coordinator.etcd.ops import (cmp_absent, cmp_exists, cmp_mod_revision, cmp_range_unchanged, op_delete, op_put,
                                  range_req)
from coordinator.etcd.removals import Removal, remove_entries
from coordinator.etcd.store import KV
from coordinator.replica.view import HostView, host_ranges, host_view, queue_entry

if TYPE_CHECKING:
    from coordinator.replica.service import CoordinatorService

log = logging.getLogger(__name__)

# etcd refuses a transaction with more than 128 compares, or 128 operations (--max-txn-ops). A round stops
# deciding before it would pass these budgets; the rest is decided in the next round.
TXN_OPS_BUDGET = 120
TXN_COMPARES_BUDGET = 120
ORPHAN_GRACE_S = 2.0


@dataclasses.dataclass(eq=False)
class AcquireCall:
    session: SessionInfo
    vram_mb: int
    gpu_ref: str | None
    priority: int
    preemptible: bool
    request_id: str
    lease_id: str
    wait_s: float
    future: asyncio.Future[VramLease]
    arrival_ns: int = dataclasses.field(default_factory=time.time_ns)
    deadline: float = 0.0         # monotonic
    rank: str | None = None       # set once it is queued in etcd
    entry_revision: int = 0       # its queue entry's mod_revision, as this replica last wrote or read it

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.wait_s


@dataclasses.dataclass
class _Item:
    """One request of a round: a queue entry from etcd, a call of ours, or both (our queued call)."""

    rank: str
    entry: QueueEntry | None
    call: AcquireCall | None

    @property
    def agent(self) -> str:
        return self.entry.agent if self.entry else self.call.session.agent  # type: ignore[union-attr]

    def field(self, name: str) -> Any:
        if self.entry is not None:
            return getattr(self.entry, name)
        assert self.call is not None
        return {"gpu": self.call.gpu_ref or ""}.get(name, getattr(self.call, name, None))


@dataclasses.dataclass
class _Wait:
    """A call that waits in the queue after this round: its entry's rank, and the entry's mod_revision as
    the snapshot showed it (0: this round's transaction writes the entry)."""

    call: AcquireCall
    rank: str
    revision: int


@dataclasses.dataclass
class _Round:
    """What a round decided: the transaction to commit and what to tell the callers.

    ``refusals`` need no write and are answered at once; everything else (grants, ``failures`` whose entry
    this transaction removes, waits) is told only once the transaction has committed.
    """

    compares: list[Any] = dataclasses.field(default_factory=list)
    ops: list[Any] = dataclasses.field(default_factory=list)
    grants: list[tuple[AcquireCall | None, VramLease]] = dataclasses.field(default_factory=list)
    waits: list[_Wait] = dataclasses.field(default_factory=list)
    refusals: list[tuple[AcquireCall, errors.GpucoordError]] = dataclasses.field(default_factory=list)
    failures: list[tuple[AcquireCall, errors.GpucoordError]] = dataclasses.field(default_factory=list)
    left: list[QueueEntry] = dataclasses.field(default_factory=list)   # entries removed without a grant
    superseded: list[AcquireCall] = dataclasses.field(default_factory=list)   # replaced by a retry
    new_leases: list[VramLease] = dataclasses.field(default_factory=list)
    new_entries: int = 0
    deferred: list[AcquireCall] = dataclasses.field(default_factory=list)  # past the budget: next round
    more: bool = False          # something was left for the next round (evictions past the budget)
    sessions: dict[str, SessionInfo] = dataclasses.field(default_factory=dict)  # of new grants and waits
    evictions: int = 0


class HostAdmitter:
    """The tasks that decide admission on one host for this replica: the round loop, and the expiry of
    its waiters (a separate task, so that waits end on time however busy the rounds are)."""

    def __init__(self, svc: CoordinatorService, host: str) -> None:
        self.svc = svc
        self.host = host
        self.keys: Keys = svc.keys
        self._pending: list[AcquireCall] = []     # arrived, not yet decided
        self._waiting: dict[str, AcquireCall] = {}  # lease_id -> call queued in etcd, served by us
        self._wake = asyncio.Event()
        self._expire_wake = asyncio.Event()
        self._dirty = False
        self._last_commit = 0   # the mirror is used only once it has caught up with our own commits
        self._orphans: dict[str, int] = {}   # lease id -> revision: granted to a caller that went away
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run())
        self._expiry = loop.create_task(self._expire_loop())

    # -- the outside -----------------------------------------------------------------------------
    async def submit(self, call: AcquireCall) -> VramLease:
        if self._task.done():
            raise errors.Unavailable("coordinator is shutting down; retry on another replica")
        self._pending.append(call)
        self._wake.set()
        # A caller that goes away (cancelled RPC) must leave the queue at once.
        call.future.add_done_callback(lambda f: self._expire_wake.set() if f.cancelled() else None)
        return await call.future

    def notify(self) -> None:
        """Something changed on the host (a watch event): decide again."""
        self._dirty = True
        self._wake.set()

    @property
    def has_waiters(self) -> bool:
        return bool(self._waiting)

    async def stop(self) -> None:
        await cancel_and_wait([self._task, self._expiry])
        # Waiting RPCs get UNAVAILABLE; their queue entries stay in etcd, so a retry through another
        # replica keeps its place.
        for c in [*self._pending, *self._waiting.values()]:
            if not c.future.done():
                c.future.set_exception(errors.Unavailable("coordinator is shutting down; retry on another replica"))

    # -- answers ---------------------------------------------------------------------------------
    def _fail(self, c: AcquireCall, err: errors.GpucoordError) -> None:
        """Tell the caller (once the transaction that makes it true, if any, has committed)."""
        if self._waiting.get(c.lease_id) is c:
            del self._waiting[c.lease_id]
        if not c.future.done():
            metrics.REFUSALS.labels(type(err).__name__).inc()
            c.future.set_exception(err)

    # -- the loop --------------------------------------------------------------------------------
    async def _run(self) -> None:
        cfg = self.svc.config
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch: list[AcquireCall] = []
            try:
                while self._pending or self._dirty:
                    self._dirty = False
                    batch = [c for c in self._pending[: cfg.batch_max] if not c.future.done()]
                    del self._pending[: cfg.batch_max]
                    if not batch and not self._waiting:
                        continue
                    metrics.BATCH_SIZE.observe(max(1, len(batch)))
                    await self._round(batch)
                    batch = []
                metrics.QUEUE_DEPTH.labels(self.host).set(len(self._waiting))
            except asyncio.CancelledError:
                raise
            except Exception as e:
                err = e if isinstance(e, errors.GpucoordError) else errors.Unavailable(f"internal error: {e!r}")
                if not isinstance(e, errors.GpucoordError):
                    log.exception("admission round on %s failed", self.host)
                metrics.ETCD_ERRORS.labels(type(err).__name__).inc()
                # Every caller of the failed round and every one still pending is answered: nothing hangs.
                # (A caller whose entry is already in etcd stays a waiter: its entry keeps its place.)
                for c in [*batch, *self._pending]:
                    if not c.future.done() and c.lease_id not in self._waiting:
                        c.future.set_exception(err)
                self._pending.clear()
                if self._waiting:
                    asyncio.get_running_loop().call_later(0.2, self.notify)

    # -- expiry ----------------------------------------------------------------------------------
    async def _expire_loop(self) -> None:
        """Waiters whose time is up, or whose caller went away, leave the queue, then are answered.

        Woken by each waiter's deadline timer and by cancelled calls, independently of the round loop:
        a host whose rounds never go idle (another replica committing all the time) still ends its
        waits on time.
        """
        while True:
            await self._expire_wake.wait()
            self._expire_wake.clear()
            try:
                await self._expire()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if not isinstance(e, errors.GpucoordError):
                    log.exception("expiring waiters on %s failed", self.host)
                else:
                    log.warning("could not remove expired waiters of %s from the queue: %s", self.host, e)
                # Not removed yet: they stay ours, and we try again shortly.
                asyncio.get_running_loop().call_later(0.2, self._expire_wake.set)

    async def _expire(self) -> None:
        now = time.monotonic()
        due = [c for c in self._waiting.values() if c.future.done() or now >= c.deadline]
        tries = 0
        while due:
            tries += 1
            outcomes = await remove_entries(self.svc.store, [
                Removal(self.keys.queue_entry(self.host, c.rank or ""), c.entry_revision) for c in due])
            retry: list[AcquireCall] = []
            granted: list[AcquireCall] = []
            for c, out in zip(due, outcomes):
                if out.removed is not None:
                    self._expired(c, QueueEntry.from_kv(out.removed))
                elif out.current is None:
                    granted.append(c)   # gone meanwhile: with a grant (by any replica), or removed
                elif _served_here(out.current, self.svc.replica_id, c.lease_id):
                    c.entry_revision = out.current.mod_revision   # rewritten by one of our rounds
                    if tries < 3:
                        retry.append(c)
                    else:   # our rounds keep rewriting it: still ours, removed on the next pass
                        asyncio.get_running_loop().call_later(0.05, self._expire_wake.set)
                else:
                    # Another replica serves a retry of this request now: its entry is that replica's.
                    self._expired(c, None)
            if granted:
                leases = await self.svc.store.get_prefix(self.keys.leases(self.host))
                for c in granted:
                    lease = _lease_in(leases.ranges[0], c.lease_id)
                    if self._waiting.get(c.lease_id) is c:
                        del self._waiting[c.lease_id]
                    if lease is not None and not c.future.done():
                        c.future.set_result(lease)
                    else:
                        self._expired(c, None)
            due = retry

    def _expired(self, c: AcquireCall, removed: QueueEntry | None) -> None:
        self._fail(c, _wait_over(c))
        if removed is not None and removed.victims:
            task = asyncio.get_running_loop().create_task(self.svc.withdraw_evictions(removed))
            log_failure(task, "withdrawing eviction notices")

    # -- rounds ----------------------------------------------------------------------------------
    async def _round(self, batch: list[AcquireCall]) -> None:
        svc = self.svc
        batch = _merge_duplicates(batch)
        mirror = svc.mirror
        use_mirror = (mirror.ready and not self._waiting and mirror.revision >= self._last_commit
                      and not mirror.host_items("queue", self.host))
        for attempt in range(svc.config.commit_attempts):
            batch = [c for c in batch if not c.future.done()]
            sessions = list({c.session.session_id: c.session for c in batch}.values())
            session_keys = [self.keys.session(s.agent, s.session_id) for s in sessions]
            if use_mirror:
                # The fast path: decide from the watch-fed mirror, no read. Only a plan made of grants
                # is committed from it (the compares validate them); anything else is decided again from
                # a real snapshot, so a stale copy never refuses, queues or evicts.
                snap = mirror.host_snapshot(self.host, session_keys)
            else:
                # Linearizable: a refusal, a wait or "no such session" must reflect every write acknowledged
                # before this request (read-your-writes), not what a lagging member has applied.
                snap = await svc.store.snapshot(
                    host_ranges(self.keys, self.host) + [range_req(k) for k in session_keys])
            view = host_view(self.keys, self.host, snap, svc.config.untracked_vram, svc.usage_age)
            live = {s.session_id for s, r in zip(sessions, snap.ranges[6:]) if r}
            plan = self._decide(view, batch, live, time.monotonic())
            if use_mirror:
                use_mirror = False
                if plan.refusals or plan.failures or plan.waits or plan.evictions or not plan.ops:
                    continue
            # A refusal that needs no write is true as of the snapshot: it is answered at once.
            for c, err in plan.refusals:
                self._fail(c, err)
            if not plan.ops:
                self._settle(plan, revision=0)
                return
            try:
                res = await svc.store.commit(plan.compares, plan.ops)
            except (errors.SessionGone, errors.OutcomeUnknown):
                res = None  # ids are deterministic: reading again settles it
            if res is not None and res.succeeded:
                self._last_commit = res.revision
                self._settle(plan, res.revision)
                for entry in plan.left:
                    if entry.victims:
                        try:
                            await svc.withdraw_evictions(entry)
                        except errors.GpucoordError as e:
                            log.warning("could not withdraw the notices of %s/%s: %s", entry.agent,
                                        entry.request_id, e)
                return
            metrics.CONFLICTS.inc()
            await asyncio.sleep(random.uniform(0, min(0.05, 0.001 * 2 ** attempt)))
        err = errors.Unavailable(f"acquire: admission on host {self.host} lost {svc.config.commit_attempts} "
                                 "compare-and-set rounds in a row; retry")
        for c in batch:
            if not c.future.done():
                c.future.set_exception(err)

    def _settle(self, plan: _Round, revision: int) -> None:
        """The round's transaction has committed (or there was nothing to write): tell the callers."""
        for failed, err in plan.failures:
            self._fail(failed, err)
        for prior in plan.superseded:
            self._fail(prior, errors.Unavailable("superseded by a retry of the same request"))
        new = {id(x) for x in plan.new_leases}
        for c, lease in plan.grants:
            metrics.ADMISSIONS.labels(self.host).inc()
            if c is None:
                continue
            if not c.future.done():
                self._orphans.pop(lease.id, None)   # a retry claims a lease its cancelled first try got
            if self._waiting.get(c.lease_id) is c:
                del self._waiting[c.lease_id]
            if not c.future.done():
                c.future.set_result(dataclasses.replace(lease, mod_revision=revision)
                                    if revision and id(lease) in new else lease)
            elif id(lease) in new and revision:
                # Its caller went away while the grant was being committed: nobody knows the lease, so it
                # is given back rather than held for the rest of the session, unless a retry of the same
                # request claims it first (a client retries at once after a cancelled call).
                self._orphans[lease.id] = revision
                asyncio.get_running_loop().call_later(ORPHAN_GRACE_S, self._schedule_give_back, lease)
        if plan.deferred:
            self._pending[:0] = plan.deferred
            self.notify()
        if plan.more:
            self.notify()
        loop = asyncio.get_running_loop()
        for w in plan.waits:
            c = w.call
            c.rank = w.rank
            c.entry_revision = w.revision or revision
            if self._waiting.get(c.lease_id) is c:
                continue
            # Recorded even if its caller has gone meanwhile: the expiry then removes the entry at once.
            self._waiting[c.lease_id] = c
            if c.future.done():
                self._expire_wake.set()
            else:
                loop.call_later(max(0.0, c.deadline - time.monotonic()), self._expire_wake.set)
        metrics.EVICTIONS.labels("notice").inc(plan.evictions)

    def _schedule_give_back(self, lease: VramLease) -> None:
        asyncio.get_running_loop().create_task(self._give_back(lease))

    async def _give_back(self, lease: VramLease) -> None:
        revision = self._orphans.pop(lease.id, None)
        if revision is None:
            return   # claimed by a retry
        key = self.keys.lease(self.host, lease.gpu_uuid, lease.id)
        try:
            await self.svc.store.commit([cmp_mod_revision(key, revision)], [op_delete(key)])
        except errors.GpucoordError as e:
            log.warning("could not give back lease %s of a caller that went away: %s", lease.id, e)

    # -- the decision (pure over the snapshot) ---------------------------------------------------
    def _decide(self, view: HostView, batch: list[AcquireCall], live: set[str], now: float) -> _Round:
        """Decide a round from one snapshot; ``now`` is the monotonic clock the waiters' deadlines use.

        It reads ``self._waiting`` (which calls this replica serves) but changes nothing outside the plan.
        """
        cfg = self.svc.config
        plan = _Round()
        queue = [queue_entry(kv) for kv in view.queue]
        by_lease = {e.lease_id: e for e in queue}
        # Our waiters whose entry vanished: granted (by any replica), or removed by someone else.
        for lease_id, c in self._waiting.items():
            if lease_id not in by_lease:
                lease = view.leases.get(lease_id)
                if lease is not None:
                    plan.grants.append((c, lease))
                else:
                    plan.refusals.append((c, self._why_removed(view, c, now)))
        attached: dict[str, AcquireCall] = {}
        fresh: list[_Item] = []
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
                prior = self._waiting.get(c.lease_id)
                if prior is not None and prior is not c and not prior.future.done():
                    plan.superseded.append(prior)
                attached[c.lease_id] = c
                continue
            fresh.append(_Item(Keys.queue_rank(c.priority, c.arrival_ns, c.lease_id), None, c))
        items = [_Item(e.rank, e, attached.get(e.lease_id) or self._waiting.get(e.lease_id)) for e in queue]
        items += fresh
        items.sort(key=lambda it: it.rank)
        attached_calls = {id(c) for c in attached.values()}

        def leaving(it: _Item) -> bool:
            """Our waiter whose caller went away or whose wait is over: the expiry removes its entry, so it
            neither blocks a GPU nor counts against the queue bounds, and it is not granted any more."""
            c = it.call
            return (c is not None and it.entry is not None and id(c) not in attached_calls
                    and (c.future.done() or now >= c.deadline))

        blocked: set[str] = set()   # GPUs that a request ranked earlier is still waiting for
        staying = [it.entry for it in items if it.entry is not None and not leaving(it)]
        queued = len(staying)
        per_agent = collections.Counter(e.agent for e in staying)
        displaced: set[str] = set()   # ranks of entries this round displaces
        evicting = {lease_id for lease_id in self.svc.evictions}

        def fits_budget(ops: int, compares: int) -> bool:
            used_ops = len(plan.ops) + len(plan.new_leases) + len(view.gpus)   # + one ledger put per GPU at most
            # Guards: host, partition, queue, every ledger, and one per caller's session (+1 for this one).
            guards = 3 + len(view.gpus) + len(plan.sessions) + 1
            return (used_ops + ops <= TXN_OPS_BUDGET
                    and len(plan.compares) + guards + compares <= TXN_COMPARES_BUDGET)

        def leaves(entry: QueueEntry, call: AcquireCall | None, err: errors.GpucoordError | None) -> None:
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
                candidates, caps = self._candidates(view, it, count_leases=it.entry is None)
            except errors.GpucoordError as e:
                if it.entry is None:
                    assert it.call is not None
                    plan.refusals.append((it.call, e))
                else:   # it can never be granted any more: it leaves the queue
                    leaves(it.entry, it.call, _left_the_queue(e))
                continue
            vram, priority = int(it.field("vram_mb")), int(it.field("priority"))
            free_of_queue = [g for g in candidates if g.uuid not in blocked]
            victims_pending = it.entry is not None and any(v in view.leases for v in it.entry.victims)
            placement = best_fit(vram, agent, free_of_queue, caps) if not victims_pending else None
            if placement is not None and placement.gpu is not None:
                if it.call is not None and it.entry is None:
                    plan.sessions[it.call.session.session_id] = it.call.session
                lease = self._grant(view, it, placement.gpu)
                plan.grants.append((it.call, lease))
                plan.new_leases.append(lease)
                if it.entry is not None:
                    leaves(it.entry, None, None)
                continue
            if it.entry is None:
                assert it.call is not None
                refusal = self._may_not_wait(it.call, now, vram, bool(blocked & {g.uuid for g in candidates}),
                                             per_agent[agent])
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
                new = self._plan_eviction(free_of_queue, caps, vram, priority, agent, evicting)
                if new and not fits_budget(len(new) + 2, 2 * len(new) + 2):
                    new = []              # too many for this transaction: evict in the next round
                    plan.more = True
                for victim in new:
                    plan.ops.append(self._eviction_op(victim, it, priority))
                    plan.compares.append(cmp_mod_revision(
                        self.keys.lease(self.host, victim.gpu_uuid, victim.id), victim.mod_revision))
                    plan.compares.append(cmp_absent(self.keys.eviction(victim.id)))
                    evicting.add(victim.id)
                    plan.evictions += 1
                if new:
                    victims = [v.id for v in new]
            blocked |= {g.uuid for g in candidates}
            if it.entry is None:
                assert it.call is not None
                plan.sessions[it.call.session.session_id] = it.call.session
                entry = self._entry(it.call, it.rank, tuple(victims))
                key = self.keys.queue_entry(self.host, it.rank)
                plan.compares.append(cmp_absent(key))
                plan.ops.append(op_put(key, dumps(entry.to_json()), it.call.session.etcd_lease))
                plan.waits.append(_Wait(it.call, it.rank, 0))
                plan.new_entries += 1
                queued += 1
                per_agent[agent] += 1
            else:
                updated = it.entry
                if tuple(victims) != it.entry.victims:
                    updated = dataclasses.replace(updated, victims=tuple(victims))
                if it.call is not None and (it.entry.replica != self.svc.replica_id):
                    updated = dataclasses.replace(updated, replica=self.svc.replica_id,
                                                  deadline_unix=max(updated.deadline_unix,
                                                                    clock.wall() + max(0.0, it.call.deadline - now)))
                if updated is not it.entry:
                    key = self.keys.queue_entry(self.host, it.entry.rank)
                    plan.compares.append(cmp_mod_revision(key, it.entry.mod_revision))
                    plan.ops.append(op_put(key, dumps(updated.to_json()), updated.etcd_lease))
                if it.call is not None:
                    plan.waits.append(_Wait(it.call, it.entry.rank,
                                            0 if updated is not it.entry else it.entry.mod_revision))
        for lease in plan.new_leases:
            plan.ops.append(op_put(self.keys.lease(self.host, lease.gpu_uuid, lease.id), dumps(lease.to_json()),
                                   lease.etcd_lease))
        for uuid_ in sorted({lease.gpu_uuid for lease in plan.new_leases}):
            gpu = view.gpus[uuid_]
            plan.ops.append(op_put(self.keys.gpu(self.host, uuid_),
                                   dumps({"capacity_mb": gpu.total_mb, "seq": gpu.seq})))
        if plan.ops:
            # Admitting or queueing needs a live host; removing entries of a host that is gone does not.
            adds = bool(plan.new_leases) or plan.new_entries > 0
            plan.compares += self._guards(view, list(plan.sessions.values()), host_must_live=adds)
        return plan

    def _may_not_wait(self, c: AcquireCall, now: float, vram: int, behind_waiters: bool,
                      agent_waiting: int) -> errors.GpucoordError | None:
        """Why a new request that does not fit now may not wait, or None (the host's bound is apart)."""
        cfg = self.svc.config
        if c.deadline <= now:
            if c.wait_s > 0:
                return _wait_over(c)
            return errors.CapacityError(
                f"vram_mb: {vram} MiB does not fit now without overtaking waiting requests" if behind_waiters
                else f"vram_mb: {vram} MiB does not fit now on any allowed GPU", "vram_mb")
        if agent_waiting >= cfg.max_queue_per_agent:
            return errors.CapacityError(
                f"queue: agent {c.session.agent!r} already has {agent_waiting} waiting requests on host "
                f"{self.host!r} (limit {cfg.max_queue_per_agent} per agent)", "queue")
        return None

    def _why_removed(self, view: HostView, c: AcquireCall, now: float) -> errors.GpucoordError:
        """The answer for our waiter whose entry someone else removed without a grant, from the snapshot:
        FAILED_PRECONDITION only when it can never be granted there any more (the host is gone, the
        partition changed); otherwise it was displaced, or removed at the end of its wait."""
        try:
            self._candidates(view, _Item(c.rank or "", None, c), count_leases=False)
        except errors.GpucoordError as e:
            return _left_the_queue(e)
        if now >= c.deadline:
            return _wait_over(c)
        return errors.CapacityError(
            "queue: the waiting request was removed from the queue without a grant (displaced by a request "
            "of higher priority)", "queue")


    def _remove_entry(self, plan: _Round, entry: QueueEntry) -> None:
        """The entry leaves the queue in this round's transaction, if nobody changed it since the snapshot."""
        key = self.keys.queue_entry(self.host, entry.rank)
        plan.compares.append(cmp_mod_revision(key, entry.mod_revision))
        plan.ops.append(op_delete(key))

    def _candidates(self, view: HostView, it: _Item, count_leases: bool) -> tuple[list[GpuView], dict[str, int]]:
        """The GPUs this request may ever use, with the agent's cap on each; raises why there are none.
        ``count_leases``: a new request is also refused when its agent holds its limit of leases."""
        agent = it.agent
        if view.inventory is None or not view.alive:
            raise errors.FailedPrecondition(
                f"host: the node daemon of host {self.host!r} is gone; no new admissions there", "host")
        partition = view.effective_partition()
        if not partition.allows(agent):
            raise errors.NotOwner(f"agent: {agent!r} is not in the partition of host {self.host!r}", "agent")
        if count_leases:
            mine = sum(1 for lease in view.leases.values() if lease.agent == agent)
            if mine >= self.svc.config.max_leases_per_agent:
                raise errors.CapacityError(
                    f"agent: {agent!r} already holds {mine} leases on {self.host!r} (limit "
                    f"{self.svc.config.max_leases_per_agent})", "agent")
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

    def _grant(self, view: HostView, it: _Item, gpu: GpuView) -> VramLease:
        gpu.seq += 1
        if it.entry is not None:
            e = it.entry
            session_id, etcd_lease = e.session_id, e.etcd_lease
        else:
            assert it.call is not None
            session_id, etcd_lease = it.call.session.session_id, it.call.session.etcd_lease
        lease = VramLease(
            id=it.field("lease_id"), host=self.host, gpu_uuid=gpu.uuid, gpu_index=gpu.index, agent=it.agent,
            session_id=session_id, vram_mb=int(it.field("vram_mb")), priority=int(it.field("priority")),
            preemptible=bool(it.field("preemptible")), request_id=it.field("request_id"), token=gpu.seq,
            created_at=clock.wall(), etcd_lease=etcd_lease)
        gpu.leases.append(lease)
        view.leases[lease.id] = lease
        return lease

    def _plan_eviction(self, gpus: list[GpuView], caps: dict[str, int], vram: int, priority: int, agent: str,
                       evicting: set[str]) -> list[VramLease]:
        """The cheapest victim set on one GPU (fewest, then lowest priorities), counting leases that are
        already being evicted as gone. [] when nothing needs evicting (or nothing would help)."""
        best: tuple[tuple[int, int], list[VramLease]] | None = None
        for g in gpus:
            if g.uuid not in caps:
                continue
            after = dataclasses.replace(g, leases=[x for x in g.leases if x.id not in evicting])
            victims = choose_victims(vram, priority, agent, after, caps[g.uuid])
            if victims is None:
                continue
            if not victims:
                return []   # pending evictions will make room: wait for them
            cost = (len(victims), max(v.priority for v in victims))
            if best is None or cost < best[0]:
                best = (cost, victims)
        return best[1] if best else []

    def _eviction_op(self, victim: VramLease, it: _Item, priority: int) -> Any:
        now = clock.wall()
        record = EvictionRecord(
            lease_id=victim.id, host=self.host, gpu_uuid=victim.gpu_uuid, agent=victim.agent,
            session_id=victim.session_id, victim_priority=victim.priority,
            requested_by=f"{it.agent}/{it.field('request_id')}", requester_priority=priority,
            reason=f"priority {priority} request for {it.field('vram_mb')} MiB needs the room",
            deadline_unix=now + self.svc.config.eviction_grace_s, created_at=now)
        return op_put(self.keys.eviction(victim.id), dumps(record.to_json()), victim.etcd_lease)

    def _entry(self, c: AcquireCall, rank: str, victims: tuple[str, ...]) -> QueueEntry:
        return QueueEntry(rank=rank, agent=c.session.agent, session_id=c.session.session_id,
                          etcd_lease=c.session.etcd_lease, vram_mb=c.vram_mb, gpu=c.gpu_ref or "",
                          priority=c.priority, preemptible=c.preemptible, request_id=c.request_id,
                          lease_id=c.lease_id, deadline_unix=clock.wall() + max(0.0, c.deadline - time.monotonic()), replica=self.svc.replica_id,
                          victims=victims, wait_s=max(0.0, c.deadline - time.monotonic()))

    def _guards(self, view: HostView, sessions: list[SessionInfo], host_must_live: bool) -> list[Any]:
        """What must still hold at commit: nothing admitted or queued on the host since the snapshot, and
        the sessions of the new grants and entries still live."""
        keys = self.keys
        out = [cmp_exists(keys.host(self.host))] if host_must_live else []
        out.append(cmp_mod_revision(keys.partition(self.host),
                                    view.partition_kv.mod_revision if view.partition_kv else 0))
        out += [cmp_mod_revision(keys.gpu(self.host, u), g.ledger.mod_revision) for u, g in sorted(view.gpus.items())]
        # The queue condition: no entry was created or rewritten since the snapshot (G2 across replicas).
        out.append(cmp_range_unchanged(keys.queue(self.host), view.revision))
        out += [cmp_exists(keys.session(x.agent, x.session_id)) for x in sessions]
        return out


def _wait_over(c: AcquireCall) -> errors.CapacityError:
    return errors.CapacityError(f"vram_mb: {c.vram_mb} MiB did not fit after waiting {c.wait_s:g} s", "vram_mb")


def _left_the_queue(e: errors.GpucoordError) -> errors.FailedPrecondition:
    """A waiting request that can never be granted on the host any more (the host is gone, the partition
    changed): it leaves the queue, and its caller learns why."""
    return errors.FailedPrecondition(f"{e.message}; the waiting request left the queue", e.field or "queue")


def _lowest_waiter(items: list[_Item], start: int, displaced: set[str],
                   leaving: Callable[[_Item], bool]) -> _Item | None:
    """The lowest-ranked entry of the queue among ``items[start:]`` (which rank below the arrival) that a
    higher-ranked arrival may displace."""
    for it in reversed(items[start:]):
        if it.entry is not None and it.rank not in displaced and not leaving(it):
            return it
    return None


def _served_here(kv: KV, replica_id: str, lease_id: str) -> bool:
    d = kv.json()
    return bool(d.get("replica") == replica_id and d.get("lease_id") == lease_id)


def _lease_in(kvs: Sequence[KV], lease_id: str) -> VramLease | None:
    suffix = b"/" + lease_id.encode()
    for kv in kvs:
        if kv.key.endswith(suffix):
            return VramLease.from_kv(kv)
    return None


def _merge_duplicates(batch: list[AcquireCall]) -> list[AcquireCall]:
    """Calls of one round that name the same request (agent, request_id) are one request: the first one is
    decided, and the others get its answer."""
    first: dict[str, AcquireCall] = {}
    for c in batch:
        primary = first.setdefault(c.lease_id, c)
        if primary is not c:
            primary.future.add_done_callback(functools.partial(_copy_outcome, c.future))
    return list(first.values())


def _copy_outcome(target: asyncio.Future[VramLease], source: asyncio.Future[VramLease]) -> None:
    if target.done():
        return
    if source.cancelled():
        target.set_exception(errors.Unavailable("the request was cancelled; retry"))
    elif source.exception() is not None:
        target.set_exception(source.exception())  # type: ignore[arg-type]
    else:
        target.set_result(source.result())
