"""One acquire as the admitter of its host holds it, from its arrival to its answer."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Sequence

from coordinator import errors
from coordinator.etcd.store import Store
from coordinator.records import SessionInfo, VramLease
from coordinator.txn import Delete, ModRevisionIs

log = logging.getLogger(__name__)

# A forwarded call whose caller went away keeps its place this long: its client retries at once.
ORPHAN_GRACE_S = 2.0


async def give_back(store: Store, keys: Sequence[bytes], revision: int, lease_id: str) -> None:
    """Give back a lease granted to a caller that went away (no retry claimed it within ``ORPHAN_GRACE_S``): every
    record of it, each compared on the revision its grant wrote them at (a host's round, or a multi-host gang's)."""
    try:
        await store.commit([ModRevisionIs(k, revision) for k in keys], [Delete(k) for k in keys])
    except errors.GpucoordError as e:
        log.warning("could not give back lease %s of a caller that went away: %s", lease_id, e)


@dataclasses.dataclass(eq=False)
class AcquireCall:
    session: SessionInfo
    vram_mb: int
    gpu_ref: str | None
    priority: int
    preemptible: bool
    request_id: str
    lease_id: str
    wait_s: float
    future: asyncio.Future[VramLease]
    arrival_ns: int = dataclasses.field(default_factory=time.time_ns)
    deadline: float = 0.0         # monotonic
    rank: str | None = None       # set once it is queued in etcd
    entry_revision: int = 0       # its queue entry's mod_revision, as this replica last wrote or read it
    forwarded: bool = False       # sent by another replica on its caller's behalf (host ownership)
    capped: bool = True           # held to its agent's priority cap (an operator's own acquire is not)
    cancelled_at: float | None = None   # monotonic, when its caller went away
    gpu_count: int = 1            # a gang (issue 21): several GPUs, whole ones, a topology, exact GPUs
    exclusive: bool = False
    topology: str = "any"
    gpus: tuple[str, ...] = ()
    min_runtime_s: float = 0.0    # teams: how long its lease runs before another team may reclaim it
    time_limit_s: float = 0.0     # time limits: its lease's limit and warning, resolved (0: no limit)
    time_limit_warning_s: float = 0.0
    parts: tuple[VramLease, ...] = ()   # once granted: each GPU's record (a gang's), set before the future
    # Queued and held back by its team's limit alone as of its last round (G11): why ("team: ..."); "" when it
    # waits for room. Its wait then ends naming ``team``, and a drop of its team's use wakes its host's rounds.
    team_limit: str = ""
    cordoned: str = ""   # queued on a cordoned host as of its last round: why ("host: ..."); its wait ends so

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.wait_s

    @property
    def gone(self) -> bool:
        """Answered already, or its caller went away. A forwarded caller that went away (the replica that
        forwarded it died) is given ``ORPHAN_GRACE_S`` first: the client retries at once through another
        replica with the same request_id, and its queue entry must still be there to keep its place."""
        if not self.future.done():
            return False
        if self.forwarded and self.cancelled_at is not None:
            return time.monotonic() >= self.cancelled_at + ORPHAN_GRACE_S
        return True
