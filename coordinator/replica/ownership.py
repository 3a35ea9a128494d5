"""Host ownership: which replica admits on a host (rendezvous hashing over the replicas registered under
``coordinators/``, as this replica's mirror shows them). Ownership is a performance property only: every
decision is still a compare-and-set (see ``coordinator.rpc.forward``)."""
from __future__ import annotations

import hashlib
from typing import Iterable

from coordinator.replica.mirror import Mirror


class Ownership:
    def __init__(self, mirror: Mirror) -> None:
        self.mirror = mirror
        self._replicas_cache: tuple[int, dict[str, str]] | None = None

    def live_replicas(self) -> dict[str, str]:
        """replica id -> gRPC address, of the replicas registered under ``coordinators/`` (the mirror).
        Asked on every acquire: decoded again only when a registration has changed."""
        generation = self.mirror.generation("coordinators")
        if self._replicas_cache is not None and self._replicas_cache[0] == generation:
            return self._replicas_cache[1]
        out: dict[str, str] = {}
        for kv in self.mirror.items("coordinators"):
            try:
                doc = kv.json()
                out[str(doc["replica"])] = str(doc.get("address", ""))
            except (ValueError, KeyError, TypeError):
                continue
        self._replicas_cache = (generation, out)
        return out

    def owner(self, host: str) -> tuple[str, str] | None:
        """The replica that admits on ``host`` (id, address), by rendezvous hashing over the live replicas;
        None when this replica cannot tell (its mirror is not current, or no replica is registered).
        Ownership is a performance property: every decision is still a compare-and-set, so two replicas
        that disagree for a moment (one joined, one died) stay correct, only slower."""
        if not self.mirror.ready:
            return None
        replicas = self.live_replicas()
        if not replicas:
            return None
        winner = owner_of(host, replicas)
        return winner, replicas[winner]


def owner_of(host: str, replicas: Iterable[str]) -> str:
    """Rendezvous (highest random weight) hashing: the replica whose hash with the host is highest. When a
    replica joins or leaves, only the hosts it wins or held move."""
    return max(replicas, key=lambda r: hashlib.sha256(f"{host}\0{r}".encode()).digest())
