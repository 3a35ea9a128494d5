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
    """The certificates of an all-in-one secure install, in ``<data dir>/pki``: ``ca`` signs the gRPC
    identities, ``etcd_ca`` etcd's server and its clients (``etcd_clients``: the coordinator alone, and
    ``etcd_root`` for break glass; the operator and the node daemon talk to the coordinator only)."""

    dir: pathlib.Path
    ca: str
    etcd_ca: str
    etcd_server: TlsFiles
    etcd_root: TlsFiles
    coordinator: TlsFiles
    node: TlsFiles
    operator: TlsFiles
    agents: dict[str, TlsFiles]
    etcd_clients: dict[str, TlsFiles]   # "coordinator" -> its etcd client certificate (no operator's, no node's)

    def etcd_flags(self, role: str) -> list[str]:
        files = self.etcd_clients[role]
        return ["--etcd-ca", self.etcd_ca, "--etcd-cert", files.cert, "--etcd-key", files.key]

    def tls_flags(self, files: TlsFiles) -> list[str]:
        return ["--tls-ca", files.ca, "--tls-cert", files.cert, "--tls-key", files.key]

    def etcd_security(self, files: TlsFiles) -> etcd_auth.EtcdSecurity:
        return etcd_auth.EtcdSecurity(ca=self.etcd_ca, cert=files.cert, key=files.key)

    def break_glass_env(self) -> dict[str, str]:
        """``GPUCOORD_ETCD_CA/CERT/KEY`` of etcd's root (``gpucoord keys``, ``certs revoke --etcd``): break glass."""
        return {"GPUCOORD_ETCD_CA": self.etcd_ca, "GPUCOORD_ETCD_CERT": self.etcd_root.cert,
                "GPUCOORD_ETCD_KEY": self.etcd_root.key}


def prepare_secure(data_dir: pathlib.Path, host: str, agents: Sequence[str]) -> SecureSetup:
    """Both CAs (kept if the data dir already has them) and the certificates of every part."""
    pki = data_dir / "pki"
    if not ((pki / "ca.crt").exists() and (pki / "etcd-ca.crt").exists()):
        certs.init_ca(pki)
    ca, etcd_ca = str(pki / "ca.crt"), str(pki / "etcd-ca.crt")
    etcd_clients: dict[str, TlsFiles] = {}

    def issue(kind: str, name: str) -> TlsFiles:
        f = certs.issue(pki, kind, name)
        if f.etcd_cert is not None and f.etcd_key is not None:
            etcd_clients[kind] = TlsFiles(etcd_ca, str(f.etcd_cert), str(f.etcd_key))
        return TlsFiles(etcd_ca if kind in certs.ETCD_ONLY_KINDS else ca, str(f.cert), str(f.key))
    return SecureSetup(pki, ca, etcd_ca, issue("etcd", "etcd"), issue("etcd-root", "root"),
                       issue("coordinator", "coordinator"), issue("node", host), issue("operator", "operator"),
                       {a: issue("agent", a) for a in agents}, etcd_clients)
