"""When this replica first observed each version of a key, on its own monotonic clock.

Ages that matter across machines (how old a node's usage report is, how long an eviction notice or a
queue entry has stood) are measured from the moment this replica saw the revision, never by comparing the
wall clock written by another machine with ours. A replica that starts late (or a new leader) sees
everything "now": an age is then a lower bound, so a deadline can be late but never early, and stale usage
is noticed at most 3 node intervals after the replica starts.
"""
from __future__ import annotations

from typing import Iterable

from coordinator import clock


class Observed:
    """key -> (identity of the version, monotonic time it was first seen)."""

    def __init__(self) -> None:
        self._seen: dict[bytes, tuple[int, float]] = {}

    def saw(self, key: bytes, ident: int, now: float | None = None) -> float:
        """Record that ``key`` exists at version ``ident`` (a mod_revision or create_revision); returns when
        this version was first seen."""
        held = self._seen.get(key)
        if held is not None and held[0] == ident:
            return held[1]
        if held is not None and held[0] > ident:
            return held[1]   # an older copy (a lagging read) than what the watch showed: keep the newer
        t = clock.monotonic() if now is None else now
        self._seen[key] = (ident, t)
        return t

    def age(self, key: bytes, ident: int, now: float | None = None) -> float:
        """Seconds since this version of ``key`` was first seen (0 the first time)."""
        now = clock.monotonic() if now is None else now
        return max(0.0, now - self.saw(key, ident, now))

    def forget(self, key: bytes) -> None:
        self._seen.pop(key, None)

    def reload(self, versions: Iterable[tuple[bytes, int]], now: float | None = None) -> None:
        """What ``saw`` of each (key, version) would keep, and nothing else: the keys of a state read again. One
        pass, one clock reading (a replica's first read is 110,000 such keys at 100,000 leases)."""
        now = clock.monotonic() if now is None else now
        old, seen = self._seen, {}
        for key, ident in versions:
            held = old.get(key)
            seen[key] = held if held is not None and held[0] >= ident else (ident, now)
        self._seen = seen

    def __len__(self) -> int:
        return len(self._seen)
