"""Fixtures of the security tests: a PKI (``tests.support.pki.make_pki``); ``world`` (a TLS coordinator and node,
``tests.support.tls_world``), one per module; ``own_etcd`` is in tests/conftest.py."""
from __future__ import annotations

from typing import Iterator

import pytest

from tests.support.pki import Pki, make_pki
from tests.support.tls_world import World, tls_world


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pki]:
    yield make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def world(own_etcd: list[str], pki: Pki) -> Iterator[World]:
    with tls_world(own_etcd, pki) as w:
        yield w
