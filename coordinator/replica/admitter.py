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
import functools
import logging
import time
from typing import Callable

from coordinator import errors, metrics
from coordinator.aio import cancel_and_wait, spawn
from coordinator.keys import Keys
from coordinator.records import (
    VramLease,
)
from coordinator.replica.call import ORPHAN_GRACE_S, AcquireCall
from coordinator.replica.context import ReplicaContext
from coordinator.replica.expiry import QueueExpiry
from coordinator.replica.leases import Leases
from coordinator.replica.round import MIRROR_WAIT_S, AdmissionRound

log = logging.getLogger(__name__)

# An admitter with nothing to decide and nobody waiting for this long retires (bounded memory).
ADMITTER_IDLE_S = 30.0
# A waiting acquire not answered this long after its deadline while etcd has not answered this replica for as
# long either (its queue entry could not be removed, or its round is stuck: etcd slow, or out of reach) is
# answered UNAVAILABLE meanwhile: its client retries with the same request_id, through another replica if it
# can, which settles it (finds its lease, takes its queue entry over or removes it). What this replica was doing
# for it goes on, and a lease it grants is kept for the retry. (A call that does not wait: the etcd timeout.)
ANSWER_BY_S = 0.4


class HostAdmitter(QueueExpiry, AdmissionRound):
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
        self._teams_revision = 0
        self._task = spawn(self._run(), f"admission rounds on {host}")
        self._expiry = spawn(self._expire_loop(), f"queue expiry on {host}")

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
        self.ctx.team_waiting.discard(self.host)
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
