"""A multi-host gang's parts as a launcher needs them (issue 30, docs/agents.md "Joining a multi-host lease"):
the hostfile, and the environment of each rank's command, with torchrun's ``PET_*`` variables so that
``torchrun train.py`` needs no flags. Pure: ``gpucoord run --join`` and ``gpucoord lease show`` build both
from what they read.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Iterable, Sequence

from agent_client.api import coordinator_pb2 as pb

MASTER_PORT_BASE = 29500
"""torchrun's default master port; a lease's own port is this plus a number in [0, 1000) from its id."""


@dataclasses.dataclass(frozen=True)
class GangPart:
    """One host's part of a lease: its rank, host, and GPU uuids in index order."""
    rank: int
    host: str
    uuids: tuple[str, ...]


def master_port(lease_id: str) -> int:
    """The rendezvous port of a lease's ranks: ``29500 + int(sha256(lease_id)) % 1000``, the same on every host
    without anyone choosing it (two gangs on one master host collide with probability 1/1000)."""
    return MASTER_PORT_BASE + int(hashlib.sha256(lease_id.encode()).hexdigest(), 16) % 1000


def master_host(address: str, fallback: str) -> str:
    """The host part of a node daemon's registered address (``10.0.0.5:7001``, ``[fd00::1]:7001``, ``n1``),
    else ``fallback`` (rank 0's host name) when it has none."""
    host = address.strip()
    if host.startswith("["):
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host or fallback


def hostfile(parts: Sequence[GangPart]) -> str:
    """One line per rank, in rank order: ``host slots=N`` (N: the GPUs of that host's part), as MPI,
    DeepSpeed and pdsh launchers read it."""
    return "".join(f"{p.host} slots={len(p.uuids)}\n" for p in sorted(parts, key=lambda p: p.rank))


def rank_env(lease_id: str, parts: Sequence[GangPart], rank: int, master_addr: str) -> dict[str, str]:
    """The variables of rank ``rank``'s command: its GPUs (``CUDA_VISIBLE_DEVICES``, uuids in index order), the
    lease (``GPUCOORD_LEASE_ID``, ``GPUCOORD_GPU_UUIDS``, ``GPUCOORD_RANK``, ``GPUCOORD_HOSTS``: every host in
    rank order, comma-separated) and torchrun's (``PET_NNODES``, ``PET_NODE_RANK``, ``PET_NPROC_PER_NODE``,
    ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``). ValueError for a rank the parts do not have."""
    ordered = sorted(parts, key=lambda p: p.rank)
    own = next((p for p in ordered if p.rank == rank), None)
    if own is None:
        raise ValueError(f"rank: {rank} is not a rank of lease {lease_id} (ranks 0 to {len(ordered) - 1})")
    uuids = ",".join(own.uuids)
    return {
        "CUDA_VISIBLE_DEVICES": uuids,
        "GPUCOORD_LEASE_ID": lease_id,
        "GPUCOORD_GPU_UUIDS": uuids,
        "GPUCOORD_RANK": str(rank),
        "GPUCOORD_HOSTS": ",".join(p.host for p in ordered),
        "PET_NNODES": str(len(ordered)),
        "PET_NODE_RANK": str(rank),
        "PET_NPROC_PER_NODE": str(len(own.uuids)),
        "PET_MASTER_ADDR": master_addr,
        "PET_MASTER_PORT": str(master_port(lease_id)),
    }


def lease_parts(leases: Iterable[tuple[str, pb.Lease]]) -> tuple[GangPart, ...]:
    """A lease's parts from its messages as the hosts' status shows them (``(host, message)``: each host lists
    the lease with its own GPUs there): ranks from ``Lease.hosts`` (rank order; empty for a lease of one host),
    each host's GPUs from the ``gpus`` that message lists on that host, in index order. A host of ``hosts``
    that no message covers keeps no GPUs (the caller read less than every host)."""
    order: list[str] = []
    gpus: dict[str, dict[str, int]] = {}
    for host, msg in leases:
        if not order:
            order = list(msg.hosts) or [msg.host or host]
        for g in msg.gpus or [pb.LeaseGpu(index=msg.gpu_index, uuid=msg.gpu_uuid, host=msg.host)]:
            on = g.host or msg.host or host
            gpus.setdefault(on, {})[g.uuid] = g.index
    return tuple(GangPart(rank, host, tuple(sorted(gpus.get(host, {}), key=lambda u: (gpus[host][u], u))))
                 for rank, host in enumerate(order))


__all__ = ["MASTER_PORT_BASE", "GangPart", "hostfile", "lease_parts", "master_host", "master_port", "rank_env"]
