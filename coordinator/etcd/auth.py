"""The channel to etcd, and etcd's TLS and RBAC on the wire: its options, TLS, the auth token on every call,
and the roles and users of ``gpucoord etcd-setup``.

What a process presents to etcd, and which roles grant what, is configuration: it lives in
``coordinator.security.etcd_auth`` (``EtcdSecurity``, ``role_permissions``). This module puts it on etcd's
own messages, so that nothing outside ``coordinator/etcd/`` talks to aetcd.
"""
from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import secrets
from typing import Awaitable, Callable, Sequence, TypeVar

import grpc
from aetcd import rpc

from coordinator.security.etcd_auth import (
    RETIRED_USERS,
    EtcdSecurity,
    Permission,
    role_permissions,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

_PERMISSION = {"read": rpc.Permission.READ, "readwrite": rpc.Permission.READWRITE}

# Round robin over the members: a dead member leaves the rotation, so an etcd minority loss costs at most one
# failed (and retried) call. gRPC's default reconnect backoff grows to 120 s, which once left a replica
# unable to reach a restarted etcd for 90 s; capped at 1 s, every replica is back within about a second.
# min_reconnect_backoff_ms is also the shortest connect timeout: plenty on the networks etcd runs on.
# A member that hangs (SIGSTOP, a stalled VM) keeps its TCP connection open, so only a missed ping takes it
# out of the rotation: a ping every 5 s (etcd's --grpc-keepalive-min-time; faster pings get GOAWAY) answered
# within 1 s, also while calls are stuck on it (no limit on pings without data), drops it within ~6 s.
CHANNEL_OPTIONS: dict[str, str | int] = {
    "grpc.lb_policy_name": "round_robin",
    "grpc.keepalive_time_ms": 5_000,
    "grpc.keepalive_timeout_ms": 1_000,
    "grpc.http2.max_pings_without_data": 0,
    "grpc.enable_retries": 1,
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 1_000,
    "grpc.max_reconnect_backoff_ms": 1_000,
}


ChannelFactory = Callable[[str], grpc.aio.Channel]
"""Builds the gRPC channel to etcd for a target (``host:port``, or ``ipv4:`` and a list of them)."""


def default_channel(security: EtcdSecurity) -> ChannelFactory:
    """The one place a gRPC channel to etcd is built: plaintext or TLS, with etcd's auth token on every
    call when a user is configured (``etcd.auth.open_channel``), and ``CHANNEL_OPTIONS``."""
    return lambda target: open_channel(target, security, list(CHANNEL_OPTIONS.items()))


def open_channel(target: str, security: EtcdSecurity, options: Sequence[tuple[str, str | int]]) -> grpc.aio.Channel:
    """The channel to etcd: TLS when a CA is configured, and an auth token on every call when a user is."""
    interceptors: list[grpc.aio.ClientInterceptor] = []
    token: _Token | None = None
    if security.user:
        token = _Token(security.user, security.password)
        interceptors = [_UnaryToken(token), _StreamToken(token)]
    if security.tls:
        ch = grpc.aio.secure_channel(target, security.channel_credentials(), options=list(options),
                                     interceptors=interceptors or None)
    else:
        ch = grpc.aio.insecure_channel(target, options=list(options), interceptors=interceptors or None)
    if token is not None:
        token.channel = ch
    return ch


# -- the auth token --------------------------------------------------------------------------------
class _Token:
    """etcd's token for a user and password: fetched on first use, fetched again when etcd says it is
    invalid (tokens of the ``simple`` kind expire after 5 idle minutes and do not survive a restart)."""

    def __init__(self, user: str, password: str) -> None:
        self.user, self._password = user, password
        self.channel: grpc.aio.Channel | None = None
        self._value = ""
        self._lock = asyncio.Lock()

    async def get(self, stale: str = "") -> str:
        async with self._lock:
            if self._value and self._value != stale:
                return self._value
            assert self.channel is not None
            resp = await rpc.AuthStub(self.channel).Authenticate(
                rpc.AuthenticateRequest(name=self.user, password=self._password), timeout=5)
            self._value = str(resp.token)
            return self._value


def _with_token(details: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    metadata = [(k, v) for k, v in (details.metadata or ()) if k != "token"]
    metadata.append(("token", token))
    return details._replace(metadata=grpc.aio.Metadata(*metadata))


def _invalid_token(e: BaseException) -> bool:
    return (isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.UNAUTHENTICATED
            and "token" in (e.details() or ""))


class _UnaryToken(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    def __init__(self, token: _Token) -> None:
        self.token = token

    async def intercept_unary_unary(self, continuation: Callable[..., Awaitable[grpc.aio.UnaryUnaryCall]],
                                    details: grpc.aio.ClientCallDetails, request: object) -> object:
        method = details.method.decode() if isinstance(details.method, bytes) else str(details.method)
        if method.endswith("/Authenticate"):
            return await continuation(details, request)
        value = await self.token.get()
        call = await continuation(_with_token(details, value), request)
        try:
            return await call
        except grpc.aio.AioRpcError as e:
            if not _invalid_token(e):
                raise
        # The call was refused before etcd applied anything: once more, with a fresh token.
        value = await self.token.get(stale=value)
        return await (await continuation(_with_token(details, value), request))


class _StreamToken(grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    """Watch and LeaseKeepAlive streams carry the token of their opening; a stream refused for a stale
    token is reopened by its owner, by then with the token a unary call has refreshed."""

    def __init__(self, token: _Token) -> None:
        self.token = token

    async def intercept_stream_stream(self, continuation: Callable[..., Awaitable[grpc.aio.StreamStreamCall]],
                                      details: grpc.aio.ClientCallDetails,
                                      request_iterator: object) -> grpc.aio.StreamStreamCall:
        return await continuation(_with_token(details, await self.token.get()), request_iterator)


# -- roles and users ---------------------------------------------------------------------------------
async def setup_roles(endpoint: str, security: EtcdSecurity, prefix: str, nodes: Sequence[str],
                      password_dir: str | None = None, enable: bool = True) -> dict[str, str]:
    """Create (idempotently) the roles and users of ``etcd_auth.role_permissions``, then enable auth. Users
    get no password (they authenticate with a client certificate whose CN is the user) unless
    ``password_dir`` is given: then each gets a random password written to ``password_dir/<user>.password``
    (0600). The users of ``RETIRED_USERS`` (an earlier release's ``gpucoord-operator``) and their roles are
    deleted. Returns user -> the file of its password ("" without one)."""
    perms = role_permissions(prefix, nodes)
    files: dict[str, str] = {}
    channel = open_channel(endpoint, security, [])
    try:
        auth = rpc.AuthStub(channel)

        async def ignore_exists(call: Awaitable[object]) -> None:
            try:
                await call
            except grpc.aio.AioRpcError as e:
                if "already exists" not in (e.details() or "") and "already" not in (e.details() or ""):
                    raise

        async def add_user(user: str) -> None:
            pw = ""
            if password_dir:
                path = pathlib.Path(password_dir) / f"{user}.password"
                if path.exists():
                    pw = path.read_text().strip()
                else:
                    pw = secrets.token_urlsafe(24)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    with os.fdopen(fd, "w") as f:
                        f.write(pw + "\n")
                files[user] = str(path)
            else:
                files[user] = ""
            req = (rpc.AuthUserAddRequest(name=user, password=pw) if pw else
                   rpc.AuthUserAddRequest(name=user, options=rpc.UserAddOptions(no_password=True)))
            await ignore_exists(auth.UserAdd(req, timeout=5))

        def permission(perm: Permission, key: bytes, range_end: bytes) -> rpc.Permission:
            return rpc.Permission(permType=_PERMISSION[perm], key=key, range_end=range_end)

        await ignore_exists(auth.RoleAdd(rpc.AuthRoleAddRequest(name="root"), timeout=5))
        await add_user("root")
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=5)
        for role, grants in perms.items():
            await ignore_exists(auth.RoleAdd(rpc.AuthRoleAddRequest(name=role), timeout=5))
            for perm, key, range_end in grants:
                await auth.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(
                    name=role, perm=permission(perm, key, range_end)), timeout=5)
            await add_user(role)
            await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=role, role=role), timeout=5)
        for user in RETIRED_USERS:   # operators act through a coordinator now: their etcd user goes
            for call in (auth.UserDelete(rpc.AuthUserDeleteRequest(name=user), timeout=5),
                         auth.RoleDelete(rpc.AuthRoleDeleteRequest(role=user), timeout=5)):
                try:
                    await call
                except grpc.aio.AioRpcError as e:
                    if "not found" not in (e.details() or ""):
                        raise
        if enable:
            await auth.AuthEnable(rpc.AuthEnableRequest(), timeout=5)
            log.info("etcd auth enabled: users %s", ", ".join(sorted(files)))
    finally:
        await channel.close()
    return files
