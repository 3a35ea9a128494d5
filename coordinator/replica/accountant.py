"""The leader's accountant (issue 33): one usage record for every VRAM lease that ends, exactly once.

It watches every deletion under the prefix with its previous value (etcd's NOPUT filter and ``prev_kv``), so
a lease that etcd deleted with its session's etcd_lease is seen like one released or revoked, and turns the
deletions of each revision into usage records (``coordinator.policy.accounting``). How far it has read is the
cursor ``accounting/cursor``, in etcd: every transaction that writes records writes their hourly rollups and
moves the cursor past them, comparing the cursor's mod_revision and the leader's fence. So a record and its
rollups are written once, by one leader: a deposed leader's transaction fails on the fence, and the next
leader reads the cursor and resumes from the revision after it (a revision too large for one transaction is
written in parts, the cursor counting the records of it already written).

If etcd compacted its history past the cursor (no leader accounted for longer than etcd keeps history), the
deletions in between are lost to it: the accountant logs it, counts ``gpucoord_usage_resyncs_total``, and goes
on from the current revision (docs/teams.md, "Usage accounting": keep etcd's history longer than a leader gap).

It also deletes raw records past ``usage_retention_s`` and rollups past ``usage_rollup_days``.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from itertools import groupby
from typing import Any, Sequence

import orjson

from coordinator import clock, errors, metrics
from coordinator.aio import cancel_and_wait
from coordinator.etcd.election import Election
from coordinator.etcd.removals import Removal, remove_entries
from coordinator.etcd.types import WatchBatch, WatchEvent
from coordinator.policy.accounting import (
    EVICTED,
    Deleted,
    Unit,
    UsageRecord,
    charge,
    empty_rollup,
    ended_in,
    hour_of,
    hour_start,
    plan_commit,
    rollup_keys,
    seconds,
)
from coordinator.policy.idle import idle_seconds
from coordinator.policy.teams import Membership
from coordinator.records import dumps
from coordinator.replica.context import ReplicaContext
from coordinator.replica.teams import mirror_membership
from coordinator.txn import ModRevisionIs, Op, Put, Range

log = logging.getLogger(__name__)

OPS_PER_TXN = 100        # below etcd's --max-txn-ops (128): records, rollups and the cursor of one commit
IDLE_CURSOR_S = 10.0     # the cursor follows deletions that ended no lease at most this late
SWEEP_EVERY_S = 60.0
GATHER_S = 0.25          # the lease ends of this long after a watch batch share its transactions


@dataclasses.dataclass(frozen=True)
class Cursor:
    revision: int      # every deletion up to this revision is accounted for
    skip: int = 0      # records of revision + 1 already written (a revision written in parts) ...
    part: int = 0      # ... and hours of the next one already charged
    end_unix: float = 0.0   # the end time of revision + 1's records, while it is written in parts
    mod_revision: int = 0   # of the cursor key (0: none yet)

    def to_json(self) -> dict[str, object]:
        d: dict[str, object] = {"revision": self.revision, "at": clock.wall()}
        if self.skip or self.part:
            d.update(skip=self.skip, part=self.part, end_unix=self.end_unix)
        return d


class Accountant:
    def __init__(self, ctx: ReplicaContext) -> None:
        self.ctx = ctx
        self.keys = ctx.keys
        self._rollups: dict[tuple[str, str], dict[str, Any]] = {}

    async def run(self, term: Election) -> None:
        """Account until the term ends (cancelled): a failed pass starts over from the cursor in etcd."""
        sweeper = asyncio.ensure_future(self._sweep_forever(term))
        try:
            while True:
                try:
                    await self._follow(term)
                except (errors.GpucoordError, ValueError, KeyError, TypeError) as e:
                    # NotOwner too (the term ends, and this task with it); a malformed cursor or rollup is logged
                    # and read again (an operator repairs it): the other duties go on.
                    log.warning("accountant: %r; starting over from the cursor", e)
                    await asyncio.sleep(0.5)
        finally:
            sweeper.cancel()

    async def read_cursor(self) -> Cursor | None:
        kv = await self.ctx.store.get(self.keys.accounting_cursor())
        if kv is None:
            return None
        d = json.loads(kv.value)
        return Cursor(int(d["revision"]), int(d.get("skip", 0)), int(d.get("part", 0)), float(d.get("end_unix", 0.0)),
                      kv.mod_revision)

    async def _follow(self, term: Election) -> None:
        self._rollups.clear()      # read again from etcd: only the cursor's holder writes them
        cursor = await self.read_cursor()
        if cursor is None:
            # The first leader that accounts: leases that ended before it have no record.
            cursor = await self._commit(term, Cursor(0), [], Cursor(await self._now()))
        written_at = clock.monotonic()
        batches: asyncio.Queue[WatchBatch | Exception] = asyncio.Queue()
        reader = asyncio.ensure_future(self._watch(cursor.revision + 1, batches))
        try:
            while True:
                events, resync = await self._next(batches)
                if events:
                    cursor, written_at = await self._batch(term, cursor, events, written_at)
                if resync:
                    metrics.USAGE_RESYNCS.inc()
                    now = await self._now()
                    log.error("accountant: etcd compacted its history past revision %d: the leases that ended up "
                              "to revision %d have no usage record", cursor.revision, now)
                    await self._commit(term, cursor, [], Cursor(now))
                    return
        finally:
            await cancel_and_wait([reader])

    async def _watch(self, start_revision: int, batches: asyncio.Queue[WatchBatch | Exception]) -> None:
        """The watch's batches into ``batches``, then how it ended (its error; it ends after a resync batch)."""
        try:
            async for batch in self.ctx.store.watch(self.keys.root(), start_revision=start_revision, prev_kv=True,
                                                    deletes_only=True):
                batches.put_nowait(batch)
                if batch.resync:
                    return
            batches.put_nowait(errors.Unavailable("accountant: its watch ended"))
        except Exception as e:   # noqa: BLE001 - handed to the accountant's loop, which raises it
            batches.put_nowait(e)

    @staticmethod
    async def _next(batches: asyncio.Queue[WatchBatch | Exception]) -> tuple[list[WatchEvent], bool]:
        """The deletions of the next watch batch and of every batch that came within ``GATHER_S`` of it, so that
        their records share transactions (under load a batch holds a lease end or two: one transaction each
        doubled the etcd writes of a release); and whether a resync batch ends them. The watch's error is raised
        (the pass starts over from the cursor)."""
        item = await batches.get()
        if isinstance(item, Exception):
            raise item
        if not item.resync:
            await asyncio.sleep(GATHER_S)
        events: list[WatchEvent] = []
        while not item.resync:
            events += item.events
            try:
                item = batches.get_nowait()
            except asyncio.QueueEmpty:
                return events, False
            if isinstance(item, Exception):
                raise item
        return events, True

    async def _batch(self, term: Election, cursor: Cursor, events: Sequence[WatchEvent],
                     written_at: float) -> tuple[Cursor, float]:
        """Account one watch batch: its records in as few transactions as etcd takes (several revisions in
        one). The cursor after it, and when it was last written."""
        start = cursor
        now_unix = clock.wall()
        todo: list[tuple[int, UsageRecord]] = []     # (revision, record), in order
        ends: dict[int, float] = {}
        first_index: dict[int, int] = {}
        last = cursor.revision
        for rev, evs in groupby(events, key=lambda ev: ev.kv.mod_revision):
            if rev <= start.revision:
                continue
            last = rev
            resumed = rev == start.revision + 1 and bool(start.skip or start.part)
            ends[rev] = start.end_unix if resumed else now_unix
            records = self._ended(list(evs), ends[rev])[start.skip if resumed else 0:]
            first_index[rev] = len(todo) - (start.skip if resumed else 0)
            todo += [(rev, r) for r in records]
        records = [r for _, r in todo]
        i, part = 0, start.part if todo and todo[0][0] == start.revision + 1 else 0
        while i < len(records):
            units, i, part = plan_commit(records, i, part, OPS_PER_TXN - 1)
            if i == len(records):
                after = Cursor(last)
            else:
                rev = todo[i][0]
                after = Cursor(rev - 1, i - first_index[rev], part, ends[rev])
            cursor = await self._commit(term, cursor, units, after)
            written_at = clock.monotonic()
        if last > cursor.revision:
            if clock.monotonic() - written_at > IDLE_CURSOR_S:
                cursor = await self._commit(term, cursor, [], Cursor(last))
                written_at = clock.monotonic()
            else:
                cursor = dataclasses.replace(cursor, revision=last, skip=0, part=0)   # in memory: nothing to write
        return cursor, written_at

    async def _now(self) -> int:
        return (await self.ctx.store.get_prefix(self.keys.accounting_cursor(), keys_only=True)).revision

    def _ended(self, events: list[WatchEvent], end_unix: float) -> list[UsageRecord]:
        deleted = [Deleted(ev.kv.key, ev.prev_kv.value, ev.prev_kv.create_revision, ev.kv.mod_revision)
                   for ev in events if ev.prev_kv is not None]
        if not deleted:
            return []
        membership = mirror_membership(self.ctx.mirror)
        team_of = membership.team_of if membership is not None else (lambda _agent: "default")
        return [self._with_idle(r, membership) for r in ended_in(deleted, self.keys, team_of, end_unix)]

    def _with_idle(self, record: UsageRecord, membership: Membership | None) -> UsageRecord:
        """The record with its idle GPU-seconds: each GPU's time within the lease below the idle threshold (its
        team's, else the fleet's), from this replica's sampled utilization (``policy.idle.idle_seconds``), the
        lease's wall times turned into this replica's monotonic clock."""
        c = self.ctx.config
        below = (membership.team(record.team).idle_below_pct if membership is not None else 0.0) or c.idle_below_pct
        shift = clock.monotonic() - clock.wall()
        start, end = record.start_unix + shift, record.start_unix + shift + seconds(record.start_unix, record.end_unix)
        idle = sum(idle_seconds(self.ctx.utilization.points(u), start, end, below) for u in record.gpus)
        return dataclasses.replace(record, idle_gpu_seconds=round(min(idle, record.gpu_seconds), 3)) if idle else record

    async def _load_rollups(self, needed: set[tuple[str, str]]) -> None:
        """Read the rollups of ``needed`` that are not cached yet."""
        missing = sorted(needed - set(self._rollups))
        if missing:
            snap = await self.ctx.store.snapshot([Range(self.keys.usage_rollup(h, t)) for h, t in missing])
            for (h, t), kvs in zip(missing, snap.ranges):
                self._rollups[(h, t)] = json.loads(kvs[0].value) if kvs else empty_rollup()

    async def _commit(self, term: Election, cursor: Cursor, units: list[Unit], after: Cursor) -> Cursor:
        """Write ``units`` (records and their rollups) and the cursor ``after`` in one transaction that compares
        the cursor as read and the fence. Raises NotOwner when the fence fails (the term is over)."""
        # A copy of the rollups this commit charges, not of every cached one: a rollup lists its team's agents, and
        # the cache holds up to 4096 of them.
        needed = {k for u in units for k in rollup_keys(u.record, u.pieces, u.final)}
        await self._load_rollups(needed)
        staged = {k: orjson.loads(orjson.dumps(self._rollups[k])) for k in needed}   # deep copies, 5x json's speed
        touched: set[tuple[str, str]] = set()
        for u in units:
            touched |= charge(staged, u.record, u.pieces, u.final)
        records = [u.record for u in units if u.final]
        ops: list[Op] = [Put(self.keys.usage_record(r.key_name), dumps(r.to_json())) for r in records]
        ops += [Put(self.keys.usage_rollup(h, t), dumps(staged[(h, t)])) for h, t in sorted(touched)]
        cursor_key = self.keys.accounting_cursor()
        ops.append(Put(cursor_key, dumps(after.to_json())))
        res = await self.ctx.store.commit([ModRevisionIs(cursor_key, cursor.mod_revision), *term.fence()], ops)
        if not res.succeeded:
            if not await term.holds():
                raise errors.NotOwner("accountant: this replica is no longer the leader", "leader")
            raise errors.Unavailable("accountant: the cursor moved under it")
        self._rollups.update({k: staged[k] for k in touched})
        if len(self._rollups) > 4096:
            self._rollups.clear()
        for r in records:
            metrics.TEAM_GPU_SECONDS.labels(r.team).inc(r.gpu_seconds)
            metrics.TEAM_VRAM_MIB_SECONDS.labels(r.team).inc(r.vram_mib_seconds)
            if r.reason in EVICTED:
                metrics.TEAM_EVICTIONS_SUFFERED.labels(r.team).inc()
            if r.caused_team:
                metrics.TEAM_EVICTIONS_CAUSED.labels(r.caused_team).inc()
            if r.idle_gpu_seconds:
                metrics.TEAM_IDLE_GPU_SECONDS.labels(r.team).inc(r.idle_gpu_seconds)
            metrics.USAGE_RECORDS.labels(r.reason).inc()
        return dataclasses.replace(after, mod_revision=res.revision)

    # -- retention --------------------------------------------------------------------------------
    async def _sweep_forever(self, term: Election) -> None:
        while True:
            try:
                await self.sweep(term)
            except errors.GpucoordError as e:
                log.warning("accountant: retention sweep failed: %s", e)
            await asyncio.sleep(SWEEP_EVERY_S)

    async def sweep(self, term: Election) -> int:
        """Delete raw records that ended more than ``usage_retention_s`` ago and rollups of hours older than
        ``usage_rollup_days``; how many went."""
        now = clock.wall()
        keep_records = now - self.ctx.config.usage_retention_s
        keep_hours = hour_of(now - self.ctx.config.usage_rollup_days * 86400)
        snap = await self.ctx.store.snapshot([Range(self.keys.usage_records(), prefix=True),
                                              Range(self.keys.usage_rollups(), prefix=True, keys_only=True)])
        old: list[Removal] = []
        for kv in snap.ranges[0]:
            try:
                if float(json.loads(kv.value)["end_unix"]) < keep_records:
                    old.append(Removal(kv.key, kv.mod_revision))
            except (ValueError, KeyError, TypeError):
                continue
        for kv in snap.ranges[1]:
            hour = self.keys.parse(kv.key)[1][1]
            try:
                if hour_start(hour) < hour_start(keep_hours):
                    old.append(Removal(kv.key, kv.mod_revision))
            except ValueError:
                continue
        if not old:
            return 0
        outcomes = await remove_entries(self.ctx.store, old, common=term.fence())
        return sum(1 for o in outcomes if o.removed is not None)
