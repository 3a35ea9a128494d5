"""What etcd says of itself, as ``Store`` asks it (a base of ``etcd.store.Store``): its database size, its
etcd_leases, each endpoint's version, and its members with the raft leader."""
from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any, Awaitable, Iterable, Sequence, TypeVar

import grpc
from aetcd import rpc

from coordinator.etcd.auth import ChannelFactory
from coordinator.etcd.translate import translate
from coordinator.etcd.types import EtcdMember
from coordinator.etcd.versions import log_versions

log = logging.getLogger(__name__)
T = TypeVar("T")


def endpoint_target(endpoints: Sequence[str]) -> str:
    """One endpoint as it is (gRPC resolves a name); several as gRPC's ``ipv4:`` list, which takes addresses
    only: a name (``etcd-0:2379`` in docker-compose.yml) is resolved here. One that does not resolve (a stopped
    container's) is left out while another does."""
    eps = [e.removeprefix("http://") for e in endpoints]
    if len(eps) == 1:
        return eps[0]
    resolved = [a for a in map(_ipv4, eps) if a]
    return "ipv4:" + ",".join(resolved if resolved else eps)


def _ipv4(endpoint: str) -> str:
    host, _, port = endpoint.rpartition(":")
    try:
        return f"{socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]}:{port}"
    except (OSError, UnicodeError):
        return ""


async def gather_or_cancel(coros: Iterable[Awaitable[T]]) -> list[T]:
    """``asyncio.gather`` that cancels (and waits for) the others when one fails."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class ServerInfo:
    """``Store``'s questions about the server (its attributes are ``Store``'s)."""

    endpoints: list[str]
    timeout: float
    _client: Any
    _channel: ChannelFactory

    async def db_size(self) -> int:
        """The size of etcd's database in bytes, as the member the call lands on reports it."""
        try:
            resp = await self._client.maintenancestub.Status(rpc.StatusRequest(), timeout=self.timeout,
                                                             wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            raise translate(e, write=False) from e
        return int(resp.dbSize)

    async def members(self) -> list[EtcdMember]:
        """The cluster's members (its member list) and which is the raft leader (the leader the member the call
        lands on knows: 0, none, during an election)."""
        try:
            listed = await self._client.clusterstub.MemberList(rpc.MemberListRequest(), timeout=self.timeout,
                                                               wait_for_ready=True)
            status = await self._client.maintenancestub.Status(rpc.StatusRequest(), timeout=self.timeout,
                                                               wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            raise translate(e, write=False) from e
        return [EtcdMember(str(m.name), int(m.ID), tuple(str(u) for u in m.clientURLs), int(m.ID) == int(status.leader))
                for m in listed.members]

    async def lease_ids(self) -> set[int]:
        """The id of every etcd_lease etcd holds."""
        try:
            resp = await self._client.leasestub.LeaseLeases(rpc.LeaseLeasesRequest(), timeout=self.timeout,
                                                            wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            raise translate(e, write=False) from e
        return {int(x.ID) for x in resp.leases}

    async def server_versions(self) -> dict[str, str]:
        """Each endpoint's etcd version, from its Maintenance Status ("" where it did not answer)."""
        async def one(endpoint: str) -> str:
            channel = self._channel(endpoint_target([endpoint]))
            try:
                resp = await rpc.MaintenanceStub(channel).Status(rpc.StatusRequest(), timeout=min(self.timeout, 5.0))
                return str(resp.version)
            except grpc.aio.AioRpcError as e:
                log.info("etcd %s did not say its version: %s", endpoint, e.code().name)
                return ""
            finally:
                await channel.close()
        return dict(zip(self.endpoints, await gather_or_cancel(one(ep) for ep in self.endpoints)))

    async def check_server_version(self) -> dict[str, str]:
        """Log every member's version, with a WARNING for versions with known crash bugs. Never raises."""
        try:
            versions = await self.server_versions()
        except Exception as e:  # noqa: BLE001 - a check at start must not stop the start
            log.warning("could not read the etcd server version: %r", e)
            return {}
        log_versions(versions, log)
        return versions

