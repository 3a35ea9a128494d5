"""The security interceptor of both servers, with what it follows: the deny list of revoked certificates
(a watch of ``revoked/`` for as long as the server runs) and the per-identity limits."""
from __future__ import annotations

import asyncio

import grpc

from coordinator import errors, metrics
from coordinator.aio import cancel_and_wait, spawn
from coordinator.etcd.contract import KeyFeed
from coordinator.keys import Keys
from coordinator.security.interceptor import SecurityInterceptor
from coordinator.security.limits import Limits
from coordinator.security.revocation import Revocations


def make_guard(tls: bool, calls_per_s: float, burst: int, max_streams: int) -> SecurityInterceptor:
    """The interceptor; with TLS it has identities to limit and certificates to revoke."""
    if not tls:
        return SecurityInterceptor(False, metrics.count_refusal)
    return SecurityInterceptor(True, metrics.count_refusal, limits=Limits(calls_per_s, burst, max_streams),
                               revocations=Revocations())


async def follow_revocations(server: grpc.aio.Server, guard: SecurityInterceptor, store: KeyFeed, keys: Keys,
                             ready_within_s: float, wait: bool = True) -> None:
    """Follow ``revoked/`` into ``guard`` until ``server`` stops; return once the list has been read (a server
    must not serve before it knows which certificates are revoked), or at once when not ``wait`` (the guard
    refuses every call until then)."""
    revocations = guard.revocations
    if revocations is None:
        return

    async def follow() -> None:
        task = spawn(revocations.follow(store, keys), "the revoked certificates' watch")
        try:
            await server.wait_for_termination()
        finally:
            await cancel_and_wait([task])

    spawn(follow(), "following revoked certificates")
    if not wait:
        return
    try:
        await asyncio.wait_for(revocations.ready.wait(), ready_within_s)
    except asyncio.TimeoutError:
        await server.stop(None)
        raise errors.Unavailable(f"could not read the list of revoked certificates ({keys.revocations().decode()}) "
                                 f"within {ready_within_s:g} s: is etcd reachable, and may this process's etcd "
                                 "user read it? (gpucoord etcd-setup grants it)") from None
