"""The certificate side of ``gpucoord up --secure`` (the commands ``certs`` and ``etcd-setup`` are in
coordinator/cli/security.py)."""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Sequence

from coordinator.security import certs, etcd_auth
from coordinator.security.tls import TlsFiles


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
