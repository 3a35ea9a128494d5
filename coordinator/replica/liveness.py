"""Sessions kept alive in the replica's memory (issue 32): an agent's keepalive touches an entry here, not etcd.

Each session still has an etcd lease of its own, which carries its keys (its record, leases, queue entries and
notices), so that a session ends in one revision whichever way it ends. But that etcd lease has a long TTL
(``session_etcd_ttl_s``, refreshed once a third of it has passed), and the session's own TTL is kept here:

* **Tracking.** The replica that opened a session, or that last took it over, tracks it (its record's
  ``coordinator``). A keepalive to another replica takes it over first: one compare-and-put of the record.
* **Expiry.** Deadlines sit in buckets of ``TICK_S`` (``replica/session_table.py``, as ZooKeeper's session
  tracker keeps them). Each tick the replica takes the sessions past their deadline, reads the registrations
  linearizably, waits for its mirror to reach that revision (or reads those sessions' records from etcd once the
  mirror stands still short of it: a write outside the prefix moves etcd's revision where no event of the
  prefix may carry the mirror), and revokes the etcd lease of each session whose record still names this
  replica (or a replica no longer registered): etcd deletes the session's keys in one revision, as when the
  etcd lease expired by itself. One that another replica took over meanwhile is left to it. When many are due
  at once, their keys go in shared transactions first (``replica/ended_together.py``).
* **Adoption.** The sessions of a replica that is no longer registered (killed, or cut from etcd past its
  election TTL) are adopted, each by the live replica that rendezvous hashing of its id picks, with a deadline
  of one TTL from then. A live agent moves to another replica and keeps its session; a dead one's session is
  revoked then.
* **Upgrades.** A replica of the previous release (its registration lacks ``"sessions": "memory"``) keeps
  sessions alive by refreshing their etcd leases, and never takes one over. While one is registered, a session
  past its deadline is revoked only if its etcd lease has no more TTL left than this replica's own last refresh
  (or, for an adopted one, than when it was first found past its deadline) leaves it: more means another
  replica refreshed it, and the deadline moves on by a TTL.

What etcd promises is then only the long TTL: with no replica running at all, a dead agent's keys go when it
passes. What gpucoord promises is docs/guarantees.md's G4 and G7.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable, Iterable

from coordinator import clock, errors
from coordinator.aio import cancel_and_wait, spawn
from coordinator.etcd.types import KV
from coordinator.record_fields import load_record
from coordinator.records import InvalidRecord, SessionInfo, dumps
from coordinator.replica.context import ReplicaContext
from coordinator.replica.ended_together import (
    TOGETHER_AT_LEAST,
    delete_together,
    revoke_all,
)
from coordinator.replica.session_table import TICK_S, SessionTable, Tracked, adopter
from coordinator.txn import ModRevisionIs, Put

log = logging.getLogger(__name__)

ADOPT_SCAN_S = 30.0
# A refresh of a session's etcd lease that this replica did not make shows as more TTL left than its own last
# refresh leaves: by more than this (etcd counts whole seconds, and the refresh took a while).
REFRESH_SLACK_S = 2.0
REVOKES_AT_ONCE = 256     # etcd revokes in flight together when many sessions end in one tick (64 took 5 s more
#                           for 1,000 at once; one client revokes about 4,000 a second whatever the number)
MIRROR_WAIT_S = 1.0       # how long expiry waits for a mirror short of etcd's revision to move, before reading etcd
LOGGED_PER_ROUND = 20     # expired sessions named in the log per expiry round (the rest are counted)


class Liveness:
    """The keepalive, expiry and adoption of the sessions this replica tracks (module doc)."""

    def __init__(self, ctx: ReplicaContext, on_gone: Callable[[SessionInfo], object]) -> None:
        self.ctx = ctx
        self.table = SessionTable()
        self.on_gone = on_gone         # the service forgets its cached identity
        self._adopted_at = -1          # the generation of coordinators/ (the mirror's) last adopted at
        self._scanned = 0.0            # when every session was last looked at for adoption
        self._trackers: dict[bytes, tuple[int, str]] = {}   # session key -> (mod_revision, tracker) at the last scan
        self._revoking: set[asyncio.Task[None]] = set()      # revokes after sessions ended together (ended_together)

    def etcd_ttl(self, ttl_s: int) -> int:
        """The TTL of a new session's etcd lease: the configured long one, at least three session TTLs."""
        return max(self.ctx.config.session_etcd_ttl_s, 3 * ttl_s)

    def opened(self, info: SessionInfo, etcd_ttl: int) -> None:
        self.table.touch(info, info.ttl_s, etcd_ttl, refreshed=True)

    def forget(self, session_id: str) -> None:
        self.table.drop(session_id)

    async def keepalive(self, info: SessionInfo, timeout: float | None) -> int:
        """Keep ``info`` alive here: the session's TTL (taken over first if another replica tracks it). Its etcd
        lease is refreshed once a third of its TTL has passed since the last refresh here."""
        ttl = info.ttl_s or self.ctx.config.session_ttl_s
        t = self.table.get(info.session_id)
        if t is None or not t.owned or not self._mine_in_mirror(info, t):
            # Not tracked here, or the mirror shows it gone or kept by another replica (or has not seen it
            # yet): etcd says, and this replica takes it over.
            etcd_ttl = await self._take_over(info, timeout)
            self.table.touch(info, ttl, etcd_ttl, refreshed=True)
        elif clock.monotonic() - t.refreshed_at > t.etcd_ttl / 3:
            self.table.touch(info, ttl, await self._refresh(info, timeout), refreshed=True)
        else:
            self.table.touch(info, ttl)
        return ttl

    def kept_in_memory(self, info: SessionInfo) -> bool:
        """``keepalive`` for a session it would keep without etcd (tracked here, the mirror showing it so, its
        etcd lease not due for a refresh): touched, True. False, untouched: it needs ``keepalive``."""
        t = self.table.get(info.session_id)
        if t is None or not t.owned or clock.monotonic() - t.refreshed_at > t.etcd_ttl / 3 \
                or not self._mine_in_mirror(info, t):
            return False
        self.table.touch(info, info.ttl_s or self.ctx.config.session_ttl_s)
        return True

    def _mine_in_mirror(self, info: SessionInfo, t: Tracked) -> bool:
        # A session record is a flat key: read without parsing the key for its bucket (every keepalive comes here).
        kv = self.ctx.mirror.flat(self.ctx.keys.session(info.agent, info.session_id))
        if kv is None:
            return False
        if kv.mod_revision == t.mine_at:
            return True
        mine = _tracker(kv.value) == self.ctx.replica_id
        if mine:
            t.mine_at = kv.mod_revision
        return mine

    async def _take_over(self, info: SessionInfo, timeout: float | None) -> int:
        """Make this replica the session's tracker (its record's ``coordinator``); its etcd lease's TTL."""
        key = self.ctx.keys.session(info.agent, info.session_id)
        # The mirror's record first (a replica taking over a failed one's thousands of sessions reads none of them
        # from etcd): the compare-and-put fails on a stale one, and etcd is read then.
        kv = self.ctx.mirror.flat(key)
        for _ in range(self.ctx.config.commit_attempts):
            if kv is None:
                kv = await self.ctx.store.get(key)
            if kv is None:
                self._gone(info)
                raise _expired(info)
            doc = load_record(kv.value)
            if doc.get("coordinator") != self.ctx.replica_id:
                doc["coordinator"] = self.ctx.replica_id
                res = await self.ctx.store.commit([ModRevisionIs(key, kv.mod_revision)],
                                                  [Put(key, dumps(doc), kv.etcd_lease)])
                if not res.succeeded:
                    kv = None
                    continue
            return await self._refresh(info, timeout)
        raise errors.Unavailable("keepalive: the session's record keeps changing; retry")

    async def _refresh(self, info: SessionInfo, timeout: float | None) -> int:
        """Refresh the session's etcd lease: its TTL as restored; SessionGone (forgotten here) if it is gone."""
        left = await self.ctx.store.keepalive(info.etcd_lease, timeout=timeout)
        if left <= 0:
            self._gone(info)
            raise _expired(info)
        return left

    def _gone(self, info: SessionInfo) -> None:
        self.table.drop(info.session_id)
        self.on_gone(info)

    # -- expiry and adoption ------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            while True:
                await asyncio.sleep(TICK_S)
                try:
                    self.adopt()
                    if self.table.expired():
                        await self.expire()
                except errors.GpucoordError as e:
                    log.warning("session expiry: %s; trying again", e)
                    await asyncio.sleep(0.5)
                except Exception:   # the expiry of every session here must go on (logged with its stack)
                    log.exception("session expiry: an unexpected error; trying again")
                    await asyncio.sleep(0.5)
        finally:
            await cancel_and_wait(self._revoking)   # the replica stops: the long TTL ends what is left

    def _live(self, registrations: Iterable[KV] | None = None) -> dict[str, str] | None:
        """The registered replicas (id -> how they keep sessions: "memory", or "" for the previous release's
        etcd refreshes), from ``registrations`` (default: the mirror's); None while this one is not registered
        (not yet, or not now): it adopts nothing."""
        if registrations is None:
            if not self.ctx.mirror.ready:
                return None
            registrations = self.ctx.mirror.items("coordinators")
        live: dict[str, str] = {}
        for kv in registrations:
            try:
                doc = kv.json()
                live[str(doc["replica"])] = str(doc.get("sessions", ""))
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
        return live if self.ctx.replica_id in live else None

    def _info(self, kv: KV) -> SessionInfo | None:
        """The session a mirror's record is (None for a malformed one)."""
        try:
            _, parts = self.ctx.keys.parse(kv.key)
            doc = load_record(kv.value)
            ttl = doc.get("ttl")
            return SessionInfo(parts[0], parts[1], str(doc.get("host", "")), kv.etcd_lease,
                               ttl if isinstance(ttl, int) else 0)
        except (ValueError, IndexError, InvalidRecord):
            return None

    def adopt(self) -> None:
        """Track the sessions of replicas no longer registered that rendezvous hashing gives this one: a
        deadline of one TTL from now (a live agent keeps it alive here or elsewhere by then)."""
        # Looked at when a replica joins or leaves (or this one registers), and every ADOPT_SCAN_S besides (a
        # session written by a replica that died at once): not at each open, which would scan every session.
        generation = self.ctx.mirror.generation("coordinators")
        if generation == self._adopted_at and clock.monotonic() - self._scanned < ADOPT_SCAN_S:
            return
        live = self._live()
        if live is None:
            return
        self._adopted_at, self._scanned = generation, clock.monotonic()
        me = self.ctx.replica_id
        # Each record's tracker is parsed once per version (10,000 sessions every ADOPT_SCAN_S otherwise cost a
        # JSON parse each): the map is built anew at each scan, so it holds only the sessions of the last one.
        before, trackers = self._trackers, {}
        for kv in self.ctx.mirror.items("sessions"):
            known = before.get(kv.key)
            tracker = known[1] if known is not None and known[0] == kv.mod_revision else _tracker(kv.value)
            trackers[kv.key] = (kv.mod_revision, tracker)
            if tracker in live:
                continue
            info = self._info(kv)
            if info is not None and info.session_id not in self.table and adopter(info.session_id, live) == me:
                self.table.touch(info, info.ttl_s or self.ctx.config.session_ttl_s, owned=False)
        self._trackers = trackers

    async def expire(self) -> None:
        """Revoke the sessions past their deadline that no live replica took over meanwhile."""
        store, keys = self.ctx.store, self.ctx.keys
        registrations = await store.get_prefix(keys.coordinators())
        # Decided from what etcd held at this read or later: a takeover by another replica until now is seen.
        records: Callable[[bytes], KV | None]
        from_mirror = await self._mirror_reaches(registrations.revision)
        if from_mirror:
            expired = self.table.expired()
            live, records = self._live(), self.ctx.mirror.get
        else:
            # The mirror has not reached etcd's revision: it lags, or the last writes were outside the prefix
            # (another application sharing etcd, an etcd lease of another prefix expiring) and no event of the
            # prefix comes to carry it there while the fleet is quiet (etcd's progress notifications are not
            # trusted before 3.5.8: coordinator.etcd.watch). The records are read from etcd instead.
            read = await self._read(self.table.expired())
            # Those still past their deadline after the read (a keepalive meanwhile moved it on), read by it.
            expired = [i for i in self.table.expired() if keys.session(i.agent, i.session_id) in read]
            live, records = self._live(registrations.kvs), read.get
        if live is None:
            return   # not registered (not yet, or not now): another replica adopts what must go
        due = []
        for info in expired:
            kv = records(keys.session(info.agent, info.session_id))
            if kv is None:
                self._gone(info)
                continue
            tracker = _tracker(kv.value)
            if tracker != self.ctx.replica_id and tracker in live:
                self.table.drop(info.session_id)     # another replica keeps it alive
                continue
            due.append(info)
        if any(how != "memory" for how in live.values()):
            due = [info for info in await asyncio.gather(*(self._unrefreshed(i) for i in due)) if info is not None]
        together: list[SessionInfo] = []
        if from_mirror and len(due) >= TOGETHER_AT_LEAST:
            # Many at once: their keys go in shared transactions (replica/ended_together.py), their etcd leases
            # are revoked after, in the background.
            together, due = await delete_together(self.ctx, due)
            for info in together:
                self._gone(info)
            if together:
                task = spawn(revoke_all(self.ctx, together, REVOKES_AT_ONCE), "revoking ended sessions' etcd leases")
                self._revoking.add(task)
                task.add_done_callback(self._revoking.discard)
        gate = asyncio.Semaphore(REVOKES_AT_ONCE)

        async def revoke(info: SessionInfo) -> None:
            async with gate:
                await store.revoke(info.etcd_lease)
            self._gone(info)
        results = await asyncio.gather(*(revoke(i) for i in due), return_exceptions=True)
        # One line per round, not per session: 10,000 agents dying together write 10,000 lines otherwise.
        done = together + [i for i, r in zip(due, results) if not isinstance(r, BaseException)]
        for info in done[:LOGGED_PER_ROUND]:
            log.info("session %s of agent %r expired (no keepalive for %d s)", info.session_id, info.agent,
                     info.ttl_s or self.ctx.config.session_ttl_s)
        if len(done) > LOGGED_PER_ROUND:
            log.info("%d more sessions expired in the same round", len(done) - LOGGED_PER_ROUND)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise failed[0] if isinstance(failed[0], errors.GpucoordError) else errors.Unavailable(str(failed[0]))

    async def _mirror_reaches(self, revision: int) -> bool:
        """Whether the mirror reaches ``revision``: waited for while it moves (the etcd timeout at most), given
        up once it stands still for ``MIRROR_WAIT_S`` short of it."""
        mirror, loop = self.ctx.mirror, asyncio.get_running_loop()
        until = loop.time() + self.ctx.config.etcd_timeout_s
        while True:
            seen = mirror.revision
            if await mirror.caught_up(revision, max(0.0, min(MIRROR_WAIT_S, until - loop.time()))):
                return True
            if mirror.revision == seen or loop.time() >= until:
                return False

    async def _read(self, sessions: list[SessionInfo]) -> dict[bytes, KV | None]:
        """The records of ``sessions`` in etcd now (linearizable), by key: None for one read and not found."""
        return await self.ctx.store.get_many([self.ctx.keys.session(i.agent, i.session_id) for i in sessions])

    async def _unrefreshed(self, info: SessionInfo) -> SessionInfo | None:
        """``info`` if no other replica has refreshed its etcd lease since this one last did (see the module doc);
        else None, its deadline moved on by a TTL."""
        t = self.table.get(info.session_id)
        left = await self.ctx.store.time_to_live(info.etcd_lease)
        if t is None or left < 0:
            return info    # gone already: the revoke is a no-op
        now = clock.monotonic()
        expected = t.etcd_ttl - (now - t.refreshed_at) if t.refreshed_at else None
        if expected is not None and left <= expected + REFRESH_SLACK_S:
            return info
        # Refreshed elsewhere (or first seen so): its last refresh was about (etcd TTL - left) ago.
        t.etcd_ttl = max(t.etcd_ttl, left)
        t.refreshed_at = now - (t.etcd_ttl - left)
        self.table.touch(info, info.ttl_s or self.ctx.config.session_ttl_s, owned=t.owned)
        return None


def _tracker(value: bytes) -> str:
    """The replica a session record names as keeping it alive ("" for none, or a malformed record)."""
    try:
        return str(load_record(value).get("coordinator", ""))
    except InvalidRecord:
        return ""


def _expired(info: SessionInfo) -> errors.SessionGone:
    return errors.SessionGone(f"session: session {info.session_id} of agent {info.agent!r} has expired", "session")
