"""``gpucoord certs`` and ``gpucoord etcd-setup``: the commands around coordinator.security's certificates
and etcd roles, with the CLI's conventions (one ``gpucoord: error:`` line, exit codes 1/2/3)."""
from __future__ import annotations

import argparse
import asyncio
from typing import Any, Callable

import grpc

from coordinator.cli.common import EXIT_UNREACHABLE, CliError, UsageError
from coordinator.security import certs, etcd_auth


def cmd_certs(args: argparse.Namespace) -> int:
    try:
        if args.certs_cmd == "init":
            files = certs.init_ca(args.dir, days=args.days or certs.CA_DAYS, force=args.force)
            print(f"CA: {files.cert} (key {files.key}, keep it private)")
        else:
            files = certs.issue(args.dir, args.role, args.name, hosts=args.host_ip, days=args.days)
            print(f"{args.role} {args.name}: {files.cert} (key {files.key})")
    except ValueError as e:
        raise UsageError(str(e), f"see 'gpucoord certs {args.certs_cmd} --help'") from e
    except OSError as e:
        raise CliError(f"certs: {e}", f"is {args.dir} writable?") from e
    return 0


def cmd_etcd_setup(args: argparse.Namespace) -> int:
    try:
        security = etcd_auth.from_args(args)
        files = asyncio.run(etcd_auth.setup_roles(args.etcd.split(",")[0], security, args.prefix, args.node,
                                                  password_dir=args.password_dir, enable=not args.no_enable))
    except (etcd_auth.EtcdSecurityError, OSError) as e:
        raise UsageError(str(e), "see 'gpucoord etcd-setup --help'") from e
    except Exception as e:   # noqa: BLE001 - etcd's answer, shown as is
        details = e.details() if hasattr(e, "details") else str(e)
        code = e.code().name if isinstance(e, grpc.RpcError) and callable(getattr(e, "code", None)) else ""
        if code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
            raise CliError(f"cannot reach etcd at {args.etcd} ({code}: {details})",
                           "is etcd running? give its address with --etcd HOST:PORT (and --etcd-ca for TLS)",
                           EXIT_UNREACHABLE) from e
        raise CliError(f"etcd refused: {details}", "once auth is on, etcd-setup needs etcd's root user "
                       "(--etcd-cert of a certificate with CN=root, or --etcd-user root)") from e
    for user, path in sorted(files.items()):
        how = f"password in {path}" if path else "client certificate with CN=" + user
        print(f"etcd user {user}: {how}")
    print("etcd auth is enabled" if not args.no_enable else "roles and users created; auth not enabled")
    return 0


def add_parsers(sub: Any, command: Callable[..., argparse.ArgumentParser]) -> None:
    """``certs`` and ``etcd-setup`` on ``sub``; ``command(sub, name, uses, **kw)`` makes a subcommand that
    takes the global options ``uses`` (coordinator.cli.main)."""
    ce = command(sub, "certs", help="make a CA and issue certificates (ECDSA P-256)")
    csub = ce.add_subparsers(dest="certs_cmd", required=True, metavar="init|issue")
    ini = command(csub, "init", help="make ca.crt and ca.key in DIR")
    ini.add_argument("--dir", required=True)
    ini.add_argument("--days", type=int, default=None, help=f"CA lifetime (default {certs.CA_DAYS})")
    ini.add_argument("--force", action="store_true", help="replace an existing CA")
    iss = command(csub, "issue", help="issue ROLE-NAME.crt/.key for gpucoord://ROLE/NAME")
    iss.add_argument("--dir", required=True)
    iss.add_argument("--role", required=True, choices=certs.CERT_KINDS)
    iss.add_argument("--name", required=True)
    iss.add_argument("--host-ip", action="append", default=[], metavar="IP_OR_DNS",
                     help="a server's address, as a SAN (repeatable)")
    iss.add_argument("--days", type=int, default=None,
                     help="lifetime (default: " + ", ".join(f"{k} {v}" for k, v in certs.DEFAULT_DAYS.items()) + ")")
    ce.set_defaults(fn=cmd_certs)

    es = command(sub, "etcd-setup", ("etcd", "prefix"),
                 help="create etcd roles and users for gpucoord, then enable auth")
    es.add_argument("--node", action="append", default=[], metavar="HOST",
                    help="a host whose node daemon gets its own user (repeatable)")
    es.add_argument("--password-dir", default=None,
                    help="give each user a random password, written to DIR/<user>.password (0600); default: "
                         "no passwords, users authenticate with client certificates (CN = user)")
    es.add_argument("--no-enable", action="store_true", help="create roles and users but leave auth off")
    etcd_auth.add_arguments(es)
    es.set_defaults(fn=cmd_etcd_setup)
