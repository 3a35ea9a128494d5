"""Fixtures of the security tests: a PKI (``tests.harness.make_pki``) and an etcd per module."""
from __future__ import annotations

from typing import Iterator

import pytest

from tests.harness import Pki, make_pki


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
