"""gpucoord's agent client: sessions and VRAM leases, sync (``Client``) and asyncio (``AsyncClient``)."""
from agent_client import errors
from agent_client.client import AsyncClient, AsyncLease, Client, EvictionNotice, Lease

__all__ = ["AsyncClient", "AsyncLease", "Client", "EvictionNotice", "Lease", "errors"]
