"""``gpucoord certs``, ``gpucoord etcd-setup`` and the certificate side of ``gpucoord up --secure``."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import pathlib
import sys
from typing import Sequence

from coordinator.security import certs, etcd_auth
from coordinator.security.tls import TlsFiles


def cmd_certs(args: argparse.Namespace) -> int:
    try:
        if args.certs_cmd == "init":
            files = certs.init_ca(args.dir, days=args.days or certs.CA_DAYS, force=args.force)
            print(f"CA: {files.cert} (key {files.key}, keep it private)")
        else:
            files = certs.issue(args.dir, args.role, args.name, hosts=args.host_ip, days=args.days)
            print(f"{args.role} {args.name}: {files.cert} (key {files.key})")
    except (ValueError, OSError) as e:
        print(f"gpucoord certs: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_etcd_setup(args: argparse.Namespace) -> int:
    try:
        security = etcd_auth.from_args(args)
        files = asyncio.run(etcd_auth.setup_roles(args.etcd.split(",")[0], security, args.prefix, args.node,
                                                  password_dir=args.password_dir, enable=not args.no_enable))
    except (etcd_auth.EtcdSecurityError, OSError) as e:
        print(f"gpucoord etcd-setup: {e}", file=sys.stderr)
        return 2
    except Exception as e:   # noqa: BLE001 - etcd's answer, shown as is
        details = e.details() if hasattr(e, "details") else str(e)
        print(f"gpucoord etcd-setup: etcd refused: {details}", file=sys.stderr)
        return 1
    for user, path in sorted(files.items()):
        how = f"password in {path}" if path else "client certificate with CN=" + user
        print(f"etcd user {user}: {how}")
    print("etcd auth is enabled" if not args.no_enable else "roles and users created; auth not enabled")
    return 0


def add_parsers(sub: argparse._SubParsersAction, default_etcd: str) -> None:  # type: ignore[type-arg]
    ce = sub.add_parser("certs", help="make a CA and issue certificates (ECDSA P-256)")
    csub = ce.add_subparsers(dest="certs_cmd", required=True)
    ini = csub.add_parser("init", help="make ca.crt and ca.key in DIR")
    ini.add_argument("--dir", required=True)
    ini.add_argument("--days", type=int, default=None, help=f"CA lifetime (default {certs.CA_DAYS})")
    ini.add_argument("--force", action="store_true", help="replace an existing CA")
    iss = csub.add_parser("issue", help="issue ROLE-NAME.crt/.key for gpucoord://ROLE/NAME")
    iss.add_argument("--dir", required=True)
    iss.add_argument("--role", required=True, choices=certs.CERT_KINDS)
    iss.add_argument("--name", required=True)
    iss.add_argument("--host-ip", action="append", default=[], metavar="IP_OR_DNS",
                     help="a server's address, as a SAN (repeatable)")
    iss.add_argument("--days", type=int, default=None,
                     help="lifetime (default: " + ", ".join(f"{k} {v}" for k, v in certs.DEFAULT_DAYS.items()) + ")")
    ce.set_defaults(fn=cmd_certs)

    es = sub.add_parser("etcd-setup", help="create etcd roles and users for gpucoord, then enable auth")
    es.add_argument("--etcd", default=default_etcd)
    es.add_argument("--prefix", default="/gpucoord/")
    es.add_argument("--node", action="append", default=[], metavar="HOST",
                    help="a host whose node daemon gets its own user (repeatable)")
    es.add_argument("--password-dir", default=None,
                    help="give each user a random password, written to DIR/<user>.password (0600); default: "
                         "no passwords, users authenticate with client certificates (CN = user)")
    es.add_argument("--no-enable", action="store_true", help="create roles and users but leave auth off")
    etcd_auth.add_arguments(es)
    es.set_defaults(fn=cmd_etcd_setup)


# -- up --secure ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SecureSetup:
    """The certificates of an all-in-one secure install, in ``<data dir>/pki``."""

    dir: pathlib.Path
    ca: str
    etcd_server: TlsFiles
    etcd_root: TlsFiles
    coordinator: TlsFiles
    node: TlsFiles
    operator: TlsFiles
    agents: dict[str, TlsFiles]

    def etcd_flags(self, files: TlsFiles) -> list[str]:
        return ["--etcd-ca", self.ca, "--etcd-cert", files.cert, "--etcd-key", files.key]

    def tls_flags(self, files: TlsFiles) -> list[str]:
        return ["--tls-ca", files.ca, "--tls-cert", files.cert, "--tls-key", files.key]

    def etcd_security(self, files: TlsFiles) -> etcd_auth.EtcdSecurity:
        return etcd_auth.EtcdSecurity(ca=self.ca, cert=files.cert, key=files.key)


def prepare_secure(data_dir: pathlib.Path, host: str, agents: Sequence[str]) -> SecureSetup:
    """A CA (kept if the data dir already has one) and the certificates of every part."""
    pki = data_dir / "pki"
    if not (pki / "ca.crt").exists():
        certs.init_ca(pki)
    ca = str(pki / "ca.crt")

    def issue(kind: str, name: str) -> TlsFiles:
        f = certs.issue(pki, kind, name)
        return TlsFiles(ca, str(f.cert), str(f.key))
    return SecureSetup(pki, ca, issue("etcd", "etcd"), issue("etcd-root", "root"), issue("coordinator", "coordinator"),
                       issue("node", host), issue("operator", "operator"), {a: issue("agent", a) for a in agents})
