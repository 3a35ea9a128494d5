"""TLS material for gRPC: where it comes from, and the server and channel credentials made of it.

The three files (CA, certificate, key) come from flags (``--tls-ca --tls-cert --tls-key``), else the
environment (``GPUCOORD_TLS_CA``, ``GPUCOORD_TLS_CERT``, ``GPUCOORD_TLS_KEY``), else a ``[tls]`` table of
the config file (``ca``, ``cert``, ``key``). All three or none: two of three is an error naming the
missing one. With them, servers require and verify client certificates (mTLS); without them, a server
listens only on loopback unless told ``--insecure``.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import tomllib
from typing import TYPE_CHECKING, Mapping, Sequence

import grpc

if TYPE_CHECKING:
    import argparse

log = logging.getLogger(__name__)

ENV = {"ca": "GPUCOORD_TLS_CA", "cert": "GPUCOORD_TLS_CERT", "key": "GPUCOORD_TLS_KEY"}
FLAGS = {"ca": "--tls-ca", "cert": "--tls-cert", "key": "--tls-key"}
MAX_RECEIVE_BYTES = 1 << 20   # gRPC's max receive size on both servers (docs/guarantees.md "Limits")


class TlsError(ValueError):
    """Bad TLS configuration: the message names the flag (or variable) at fault."""


@dataclasses.dataclass(frozen=True)
class TlsFiles:
    ca: str
    cert: str
    key: str

    def read(self) -> tuple[bytes, bytes, bytes]:
        out = []
        for part in ("ca", "cert", "key"):
            path = getattr(self, part)
            try:
                with open(path, "rb") as f:
                    out.append(f.read())
            except OSError as e:
                raise TlsError(f"{FLAGS[part]}: cannot read {path}: {e.strerror}") from None
        return out[0], out[1], out[2]

    def env(self) -> dict[str, str]:
        """The three environment variables that hand this material to a child process."""
        return {ENV["ca"]: self.ca, ENV["cert"]: self.cert, ENV["key"]: self.key}


def resolve(ca: str | None = None, cert: str | None = None, key: str | None = None,
            env: Mapping[str, str] | None = None, config_file: str | None = None) -> TlsFiles | None:
    """Flags win over the environment, which wins over the config file's ``[tls]`` table."""
    env = os.environ if env is None else env
    table: dict[str, object] = {}
    if config_file:
        with open(config_file, "rb") as f:
            table = tomllib.load(f).get("tls", {})
    given = {"ca": ca, "cert": cert, "key": key}
    values: dict[str, str] = {}
    for part in ("ca", "cert", "key"):
        v = given[part] or env.get(ENV[part]) or table.get(part)
        if v:
            values[part] = str(v)
    if not values:
        return None
    missing = [p for p in ("ca", "cert", "key") if p not in values]
    if missing:
        raise TlsError(f"{FLAGS[missing[0]]} (or {ENV[missing[0]]}): TLS needs all of --tls-ca, --tls-cert and "
                       "--tls-key")
    return TlsFiles(values["ca"], values["cert"], values["key"])


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    ca, cert, key = files.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    ca, cert, key = files.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def is_loopback(address: str) -> bool:
    """True for ``127.x.x.x:P``, ``[::1]:P`` and ``localhost:P``."""
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen_error(address: str, tls: TlsFiles | None, insecure: bool, what: str = "listen") -> str | None:
    """Why a server may not listen on ``address`` (None: it may). Without TLS, only loopback, unless
    ``--insecure``."""
    if tls is not None or is_loopback(address) or insecure:
        return None
    return (f"{what}: {address} is not a loopback address and no TLS is configured (--tls-ca, --tls-cert, "
            "--tls-key); pass --insecure to serve it in plaintext anyway")


def check_listen(address: str, tls: TlsFiles | None, insecure: bool, what: str = "listen") -> None:
    """Raise ``listen_error``, or log a warning when ``--insecure`` opens a non-loopback address."""
    error = listen_error(address, tls, insecure, what)
    if error is not None:
        raise TlsError(error)
    if tls is not None or is_loopback(address):
        return
    log.warning("INSECURE: serving %s on %s without TLS (--insecure): anyone who reaches it may act as any "
                "agent or operator", what, address)


def add_port(server: grpc.aio.Server, address: str, tls: TlsFiles | None) -> int:
    """Bind ``address`` (TLS when configured); OSError naming it when it cannot be bound."""
    try:
        port = (server.add_secure_port(address, server_credentials(tls)) if tls is not None
                else server.add_insecure_port(address))
    except RuntimeError as e:
        raise OSError(f"listen: cannot bind {address}: {e}") from None
    if port == 0:
        raise OSError(f"listen: cannot bind {address} (in use?)")
    return int(port)


def server_options() -> list[tuple[str, int]]:
    """No SO_REUSEPORT (a second server on a used port fails instead of sharing it), bounded messages."""
    return [("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES)]


def sync_channel(address: str, tls: TlsFiles | None, options: Sequence[tuple[str, int | str]] = ()) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, channel_credentials(tls), options=list(options))


def aio_channel(address: str, tls: TlsFiles | None,
                options: Sequence[tuple[str, int | str]] = ()) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, channel_credentials(tls), options=list(options))


def from_args(args: argparse.Namespace) -> TlsFiles | None:
    """TLS files from the flags, else the environment."""
    return resolve(getattr(args, "tls_ca", None), getattr(args, "tls_cert", None), getattr(args, "tls_key", None))
