"""``gpucoord certs`` and ``gpucoord etcd-setup``: the commands around coordinator.security's certificates
and etcd roles, with the CLI's conventions (one ``gpucoord: error:`` line, exit codes 1/2/3)."""
from __future__ import annotations

import argparse
import asyncio
import datetime
import getpass
import re
import sys
from typing import Any, Awaitable, Callable, Mapping, TypeVar

import grpc

from coordinator import errors
from coordinator.cli.common import (
    DEFAULT_COORDINATOR,
    EXIT_UNREACHABLE,
    CliError,
    UsageError,
    _client_tls,
    _env,
    _stub,
    rpc_error,
)
from coordinator.etcd.auth import setup_roles
from coordinator.etcd.store import Store
from coordinator.keys import Keys, last_segment
from coordinator.records import dumps
from coordinator.security import certs, etcd_auth
from coordinator.txn import Absent, Put

P = TypeVar("P", bound=argparse.ArgumentParser)
# certs list|revoke: through a coordinator (--coordinator, the operator's --tls-*), or --etcd (break glass).
_REVOCATION_USES = ("coordinator", "etcd", "prefix", "tls-ca", "tls-cert", "tls-key")
T = TypeVar("T")


def cmd_certs(args: argparse.Namespace) -> int:
    if args.certs_cmd in ("list", "revoke"):
        return _certs_list(args) if args.certs_cmd == "list" else _certs_revoke(args)
    try:
        if args.certs_cmd == "init":
            files = certs.init_ca(args.dir, days=certs.CA_DAYS if args.days is None else args.days, force=args.force)
            print(f"gRPC CA: {files.cert} (key {files.key}, keep it private): signs every identity's certificate")
            print(f"etcd CA: {files.etcd_cert} (key {files.etcd_key}, keep it private): signs etcd's server and "
                  "its clients (coordinators; root for break glass), never an agent, an operator or a node; give "
                  "it to etcd as --trusted-ca-file")
        else:
            files = certs.issue(args.dir, args.role, args.name, hosts=args.host_ip, days=args.days,
                                etcd_client=args.etcd_client)
            print(f"{args.role} {args.name}: {files.cert} (key {files.key})")
            if files.etcd_cert is not None:
                print(f"{args.role} {args.name} towards etcd: {files.etcd_cert} (key {files.etcd_key})")
    except ValueError as e:
        raise UsageError(str(e), f"see 'gpucoord certs {args.certs_cmd} --help'") from e
    except OSError as e:
        raise CliError(f"certs: {e}", f"is {args.dir} writable?") from e
    return 0


_BREAK_GLASS_HINT = ("--etcd writes etcd directly, the break-glass path: it needs etcd's root credentials "
                     "(--etcd-ca etcd-ca.crt --etcd-cert etcd-root-root.crt --etcd-key ...); without --etcd the "
                     "command goes through a coordinator with the operator's certificate")


def _break_glass(args: argparse.Namespace) -> bool:
    """Whether ``certs list|revoke`` talks to etcd itself: only with ``--etcd`` given (docs/security.md "Running
    securely": break glass, with etcd's root). Otherwise it calls a coordinator (``--coordinator``, default
    $GPUCOORD_COORDINATOR) with the operator's certificate, and etcd credentials are refused."""
    if args.etcd is not None and args.coordinator is not None:
        raise UsageError("--coordinator and --etcd: give one (--etcd is the break-glass path, etcd's root "
                         "credentials)", f"see 'gpucoord certs {args.certs_cmd} --help'")
    if args.etcd is None:
        given = [f"--etcd-{f.replace('_', '-')}" for f in ("ca", "cert", "key", "user", "password", "password_file")
                 if getattr(args, f"etcd_{f}", None) is not None]
        if given:
            raise UsageError(f"{given[0]}: only with --etcd (the break-glass path); operators revoke through a "
                             "coordinator with their certificate (--tls-*)", f"see 'gpucoord certs {args.certs_cmd} --help'")
        if args.coordinator is None:
            args.coordinator = _env("COORDINATOR", DEFAULT_COORDINATOR)
    return args.etcd is not None


def _coordinator_call(args: argparse.Namespace, call: Callable[[Any], T]) -> T:
    """``call(stub)`` on the coordinator of ``--coordinator``, with the operator's TLS files."""
    stub = _stub(args.coordinator, _client_tls(args))
    try:
        return call(stub)
    except grpc.RpcError as e:
        raise rpc_error(e, args.coordinator) from e


def _etcd_call(args: argparse.Namespace, body: Callable[[Store, Keys], Awaitable[T]]) -> T:
    """``body`` with a store on ``--etcd`` (one attempt, a short deadline, the etcd credentials given): the
    break-glass path."""
    try:
        security = etcd_auth.from_args(args)
    except ValueError as e:
        raise UsageError(str(e), f"see 'gpucoord certs {args.certs_cmd} --help'") from e

    async def run() -> T:
        store = Store(args.etcd.split(","), timeout=3.0, retry_for=0.0, security=security)
        try:
            await store.connect()
            return await body(store, Keys(args.prefix))
        except errors.GpucoordError as e:
            if "permission denied" in e.message or "user name" in e.message or "authentication" in e.message:
                raise CliError(f"etcd refused: {e.message}", _BREAK_GLASS_HINT) from e
            raise CliError(f"cannot reach etcd at {args.etcd} ({e.message})",
                           "is etcd running? give its address with --etcd HOST:PORT (and --etcd-ca for TLS)",
                           EXIT_UNREACHABLE) from e
        except (grpc.RpcError, OSError) as e:
            raise CliError(f"cannot reach etcd at {args.etcd} ({e})",
                           "is etcd running? give its address with --etcd HOST:PORT (and --etcd-ca for TLS)",
                           EXIT_UNREACHABLE) from e
        finally:
            await store.close()
    return asyncio.run(run())


def _revoked(args: argparse.Namespace) -> dict[str, dict[str, object]]:
    """serial -> its revocation record: through a coordinator, or (``--etcd``) from etcd."""
    if not _break_glass(args):
        from agent_client.api import coordinator_pb2 as pb
        listed = _coordinator_call(args, lambda stub: stub.ListRevokedCertificates(
            pb.ListRevokedCertificatesRequest(), timeout=10))
        return {c.serial: {"role": c.role, "name": c.name, "not_after": c.not_after, "revoked_at": c.revoked_at}
                for c in listed.certificates}

    async def read(store: Store, keys: Keys) -> dict[str, dict[str, object]]:
        out: dict[str, dict[str, object]] = {}
        for kv in (await store.get_prefix(keys.revocations())).kvs:
            try:
                doc = kv.json()
            except ValueError:
                doc = {}
            out[last_segment(kv.key)] = doc if isinstance(doc, dict) else {}
        return out
    return _etcd_call(args, read)


def _certs_list(args: argparse.Namespace) -> int:
    """Every certificate issued from DIR, its state (valid, expired, REVOKED), and revocations in etcd of
    certificates that DIR did not issue."""
    entries = certs.issued(args.dir)
    revoked = {} if args.offline else _revoked(args)
    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"{'SERIAL':<42} {'ROLE':<12} {'NAME':<24} {'CA':<8} {'EXPIRES':<26} STATE")
    for e in entries:
        expires = str(e.get("not_after", ""))
        try:
            expired = datetime.datetime.fromisoformat(expires) < now
        except ValueError:
            expired = False
        state = "?" if args.offline else "valid"
        if e["serial"] in revoked:
            state = "REVOKED " + str(revoked[e["serial"]].get("revoked_at", ""))
        elif expired:
            state = "expired"
        print(f"{e['serial']:<42} {e.get('role', '?'):<12} {e.get('name', '?'):<24} {e.get('ca', '?'):<8} "
              f"{expires:<26} {state}")
    known = {e["serial"] for e in entries}
    for serial, doc in sorted(revoked.items()):
        if serial not in known:
            print(f"{serial:<42} {str(doc.get('role', '?')):<12} {str(doc.get('name', '?')):<24} {'?':<8} "
                  f"{str(doc.get('not_after', '?')):<26} REVOKED {doc.get('revoked_at', '')} (not issued from {args.dir})")
    if args.offline:
        print("# --offline: revocations (in etcd) not read", file=sys.stderr)
    return 0


def _certs_revoke(args: argparse.Namespace) -> int:
    """Write ``revoked/<serial>`` for every certificate ``args.target`` names: a serial, or a NAME (or
    ROLE/NAME) of certificates issued from ``--dir`` that have not expired yet."""
    target = args.target
    entries = certs.issued(args.dir) if args.dir else []
    role, _, name = target.rpartition("/")
    now = datetime.datetime.now(datetime.timezone.utc)

    def live(e: Mapping[str, object]) -> bool:
        try:
            return datetime.datetime.fromisoformat(str(e.get("not_after"))) > now
        except ValueError:
            return True
    chosen = [e for e in entries if e["serial"] == target.lower()]
    if not chosen:
        chosen = [e for e in entries if e.get("name") == name and (not role or e.get("role") == role) and live(e)]
    if not chosen:
        if re.fullmatch(r"[0-9a-fA-F]{1,64}", target):
            chosen = [{"serial": target.lower().lstrip("0") or "0", "role": "", "name": "", "not_after": ""}]
        elif args.dir:
            raise CliError(f"certs revoke: no certificate named {target!r} that has not expired was issued from "
                           f"{args.dir}", "'gpucoord certs list --dir DIR' lists them; give a SERIAL or NAME")
        else:
            raise UsageError(f"certs revoke: {target!r} is not a serial (hex); a NAME needs --dir, where the "
                             "certificates were issued", "see 'gpucoord certs revoke --help'")
    reason = args.reason or ""
    if len(reason.encode()) > 256:
        raise UsageError("--reason: at most 256 bytes", "see 'gpucoord certs revoke --help'")

    if _break_glass(args):
        async def write(store: Store, keys: Keys) -> list[bool]:
            created = []
            for e in chosen:
                key = keys.revoked(e["serial"])
                value = dumps({"serial": e["serial"], "role": e.get("role", ""), "name": e.get("name", ""),
                               "not_after": e.get("not_after", ""), "reason": reason,
                               "revoked_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                               "revoked_by": f"break glass: {getpass.getuser()}"})
                res = await store.commit([Absent(key)], [Put(key, value)])
                created.append(res.succeeded)
            return created
        created = _etcd_call(args, write)
    else:
        from agent_client.api import coordinator_pb2 as pb
        requests = [pb.RevokeCertificateRequest(certificate=pb.RevokedCertificate(
            serial=e["serial"], role=str(e.get("role", "")), name=str(e.get("name", "")),
            not_after=str(e.get("not_after", "")), reason=reason)) for e in chosen]
        created = _coordinator_call(args, lambda stub: [bool(stub.RevokeCertificate(r, timeout=10).created)
                                                        for r in requests])
    for e, new in zip(chosen, created):
        what = f" ({e.get('role')} {e.get('name')}, {e.get('ca', '?')} CA)" if e.get("name") else ""
        print(f"{'revoked' if new else 'already revoked'}: {e['serial']}{what}")
    print("every coordinator and node refuses it from now on (they watch revoked/); etcd itself does not read "
          "this list: see docs/security.md on revoking an etcd client certificate")
    return 0


def cmd_etcd_setup(args: argparse.Namespace) -> int:
    try:
        security = etcd_auth.from_args(args)
        files = asyncio.run(setup_roles(args.etcd.split(",")[0], security, args.prefix, args.node,
                                                  password_dir=args.password_dir, enable=not args.no_enable))
    except (etcd_auth.EtcdSecurityError, OSError) as e:
        raise UsageError(str(e), "see 'gpucoord etcd-setup --help'") from e
    except Exception as e:
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


def add_parsers(sub: argparse._SubParsersAction[P],
                command: Callable[..., argparse.ArgumentParser]) -> None:
    """``certs`` and ``etcd-setup`` on ``sub``; ``command(sub, name, uses, **kw)`` makes a subcommand that
    takes the global options ``uses`` (coordinator.cli.main)."""
    ce = command(sub, "certs", _REVOCATION_USES,
                 help="make the CAs, issue, list and revoke certificates (ECDSA P-256)")
    csub = ce.add_subparsers(dest="certs_cmd", required=True, metavar="init|issue|list|revoke")
    ini = command(csub, "init", help="make the gRPC CA (ca.crt) and the etcd CA (etcd-ca.crt) in DIR")
    ini.add_argument("--dir", required=True)
    ini.add_argument("--days", type=int, default=None, help=f"CA lifetime (default {certs.CA_DAYS})")
    ini.add_argument("--force", action="store_true", help="replace existing CAs")
    iss = command(csub, "issue", help="issue ROLE-NAME.crt/.key for gpucoord://ROLE/NAME (and ROLE-NAME.etcd.crt/.key "
                                      "for a coordinator)")
    iss.add_argument("--dir", required=True)
    iss.add_argument("--role", required=True, choices=certs.CERT_KINDS)
    iss.add_argument("--name", required=True)
    iss.add_argument("--host-ip", action="append", default=[], metavar="IP_OR_DNS",
                     help="a server's address, as a SAN (repeatable)")
    iss.add_argument("--etcd-client", action="store_true",
                     help="--role node: also an etcd client certificate, for a node daemon of an earlier release that "
                          "talks to etcd itself (until it is upgraded to --coordinator)")
    iss.add_argument("--days", type=int, default=None,
                     help="lifetime (default: " + ", ".join(f"{k} {v}" for k, v in certs.DEFAULT_DAYS.items()) + ")")
    li = command(csub, "list", _REVOCATION_USES,
                 help="the certificates issued from DIR, and which are revoked (asked of a coordinator)")
    li.add_argument("--dir", required=True)
    li.add_argument("--offline", action="store_true", help="do not read etcd (revocations unknown)")
    etcd_auth.add_arguments(li)
    rv = command(csub, "revoke", _REVOCATION_USES,
                 help="revoke certificates: a coordinator writes revoked/<serial> (the operator's certificate; "
                      "--etcd: break glass, etcd's root)")
    rv.add_argument("target", metavar="NAME|ROLE/NAME|SERIAL",
                    help="a serial (hex), or the name of certificates issued from --dir that have not expired")
    rv.add_argument("--dir", default=None, help="where the certificates were issued (needed for a NAME)")
    rv.add_argument("--reason", default="", help="recorded with the revocation (at most 256 bytes)")
    etcd_auth.add_arguments(rv)
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
