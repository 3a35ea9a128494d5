"""The expiry of one host's waiters (``QueueExpiry``, a part of ``HostAdmitter``): a task of its own, woken by
each waiter's deadline and by cancelled calls, that removes their queue entries and answers them, so that
waits end on time however busy the rounds are."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Sequence

from coordinator import errors
from coordinator.aio import spawn
from coordinator.etcd.removals import Removal, remove_entries
from coordinator.etcd.types import KV
from coordinator.keys import last_segment
from coordinator.policy.cordon import cordon_wait_over
from coordinator.policy.planner import wait_over
from coordinator.policy.team_admission import team_wait_over
from coordinator.records import InvalidRecord, QueueEntry, VramLease, load_record
from coordinator.replica.admitter_state import AdmitterState
from coordinator.replica.call import AcquireCall

log = logging.getLogger(__name__)

# A waiter answered later than this after its deadline is logged (G8 promises 100 ms).
LATE_WARNING_S = 0.25
EXPIRY_SLACK_S = 0.001


class QueueExpiry(AdmitterState):
    """The expiry of a ``HostAdmitter``'s waiters."""

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
                elif _served_here(out.current, self.ctx.replica_id, c.lease_id) and self._waiting.get(c.lease_id) is c:
                    c.entry_revision = out.current.mod_revision   # rewritten by one of our rounds
                    if tries < 3:
                        retry.append(c)
                    else:   # our rounds keep rewriting it: still ours, removed on the next pass
                        asyncio.get_running_loop().call_later(0.05, self._expire_wake.set)
                else:
                    # A retry of this request serves the entry now (through another replica, or through this one:
                    # it rewrote the entry when it joined it): the entry is the retry's, not removed for this call.
                    self._expired(c, None)
            if granted:
                leases = await self.ctx.store.get_prefix(self.keys.leases(self.host))
                for c in granted:
                    lease = _lease_in(leases.kvs, c.lease_id)
                    if self._waiting.get(c.lease_id) is c:
                        del self._waiting[c.lease_id]
                    if lease is not None and not c.future.done():
                        c.parts = _parts_in(leases.kvs, c.lease_id)
                        c.future.set_result(c.parts[0])
                    else:
                        self._expired(c, None)
            due = retry

    def _expired(self, c: AcquireCall, removed: QueueEntry | None) -> None:
        late = time.monotonic() - c.deadline
        if late > LATE_WARNING_S and not c.future.done():
            log.warning("waiter %s/%s of %s on %s answered %.2f s after its deadline (done=%s)", c.session.agent,
                        c.request_id, c.vram_mb, self.host, late, c.future.done())
        self._fail(c, cordon_wait_over(c.cordoned, c.wait_s) if c.cordoned
                   else team_wait_over(c.team_limit, c.wait_s) if c.team_limit
                   else wait_over(c.vram_mb, c.wait_s, c.gpu_count, c.exclusive))
        if removed is not None and removed.victims:
            spawn(self.leases.withdraw_evictions(removed), "withdrawing eviction notices")


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


def _parts_in(kvs: Sequence[KV], lease_id: str) -> tuple[VramLease, ...]:
    """Every GPU's record of the lease among ``leases/<host>/...`` keys, in index order."""
    parts = []
    for kv in kvs:
        if last_segment(kv.key) == lease_id:
            try:
                parts.append(VramLease.from_kv(kv))
            except InvalidRecord:
                continue
    return tuple(sorted(parts, key=lambda x: x.gpu_index))
