"""``gpucoord run --join LEASE_ID --rank R``: a command bound to one host's part of a lease that another session
of the same agent holds (a multi-host gang's launcher, issue 30; docs/agents.md "Joining a multi-host lease").

It acquires nothing. Its own session (same agent, on the host of rank R) reads the lease from the hosts'
status (there is no RPC that returns one lease by id: ``GetStatus`` of this host lists it with its GPUs here,
and ``Lease.hosts`` gives every host in rank order), checks that rank R's host is the session's host, and
runs the command as ``AsyncBoundProcess`` does, with the rank's environment (``agent_client.gang_env``):
its GPUs only, ``GPUCOORD_RANK``/``GPUCOORD_HOSTS`` and torchrun's ``PET_*``. Then, as for any bound command:
``AttachProcesses`` records its process group on the lease before it runs; an eviction notice for the lease
that reaches this session sends SIGTERM, then SIGKILL at the deadline; the lease gone (``AttachProcesses``
answers NOT_FOUND at the check interval) or the session over sends SIGKILL at once. When the command ends
the lease is not released: the gang is its holder's to release.
"""
from __future__ import annotations

from typing import Callable, Mapping, Protocol, Sequence, TypedDict, Unpack

from agent_client import errors
from agent_client.api import coordinator_pb2 as pb
from agent_client.gang_env import GangPart, lease_parts, master_host, rank_env
from agent_client.lease import AsyncLease, EvictionNotice, LeaseHolder
from agent_client.process import child_env
from agent_client.run import AsyncBoundProcess, SessionClient, Stdio


class JoiningClient(SessionClient, Protocol):
    """What a joined command needs of its client (``AsyncClient``): its host, the hosts' status, and the table
    that routes eviction notices to the leases it knows."""

    host: str
    _leases: dict[str, AsyncLease]
    _early_notices: dict[str, EvictionNotice]

    async def status(self, host: str | None = None) -> pb.GetStatusResponse: ...

    async def release(self, lease_id: str) -> bool: ...


class JoinOptions(TypedDict, total=False):
    """The options of a joined command (as ``AsyncBoundProcess``'s that do not acquire)."""

    kill_after: float | None
    cgroup_root: str | None
    env: Mapping[str, str] | None
    cwd: str | None
    stdin: Stdio
    stdout: Stdio
    stderr: Stdio
    check_interval: float | None
    say: Callable[[str], None] | None
    foreground: bool


class JoinedLease(AsyncLease):
    """One host's part of a lease another session holds: its GPUs here; ``release`` leaves the lease alone."""

    def __init__(self, client: LeaseHolder, msg: pb.Lease, rank: int, parts: Sequence[GangPart]) -> None:
        super().__init__(client, msg)
        self.rank = rank
        self.gang_parts = tuple(parts)

    async def release(self) -> bool:
        self.released = True   # the holder releases the whole gang, not a part's command
        return False


def own_part(msg: pb.Lease, host: str) -> pb.Lease:
    """The lease's message narrowed to ``host``'s GPUs (its single-GPU fields naming the first of them)."""
    part = pb.Lease()
    part.CopyFrom(msg)
    mine = [g for g in msg.gpus if (g.host or msg.host) == host]
    del part.gpus[:]
    part.gpus.extend(mine)
    if mine:
        part.host, part.gpu_uuid, part.gpu_index, part.token, part.vram_mb = (
            host, mine[0].uuid, mine[0].index, mine[0].token, mine[0].vram_mb)
    return part


class AsyncJoinedProcess(AsyncBoundProcess):
    """A command bound to rank ``rank``'s part of lease ``lease_id`` (None: the rank of the client's host)."""

    client: JoiningClient

    def __init__(self, client: JoiningClient, cmd: Sequence[str], lease_id: str, rank: int | None = None,
                 **options: Unpack[JoinOptions]) -> None:
        super().__init__(client, cmd, 0, **options)
        self.lease_id, self.rank = lease_id, rank
        self.gang_env: dict[str, str] = {}

    async def _found(self, host: str | None) -> list[tuple[str, pb.Lease]]:
        resp = await self.client.status(host)
        return [(hs.host, x) for hs in resp.hosts for x in hs.leases if x.id == self.lease_id]

    async def _lease(self) -> AsyncLease:
        here = self.client.host
        found = await self._found(here) or await self._found(None)
        if not found:
            raise errors.NotFound(f"lease_id: no live lease {self.lease_id} that agent {self.client.agent} can see",
                                  "", "lease_id")
        parts = lease_parts(found)
        rank = self.rank if self.rank is not None else next((p.rank for p in parts if p.host == here), -1)
        if not 0 <= rank < len(parts):
            which = f"rank {rank} is not one of its ranks (0 to {len(parts) - 1})" if self.rank is not None else (
                f"this session's host {here} holds no part of it (give --rank)")
            raise errors.FailedPrecondition(f"rank: lease {self.lease_id}: {which}", "", "rank")
        if parts[rank].host != here:
            raise errors.FailedPrecondition(
                f"rank: rank {rank} of lease {self.lease_id} is on host {parts[rank].host}, not on this session's "
                f"host {here} (run it there, with --host {parts[rank].host})", "", "rank")
        msg = next((x for h, x in found if h == here), None)
        if msg is None or not parts[rank].uuids:
            raise errors.NotFound(f"lease_id: lease {self.lease_id} lists no GPU on host {here}", "", "lease_id")
        self.gang_env = rank_env(self.lease_id, parts, rank, await self._master_addr(parts[0].host))
        lease = JoinedLease(self.client, own_part(msg, here), rank, parts)
        # Eviction notices of the lease that reach this session go to this part (as to a lease it acquired).
        self.client._leases[lease.id] = lease
        early = self.client._early_notices.pop(lease.id, None)
        if early is not None:
            lease._notify(early)
        return lease

    async def _master_addr(self, host: str) -> str:
        """Rank 0's address: its node daemon's registered address, where this agent may read that host's status
        (with TLS, only a host it has a session on), else its host name."""
        try:
            resp = await self.client.status(host)
        except errors.GpucoordError:
            return host
        return next((master_host(hs.address, host) for hs in resp.hosts if hs.host == host), host)

    def _child_env(self, lease: AsyncLease) -> dict[str, str]:
        return child_env(self._env, lease) | self.gang_env


__all__ = ["AsyncJoinedProcess", "JoinOptions", "JoinedLease", "JoiningClient", "own_part"]
