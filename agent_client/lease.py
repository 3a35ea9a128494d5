"""A granted VRAM lease, as the client holds it: its identity and fencing token, and its eviction notice."""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Callable, Protocol, Sequence

from agent_client.api import coordinator_pb2 as pb

log = logging.getLogger(__name__)


class LeaseHolder(Protocol):
    """What a lease asks of the client that holds it (``AsyncClient``)."""

    async def release(self, lease_id: str) -> bool: ...

    async def attach_processes(self, lease_id: str, pids: Sequence[int], pgid: int = 0) -> bool: ...


@dataclasses.dataclass(frozen=True)
class LeaseGpu:
    """One GPU of a lease, with the fencing token its ledger gave the lease there."""
    index: int
    uuid: str
    token: int
    vram_mb: int


@dataclasses.dataclass(frozen=True)
class EvictionNotice:
    """``deadline`` is on this process's ``time.monotonic()`` clock: the time left that the coordinator
    sent, added to ours when the notice came (``deadline_unix`` is the coordinator's wall clock, for
    people: the two machines' clocks need not agree). ``revoke``: an operator's revoke of a lease bound to
    processes, which are to be killed at once. ``reclaim_team``: the team that reclaims this lease, over its
    own team's quota ("" for an eviction by priority or by an operator). ``withdrawn``: the notice was
    withdrawn (its requester no longer needs the lease): the lease is not revoked for it."""
    lease_id: str
    gpu_uuid: str
    reason: str
    requested_by: str
    deadline_unix: float
    deadline: float = 0.0
    revoke: bool = False
    reclaim_team: str = ""
    withdrawn: bool = False

    def supersedes(self, other: EvictionNotice) -> bool:
        """Whether this notice changes what the holder must do after ``other``: it is a revoke, or it brings
        the deadline forward (an operator's shorter grace)."""
        return (self.revoke and not other.revoke) or self.deadline < other.deadline - 0.05

    @property
    def seconds_left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


class _LeaseBase:
    """What a granted VRAM lease carries. ``token`` is the fencing token (see docs/agents.md, "Fencing")."""

    def __init__(self, msg: pb.Lease) -> None:
        self.id: str = msg.id
        self.host: str = msg.host
        self.gpu_uuid: str = msg.gpu_uuid
        self.gpu_index: int = msg.gpu_index
        self.vram_mb: int = msg.vram_mb
        self.priority: int = msg.priority
        self.preemptible: bool = msg.preemptible
        self.token: int = msg.token
        self.request_id: str = msg.request_id
        # Every GPU of the lease in index order (a gang's all; the fields above name the first).
        self.gpus: tuple[LeaseGpu, ...] = tuple(LeaseGpu(g.index, g.uuid, g.token, g.vram_mb) for g in msg.gpus) or (
            LeaseGpu(msg.gpu_index, msg.gpu_uuid, msg.token, msg.vram_mb),)
        self.exclusive: bool = msg.exclusive
        self.topology: str = msg.topology or "any"
        # Teams: over its team's quota when granted (borrowed), and its declared minimum runtime.
        self.over_quota: bool = msg.over_quota
        self.min_runtime: float = msg.min_runtime_seconds
        # Time limits: the limit it was granted with (0: none); it ends time_limit seconds after its grant.
        self.time_limit: float = msg.time_limit_seconds
        self.evicting = threading.Event()
        self.notice: EvictionNotice | None = None
        self.released = False
        self._callbacks: list[Callable[[EvictionNotice], object]] = []
        self._withdrawn_callbacks: list[Callable[[EvictionNotice], object]] = []

    def on_evict(self, callback: Callable[[EvictionNotice], object]) -> None:
        """Call ``callback(notice)`` when the coordinator asks for this lease back (at once if it already has),
        and again if a later notice supersedes it (a revoke, or an earlier deadline)."""
        self._callbacks.append(callback)
        if self.notice is not None:
            callback(self.notice)

    def on_withdrawn(self, callback: Callable[[EvictionNotice], object]) -> None:
        """Call ``callback(notice)`` (``notice.withdrawn`` set) when the coordinator withdraws this lease's
        notice: its requester no longer needs the lease, which is not revoked for it (``evicting`` is cleared)."""
        self._withdrawn_callbacks.append(callback)

    def _notify(self, notice: EvictionNotice) -> None:
        if notice.withdrawn:
            if self.notice is None or self.notice.revoke:
                return
            self.notice = None
            self.evicting.clear()
            log.info("lease %s: notice withdrawn: its requester no longer needs the lease", self.id)
            for cb in list(self._withdrawn_callbacks):
                try:
                    cb(notice)
                except Exception:
                    log.exception("on_withdrawn callback of lease %s failed", self.id)
            return
        if self.notice is not None and not notice.supersedes(self.notice):
            return
        self.notice = notice
        self.evicting.set()
        for cb in list(self._callbacks):
            try:
                cb(notice)
            except Exception:
                log.exception("on_evict callback of lease %s failed", self.id)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(id={self.id!r}, gpu_index={self.gpu_index}, vram_mb={self.vram_mb}, "
                f"token={self.token})")


class AsyncLease(_LeaseBase):
    def __init__(self, client: LeaseHolder, msg: pb.Lease) -> None:
        super().__init__(msg)
        self._client = client

    async def release(self) -> bool:
        if self.released:
            return False
        result = await self._client.release(self.id)   # a failure leaves it releasable again
        self.released = True
        return result

    async def attach(self, pids: Sequence[int] | None = None, pgid: int = 0) -> bool:
        """Record the processes this lease covers (default: this process), so that the node daemon can
        match the GPU's processes to it. Replaces what was recorded before."""
        return await self._client.attach_processes(self.id, [os.getpid()] if pids is None else pids, pgid)

    async def __aenter__(self) -> AsyncLease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()
