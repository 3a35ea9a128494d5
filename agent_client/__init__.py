"""gpucoord's agent client: sessions and VRAM leases, sync (``Client``) and asyncio (``AsyncClient``);
commands bound to a lease (``client.run``, see ``agent_client.run``)."""
from agent_client import errors
from agent_client.client import AsyncClient
from agent_client.lease import AsyncLease, EvictionNotice
from agent_client.run import AsyncBoundProcess
from agent_client.sync import BoundProcess, Client, Lease

__all__ = ["AsyncBoundProcess", "AsyncClient", "AsyncLease", "BoundProcess", "Client", "EvictionNotice", "Lease",
           "errors"]
