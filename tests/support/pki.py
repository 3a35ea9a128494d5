"""Certificates for the security tests: ``make_pki``/``Pki``; ``coordinator_tls`` (a coordinator's TLS settings)
and ``secure_cluster`` (a Cluster whose node serves TLS); ``scrape`` (one HTTPS scrape of a /metrics)."""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import pathlib
import ssl
import urllib.error
import urllib.request
import uuid
from typing import TYPE_CHECKING, Iterator

from tests.support.cluster import Cluster

if TYPE_CHECKING:
    from coordinator.security.tls import TlsFiles


@dataclasses.dataclass(frozen=True)
class Pki:
    """Certificates for the security tests: one CA with every role, another CA, an expired certificate."""
    dir: pathlib.Path
    ca: str
    files: dict[str, TlsFiles]   # "coordinator", "node", "agent-a", "agent-b", "operator", "metrics", "viewer",
    # "other-ca", "expired"

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
             "operator": issue("operator", "ops"), "metrics": issue("metrics", "prometheus"),
             "viewer": issue("viewer", "alice")}
    past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=2)
    files["expired"] = issue("agent", "agent-a", not_before=past - datetime.timedelta(days=1),
                             not_after=past, out_name="expired-agent-a")
    other = base / "other-pki"
    certs.init_ca(other)
    theirs = issue("agent", "agent-a", directory=other)
    # Presented to our servers, verified against OUR CA: its client cert is from the other CA.
    files["other-ca"] = TlsFiles(ca, theirs.cert, theirs.key)
    return Pki(d, ca, files)


def coordinator_tls(pki: Pki) -> dict[str, str]:
    """The coordinator's certificate as ``Cluster.start_coordinator`` settings."""
    c = pki["coordinator"]
    return {"tls_ca": c.ca, "tls_cert": c.cert, "tls_key": c.key}


@contextlib.contextmanager
def secure_cluster(endpoints: list[str], pki: Pki, name: str, host: str = "h1",
                   fake_gpus: str = "2x16GiB") -> Iterator[Cluster]:
    """A Cluster under a prefix of its own (``/gpucoord-NAME-PID-RANDOM/``) with a node daemon on ``host`` that
    serves TLS with the node's certificate and sends no usage heartbeats meanwhile (the revision moves only when
    a call writes); closed at the end."""
    c = Cluster(endpoints, f"/gpucoord-{name}-{os.getpid()}-{uuid.uuid4().hex[:6]}/")
    try:
        c.start_node(host, fake_gpus, heartbeat_s=3600, tls=pki["node"])
        yield c
    finally:
        c.close()


def scrape(port: int, ca: str, files: TlsFiles | None) -> tuple[int, str]:
    """(HTTP status, body) of one scrape of ``https://127.0.0.1:PORT/metrics`` with the client certificate
    ``files`` (None: none); the status is 0 when the TLS handshake (or the first read) failed."""
    ctx = ssl.create_default_context(cafile=ca)
    if files is not None:
        ctx.load_cert_chain(files.cert, files.key)
    try:
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/metrics", context=ctx, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, ssl.SSLError, ConnectionError) as e:
        return 0, str(e)
