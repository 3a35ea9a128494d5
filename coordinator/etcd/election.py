"""Leader election on etcd, etcd's own recipe: every candidate puts a key under its session's etcd_lease, and
the candidate whose key has the lowest create_revision leads. When the leader's session ends, its key goes
and the next candidate leads.

``fence()`` is what makes a leader's writes safe after a pause (SIGSTOP, a long GC, a VM stall): a compare,
to put in the same transaction as the write, that holds only while this very candidacy still exists. A
deposed leader that wakes up and writes fails the compare instead of acting beside its successor.
"""
from __future__ import annotations

import logging
from typing import Callable, Iterable, Sequence

from coordinator import errors
from coordinator.etcd.session import EtcdSession
from coordinator.etcd.types import KV, GetResult
from coordinator.keys import Keys, last_segment
from coordinator.txn import Absent, Compare, CreateRevisionIs, Get, Op, Put

log = logging.getLogger(__name__)


class Election:
    def __init__(self, session: EtcdSession, keys: Keys, candidate_id: str) -> None:
        self.session = session
        self.store = session.store
        self.keys = keys
        self.candidate_id = candidate_id
        self.key = keys.candidate(candidate_id)
        self.create_revision = 0     # of our candidacy, once campaigned
        self.leader_id = ""

    @property
    def is_leader(self) -> bool:
        return bool(self.leader_id) and self.leader_id == self.candidate_id

    async def campaign(self, value: bytes, extra_puts: Sequence[tuple[bytes, bytes]] = ()) -> None:
        """Stand: put the candidacy (and ``extra_puts``, e.g. the replica's registration) under the session.

        A candidacy of ours from an earlier term may still stand, on that term's etcd_lease: the holder gave
        its session up for lost (no keepalive got through for a TTL) while etcd still held it (a keepalive held
        up by a partition arrived late, or etcd expired it a moment later than the holder counted). That
        etcd_lease is ours and dead to us: it is revoked (its keys go with it) and we stand again."""
        ops: list[Op] = [Put(self.key, value, self.session.etcd_lease)]
        ops += [Put(k, v, self.session.etcd_lease) for k, v in extra_puts]
        for _ in range(3):
            res = await self.store.commit([Absent(self.key)], ops, [Get(self.key)])
            if res.succeeded:
                self.create_revision = res.revision
                return
            got = res.responses[0]
            assert isinstance(got, GetResult)
            stale = got.kvs[0].etcd_lease if got.kvs else 0
            if stale == self.session.etcd_lease:
                break
            if stale:
                log.warning("candidate %s: our candidacy of an earlier term still stands on etcd_lease %x; "
                            "revoking it to stand again", self.candidate_id, stale)
                await self.store.revoke(stale)
        raise errors.Unavailable(f"candidate {self.candidate_id} already stands")

    def fence(self) -> list[Compare]:
        """The compare that keeps a leader's write from landing once this candidacy is gone."""
        return [CreateRevisionIs(self.key, self.create_revision)]

    async def observe(self, on_change: Callable[[str], None]) -> None:
        """Follow the election; ``on_change(leader_id)`` on every change of leader. Returns when our own
        candidacy is gone (the session ended) or the watch lost history (stand again to be sure)."""
        prefix = self.keys.election()
        snap = await self.store.get_prefix(prefix)
        candidates = {kv.key: kv for kv in snap.kvs}
        self._elect(candidates.values(), on_change)
        async for batch in self.store.watch(prefix, start_revision=snap.revision + 1):
            if batch.resync:
                return
            for ev in batch.events:
                if ev.kind == "PUT":
                    candidates[ev.kv.key] = ev.kv
                else:
                    candidates.pop(ev.kv.key, None)
            if self.key not in candidates:
                self.leader_id = ""
                on_change("")
                return
            self._elect(candidates.values(), on_change)

    def _elect(self, kvs: Iterable[KV], on_change: Callable[[str], None]) -> None:
        kv_list: list[KV] = list(kvs)
        leader = last_segment(min(kv_list, key=lambda kv: kv.create_revision).key) if kv_list else ""
        if leader != self.leader_id:
            self.leader_id = leader
            on_change(leader)

    async def holds(self) -> bool:
        """Whether our candidacy still stands (read from etcd, linearizable)."""
        kv = await self.store.get(self.key)
        return kv is not None and kv.create_revision == self.create_revision
