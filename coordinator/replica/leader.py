"""Leader election through etcd, and the duties that need a single actor.

Every replica registers ``coordinators/<id>`` and campaigns with ``election/<id>``, both on one etcd_lease
of ``election_ttl_s`` (``etcd/session.py``, ``etcd/election.py``). The leader is the candidate whose key has
the lowest create_revision (etcd's own election recipe). When the leader dies its keys expire and the next
candidate leads within the TTL. Every write made as leader compares the leader's own candidacy in the
same transaction (``Election.fence``), so a leader paused past its TTL cannot act beside its successor. A
leader cut off from etcd stops its duties as soon as its session is in doubt (two keepalives in a row failed),
well before its election can lapse, and takes them up again if a keepalive gets through while it still leads.
The same session tells the replica whether it can reach etcd at all (``replica/reach.py``).

The leader's duties, all restartable from etcd alone:

* eviction deadlines: a lease still held when its notice's deadline passes is revoked, at once if it is
  bound to processes that the nodes no longer report on any of its GPUs (``replica/stopped.py``), else at the kill margin past the deadline; and the
  ``departing/`` records of ended leases are deleted once the node reports none of their processes;
* the queue sweep: entries of hosts that are gone, and entries past their waiter's deadline whose
  replica is no longer there to remove them;
* usage accounting: a usage record for every lease that ends (``replica/accountant.py``);
* drains cut short are finished (``replica/cordons.py``), and leases with a time limit get their ``time-limit``
  notice at their end minus the warning (``replica/time_limits.py``), and idle leases theirs under
  ``idle_action evict`` (``replica/idle.py``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging

from coordinator import clock, errors, metrics
from coordinator.aio import first_of, spawn
from coordinator.etcd.election import Election
from coordinator.etcd.removals import Removal, remove_entries
from coordinator.etcd.session import EtcdSession
from coordinator.etcd.types import KV
from coordinator.policy.departing import still_reported
from coordinator.records import (
    DepartingRecord,
    EvictionRecord,
    InvalidRecord,
    QueueEntry,
    VramLease,
    dumps,
)
from coordinator.replica.accountant import Accountant
from coordinator.replica.context import ReplicaContext
from coordinator.replica.cordons import Cordons
from coordinator.replica.export import Exporter
from coordinator.replica.host_lost import HostLoss
from coordinator.replica.idle import IdleReclaim
from coordinator.replica.leases import Leases, usage_report
from coordinator.replica.stopped import stopped_everywhere
from coordinator.replica.time_limits import TimeLimits
from coordinator.txn import Absent, Delete, ModRevisionIs, Put, Range

log = logging.getLogger(__name__)

SWEEP_INTERVAL_S = 1.0
SWEEP_GRACE_S = 2.0
# A waiter's own replica removes its entry within moments of its deadline; the leader removes one that is
# still there this long after it only as a safety net (and the waiter's replica still answers it right).
OVERDUE_S = 20.0
# A forced departing record (its processes outlived the kill margin) is kept this long for status and the
# history, then forgotten even if the node still reports them (it kills them with --enforce kill).
DEPARTING_KEEP_S = 300.0


class Leadership:
    """This replica's candidacy (``etcd/election.py`` on an ``etcd/session.py`` session) and, while it
    leads, the duties. Every write made as leader carries the election's fence."""

    def __init__(self, ctx: ReplicaContext, leases: Leases) -> None:
        self.ctx = ctx
        self.leases = leases    # revocation at a deadline, withdrawal of notices
        self.accountant = Accountant(ctx)   # usage records of ended leases (issue 33)
        self.exporter = Exporter(ctx)       # and their JSON-lines export
        self.cordons = Cordons(ctx, leases)  # drains cut short are finished (issue 31)
        self.time_limits = TimeLimits(ctx, leases)  # leases warned before their time limit (issue 31)
        self.host_loss = HostLoss(ctx, leases, SWEEP_GRACE_S, OVERDUE_S)  # multi-host gangs that lost a host (issue 30)
        self.idle = IdleReclaim(ctx, leases)        # idle leases evicted under idle_action evict (issue 31)
        self.keys = ctx.keys
        self.election: Election | None = None
        self._session: EtcdSession | None = None
        self._duties: asyncio.Task[None] | None = None
        self.deadline_wake = asyncio.Event()
        self._resigned = False

    @property
    def is_leader(self) -> bool:
        return self.election is not None and self.election.is_leader

    @property
    def acting(self) -> bool:
        """Whether this replica's leader duties run now."""
        return self._duties is not None

    @property
    def session(self) -> EtcdSession | None:
        """The session of the current candidacy (its ``expires_by``, ``in_doubt``)."""
        return self._session

    @property
    def leader_id(self) -> str:
        return self.election.leader_id if self.election is not None else ""

    async def run(self) -> None:
        while not self._resigned:
            try:
                await self._term()
            except asyncio.CancelledError:
                raise
            except errors.GpucoordError as e:
                log.warning("election: %s; campaigning again", e)
            except Exception:
                log.exception("election: a term ended with an unexpected error; campaigning again")
            self._step_down()
            if self._session is not None and not self._resigned:
                await self._session.orphan()
            await asyncio.sleep(0.5)

    async def _term(self) -> None:
        """One candidacy: stand, then follow the election until our session ends."""
        me = self.ctx.replica_id
        session = self._session = await EtcdSession(self.ctx.store, self.ctx.config.election_ttl_s,
                                                    f"replica {me}").open()
        self.ctx.reach.set(True)
        session.on_doubt = self._on_doubt
        session.on_refresh = self.ctx.reach.refreshed
        self.ctx.reach.probe = session.probe
        election = self.election = Election(session, self.keys, me)
        # "sessions": this replica keeps sessions alive in memory (replica/liveness.py): one without it (the
        # previous release) refreshes their etcd leases on each keepalive instead.
        info = dumps({"replica": me, "address": self.ctx.advertise, "started_at": clock.wall(), "sessions": "memory"})
        await election.campaign(info, extra_puts=[(self.keys.coordinator(me), info)])
        while not session.done.is_set():
            observer = asyncio.ensure_future(election.observe(self._on_leader))
            if await first_of(observer, session.done.wait()) is observer:
                observer.result()      # an error of the watch ends the term
            if not await election.holds():
                return    # our candidacy is gone: stand again

    def _on_doubt(self, doubt: bool) -> None:
        """Our session's keepalives fail (etcd out of reach), or get through again."""
        if doubt:
            left = (self._session.expires_by if self._session else 0.0) - asyncio.get_running_loop().time()
            self.ctx.reach.set(False, "the keepalives of its own etcd_lease fail")
            if self._duties is not None:
                log.warning("replica %s stops its leader duties: its candidacy may lapse in %.1f s",
                            self.ctx.replica_id, left)
            self._step_down()
        else:
            self.ctx.reach.set(True)
            if self.election is not None and self.election.is_leader:
                self._on_leader(self.election.leader_id)

    def _on_leader(self, leader_id: str) -> None:
        me = self.ctx.replica_id
        in_doubt = self._session is not None and self._session.in_doubt
        if leader_id == me and self._duties is None and self.election is not None and not in_doubt:
            log.info("replica %s is the leader", me)
            # The duties fence their writes with the candidacy that won, for the whole term: a later
            # candidacy of ours (after this one was lost) must not make an old term's writes pass.
            self._duties = spawn(self._lead(self.election), "leader duties")
        elif leader_id != me:
            self._step_down()

    def _step_down(self) -> None:
        if self._duties is not None:
            log.info("replica %s is no longer the leader", self.ctx.replica_id)
            self._duties.cancel()
            self._duties = None

    async def resign(self) -> None:
        """Give up leadership at once (a clean shutdown): the next candidate leads without waiting a TTL."""
        self._resigned = True
        self._step_down()
        if self._session is not None:
            await self._session.close()

    # -- duties ----------------------------------------------------------------------------------
    async def _lead(self, term: Election) -> None:
        """The duties of one term. ``term`` is the candidacy that won: every write made as leader carries
        ``term.fence()``, a compare that fails once that candidacy is gone."""
        await asyncio.gather(self._enforce_deadlines(term), self._sweep_queue(term), self.accountant.run(term),
                             self.exporter.run(term), self.cordons.finish_drains(), self.time_limits.run(),
                             self.idle.run(), self.host_loss.run(term))

    async def _enforce_deadlines(self, term: Election) -> None:
        """Revoke every lease whose eviction deadline passed (at once for a lease bound to processes once the
        node reports none of them, else at the kill margin past the deadline), and end the ``departing/``
        records once their processes are gone. Notices live in etcd, so a new leader picks them up from the
        replica's watch-fed cache of ``evictions/``. A deadline is the notice's grace measured on this
        replica's monotonic clock from when it first saw the notice (never the writer's wall clock against
        ours): with a leader change it can come late, never early."""
        while True:
            now = clock.monotonic()
            failed = False
            upcoming: list[float] = []
            for record, at in self._deadlines():
                try:
                    again = await self._deadline(record, at, now, term)
                except (errors.GpucoordError, InvalidRecord) as e:   # (a lease read from etcd may be malformed)
                    log.warning("could not enforce the deadline of lease %s: %s", record.lease_id, e)
                    failed = True
                    continue
                if again is None:
                    self.ctx.evictions.pop(record.lease_id, None)
                else:
                    upcoming.append(again)
            for kv in self.ctx.mirror.all_host_items("departing"):
                try:
                    departing = DepartingRecord.from_kv(kv)
                except InvalidRecord:
                    continue   # left as it is: its host is INVALID (the admitters report it) until it is rewritten
                try:
                    again = await self._departing(kv, departing, now, term)
                except (errors.GpucoordError, ValueError, TypeError, KeyError) as e:
                    log.warning("could not end the departing record %r: %s", kv.key, e)
                    failed = True
                    continue
                if again is not None:
                    upcoming.append(again)
            timeout = max(0.0, min(upcoming) - clock.monotonic()) if upcoming else 1.0
            if failed:
                timeout = max(timeout, 0.2)   # etcd is failing us: do not spin
            self.deadline_wake.clear()
            try:
                await asyncio.wait_for(self.deadline_wake.wait(), min(timeout, 1.0))
            except asyncio.TimeoutError:
                pass

    def _deadlines(self) -> list[tuple[EvictionRecord, float]]:
        out = []
        for record in list(self.ctx.evictions.values()):
            kv = self.ctx.mirror.get(self.keys.eviction(record.lease_id))
            if kv is not None:
                out.append((record, self.ctx.notice_deadline(kv, record)))
        return out

    async def _deadline(self, record: EvictionRecord, at: float, now: float, term: Election) -> float | None:
        """Act on one notice: None when it is settled (revoked, withdrawn, gone), else when to look again.

        Before the deadline nothing happens. After it, the request it was made for may have gone (then the
        notice is withdrawn: nobody needs the room). Otherwise the lease is revoked: at once if every GPU
        of it is shown free of its processes, in usage reports published after the deadline, on every host
        of a multi-host gang, a lost host's part settled by the loss (``replica/stopped.py``); else at the kill margin past the deadline (``eviction_kill_margin_s``), when the holder has
        had its chance to kill them and see them exit (G3)."""
        if now < at:
            return at
        key = self.keys.eviction(record.lease_id)
        kv = self.ctx.mirror.get(key)
        if kv is None:
            return None
        # A request's notice stands only while its queue entry still lists the victim; the revoke compares it.
        entry_kv = self._still_waiting(record) if record.requester_priority is not None else None
        if record.requester_priority is not None and entry_kv is None:
            res = await self.ctx.store.commit([ModRevisionIs(key, kv.mod_revision), *term.fence()],
                                              [Delete(key)])
            if res.succeeded:
                log.info("withdrew the notice of lease %s: its requester %s is gone or no longer needs it",
                         record.lease_id, record.requested_by)
            return None
        also = [ModRevisionIs(entry_kv.key, entry_kv.mod_revision)] if entry_kv is not None else []
        bound = at + self.ctx.config.eviction_kill_margin_s
        lease_kv = self.ctx.mirror.lease(record.lease_id)
        try:
            lease = VramLease.from_kv(lease_kv) if lease_kv is not None else None
        except InvalidRecord:
            # Its host is INVALID (no admission there) until the value is rewritten: look again then.
            return max(bound, now + 1.0)
        if lease is None and now < bound:
            return bound         # gone (its notice goes in the same transaction): nothing to decide early
        if lease is not None and now < bound:
            decided = stopped_everywhere(self.ctx, record, lease, at)   # (None: a cooperative holder, or the margin)
            if decided is not None and await self.leases.revoke(
                    record.lease_id, record.host, notice_revision=kv.mod_revision, fence=term, decided_on=decided,
                    also=also, reason=ended_by(record)):
                log.info("revoked lease %s of %s after its eviction deadline: the node of each of its hosts reports "
                         "none of its processes on its GPUs", record.lease_id, record.agent)
                return None
            return bound
        if await self.leases.revoke(record.lease_id, record.host, notice_revision=kv.mod_revision, fence=term,
                                    at_bound=True, also=also, reason=ended_by(record)):
            log.info("revoked lease %s of %s at the kill margin past its eviction deadline", record.lease_id,
                     record.agent)
        return None

    async def _departing(self, kv: KV, record: DepartingRecord, now: float, term: Election) -> float | None:
        """Settle one ``departing/`` record: delete it once the node reports none of its processes (or the
        host is gone), mark it forced at its bound, delete a forced one ``DEPARTING_KEEP_S`` after. None
        when settled, else when to look again."""
        bound = self.ctx.observed.saw(kv.key, kv.create_revision) + max(0.0, record.bound_unix - record.created_at)
        usage_kv = self.ctx.mirror.get(self.keys.usage(record.host))
        compares = [ModRevisionIs(kv.key, kv.mod_revision), *term.fence()]
        usage = usage_report(usage_kv) if usage_kv is not None else None
        # A malformed report counts as listing them (fail closed); no report at all: the host is gone.
        reported = usage_kv is not None and (usage is None or still_reported(usage, record.gpu_uuid,
                                                                             record.lease_id, record.pids))
        if not reported or (record.forced and now >= bound + DEPARTING_KEEP_S):
            if usage_kv is not None:
                compares.append(ModRevisionIs(usage_kv.key, usage_kv.mod_revision))
            else:
                compares.append(Absent(self.keys.usage(record.host)))
            res = await self.ctx.store.commit(compares, [Delete(kv.key)])
            if res.succeeded and reported:
                log.warning("forgot departing lease %s: the node still reports its processes %s on GPU %s %.0f s "
                            "after the kill margin", record.lease_id, list(record.pids), record.gpu_uuid,
                            DEPARTING_KEEP_S)
            return None
        if record.forced:
            return bound + DEPARTING_KEEP_S
        if now < bound:
            return bound
        forced = dataclasses.replace(record, forced=True)
        res = await self.ctx.store.commit(compares, [Put(kv.key, dumps(forced.to_json()))])
        if res.succeeded:
            metrics.EVICTIONS.labels("margin").inc()
            log.warning("departing lease %s of %s: the kill margin passed while the node still reports its "
                        "processes on GPU %s; its VRAM counts as free now", record.lease_id, record.agent,
                        record.gpu_uuid)
        return None

    def _still_waiting(self, record: EvictionRecord) -> KV | None:
        """The queue entry of the notice's requester, while it still lists the notice's lease as a victim."""
        for kv in self.ctx.mirror.host_items("queue", record.host):
            try:
                entry = QueueEntry.from_kv(kv)
            except InvalidRecord:
                continue   # (its host is INVALID; the admitters report it)
            if f"{entry.agent}/{entry.request_id}" == record.requested_by:
                return kv if record.lease_id in entry.victims else None
        return None

    async def _sweep_queue(self, term: Election) -> None:
        while True:
            try:
                await self._sweep_once(term)
            except errors.GpucoordError as e:
                log.warning("queue sweep failed: %s", e)
            await asyncio.sleep(SWEEP_INTERVAL_S)

    async def _sweep_once(self, term: Election) -> None:
        """Remove the entries nobody else will: those of hosts that are gone, those whose replica died, and
        (a safety net) those long past their deadline. Removals go in batched transactions, each entry
        compared on its mod_revision, so an entry that a replica granted, removed or rewrote meanwhile
        stays as it is. The waiter's replica answers from what it then reads (FAILED_PRECONDITION only if
        the host is gone or the partition changed), so a sweep never changes the answer."""
        keys = self.keys
        snap = await self.ctx.store.snapshot([Range(keys.queue(), prefix=True),
                                              Range(keys.coordinators(), prefix=True, keys_only=True)])
        if not snap.ranges[0]:
            return
        # The registrations of the queues' hosts only, read after the queue: a fleet of 10,000 hosts with
        # nobody waiting read 10,000 keys a sweep. A host registered meanwhile is seen; one gone meanwhile is
        # swept at the next sweep (and a removal for a gone host compares its absence).
        queued = sorted({keys.parse(kv.key)[1][0] for kv in snap.ranges[0]})
        registered = await self.ctx.store.get_many([keys.host(h) for h in queued], keys_only=True)
        hosts = {h for h in queued if registered[keys.host(h)] is not None}
        replicas = {keys.parse(kv.key)[1][0] for kv in snap.ranges[1]}
        now = clock.monotonic()
        removals: list[Removal] = []
        swept: list[tuple[QueueEntry, str]] = []
        for kv in snap.ranges[0]:
            host = keys.parse(kv.key)[1][0]
            try:
                entry = QueueEntry.from_kv(kv)
            except InvalidRecord:
                continue   # left as it is: its host is INVALID until it is rewritten or its session ends
            gone_host = host not in hosts
            # The wait is measured from when this replica saw this version of the entry (our clock).
            waited = self.ctx.observed.age(kv.key, kv.mod_revision, now) - entry.wait_s
            abandoned = waited > SWEEP_GRACE_S and entry.replica not in replicas
            overdue = waited > OVERDUE_S
            if gone_host or abandoned or overdue:
                removals.append(Removal(kv.key, kv.mod_revision, (Absent(keys.host(host)),) if gone_host else ()))
                swept.append((entry, "host gone" if gone_host else "waiter gone" if abandoned else "overdue"))
        if not removals:
            return
        outcomes = await remove_entries(self.ctx.store, removals, common=term.fence())
        for (entry, why), out in zip(swept, outcomes):
            if out.removed is not None:
                await self.leases.withdraw_evictions(entry)
                log.info("swept queue entry %s of %s (%s)", entry.rank, entry.agent, why)


def ended_by(record: EvictionRecord) -> str:
    """How a lease revoked at its notice's deadline ended (``gpucoord_releases_total``)."""
    return "revoke" if record.revoke else ("reclaim" if record.reclaim else "eviction")
