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
import dataclasses
import functools
import logging
import random
import time
from typing import Callable, Sequence

from coordinator import clock, errors, metrics
from coordinator.aio import cancel_and_wait, spawn
from coordinator.etcd.ops import (
    cmp_mod_revision,
    compile_compare,
    compile_op,
    op_delete,
    range_req,
)
from coordinator.etcd.removals import Removal, remove_entries
from coordinator.etcd.types import KV
from coordinator.keys import Keys, last_segment
from coordinator.policy.host import HostView
from coordinator.policy.partition.caps import TLS_DEFAULT, UNCAPPED
from coordinator.policy.partition.caps import check as check_cap
from coordinator.policy.plan import Context, Plan
from coordinator.policy.planner import plan_round, wait_over
from coordinator.records import (
    InvalidRecord,
    QueueEntry,
    SessionInfo,
    VramLease,
    load_record,
)
from coordinator.replica.context import ReplicaContext
from coordinator.replica.leases import Leases
from coordinator.replica.teams import team_state
from coordinator.replica.view import HOST_RANGES, host_ranges, host_view, invalid_host

log = logging.getLogger(__name__)

ORPHAN_GRACE_S = 2.0
# An admitter with nothing to decide and nobody waiting for this long retires (bounded memory).
ADMITTER_IDLE_S = 30.0
# How long a round waits for the watch to bring the mirror up to the replica's own last commit, before it
# reads a snapshot instead.
MIRROR_WAIT_S = 0.02
# The share of the etcd timeout an admission round may spend on etcd in all; the rest
# is for answering, so that a caller hears UNAVAILABLE within the etcd timeout when etcd has no quorum.
ROUND_ETCD_SHARE = 0.9
# A waiter answered later than this after its deadline is logged (G8 promises 100 ms).
LATE_WARNING_S = 0.25
# A waiting acquire not answered this long after its deadline while etcd has not answered this replica for as
# long either (its queue entry could not be removed, or its round is stuck: etcd slow, or out of reach) is
# answered UNAVAILABLE meanwhile: its client retries with the same request_id, through another replica if it
# can, which settles it (finds its lease, takes its queue entry over or removes it). What this replica was doing
# for it goes on, and a lease it grants is kept for the retry. (A call that does not wait: the etcd timeout.)
ANSWER_BY_S = 0.4
EXPIRY_SLACK_S = 0.001


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
    forwarded: bool = False       # sent by another replica on its caller's behalf (host ownership)
    capped: bool = True           # held to its agent's priority cap (an operator's own acquire is not)
    cancelled_at: float | None = None   # monotonic, when its caller went away

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.wait_s

    @property
    def gone(self) -> bool:
        """Answered already, or its caller went away. A forwarded caller that went away (the replica that
        forwarded it died) is given ``ORPHAN_GRACE_S`` first: the client retries at once through another
        replica with the same request_id, and its queue entry must still be there to keep its place."""
        if not self.future.done():
            return False
        if self.forwarded and self.cancelled_at is not None:
            return time.monotonic() >= self.cancelled_at + ORPHAN_GRACE_S
        return True


class HostAdmitter:
    """The tasks that decide admission on one host for this replica: the round loop, and the expiry of
    its waiters (a separate task, so that waits end on time however busy the rounds are)."""

    def __init__(self, ctx: ReplicaContext, leases: Leases, host: str, idle_s: float = ADMITTER_IDLE_S,
                 on_idle: Callable[[HostAdmitter], None] | None = None) -> None:
        self.ctx = ctx
        self.idle_s = idle_s
        self._on_idle = on_idle     # told (synchronously) when the admitter retires for lack of work
        self.retired = False
        self.leases = leases    # to withdraw the notices of a request that leaves
        self.host = host
        self.keys: Keys = ctx.keys
        self._pending: list[AcquireCall] = []     # arrived, not yet decided
        self._waiting: dict[str, AcquireCall] = {}  # lease_id -> call queued in etcd, served by us
        self._wake = asyncio.Event()
        self._expire_wake = asyncio.Event()
        self._dirty = False
        self._last_commit = 0   # the mirror is used only once it has caught up with our own commits
        self._orphans: dict[str, int] = {}   # lease id -> revision: granted to a caller that went away
        # Queued requests held back only by their victims' processes: lease id -> when first (the metric).
        self._held_since: dict[str, float] = {}
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run())
        self._expiry = loop.create_task(self._expire_loop())

    # -- the outside -----------------------------------------------------------------------------
    async def submit(self, call: AcquireCall) -> VramLease:
        if self._task.done() or self.retired:
            raise errors.Unavailable("coordinator is shutting down; retry on another replica")
        self._pending.append(call)
        self._wake.set()
        # Answered by then, whatever happens to etcd: a waiter soon after its wait, a call that does not wait
        # within the etcd timeout (even behind a round that is stuck on etcd).
        answer_by = ANSWER_BY_S if call.wait_s > 0 else self.ctx.config.etcd_timeout_s
        late = asyncio.get_running_loop().call_later(call.deadline + answer_by - time.monotonic(),
                                                      self._unanswered_in_time, call)
        call.future.add_done_callback(lambda _: late.cancel())
        # A caller that goes away (cancelled RPC) must leave the queue: at once, or after the grace of a
        # forwarded one (see ``AcquireCall.gone``).
        call.future.add_done_callback(functools.partial(self._on_done, call))
        return await call.future

    def _unanswered_in_time(self, call: AcquireCall) -> None:
        if call.future.done():
            return
        loop = asyncio.get_running_loop()
        quiet = loop.time() - self.ctx.store.answered_at()
        if quiet < ANSWER_BY_S:
            # etcd answers this replica: the answer is late for another reason (a busy machine, a mass
            # expiry), and comes by itself. Looked at again once etcd has been quiet for that long.
            loop.call_later(ANSWER_BY_S - quiet, self._unanswered_in_time, call)
            return
        if not call.future.done():
            log.warning("acquire %s/%s of %s on %s (wait %.1f s) not answered in time (etcd slow or out of reach): "
                        "answering UNAVAILABLE", call.session.agent, call.request_id, call.vram_mb, self.host,
                        call.wait_s)
            call.future.set_exception(errors.Unavailable(
                f"acquire: coordinator {self.ctx.replica_id} could not settle it in time (etcd slow or out of "
                "reach); retry with the same request_id"))
            self.ctx.reach.suspect_now("an acquire could not be answered in time")
            self._expire_wake.set()

    def _on_done(self, call: AcquireCall, future: asyncio.Future[VramLease]) -> None:
        if not future.cancelled():
            return
        call.cancelled_at = time.monotonic()
        if call.forwarded:
            asyncio.get_running_loop().call_later(ORPHAN_GRACE_S, self._expire_wake.set)
        else:
            self._expire_wake.set()

    def notify(self) -> None:
        """Something changed on the host (a watch event): decide again."""
        self._dirty = True
        self._wake.set()

    @property
    def has_waiters(self) -> bool:
        return bool(self._waiting)

    def hand_off(self, err: errors.GpucoordError) -> None:
        """etcd is out of reach: every caller, pending or waiting, is answered ``err`` (UNAVAILABLE) now, so
        that it retries through another replica, which takes over a waiter's queue entry with the same
        request_id. Our waiters stay in ``_waiting``, answered: their entries are removed once etcd is back,
        unless another replica has taken them over by then."""
        for c in [*self._pending, *self._waiting.values()]:
            if not c.future.done():
                c.future.set_exception(err)
        self._pending.clear()
        self._expire_wake.set()

    async def stop(self) -> None:
        await cancel_and_wait([self._task, self._expiry])
        # Waiting RPCs get UNAVAILABLE; their queue entries stay in etcd, so a retry through another
        # replica keeps its place.
        for c in [*self._pending, *self._waiting.values()]:
            if not c.future.done():
                c.future.set_exception(errors.Unavailable("coordinator is shutting down; retry on another replica"))

    @property
    def _idle(self) -> bool:
        return not (self._pending or self._waiting or self._orphans or self._dirty)

    def _retire(self) -> bool:
        """Nothing to decide and nobody waiting for ``idle_s``: the admitter leaves (a replica that has seen
        many hosts keeps only the busy ones). Synchronous, so no call can be submitted to it meanwhile: the
        owner drops it in ``on_idle``, and the next acquire for the host gets a new one."""
        if not self._idle or self._wake.is_set():
            return False
        self.retired = True
        self._expiry.cancel()
        try:
            metrics.QUEUE_DEPTH.remove(self.host)
        except KeyError:
            pass    # never set
        if self._on_idle is not None:
            self._on_idle(self)
        return True

    # -- answers ---------------------------------------------------------------------------------
    def _fail(self, c: AcquireCall, err: errors.GpucoordError) -> None:
        """Tell the caller (once the transaction that makes it true, if any, has committed)."""
        if self._waiting.get(c.lease_id) is c:
            del self._waiting[c.lease_id]
        if not c.future.done():   # counted where the RPC answers (gpucoord_refusals_total)
            c.future.set_exception(err)

    # -- the loop --------------------------------------------------------------------------------
    async def _run(self) -> None:
        cfg = self.ctx.config
        while True:
            if self._wake.is_set():
                pass
            elif self._on_idle is None:
                await self._wake.wait()
            else:
                # Idle: retire after idle_s. Busy with waiters or orphans: look again now and then.
                timeout = self.idle_s if self._idle else max(self.idle_s, 1.0)
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except asyncio.TimeoutError:
                    if self._retire():
                        return
                    continue
            self._wake.clear()
            batch: list[AcquireCall] = []
            try:
                while self._pending or self._dirty:
                    # Our last commit not yet in the mirror: its watch event is about a millisecond away.
                    # Waiting for it lets the round decide from the mirror instead of reading a snapshot
                    # (eight Range calls), and gathers the acquires that arrive meanwhile into the batch.
                    mirror = self.ctx.mirror
                    if mirror.ready and mirror.revision < self._last_commit and not self._waiting:
                        await mirror.caught_up(self._last_commit, MIRROR_WAIT_S)
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
                if isinstance(err, (errors.Timeout, errors.OutcomeUnknown)):
                    self.ctx.reach.suspect_now(f"an admission round on {self.host} failed: {err.message}")
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
        # A timer may fire a little before the deadline it was set for (uvloop rounds to milliseconds):
        # the waiters due within a millisecond are due now, and a timer is set for the next one anyway, so
        # that no waiter is left to wait for some other wake-up.
        due = [c for c in self._waiting.values() if c.gone or now >= c.deadline - EXPIRY_SLACK_S]
        due_ids = {id(c) for c in due}
        later = [c.deadline for c in self._waiting.values() if id(c) not in due_ids]
        if later:
            asyncio.get_running_loop().call_later(max(0.0, min(later) - now) + EXPIRY_SLACK_S,
                                                  self._expire_wake.set)
        if due and not self.ctx.reach.ok:
            # Answered already (hand_off); the entries are removed once etcd is back.
            asyncio.get_running_loop().call_later(0.5, self._expire_wake.set)
            return
        tries = 0
        while due:
            tries += 1
            outcomes = await remove_entries(self.ctx.store, [
                Removal(self.keys.queue_entry(self.host, c.rank or ""), c.entry_revision) for c in due])
            retry: list[AcquireCall] = []
            granted: list[AcquireCall] = []
            for c, out in zip(due, outcomes):
                if out.removed is not None:
                    try:
                        removed: QueueEntry | None = QueueEntry.from_kv(out.removed)
                    except InvalidRecord:
                        removed = None
                    self._expired(c, removed)
                elif out.current is None:
                    granted.append(c)   # gone meanwhile: with a grant (by any replica), or removed
                elif _served_here(out.current, self.ctx.replica_id, c.lease_id):
                    c.entry_revision = out.current.mod_revision   # rewritten by one of our rounds
                    if tries < 3:
                        retry.append(c)
                    else:   # our rounds keep rewriting it: still ours, removed on the next pass
                        asyncio.get_running_loop().call_later(0.05, self._expire_wake.set)
                else:
                    # Another replica serves a retry of this request now: its entry is that replica's.
                    self._expired(c, None)
            if granted:
                leases = await self.ctx.store.get_prefix(self.keys.leases(self.host))
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
        late = time.monotonic() - c.deadline
        if late > LATE_WARNING_S and not c.future.done():
            log.warning("waiter %s/%s of %s on %s answered %.2f s after its deadline (done=%s)", c.session.agent,
                        c.request_id, c.vram_mb, self.host, late, c.future.done())
        self._fail(c, wait_over(c.vram_mb, c.wait_s))
        if removed is not None and removed.victims:
            spawn(self.leases.withdraw_evictions(removed), "withdrawing eviction notices")

    # -- rounds ----------------------------------------------------------------------------------
    async def _round(self, batch: list[AcquireCall]) -> None:
        rep = self.ctx
        rep.reach.check()    # out of reach: answered at once (the callers go to another replica)
        batch = _merge_duplicates(batch)
        mirror = rep.mirror
        # The round spends at most (nine tenths of) the etcd timeout on etcd in all: without a quorum its
        # callers hear UNAVAILABLE within the etcd timeout, not after a timed-out commit and then a
        # timed-out read.
        deadline = asyncio.get_running_loop().time() + ROUND_ETCD_SHARE * rep.config.etcd_timeout_s
        use_mirror = (mirror.ready and not self._waiting and mirror.revision >= self._last_commit
                      and not mirror.host_items("queue", self.host))
        for attempt in range(rep.config.commit_attempts):
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
                snap = await rep.store.snapshot(
                    host_ranges(self.keys, self.host) + [range_req(k) for k in session_keys], deadline=deadline)
            view = host_view(self.keys, self.host, snap, rep.config.untracked_vram, rep.usage_age)
            if view.invalid:
                if use_mirror:
                    use_mirror = False
                    continue
                # A malformed stored value of this host: what it says cannot be trusted, so nothing is granted
                # here (fail closed) until it is rewritten; waiters keep their place until their deadline.
                for c in batch:
                    self._fail(c, invalid_host(self.host, view.invalid))
                return
            over_cap = self._over_cap(view, batch)
            if over_cap:
                if use_mirror:   # the mirror may not have the operator's latest caps yet: read them
                    use_mirror = False
                    continue
                for c, err in over_cap:
                    self._fail(c, err)
                batch = [c for c in batch if not c.future.done()]
            live = {s.session_id for s, r in zip(sessions, snap.ranges[HOST_RANGES:]) if r}
            teams = await team_state(rep, snap.revision, min(0.5, max(0.0, deadline - asyncio.get_running_loop().time())))
            ctx = Context(self.keys, rep.config, rep.replica_id, frozenset(rep.evictions), time.monotonic(),
                          clock.wall(), self._overdue(), teams)
            plan = plan_round(view, batch, self._waiting, live, ctx)
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
                res = await rep.store.commit([compile_compare(x) for x in plan.compares],
                                             [compile_op(x) for x in plan.ops], deadline=deadline)
            except (errors.SessionGone, errors.OutcomeUnknown):
                res = None  # ids are deterministic: reading again settles it
            if res is not None and res.succeeded:
                self._last_commit = res.revision
                self._settle(plan, res.revision)
                for entry in plan.left:
                    if entry.victims:
                        try:
                            await self.leases.withdraw_evictions(entry)
                        except errors.GpucoordError as e:
                            log.warning("could not withdraw the notices of %s/%s: %s", entry.agent,
                                        entry.request_id, e)
                return
            metrics.CONFLICTS.inc()
            await asyncio.sleep(random.uniform(0, min(0.05, 0.001 * 2 ** attempt)))
        err = errors.Unavailable(f"acquire: admission on host {self.host} lost {rep.config.commit_attempts} "
                                 "compare-and-set rounds in a row; retry")
        for c in batch:
            if not c.future.done():
                c.future.set_exception(err)

    def _overdue(self) -> frozenset[str]:
        """Leases of this host under a notice whose deadline has passed (as this replica measures it)."""
        now = clock.monotonic()
        out = set()
        for record in list(self.ctx.evictions.values()):
            if record.host != self.host:
                continue
            kv = self.ctx.mirror.get(self.keys.eviction(record.lease_id))
            if kv is not None and self.ctx.notice_deadline(kv, record) <= now:
                out.add(record.lease_id)
        return frozenset(out)

    def _count_process_waits(self, plan: Plan[AcquireCall]) -> None:
        """``gpucoord_victim_process_wait_seconds``: from the first round held back only by a victim's
        processes to the grant."""
        now = time.monotonic()
        granted = {lease.id for _, lease in plan.grants}
        for lease_id in granted & self._held_since.keys():
            metrics.VICTIM_PROCESS_WAITS.observe(now - self._held_since[lease_id])
        held = set(plan.held_by_processes)
        self._held_since = {k: v for k, v in self._held_since.items() if k in held}
        for lease_id in held:
            self._held_since.setdefault(lease_id, now)

    def _over_cap(self, view: HostView, batch: list[AcquireCall]) -> list[tuple[AcquireCall, errors.GpucoordError]]:
        """The calls above their agent's priority cap on this host (G9), from the partition of the snapshot
        (every grant compares its mod_revision, so a cap changed meanwhile is read again). A request already
        granted (a retry of it) is answered with its lease, whatever the cap says now."""
        if view.inventory is None or not any(c.capped for c in batch):
            return []
        partition = view.effective_partition()
        caps = partition.spec.priority_caps if partition.spec is not None else ()
        default = TLS_DEFAULT if self.ctx.config.tls_ca else UNCAPPED
        out: list[tuple[AcquireCall, errors.GpucoordError]] = []
        for c in batch:
            if c.capped and c.lease_id not in view.leases:
                err = check_cap(c.session.agent, self.host, c.priority, c.preemptible, caps, default)
                if err is not None:
                    out.append((c, err))
        return out

    def _settle(self, plan: Plan[AcquireCall], revision: int) -> None:
        """The round's transaction has committed (or there was nothing to write): tell the callers."""
        self._count_process_waits(plan)
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
            elif id(lease) in new and revision and c.future.cancelled() and not c.forwarded:
                # Its caller went away while the grant was being committed: nobody knows the lease, so it
                # is given back rather than held for the rest of the session, unless a retry of the same
                # request claims it first (a client retries at once after a cancelled call). A caller we
                # answered UNAVAILABLE (``_unanswered_in_time``, ``hand_off``) retries, maybe through another replica
                # that finds the lease: it is kept for that retry; so is the lease of a forwarded call, whose
                # forwarding replica cancelled it to decide the request itself (and may hand this lease out).
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
        metrics.EVICTIONS.labels("notice").inc(len(plan.evictions))

    def _schedule_give_back(self, lease: VramLease) -> None:
        spawn(self._give_back(lease), f"giving back the orphaned lease {lease.id}")

    async def _give_back(self, lease: VramLease) -> None:
        revision = self._orphans.pop(lease.id, None)
        if revision is None:
            return   # claimed by a retry
        key = self.keys.lease(self.host, lease.gpu_uuid, lease.id)
        try:
            await self.ctx.store.commit([cmp_mod_revision(key, revision)], [op_delete(key)])
        except errors.GpucoordError as e:
            log.warning("could not give back lease %s of a caller that went away: %s", lease.id, e)


def _served_here(kv: KV, replica_id: str, lease_id: str) -> bool:
    try:
        d = load_record(kv.value)
    except InvalidRecord:
        return False
    return bool(d.get("replica") == replica_id and d.get("lease_id") == lease_id)


def _lease_in(kvs: Sequence[KV], lease_id: str) -> VramLease | None:
    for kv in kvs:
        if last_segment(kv.key) == lease_id:
            try:
                return VramLease.from_kv(kv)
            except InvalidRecord:
                return None
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
