"""etcd's own TLS and RBAC, as gpucoord uses them.

``EtcdSecurity`` is what a process presents to etcd: a CA to verify etcd with, a client certificate
(whose CN etcd takes as the user when it runs with ``--client-cert-auth``), and/or a user and password.
``channel()`` is the one place that decides between a plaintext and a TLS channel, and adds the auth
token that etcd hands out for a password to every call.

``setup_roles`` (``gpucoord etcd-setup``) creates the roles and users that confine each party:

======================  ===================================================================
etcd user               may
======================  ===================================================================
root                    everything (etcd's administrator; needed to enable auth)
gpucoord-coordinator    read and write the whole prefix
gpucoord-operator       read the whole prefix (``gpucoord keys``), and write ``revoked/`` (``certs
                        revoke``); everything else operators do goes through the coordinator,
                        whose RPCs need the operator certificate
gpucoord-node-<host>    write ``hosts/<host>`` and ``usage/<host>``; read ``leases/<host>/``
                        (the watch behind CheckToken) and ``revoked/`` (the deny list)
======================  ===================================================================

Which certificates etcd accepts at all is decided by its ``--trusted-ca-file``: the etcd client CA
(``etcd-ca.crt``), which signs only the etcd client certificates of coordinators, nodes and operators.
Agent certificates come from the other CA, so they cannot even open a TLS connection to etcd.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import pathlib
import secrets
from typing import Any, Mapping, Sequence

import grpc
from aetcd import rpc

from coordinator.keys import Keys, prefix_range_end

log = logging.getLogger(__name__)

PASSWORD_ENV = "GPUCOORD_ETCD_PASSWORD"


class EtcdSecurityError(ValueError):
    """Bad etcd credentials configuration; the message names the flag."""


@dataclasses.dataclass(frozen=True)
class EtcdSecurity:
    ca: str = ""
    cert: str = ""
    key: str = ""
    user: str = ""
    password: str = dataclasses.field(default="", repr=False)   # never logged or printed

    @property
    def tls(self) -> bool:
        return bool(self.ca)

    @property
    def empty(self) -> bool:
        return not (self.ca or self.cert or self.key or self.user)

    def validate(self) -> EtcdSecurity:
        if bool(self.cert) != bool(self.key):
            raise EtcdSecurityError("--etcd-cert and --etcd-key: give both or neither")
        if self.cert and not self.ca:
            raise EtcdSecurityError("--etcd-ca: a client certificate needs the CA that signed etcd's certificate")
        if self.user and not self.password:
            raise EtcdSecurityError(f"--etcd-password-file (or {PASSWORD_ENV}): --etcd-user needs a password")
        return self

    def channel_credentials(self) -> grpc.ChannelCredentials:
        def read(path: str, flag: str) -> bytes:
            try:
                return pathlib.Path(path).read_bytes()
            except OSError as e:
                raise EtcdSecurityError(f"{flag}: cannot read {path}: {e.strerror}") from None
        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca, "--etcd-ca"),
            private_key=read(self.key, "--etcd-key") if self.key else None,
            certificate_chain=read(self.cert, "--etcd-cert") if self.cert else None)

    def channel(self, target: str, options: Sequence[tuple[str, Any]]) -> grpc.aio.Channel:
        """The channel to etcd: TLS when a CA is configured, and an auth token on every call when a
        user is."""
        interceptors: list[Any] = []
        token: _Token | None = None
        if self.user:
            token = _Token(self.user, self.password)
            interceptors = [_UnaryToken(token), _StreamToken(token)]
        if self.tls:
            ch = grpc.aio.secure_channel(target, self.channel_credentials(), options=list(options),
                                         interceptors=interceptors or None)
        else:
            ch = grpc.aio.insecure_channel(target, options=list(options), interceptors=interceptors or None)
        if token is not None:
            token.channel = ch
        return ch


def resolve(ca: str | None = None, cert: str | None = None, key: str | None = None, user: str | None = None,
            password: str | None = None, password_file: str | None = None,
            env: Mapping[str, str] | None = None) -> EtcdSecurity:
    """Flags, then ``GPUCOORD_ETCD_CA/CERT/KEY/USER`` and ``GPUCOORD_ETCD_PASSWORD`` (or ``_FILE``)."""
    env = os.environ if env is None else env
    pw = password or ""
    pw_file = password_file or env.get("GPUCOORD_ETCD_PASSWORD_FILE", "")
    if not pw and pw_file:
        try:
            pw = pathlib.Path(pw_file).read_text().strip()
        except OSError as e:
            raise EtcdSecurityError(f"--etcd-password-file: cannot read {pw_file}: {e.strerror}") from None
    if not pw:
        pw = env.get(PASSWORD_ENV, "")
    return EtcdSecurity(ca=ca or env.get("GPUCOORD_ETCD_CA", ""), cert=cert or env.get("GPUCOORD_ETCD_CERT", ""),
                        key=key or env.get("GPUCOORD_ETCD_KEY", ""), user=user or env.get("GPUCOORD_ETCD_USER", ""),
                        password=pw).validate()


def add_arguments(parser: Any) -> None:
    """The etcd credential flags, shared by every command that talks to etcd."""
    g = parser.add_argument_group("etcd TLS and auth")
    g.add_argument("--etcd-ca", default=None, help="CA of etcd's server certificate (turns TLS on)")
    g.add_argument("--etcd-cert", default=None, help="client certificate for etcd (its CN is the etcd user)")
    g.add_argument("--etcd-key", default=None, help="key of --etcd-cert")
    g.add_argument("--etcd-user", default=None, help="etcd user (password auth)")
    g.add_argument("--etcd-password", default=None, help=f"etcd password (prefer --etcd-password-file or "
                                                         f"{PASSWORD_ENV}: a flag shows in ps)")
    g.add_argument("--etcd-password-file", default=None, help="file holding the etcd password")


def from_args(args: Any) -> EtcdSecurity:
    return resolve(args.etcd_ca, args.etcd_cert, args.etcd_key, args.etcd_user, args.etcd_password,
                   args.etcd_password_file)


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


def _with_token(details: Any, token: str) -> Any:
    metadata = [(k, v) for k, v in (details.metadata or ()) if k != "token"]
    metadata.append(("token", token))
    return details._replace(metadata=grpc.aio.Metadata(*metadata))


def _invalid_token(e: BaseException) -> bool:
    return (isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.UNAUTHENTICATED
            and "token" in (e.details() or ""))


class _UnaryToken(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    def __init__(self, token: _Token) -> None:
        self.token = token

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
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

    async def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(_with_token(details, await self.token.get()), request_iterator)


# -- roles and users ---------------------------------------------------------------------------------
def node_user(host: str) -> str:
    return f"gpucoord-node-{host}"


def role_permissions(prefix: str, nodes: Sequence[str]) -> dict[str, list[tuple[int, bytes, bytes]]]:
    """etcd role -> (permission type, key, range_end) grants. range_end b"" is the one key."""
    keys = Keys(prefix)
    root = keys.root()
    revoked = keys.revocations()
    perms: dict[str, list[tuple[int, bytes, bytes]]] = {
        "gpucoord-coordinator": [(rpc.Permission.READWRITE, root, prefix_range_end(root))],
        "gpucoord-operator": [(rpc.Permission.READ, root, prefix_range_end(root)),
                              (rpc.Permission.READWRITE, revoked, prefix_range_end(revoked))],
    }
    for host in nodes:
        leases = keys.leases(host)
        perms[node_user(host)] = [(rpc.Permission.READWRITE, keys.host(host), b""),
                                  (rpc.Permission.READWRITE, keys.usage(host), b""),
                                  (rpc.Permission.READ, leases, prefix_range_end(leases)),
                                  (rpc.Permission.READ, revoked, prefix_range_end(revoked))]
    return perms


async def setup_roles(endpoint: str, security: EtcdSecurity, prefix: str, nodes: Sequence[str],
                      password_dir: str | None = None, enable: bool = True) -> dict[str, str]:
    """Create (idempotently) the roles and users above, then enable auth. Users get no password (they
    authenticate with a client certificate whose CN is the user) unless ``password_dir`` is given: then
    each gets a random password written to ``password_dir/<user>.password`` (0600). Returns user -> the
    file of its password ("" without one)."""
    perms = role_permissions(prefix, nodes)
    files: dict[str, str] = {}
    channel = security.channel(endpoint, [])
    try:
        auth = rpc.AuthStub(channel)

        async def ignore_exists(coro: Any) -> None:
            try:
                await coro
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

        await ignore_exists(auth.RoleAdd(rpc.AuthRoleAddRequest(name="root"), timeout=5))
        await add_user("root")
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=5)
        for role, grants in perms.items():
            await ignore_exists(auth.RoleAdd(rpc.AuthRoleAddRequest(name=role), timeout=5))
            for perm_type, key, range_end in grants:
                await auth.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(
                    name=role, perm=rpc.Permission(permType=perm_type, key=key, range_end=range_end)), timeout=5)
            await add_user(role)
            await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=role, role=role), timeout=5)
        if enable:
            await auth.AuthEnable(rpc.AuthEnableRequest(), timeout=5)
            log.info("etcd auth enabled: users %s", ", ".join(sorted(files)))
    finally:
        await channel.close()
    return files
