"""``Observed`` for the pure tests of the idle judgments: the moment a key version is first seen is the test's own
clock (``now``, which the test moves), kept from then on as the replica's is."""
from __future__ import annotations


class FakeObserved:
    def __init__(self) -> None:
        self.now = 100.0
        self.seen: dict[tuple[bytes, int], float] = {}

    def saw(self, key: bytes, ident: int) -> float:
        return self.seen.setdefault((key, ident), self.now)
