"""Certificates without pain: a CA and one certificate per identity, ECDSA P-256.

A directory made by ``gpucoord certs init --dir DIR`` holds ``ca.crt`` and ``ca.key`` (0600). Each
``gpucoord certs issue --dir DIR --role ROLE --name NAME`` writes ``ROLE-NAME.crt`` and ``ROLE-NAME.key``.
The identity is the SAN URI ``gpucoord://ROLE/NAME``; servers (coordinator, node, etcd) also get DNS and
IP SANs for their addresses. The subject's common name is the etcd user the identity acts as (etcd takes
the CN of a verified client certificate as the user name when it runs with ``--client-cert-auth``).
"""
from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
import pathlib
import socket
from typing import Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from coordinator.keys import valid_name
from coordinator.security.identity import ROLES, Identity

# "etcd" is etcd's own server certificate, and "etcd-root" the etcd administrator's client certificate
# (user root): they carry no gpucoord identity that the coordinator would accept.
CERT_KINDS = (*ROLES, "etcd", "etcd-root")
SERVER_KINDS = ("coordinator", "node", "etcd")
DEFAULT_DAYS = {"agent": 30, "operator": 30, "node": 365, "coordinator": 365, "etcd": 365, "etcd-root": 30}
CA_DAYS = 5 * 365


def etcd_user_for(kind: str, name: str) -> str:
    """The etcd user (the certificate's CN) an identity acts as; see ``etcd_auth.setup_roles``."""
    if kind == "coordinator":
        return "gpucoord-coordinator"    # every replica acts as the same etcd user
    if kind == "operator":
        return "gpucoord-operator"
    if kind == "node":
        return f"gpucoord-node-{name}"
    if kind == "etcd-root":
        return "root"
    return f"gpucoord-{kind}-{name}"


@dataclasses.dataclass(frozen=True)
class IssuedFiles:
    cert: pathlib.Path
    key: pathlib.Path


def _write(path: pathlib.Path, data: bytes, private: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def init_ca(directory: str | os.PathLike[str], days: int = CA_DAYS, name: str = "gpucoord CA",
            force: bool = False) -> IssuedFiles:
    """Make ``ca.crt`` and ``ca.key`` in ``directory``. An existing CA is kept unless ``force``."""
    d = pathlib.Path(directory)
    files = IssuedFiles(d / "ca.crt", d / "ca.key")
    if files.cert.exists() and not force:
        raise FileExistsError(f"{files.cert} exists (a CA is already there)")
    if days < 1:
        raise ValueError("days: must be >= 1")
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = _now()
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    _write(files.key, _key_pem(key), private=True)
    _write(files.cert, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return files


def issue(directory: str | os.PathLike[str], kind: str, name: str, hosts: Sequence[str] = (),
          days: int | None = None, not_before: datetime.datetime | None = None,
          not_after: datetime.datetime | None = None, out_name: str | None = None) -> IssuedFiles:
    """Issue a certificate for ``gpucoord://KIND/NAME``, signed by the CA in ``directory``.

    ``hosts`` (IP addresses or DNS names) become SANs of a server certificate; servers always get
    127.0.0.1, ::1 and localhost. ``not_before``/``not_after`` override ``days`` (tests make expired ones).
    """
    if kind not in CERT_KINDS:
        raise ValueError(f"role: must be one of {', '.join(CERT_KINDS)}, got {kind!r}")
    if not valid_name(name):
        raise ValueError(f"name: {name!r} is not a valid name (letters, digits, '.', '_', ':', '@', '-')")
    days = DEFAULT_DAYS[kind] if days is None else days
    if days < 1:
        raise ValueError("days: must be >= 1")
    d = pathlib.Path(directory)
    ca_cert = x509.load_pem_x509_certificate((d / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((d / "ca.key").read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    start = not_before or _now() - datetime.timedelta(minutes=5)
    end = not_after or _now() + datetime.timedelta(days=days)
    sans: list[x509.GeneralName] = []
    if kind in ROLES:
        sans.append(x509.UniformResourceIdentifier(Identity(kind, name).uri))
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if kind in SERVER_KINDS:
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        names = ["127.0.0.1", "::1", "localhost", socket.gethostname(), *hosts]
        seen: set[str] = set()
        for h in names:
            if not h or h in seen:
                continue
            seen.add(h)
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                sans.append(x509.DNSName(h))
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, etcd_user_for(kind, name))]))
               .issuer_name(ca_cert.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, key_cert_sign=False,
                                            crl_sign=False, content_commitment=False, data_encipherment=False,
                                            key_agreement=True, encipher_only=False, decipher_only=False),
                              critical=True)
               .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                              critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    stem = out_name or f"{kind}-{name}"
    files = IssuedFiles(d / f"{stem}.crt", d / f"{stem}.key")
    _write(files.key, _key_pem(key), private=True)
    _write(files.cert, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return files
