"""Certificates for the security tests: one CA with every role, another CA, an expired certificate."""
from __future__ import annotations

import asyncio
import dataclasses
import datetime
import pathlib
from typing import Iterator

import pytest

from coordinator.security import certs
from coordinator.security.tls import TlsFiles
from tests.harness import Cluster


@dataclasses.dataclass(frozen=True)
class Pki:
    dir: pathlib.Path
    ca: str
    files: dict[str, TlsFiles]   # "coordinator", "node", "agent-a", "agent-b", "operator", "other-ca", "expired"

    def __getitem__(self, name: str) -> TlsFiles:
        return self.files[name]


def make_pki(base: pathlib.Path, host: str = "h1") -> Pki:
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


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pki]:
    yield make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def own_etcd() -> Iterator[list[str]]:
    """An etcd of the module's own: "a refused call changed nothing" compares etcd's revision, which
    sessions of other modules (expiring in the shared etcd) would move."""
    from coordinator.etcd.process import EtcdCluster
    cluster = EtcdCluster(1).start()
    try:
        yield cluster.endpoints
    finally:
        cluster.stop()


def revision(cluster: Cluster) -> int:
    from coordinator.etcd.ops import range_req
    return int(cluster.lt.run(cluster.store.snapshot([range_req(b"/")])).revision)


def writes_since(cluster: Cluster, before: int) -> list[str]:
    """Keys written (put or deleted) after revision ``before``, other than the node daemon's own
    ``hosts/`` and ``usage/`` (it republishes usage by itself when leases change): on an etcd of the
    module's own, an empty list means nothing that a request could have caused was written."""
    now = revision(cluster)
    if now == before:
        return []

    async def collect() -> list[tuple[str, bytes, int]]:
        seen: list[tuple[str, bytes, int]] = []
        async for batch in cluster.store.watch(b"/", start_revision=before + 1):
            seen += [(ev.kind, ev.kv.key, ev.kv.mod_revision) for ev in batch.events]
            if any(rev >= now for *_, rev in seen):
                return seen
        return seen
    events = cluster.lt.run(asyncio.wait_for(collect(), 10))
    return [f"{kind} {key.decode(errors='replace')}" for kind, key, rev in events
            if rev <= now and cluster.keys.parse(key)[0] not in ("hosts", "usage")]
