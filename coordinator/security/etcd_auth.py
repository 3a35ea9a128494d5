"""etcd's own TLS and RBAC, as gpucoord uses them.

``EtcdSecurity`` is what a process presents to etcd: a CA to verify etcd with, a client certificate
(whose CN etcd takes as the user when it runs with ``--client-cert-auth``), and/or a user and password.
This module is configuration only: ``coordinator.etcd.auth.open_channel`` is the one place that decides
between a plaintext and a TLS channel and adds etcd's auth token to every call.

``role_permissions`` says which roles and users confine each party; ``coordinator.etcd.auth.setup_roles``
(``gpucoord etcd-setup``) creates them:

======================  ===================================================================
etcd user               may
======================  ===================================================================
root                    everything (etcd's administrator; needed to enable auth; the break-glass
                        path: ``gpucoord keys``, ``certs revoke --etcd``, etcdctl)
gpucoord-coordinator    read and write the whole prefix
gpucoord-node-<host>    (only for a node daemon of an earlier release, ``gpucoord node --etcd``, until it
                        is upgraded to ``--coordinator``, which needs no etcd user) write
                        ``hosts/<host>`` and ``usage/<host>``; read ``leases/<host>/`` (the watch behind
                        CheckToken) and ``revoked/`` (the deny list)
======================  ===================================================================

Which certificates etcd accepts at all is decided by its ``--trusted-ca-file``: the etcd client CA
(``etcd-ca.crt``), which signs only the etcd client certificates of coordinators and root (and of nodes
of an earlier release, when asked). Agent, operator and node certificates come from the other CA, so they
cannot even open a TLS connection to etcd. Operators act through a coordinator's RPCs (``certs revoke``:
RevokeCertificate). ``RETIRED_USERS`` are deleted by ``etcd-setup``: an install set up by an earlier
release had a ``gpucoord-operator`` user.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
from typing import Literal, Mapping, Sequence

import grpc

from coordinator.keys import Keys, prefix_range_end

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


def add_arguments(parser: argparse._ActionsContainer) -> None:
    """The etcd credential flags, shared by every command that talks to etcd."""
    g = parser.add_argument_group("etcd TLS and auth")
    g.add_argument("--etcd-ca", default=None, help="CA of etcd's server certificate (turns TLS on)")
    g.add_argument("--etcd-cert", default=None, help="client certificate for etcd (its CN is the etcd user)")
    g.add_argument("--etcd-key", default=None, help="key of --etcd-cert")
    g.add_argument("--etcd-user", default=None, help="etcd user (password auth)")
    g.add_argument("--etcd-password", default=None, help=f"etcd password (prefer --etcd-password-file or "
                                                         f"{PASSWORD_ENV}: a flag shows in ps)")
    g.add_argument("--etcd-password-file", default=None, help="file holding the etcd password")


def from_args(args: argparse.Namespace) -> EtcdSecurity:
    return resolve(args.etcd_ca, args.etcd_cert, args.etcd_key, args.etcd_user, args.etcd_password,
                   args.etcd_password_file)


# -- roles and users ---------------------------------------------------------------------------------
def node_user(host: str) -> str:
    return f"gpucoord-node-{host}"


Permission = Literal["read", "readwrite"]
# Users (and their roles) of earlier releases that ``etcd-setup`` removes: operators no longer reach etcd.
RETIRED_USERS = ("gpucoord-operator",)


def role_permissions(prefix: str, nodes: Sequence[str]) -> dict[str, list[tuple[Permission, bytes, bytes]]]:
    """etcd role -> (permission, key, range_end) grants. range_end b"" is the one key."""
    keys = Keys(prefix)
    root = keys.root()
    revoked = keys.revocations()
    perms: dict[str, list[tuple[Permission, bytes, bytes]]] = {
        "gpucoord-coordinator": [("readwrite", root, prefix_range_end(root))],
    }
    for host in nodes:
        leases = keys.leases(host)
        perms[node_user(host)] = [("readwrite", keys.host(host), b""),
                                  ("readwrite", keys.usage(host), b""),
                                  ("read", leases, prefix_range_end(leases)),
                                  ("read", revoked, prefix_range_end(revoked))]
    return perms
