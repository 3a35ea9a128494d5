"""A client of ``run --join`` (agent_client.join.JoiningClient) with no coordinator: two hosts' status, h1 and h2,
each listing one 2-host lease with its own GPUs there; attaches recorded, the lease taken away by ``gone``."""
from __future__ import annotations

import asyncio
from typing import Any, Sequence

from agent_client import errors
from agent_client.api import coordinator_pb2 as pb

LID = "0123456789abcdef0123"


def lease_msg(host: str, gpus: list[tuple[int, str]], hosts: tuple[str, ...] = ("h1", "h2"),
              rank: int = 0) -> pb.Lease:
    """The lease as ``host``'s status lists it: its GPUs there (index, uuid)."""
    return pb.Lease(id=LID, host=host, gpu_uuid=gpus[0][1], gpu_index=gpus[0][0], agent="a", vram_mb=1000,
                    token=7, hosts=list(hosts), gpus=[pb.LeaseGpu(index=i, uuid=u, token=7, vram_mb=1000,
                                                                  host=host if hosts else "", rank=rank)
                                                      for i, u in gpus])


H1 = lease_msg("h1", [(0, "GPU-a"), (1, "GPU-b")])
H2 = lease_msg("h2", [(3, "GPU-e"), (1, "GPU-c"), (2, "GPU-d")], rank=1)


class FakeJoiningClient:
    agent = "a"
    expired = False

    def __init__(self, host: str, address: str = "10.0.0.5:7001", keepalive_interval: float = 1.0) -> None:
        self.host = host
        self.keepalive_interval = keepalive_interval
        self.done = asyncio.Event()
        self._leases: dict[str, Any] = {}
        self._early_notices: dict[str, Any] = {}
        self.attached: list[tuple[str, list[int], int]] = []
        self.gone = False
        self.hosts = {"h1": pb.HostStatus(host="h1", address=address, leases=[H1]),
                      "h2": pb.HostStatus(host="h2", address="10.0.0.6:7001", leases=[H2]),
                      "h3": pb.HostStatus(host="h3")}

    async def status(self, host: str | None = None) -> pb.GetStatusResponse:
        return pb.GetStatusResponse(hosts=[h for n, h in self.hosts.items() if host in (None, n)])

    async def release(self, lease_id: str) -> bool:
        raise AssertionError("a joined part never releases the lease")

    async def partition(self) -> dict[str, object]:
        return {"explicit": False, "mine": None}

    async def attach_processes(self, lease_id: str, pids: Sequence[int], pgid: int = 0) -> bool:
        if self.gone:
            raise errors.NotFound(f"lease_id: no live lease {lease_id}", "", "lease_id")
        self.attached.append((lease_id, list(pids), pgid))
        return True

    async def acquire(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a joined part acquires nothing")
