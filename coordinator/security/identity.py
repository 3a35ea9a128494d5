"""Who is calling: ``gpucoord://ROLE/NAME``, carried as a URI in the verified peer certificate's SAN.

The identity is taken from the certificate that gRPC's TLS handshake has verified against the CA, never
from a request field. With TLS off there is no identity (``None``): the caller is trusted (loopback dev
mode).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

from coordinator.keys import valid_name

if TYPE_CHECKING:
    import grpc

ROLES = ("agent", "operator", "node", "coordinator", "metrics", "viewer")   # metrics: a Prometheus scraper;
# viewer: a person who reads the fleet console (coordinator.web) and nothing else
SCHEME = "gpucoord://"


@dataclasses.dataclass(frozen=True)
class Identity:
    role: str
    name: str

    @property
    def uri(self) -> str:
        return f"{SCHEME}{self.role}/{self.name}"

    def __str__(self) -> str:
        return self.uri

    @classmethod
    def parse(cls, uri: str) -> Identity:
        """``gpucoord://agent/agent-a`` -> Identity("agent", "agent-a"); ValueError for anything else."""
        if not uri.startswith(SCHEME):
            raise ValueError(f"{uri!r} is not a {SCHEME}ROLE/NAME identity")
        role, sep, name = uri[len(SCHEME):].partition("/")
        if not sep or role not in ROLES:
            raise ValueError(f"{uri!r}: the role must be one of {', '.join(ROLES)}")
        if not valid_name(name):
            raise ValueError(f"{uri!r}: {name!r} is not a valid name")
        return cls(role, name)


def identity_of_certificate(pem: bytes) -> Identity | None:
    """The one ``gpucoord://`` URI SAN of a PEM certificate; None when it has none (or several)."""
    return _identity_of_certificate(bytes(pem))


@functools.lru_cache(maxsize=1024)
def _identity_of_certificate(pem: bytes) -> Identity | None:
    from cryptography import x509
    try:
        cert = x509.load_pem_x509_certificate(pem)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return None
    uris = [u for u in san.get_values_for_type(x509.UniformResourceIdentifier) if u.startswith(SCHEME)]
    if len(uris) != 1:
        return None
    try:
        return Identity.parse(uris[0])
    except ValueError:
        return None


def serial_of_certificate(pem: bytes) -> str:
    """The serial number (lowercase hex) of a PEM certificate; "" when it cannot be read."""
    return _serial_of_certificate(bytes(pem))


@functools.lru_cache(maxsize=1024)
def _serial_of_certificate(pem: bytes) -> str:
    from cryptography import x509
    try:
        return format(x509.load_pem_x509_certificate(pem).serial_number, "x")
    except ValueError:
        return ""


def peer_serial(context: grpc.aio.ServicerContext) -> str:
    """The serial number (lowercase hex) of a gRPC call's verified peer certificate; "" without TLS."""
    pems = context.auth_context().get("x509_pem_cert") or ()
    return _serial_of_certificate(bytes(pems[0])) if pems else ""


def peer_identity(context: grpc.aio.ServicerContext) -> Identity | None:
    """The verified identity of a gRPC call's peer (``context`` of a servicer); None without TLS or when
    the certificate carries no gpucoord identity."""
    auth = context.auth_context()
    pems = auth.get("x509_pem_cert") or ()
    if not pems:
        return None
    return identity_of_certificate(pems[0])
