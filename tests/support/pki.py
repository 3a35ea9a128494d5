"""Certificates for the security tests: ``make_pki``/``Pki``."""
from __future__ import annotations

import dataclasses
import datetime
import pathlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coordinator.security.tls import TlsFiles

@dataclasses.dataclass(frozen=True)
class Pki:
    """Certificates for the security tests: one CA with every role, another CA, an expired certificate."""
    dir: pathlib.Path
    ca: str
    files: dict[str, TlsFiles]   # "coordinator", "node", "agent-a", "agent-b", "operator", "other-ca", "expired"

    def __getitem__(self, name: str) -> TlsFiles:
        return self.files[name]


def make_pki(base: pathlib.Path, host: str = "h1") -> Pki:
    from coordinator.security import certs
    from coordinator.security.tls import TlsFiles
    d = base / "pki"
    certs.init_ca(d)
    ca = str(d / "ca.crt")

    def issue(kind: str, name: str, directory: pathlib.Path = d, **kw: object) -> TlsFiles:
        f = certs.issue(directory, kind, name, **kw)  # type: ignore[arg-type]
        return TlsFiles(str(directory / "ca.crt"), str(f.cert), str(f.key))

    files = {"coordinator": issue("coordinator", "c1"), "node": issue("node", host),
             "agent-a": issue("agent", "agent-a"), "agent-b": issue("agent", "agent-b"),
             "operator": issue("operator", "ops")}
    past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=2)
    files["expired"] = issue("agent", "agent-a", not_before=past - datetime.timedelta(days=1),
                             not_after=past, out_name="expired-agent-a")
    other = base / "other-pki"
    certs.init_ca(other)
    theirs = issue("agent", "agent-a", directory=other)
    # Presented to our servers, verified against OUR CA: its client cert is from the other CA.
    files["other-ca"] = TlsFiles(ca, theirs.cert, theirs.key)
    return Pki(d, ca, files)
