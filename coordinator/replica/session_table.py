"""The table of sessions a replica keeps alive in memory, by deadline bucket (``replica/liveness.py`` acts on
it): pure bookkeeping, no I/O."""
from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Callable, Iterable

from coordinator import clock
from coordinator.records import SessionInfo

TICK_S = 0.1


@dataclasses.dataclass
class Tracked:
    info: SessionInfo
    bucket: int            # the tick whose end is its deadline
    refreshed_at: float    # monotonic time of the last refresh of its etcd lease by this replica (0: never)
    etcd_ttl: int          # its etcd lease's TTL as granted (what a refresh restores)
    owned: bool            # its record names this replica (opened or taken over here), not only adopted
    mine_at: int = 0       # the mod_revision of its record last seen naming this replica (parsed once per version)


def adopter(session_id: str, replicas: Iterable[str]) -> str:
    """The live replica that adopts an orphaned session: rendezvous hashing of its id."""
    return max(replicas, key=lambda r: hashlib.sha256(f"session\0{session_id}\0{r}".encode()).digest())


class SessionTable:
    """The sessions this replica keeps alive, by deadline bucket (pure bookkeeping; ``Liveness`` acts)."""

    def __init__(self, now: Callable[[], float] = clock.monotonic) -> None:
        self._now = now
        self._by_id: dict[str, Tracked] = {}
        self._buckets: dict[int, set[str]] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._by_id

    def get(self, session_id: str) -> Tracked | None:
        return self._by_id.get(session_id)

    def touch(self, info: SessionInfo, ttl_s: float, etcd_ttl: int = 0, refreshed: bool = False,
              owned: bool = True) -> Tracked:
        """Its deadline moves to ``ttl_s`` from now (rounded up to a tick). ``owned`` False: adopted only."""
        now = self._now()
        bucket = math.ceil((now + ttl_s) / TICK_S)
        t = self._by_id.get(info.session_id)
        if t is None:
            t = self._by_id[info.session_id] = Tracked(info, bucket, 0.0, etcd_ttl, owned)
        elif t.bucket != bucket:
            self._unbucket(info.session_id, t.bucket)
            t.bucket = bucket
        self._buckets.setdefault(bucket, set()).add(info.session_id)
        if refreshed:
            t.refreshed_at = now
        t.owned = t.owned or owned
        if etcd_ttl:
            t.etcd_ttl = etcd_ttl
        return t

    def _unbucket(self, session_id: str, bucket: int) -> None:
        members = self._buckets.get(bucket)
        if members is not None:
            members.discard(session_id)
            if not members:
                del self._buckets[bucket]

    def drop(self, session_id: str) -> None:
        t = self._by_id.pop(session_id, None)
        if t is not None:
            self._unbucket(session_id, t.bucket)

    def expired(self) -> list[SessionInfo]:
        """The sessions whose deadline has passed (they stay tracked until dropped or touched)."""
        last = math.floor(self._now() / TICK_S)
        out = []
        for bucket in sorted(b for b in self._buckets if b <= last):
            out += [self._by_id[sid].info for sid in self._buckets[bucket]]
        return out

    def remaining(self, session_id: str) -> float | None:
        t = self._by_id.get(session_id)
        return None if t is None else max(0.0, t.bucket * TICK_S - self._now())
