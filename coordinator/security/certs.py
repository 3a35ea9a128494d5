"""Certificates without pain: two CAs (two trust domains) and certificates per identity, ECDSA P-256.

A directory made by ``gpucoord certs init --dir DIR`` holds two CAs:

* ``ca.crt``/``ca.key``: gpucoord's gRPC CA. It signs the certificate of every identity
  (``gpucoord://ROLE/NAME`` as a SAN URI): agents, operators, nodes and coordinators. The coordinator and
  node servers trust it, and only it.
* ``etcd-ca.crt``/``etcd-ca.key``: the etcd CA. It signs etcd's server certificate and the etcd client
  certificates of coordinators and of etcd's root (the break-glass administrator); never an agent's, an
  operator's (operators act through a coordinator's RPCs) nor a node's (node daemons talk to etcd only
  through a coordinator) unless asked for a node of an earlier release. etcd trusts it, and only it
  (``--trusted-ca-file``), so no certificate but a coordinator's and root's can even open a TLS connection
  to etcd (any etcd identity could keep another agent's session alive: etcd's RBAC has no permission on
  leases, and etcd checks no permission on LeaseKeepAlive).

``gpucoord certs issue --dir DIR --role ROLE --name NAME`` writes ``ROLE-NAME.crt``/``.key`` (gRPC CA), and
for the role that talks to etcd (coordinator; a node only with ``--etcd-client``) also
``ROLE-NAME.etcd.crt``/``.key`` (etcd
CA, whose common name is the etcd user that identity acts as: etcd takes the CN of a verified client
certificate as the user when it runs with ``--client-cert-auth``). ``--role etcd`` (etcd's server) and
``--role etcd-root`` (etcd's administrator) come from the etcd CA only. Servers (coordinator, node, etcd)
also get DNS and IP SANs for their addresses.

Every certificate issued is recorded in ``DIR/issued.jsonl`` (serial, role, name, CA, expiry, file), for
``certs list`` and for ``certs revoke NAME``.
"""
from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import json
import os
import pathlib
import socket
from typing import Any, Sequence

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from coordinator.keys import valid_name
from coordinator.limits import quote
from coordinator.security.identity import ROLES, Identity

# "etcd" is etcd's own server certificate, and "etcd-root" the etcd administrator's client certificate
# (user root): they carry no gpucoord identity that the coordinator would accept.
CERT_KINDS = (*ROLES, "etcd", "etcd-root")
SERVER_KINDS = ("coordinator", "node", "etcd")
ETCD_CLIENT_KINDS = ("coordinator",)   # also gets an etcd client certificate: only coordinators talk to etcd
# A node of an earlier release talks to etcd itself: it gets an etcd client certificate only when asked
# (``certs issue --role node --etcd-client``), until it is upgraded (docs/etcd.md "Upgrading node daemons").
LEGACY_ETCD_CLIENT_KINDS = ("node",)
ETCD_ONLY_KINDS = ("etcd", "etcd-root")                    # come from the etcd CA alone
# Short by default: a certificate is renewed by issuing it again (docs/security.md "Rotating certificates").
DEFAULT_DAYS = {"agent": 7, "operator": 7, "node": 90, "coordinator": 90, "metrics": 90, "viewer": 7, "etcd": 90,
                "etcd-root": 7}
CA_DAYS = 5 * 365
MAX_DAYS = 36_500    # 100 years: a lifetime beyond (--days 99999999) is no date a certificate can carry
GRPC_CA, ETCD_CA = "ca", "etcd-ca"     # the file stems of the two CAs
INDEX = "issued.jsonl"


def etcd_user_for(kind: str, name: str) -> str:
    """The etcd user (the certificate's CN) an identity acts as; see ``etcd_auth.setup_roles``."""
    if kind == "coordinator":
        return "gpucoord-coordinator"    # every replica acts as the same etcd user
    if kind == "node":
        return f"gpucoord-node-{name}"
    if kind == "etcd-root":
        return "root"
    return f"gpucoord-{kind}-{name}"


@dataclasses.dataclass(frozen=True)
class IssuedFiles:
    cert: pathlib.Path
    key: pathlib.Path
    etcd_cert: pathlib.Path | None = None   # the etcd client certificate of a coordinator (or a legacy node)
    etcd_key: pathlib.Path | None = None


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
    """Make both CAs in ``directory``: ``ca.crt``/``ca.key`` (gRPC) and ``etcd-ca.crt``/``etcd-ca.key``
    (etcd). Existing ones are kept unless ``force``; a directory with only the gRPC CA (made before the etcd
    CA existed) gets its etcd CA. Returns the gRPC CA's files, with the etcd CA's as ``etcd_*``."""
    d = pathlib.Path(directory)
    grpc_ca = IssuedFiles(d / "ca.crt", d / "ca.key")
    etcd_ca = IssuedFiles(d / "etcd-ca.crt", d / "etcd-ca.key")
    _check_days(days)
    if grpc_ca.cert.exists() and etcd_ca.cert.exists() and not force:
        raise FileExistsError(f"{grpc_ca.cert} exists (a CA is already there)")
    if force or not grpc_ca.cert.exists():
        _make_ca(grpc_ca, days, name)
    if force or not etcd_ca.cert.exists():
        _make_ca(etcd_ca, days, f"{name} for etcd")
    return IssuedFiles(grpc_ca.cert, grpc_ca.key, etcd_ca.cert, etcd_ca.key)


def _check_days(days: int) -> None:
    if not 1 <= days <= MAX_DAYS:
        raise ValueError(f"days: must be within 1..{MAX_DAYS}, got {quote(days)}")


def _make_ca(files: IssuedFiles, days: int, name: str) -> None:
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


def issue(directory: str | os.PathLike[str], kind: str, name: str, hosts: Sequence[str] = (),
          days: int | None = None, not_before: datetime.datetime | None = None,
          not_after: datetime.datetime | None = None, out_name: str | None = None,
          etcd_client: bool = False) -> IssuedFiles:
    """Issue the certificates of ``gpucoord://KIND/NAME`` from the CAs in ``directory`` (see the module's
    docstring for which CA signs what).

    ``hosts`` (IP addresses or DNS names) become SANs of a server certificate; servers always get
    127.0.0.1, ::1 and localhost. ``not_before``/``not_after`` override ``days`` (tests make expired ones).
    ``etcd_client``: also an etcd client certificate for a node (a node of an earlier release, which talks
    to etcd itself); coordinators always get one, agents and operators never.
    """
    if kind not in CERT_KINDS:
        raise ValueError(f"role: must be one of {', '.join(CERT_KINDS)}, got {kind!r}")
    if not valid_name(name):
        raise ValueError(f"name: {name!r} is not a valid name (letters, digits, '.', '_', ':', '@', '-')")
    days = DEFAULT_DAYS[kind] if days is None else days
    _check_days(days)
    d = pathlib.Path(directory)
    if etcd_client and kind not in ETCD_CLIENT_KINDS + LEGACY_ETCD_CLIENT_KINDS:
        raise ValueError(f"etcd_client: a {kind} never talks to etcd")
    to_etcd = kind in ETCD_CLIENT_KINDS or etcd_client
    if to_etcd or kind in ETCD_ONLY_KINDS:
        if not (d / "etcd-ca.crt").exists() and (d / "ca.crt").exists():
            raise ValueError(f"{d / 'etcd-ca.crt'}: no etcd CA in {d} (made before there were two): run "
                             f"'gpucoord certs init --dir {d}' to add it, then issue again")
    start = not_before or _now() - datetime.timedelta(minutes=5)
    end = not_after or _now() + datetime.timedelta(days=days)
    stem = out_name or f"{kind}-{name}"
    if kind in ETCD_ONLY_KINDS:
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if kind == "etcd" else [])
        cert, key = _sign(d, ETCD_CA, etcd_user_for(kind, name), usages, _server_sans(kind, hosts), start, end)
        files = _save(d, stem, cert, key)
        _record(d, cert, kind, name, ETCD_CA, files.cert)
        return files
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(Identity(kind, name).uri)]
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if kind in SERVER_KINDS:
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
    cert, key = _sign(d, GRPC_CA, f"gpucoord-{kind}-{name}", usages, sans + _server_sans(kind, hosts), start, end)
    files = _save(d, stem, cert, key)
    _record(d, cert, kind, name, GRPC_CA, files.cert)
    if not to_etcd:
        return files
    etcd_cert, etcd_key = _sign(d, ETCD_CA, etcd_user_for(kind, name), [ExtendedKeyUsageOID.CLIENT_AUTH], [],
                                start, end)
    etcd_files = _save(d, f"{stem}.etcd", etcd_cert, etcd_key)
    _record(d, etcd_cert, kind, name, ETCD_CA, etcd_files.cert)
    return IssuedFiles(files.cert, files.key, etcd_files.cert, etcd_files.key)


def _server_sans(kind: str, hosts: Sequence[str]) -> list[x509.GeneralName]:
    if kind not in SERVER_KINDS:
        return []
    sans: list[x509.GeneralName] = []
    seen: set[str] = set()
    for h in ["127.0.0.1", "::1", "localhost", socket.gethostname(), *hosts]:
        if not h or h in seen:
            continue
        seen.add(h)
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    return sans


def _sign(d: pathlib.Path, ca: str, common_name: str, usages: list[x509.ObjectIdentifier],
          sans: list[x509.GeneralName], start: datetime.datetime,
          end: datetime.datetime) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    ca_cert = x509.load_pem_x509_certificate((d / f"{ca}.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((d / f"{ca}.key").read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
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
    return builder.sign(ca_key, hashes.SHA256()), key


def _save(d: pathlib.Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> IssuedFiles:
    files = IssuedFiles(d / f"{stem}.crt", d / f"{stem}.key")
    _write(files.key, _key_pem(key), private=True)
    _write(files.cert, cert.public_bytes(serialization.Encoding.PEM), private=False)
    return files


def serial_of(cert: x509.Certificate) -> str:
    """A certificate's serial as the deny list names it (lowercase hex)."""
    return format(cert.serial_number, "x")


def _record(d: pathlib.Path, cert: x509.Certificate, kind: str, name: str, ca: str, path: pathlib.Path) -> None:
    entry = {"serial": serial_of(cert), "role": kind, "name": name, "ca": ca, "file": path.name,
             "not_after": cert.not_valid_after_utc.isoformat(), "issued_at": _now().isoformat(timespec="seconds")}
    with open(d / INDEX, "a") as f:
        f.write(json.dumps(entry, sort_keys=True) + "\n")


def issued(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every certificate ``issue`` recorded in ``directory`` (oldest first); [] without a record."""
    path = pathlib.Path(directory) / INDEX
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("serial"), str):
            out.append(entry)
    return out
