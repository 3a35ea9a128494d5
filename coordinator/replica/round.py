"""One admission round on one host (``AdmissionRound``, a part of ``HostAdmitter``): read the host (from the
mirror or etcd), plan, commit the plan in one transaction, and tell the callers (``_settle``)."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import random
import time

from coordinator import clock, errors, metrics
from coordinator.aio import spawn
from coordinator.policy.host import HostView
from coordinator.policy.partition.caps import TLS_DEFAULT, UNCAPPED
from coordinator.policy.partition.caps import check as check_cap
from coordinator.policy.plan import Context, Plan
from coordinator.policy.planner import plan_round
from coordinator.records import EvictionRecord, VramLease
from coordinator.replica.admitter_state import AdmitterState
from coordinator.replica.call import ORPHAN_GRACE_S, AcquireCall, give_back
from coordinator.replica.idle import IdleNow
from coordinator.replica.teams import team_state
from coordinator.replica.view import host_view, invalid_host, read_host

log = logging.getLogger(__name__)

# How long a round waits for the watch to bring the mirror up to the replica's own last commit, before it
# reads a snapshot instead.
MIRROR_WAIT_S = 0.02
# The share of the etcd timeout an admission round may spend on etcd in all; the rest
# is for answering, so that a caller hears UNAVAILABLE within the etcd timeout when etcd has no quorum.
ROUND_ETCD_SHARE = 0.9


class AdmissionRound(AdmitterState):
    """The rounds of a ``HostAdmitter``."""

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
                snap = await read_host(rep.store, self.keys, self.host, session_keys, deadline=deadline)
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
            live = {s.session_id for s, kv in zip(sessions, snap.extra) if kv is not None}
            teams, teams_read_at = await team_state(
                rep, snap.revision, min(0.5, max(0.0, deadline - asyncio.get_running_loop().time())), attempt > 0)
            ctx = Context(self.keys, rep.config, rep.replica_id, frozenset(rep.evictions), time.monotonic(),
                          clock.wall(), self._overdue(), teams, no_teams_since=teams_read_at if teams is None else 0,
                          notices=self._notices(snap.revision), idle=IdleNow(rep))
            plan = plan_round(view, batch, self._waiting, live, ctx)
            self._teams_revision = teams.revision if teams is not None else 0
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
                res = await rep.commits.commit(plan.compares, plan.ops, deadline=deadline)
            except (errors.SessionGone, errors.OutcomeUnknown):
                res = None  # ids are deterministic: reading again settles it
            if res is not None and res.succeeded:
                self._last_commit = res.revision
                self._settle(plan, res.revision)
                for lease_id in plan.withdrawn:
                    log.info("withdrew the eviction notice of lease %s: its requester no longer needs it", lease_id)
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

    def _notices(self, revision: int) -> dict[str, tuple[int, EvictionRecord]]:
        """This host's notices with their mod_revision, from the mirror once it has caught up with the round's
        snapshot (``revision``); none before (a round then withdraws nothing: the next one will)."""
        mirror, out = self.ctx.mirror, {}
        if not mirror.ready or mirror.revision < revision:
            return {}
        for record in list(self.ctx.evictions.values()):
            kv = mirror.get(self.keys.eviction(record.lease_id)) if record.host == self.host else None
            if kv is not None:
                out[record.lease_id] = (kv.mod_revision, record)
        return out

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
                parts = plan.gangs.get(lease.id, (lease,))
                c.parts = tuple(dataclasses.replace(x, mod_revision=revision) if revision and id(x) in new else x
                                for x in parts)
                c.future.set_result(c.parts[0])
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
        if plan.wake_after is not None:    # a lease reclaim could take leaves its minimum runtime then
            asyncio.get_running_loop().call_later(plan.wake_after + 0.01, self.notify)
        loop = asyncio.get_running_loop()
        for w in plan.waits:
            c = w.call
            c.rank = w.rank
            c.team_limit = plan.team_waits.get(c.lease_id, "")
            c.cordoned = plan.cordon_waits.get(c.lease_id, "")
            c.entry_revision = w.revision or revision
            if w.deadline is not None and w.deadline > c.deadline:
                c.deadline = w.deadline     # a retry that joined its entry: the entry's (later) deadline
            if self._waiting.get(c.lease_id) is c:
                continue
            # Recorded even if its caller has gone meanwhile: the expiry then removes the entry at once.
            self._waiting[c.lease_id] = c
            if c.future.done():
                self._expire_wake.set()
            else:
                loop.call_later(max(0.0, c.deadline - time.monotonic()), self._expire_wake.set)
        metrics.EVICTIONS.labels("notice").inc(len(plan.evictions))
        # A waiter held back by its team's limit alone: a lease's end on any host may let it in (G11). True a
        # little too long at worst (an extra round).
        if any(c.team_limit for c in self._waiting.values()):
            self.ctx.team_waiting.add(self.host)
        else:
            self.ctx.team_waiting.discard(self.host)
        if plan.team_waits and self.ctx.mirror.teams_eased_at > self._teams_revision:
            # A lease ended (or a team changed) after the teams' copy this round decided on, and the watch saw it
            # before these waiters were ours to wake (``Follower._on_events``): decide again now.
            self.notify()

    def _schedule_give_back(self, lease: VramLease) -> None:
        spawn(self._give_back(lease), f"giving back the orphaned lease {lease.id}")

    async def _give_back(self, lease: VramLease) -> None:
        revision = self._orphans.pop(lease.id, None)
        if revision is None:
            return   # claimed by a retry
        # A gang: every GPU's record, all written by the one grant's transaction (at ``revision``).
        await give_back(self.ctx.store, [self.keys.lease(self.host, uuid_, lease.id) for uuid_ in lease.gpus],
                        revision, lease.id)


def _merge_duplicates(batch: list[AcquireCall]) -> list[AcquireCall]:
    """Calls of one round that name the same request (agent, request_id) are one request: the first one is
    decided, and the others get its answer."""
    first: dict[str, AcquireCall] = {}
    for c in batch:
        primary = first.setdefault(c.lease_id, c)
        if primary is not c:
            primary.future.add_done_callback(functools.partial(_copy_outcome, c, primary))
    return list(first.values())


def _copy_outcome(call: AcquireCall, primary: AcquireCall, _: object) -> None:
    target, source = call.future, primary.future
    call.parts = primary.parts
    if target.done():
        return
    if source.cancelled():
        target.set_exception(errors.Unavailable("the request was cancelled; retry"))
    elif source.exception() is not None:
        target.set_exception(source.exception())  # type: ignore[arg-type]
    else:
        target.set_result(source.result())
