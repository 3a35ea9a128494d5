"""The replica's one watch over the whole prefix (``Follower``, a part of ``CoordinatorService``): it keeps
the mirror, notes when each usage report, queue entry, notice and departing record was first seen, wakes
the hosts' admitters, delivers eviction notices to the sessions' streams, and forgets closed sessions.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Iterable, Iterator, Protocol

from coordinator.aio import retry_forever
from coordinator.etcd.store import Store
from coordinator.etcd.types import KV, WatchBatch
from coordinator.heap import collections_paused
from coordinator.keys import Keys
from coordinator.records import EvictionRecord, InvalidRecord, SessionInfo
from coordinator.replica.admitter import HostAdmitter
from coordinator.replica.context import ReplicaContext
from coordinator.replica.ends import LeaseEnds
from coordinator.replica.fleet import FleetAdmitter
from coordinator.replica.leader import Leadership
from coordinator.replica.mirror import Mirror, mirrored_ranges
from coordinator.replica.observed import Observed
from coordinator.replica.reach import EtcdReach

log = logging.getLogger(__name__)


class Outbox(Protocol):
    """Where a session's stream takes what the service pushes to it (eviction notices, a last error)."""

    def put_nowait(self, item: Any) -> None: ...


class Follower:
    """The watch side of ``CoordinatorService``: what it reads and changes of the service is declared here."""

    ctx: ReplicaContext
    store: Store
    keys: Keys
    mirror: Mirror
    observed: Observed
    reach: EtcdReach
    evictions: dict[str, EvictionRecord]
    leadership: Leadership | None
    watch_ready: asyncio.Event
    _closed: bool
    _admitters: dict[str, HostAdmitter]
    _fleet: FleetAdmitter | None
    _streams: dict[str, set[Outbox]]
    _sessions: dict[tuple[str, str], SessionInfo]
    ends: LeaseEnds

    def _deliver(self, record: EvictionRecord, only: Outbox | None = None) -> None:
        raise NotImplementedError

    def _push_pending(self, session_id: str, only: Outbox | None = None) -> None:
        raise NotImplementedError

    # -- the replica's watch ---------------------------------------------------------------------
    async def _watch(self) -> None:
        """One watch over the whole prefix: keeps the mirror, wakes the hosts' admitters and delivers
        eviction notices. It never gives up: an error starts it over from a fresh read."""
        def not_ready() -> None:
            self.mirror.ready = False
        await retry_forever("the replica's watch", self._watch_once, on_error=not_ready,
                            stop=lambda: self._closed)

    async def _watch_once(self) -> None:
        # Every key under the prefix but the kinds the mirror does not keep (the usage records and rollups:
        # a week of records in a busy fleet is hundreds of thousands of keys, read at each start and watch reset
        # only to be dropped); the watch still starts from this read's revision.
        snap = await self.store.snapshot(mirrored_ranges(self.keys))
        with collections_paused():    # 200,000 keys at 100,000 leases: no cycles among them to look for
            self.mirror.reset((kv for kvs in snap.ranges for kv in kvs), snap.revision)
            self._observe_all()
        self.evictions.clear()
        for kv in self.mirror.items("evictions"):
            try:
                record = EvictionRecord.from_kv(kv)
            except InvalidRecord as e:
                log.warning("ignoring a malformed eviction notice %r: %s", kv.key[:200], e)
                continue
            self.evictions[record.lease_id] = record
        self.watch_ready.set()
        for a in self._admitters.values():
            a.notify()
        for session_id in list(self._streams):
            self._push_pending(session_id)
        async for batch in self.store.watch(self.keys.root(), start_revision=snap.revision + 1):
            if batch.resync:
                self.mirror.ready = False
                return
            self.ends.before(batch)   # expired sessions' leases, counted while the mirror still has them
            self.mirror.apply(batch)
            self._observe([ev.kv for ev in batch.events if ev.kind == "PUT"])
            for ev in batch.events:
                if ev.kind != "PUT":
                    self.observed.forget(ev.kv.key)
            self._on_events(batch)

    _OBSERVED_KINDS = ("usage", "evictions", "queue", "gangqueue", "departing", "leases")
    _BY_CREATION = ("evictions", "departing", "leases")   # a lease's time limit runs from its creation

    def _observe(self, kvs: Iterable[KV]) -> None:
        """Note when we first saw each usage report and queue entry (by mod_revision), and each eviction
        notice and departing record (by create_revision: a rewrite keeps its grace, or its bound, running)."""
        for kv in kvs:
            try:
                kind, _ = self.keys.parse(kv.key)
            except ValueError:
                continue
            if kind in self._OBSERVED_KINDS:
                self.observed.saw(kv.key, kv.create_revision if kind in self._BY_CREATION else kv.mod_revision)

    def _observe_all(self) -> None:
        """``_observe`` of every key of the mirror just loaded, found by its kind indexes (the load parsed each key
        already), and nothing else remembered."""
        def versions() -> Iterator[tuple[bytes, int]]:
            for kind in self._OBSERVED_KINDS:
                by_creation = kind in self._BY_CREATION
                for kvs in (self.mirror.all_host_items(kind), self.mirror.items(kind)):
                    if by_creation:
                        yield from ((kv.key, kv.create_revision) for kv in kvs)
                    else:
                        yield from ((kv.key, kv.mod_revision) for kv in kvs)
        self.observed.reload(versions())

    def _on_events(self, batch: WatchBatch) -> None:
        woken: set[str] = set()
        reshaped: set[str] = set()   # hosts whose registration, partition or cordon changed
        team_room = False    # a team's use over the fleet may have dropped, or a team changed (G11)
        fleet_moved = False  # a team's lease was granted on some host (its ledger moved)
        for ev in batch.events:
            try:
                kind, parts = self.keys.parse(ev.kv.key)
            except ValueError:
                continue
            if self.mirror.eases_teams(ev.kv.key, ev.kind):
                team_room = True
            elif kind == "teamledgers":
                fleet_moved = True
            if kind == "evictions" and parts:
                if ev.kind == "PUT":
                    try:
                        record = EvictionRecord.from_kv(ev.kv)
                    except (ValueError, TypeError, KeyError) as e:
                        log.warning("ignoring a malformed eviction notice %r: %r", ev.kv.key, e)
                        continue
                    self.evictions[record.lease_id] = record
                    self._deliver(record)
                    if self.leadership is not None:
                        self.leadership.deadline_wake.set()
                    woken.add(record.host)
                else:
                    gone = self.evictions.pop(parts[0], None)
                    if gone is not None:
                        woken.add(gone.host)
                        if self.mirror.lease(gone.lease_id) is not None:   # withdrawn: its holder hears it
                            self._deliver(dataclasses.replace(gone, withdrawn=True))
            elif kind in ("leases", "queue", "partitions", "hosts", "usage", "gpus", "departing", "cordons") and parts:
                woken.add(parts[0])
                if kind in ("hosts", "partitions", "cordons"):
                    reshaped.add(parts[0])
                if kind in ("usage", "departing") and self.leadership is not None:
                    # A report without an evicted lease's processes, or a departing record: the leader's
                    # deadline duty may act now (G3).
                    self.leadership.deadline_wake.set()
            elif kind == "sessions" and ev.kind == "DELETE" and len(parts) == 2:
                # Closed or expired (its holder died): its cached identity goes with it.
                self._sessions.pop((parts[0], parts[1]), None)
        if (woken or team_room) and self._fleet is not None and self._fleet.has_calls:
            # A multi-host gang may fit now, or must move; a lease's end gives room only to a team, if any is stored.
            self._fleet.notify(woken, reshaped, team_room and bool(self.mirror.items("teams")))
        for host in woken:
            admitter = self._admitters.get(host)
            if admitter is not None and admitter.has_waiters:
                admitter.notify()
        if team_room or fleet_moved:
            # A lease ended on any host (maybe granted and released through another replica), or a team
            # changed (a raised limit, new members): the hosts whose waiters wait for their team decide again,
            # and so do those with leases under a request's notice (does the requester still need them?).
            # Those hosts only: a fleet's replica has an admitter on each of thousands of hosts.
            hosts = {r.host for r in self.evictions.values() if r.requester_priority is not None}
            if team_room:
                hosts |= self.ctx.team_waiting
            for host in hosts:
                admitter = self._admitters.get(host)
                if admitter is not None:
                    admitter.notify()

    def _on_reach(self, ok: bool) -> None:
        """etcd went out of reach: hand every caller to another replica (see replica/reach.py). The waiters'
        queue entries stay ours to remove if no other replica takes them over."""
        if ok:
            for a in self._admitters.values():
                a.notify()
            return
        err = self.reach.error()
        for a in self._admitters.values():
            a.hand_off(err)
        for q in [q for qs in self._streams.values() for q in qs]:
            q.put_nowait(err)
