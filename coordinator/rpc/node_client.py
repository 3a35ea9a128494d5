"""The coordinator's calls to node daemons: ``Node.ConfirmProcesses``, before an AttachProcesses is recorded.

Only the node on the lease's host can tell whose a process is (``coordinator.node.ownership``), so an attach
of processes waits for its answer. No answer is a refusal (UNAVAILABLE, nothing recorded): a pid is never
recorded on the coordinator's word alone, since the node's enforcer kills what a gone lease recorded.
One channel per node address, with the coordinator's own certificate when TLS is on.
"""
from __future__ import annotations

import json

import grpc

from agent_client.api import node_pb2 as pb
from agent_client.api import node_pb2_grpc as pb_grpc
from coordinator import errors
from coordinator.limits import quote
from coordinator.security.tls import TlsFiles, aio_channel

CONFIRM_TIMEOUT_S = 5.0
MAX_CHANNELS = 4096


def host_address(value: bytes) -> str:
    """The node's gRPC address in a ``hosts/<host>`` record ("" when it has none or is unreadable)."""
    try:
        doc = json.loads(value)
    except ValueError:
        return ""
    address = doc.get("address") if isinstance(doc, dict) else None
    return address if isinstance(address, str) else ""


class NodeCalls:
    def __init__(self, tls: TlsFiles | None) -> None:
        self.tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _stub(self, address: str) -> pb_grpc.NodeStub:
        channel = self._channels.get(address)
        if channel is None:
            if len(self._channels) >= MAX_CHANNELS:
                self._channels.pop(next(iter(self._channels)))   # the oldest; closed when collected
            channel = self._channels[address] = aio_channel(address, self.tls)
        return pb_grpc.NodeStub(channel)

    async def refused(self, host: str, address: str, lease_id: str, pids: list[int], pgid: int,
                      peer: str) -> list[int]:
        """The pids (and pgid) the node of ``host`` says do not belong to the caller at ``peer``. Unavailable
        when the node cannot be asked or does not answer."""
        if not address:
            raise errors.Unavailable(f"pids: host {quote(host)} has no node daemon to confirm whose processes "
                                     "these are; nothing was recorded", "pids")
        try:
            resp = await self._stub(address).ConfirmProcesses(
                pb.ConfirmProcessesRequest(lease_id=lease_id, pids=pids, pgid=pgid, peer=peer),
                timeout=CONFIRM_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            raise errors.Unavailable(f"pids: the node of host {quote(host)} could not confirm whose processes "
                                     f"these are ({e.code().name}); nothing was recorded", "pids") from None
        return list(resp.refused)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


__all__ = ["NodeCalls", "host_address"]
