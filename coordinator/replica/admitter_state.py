"""What the parts of a ``HostAdmitter`` (its rounds, ``AdmissionRound``; its expiry, ``QueueExpiry``) use of it,
declared once: the admitter's state and the two methods each part calls."""
from __future__ import annotations

import asyncio

from coordinator import errors
from coordinator.keys import Keys
from coordinator.replica.call import AcquireCall
from coordinator.replica.context import ReplicaContext
from coordinator.replica.leases import Leases


class AdmitterState:
    """The state of one host's ``HostAdmitter`` (set by its ``__init__``), as its parts see it."""

    ctx: ReplicaContext
    leases: Leases
    host: str
    keys: Keys
    _pending: list[AcquireCall]
    _waiting: dict[str, AcquireCall]
    _expire_wake: asyncio.Event
    _last_commit: int
    _orphans: dict[str, int]
    _held_since: dict[str, float]
    _teams_revision: int    # the revision of the teams' copy the last round decided on (0: no team)

    def _fail(self, c: AcquireCall, err: errors.GpucoordError) -> None:
        raise NotImplementedError

    def notify(self) -> None:
        raise NotImplementedError
