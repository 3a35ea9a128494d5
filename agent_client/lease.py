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
class LeasePart:
    """One host's part of a multi-host lease: its rank (0 first), the host, and its GPUs there in index order."""
    rank: int
    host: str
    gpus: tuple[LeaseGpu, ...]


@dataclasses.dataclass(frozen=True)
class EvictionNotice:
    """``deadline`` is on this process's ``time.monotonic()`` clock: the time left that the coordinator
    sent, added to ours when the notice came (``deadline_unix`` is the coordinator's wall clock, for
    people: the two machines' clocks need not agree). ``revoke``: an operator's revoke of a lease bound to
    processes, which are to be killed at once. ``reclaim_team``: the team that reclaims this lease, over its
    own team's quota ("" for an eviction by priority or by an operator). ``withdrawn``: the notice was
    withdrawn (its requester no longer needs the lease): the lease is not revoked for it. ``asked_by``: who
    asked for an operator's or the leader's notice (``host b lost`` when a multi-host gang lost host b)."""
    lease_id: str
    gpu_uuid: str
    reason: str
    requested_by: str
    deadline_unix: float
    deadline: float = 0.0
    revoke: bool = False
    reclaim_team: str = ""
    withdrawn: bool = False
    asked_by: str = ""

    def supersedes(self, other: EvictionNotice) -> bool:
        """Whether this notice changes what the holder must do after ``other``: it is a revoke, or it brings
        the deadline forward (an operator's shorter grace)."""
        return (self.revoke and not other.revoke) or self.deadline < other.deadline - 0.05

    @property
    def seconds_left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())


class _LeaseBase:
    """What a granted VRAM lease carries. ``token`` is the fencing token (see docs/agents.md, "Fencing").

    A multi-host lease (``acquire(hosts=N)``): ``hosts`` names its hosts in rank order (() for a lease of one
    host), ``part(rank)`` gives one host's part (``LeasePart``: rank, host, GPUs), ``rank_of(host)`` the rank
    of a host (None when it holds no part). Its single-GPU fields, ``host`` and ``gpus`` name rank 0's part,
    which need not be on this session's host."""

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
        # Every GPU of the lease on its (first) host in index order (a gang's all; the fields above name the
        # first). A multi-host lease's other hosts' GPUs are in its parts.
        self.hosts: tuple[str, ...] = tuple(msg.hosts)
        self._parts: tuple[LeasePart, ...] = _parts(msg)
        self.gpus: tuple[LeaseGpu, ...] = next((p.gpus for p in self._parts if p.host == msg.host and p.gpus),
                                               self._parts[0].gpus)
        self._msg = msg
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

    @property
    def parts(self) -> tuple[LeasePart, ...]:
        """Every host's part in rank order (one, this lease's host's, for a lease of one host)."""
        return self._parts

    def part(self, rank: int) -> LeasePart:
        """The part of rank ``rank`` (0 for a lease of one host); IndexError past the last."""
        if rank < 0:
            raise IndexError(f"rank {rank}: ranks are 0..{len(self._parts) - 1}")
        return self._parts[rank]

    def rank_of(self, host: str) -> int | None:
        """The rank of ``host``'s part, or None when the lease holds nothing there."""
        return next((p.rank for p in self._parts if p.host == host), None)

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


def _parts(msg: pb.Lease) -> tuple[LeasePart, ...]:
    """The lease's parts from its message: its GPUs grouped by host in rank order (a message without
    ``hosts``, of one host or from a release before multi-host gangs: one part, the lease's host's)."""
    def gpu(g: pb.LeaseGpu) -> LeaseGpu:
        return LeaseGpu(g.index, g.uuid, g.token, g.vram_mb)

    if not msg.hosts:
        gpus = tuple(gpu(g) for g in msg.gpus) or (LeaseGpu(msg.gpu_index, msg.gpu_uuid, msg.token, msg.vram_mb),)
        return (LeasePart(0, msg.host, gpus),)
    return tuple(LeasePart(n, host, tuple(gpu(g) for g in sorted(msg.gpus, key=lambda g: g.index)
                                          if (g.host or msg.host) == host))
                 for n, host in enumerate(msg.hosts))


class AsyncLease(_LeaseBase):
    def __init__(self, client: LeaseHolder, msg: pb.Lease) -> None:
        super().__init__(msg)
        self._client = client

    def on_part(self, rank: int) -> AsyncLease:
        """This lease as its part of rank ``rank`` holds it: the same lease (``release`` ends all of it), whose
        ``host``, single-GPU fields and ``gpus`` name that part's (what a command bound to that host's GPUs
        needs); it gets this lease's notices. IndexError for a rank the lease does not have."""
        part = self.part(rank)
        first = part.gpus[0]
        msg = pb.Lease()
        msg.CopyFrom(self._msg)
        msg.host, msg.gpu_index, msg.gpu_uuid, msg.token, msg.vram_mb = (part.host, first.index, first.uuid,
                                                                         first.token, first.vram_mb)
        view = AsyncLease(self._client, msg)
        self.on_evict(view._notify)
        self.on_withdrawn(view._notify)
        return view

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
