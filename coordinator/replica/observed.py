"""When this replica first observed each version of a key, on its own monotonic clock.

Ages that matter across machines (how old a node's usage report is, how long an eviction notice or a
queue entry has stood) are measured from the moment this replica saw the revision, never by comparing the
wall clock written by another machine with ours. A replica that starts late (or a new leader) sees
everything "now": an age is then a lower bound, so a deadline can be late but never early, and stale usage
is noticed at most 3 node intervals after the replica starts.
"""
from __future__ import annotations

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

    def keep_only(self, keys: set[bytes]) -> None:
        for key in [k for k in self._seen if k not in keys]:
            del self._seen[key]

    def __len__(self) -> int:
        return len(self._seen)
