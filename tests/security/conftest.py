"""Fixtures of the security tests: a PKI (``tests.support.pki.make_pki``); ``own_etcd`` is in tests/conftest.py."""
from __future__ import annotations

from typing import Iterator

import pytest

from tests.support.pki import Pki, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pki]:
    yield make_pki(tmp_path_factory.mktemp("pki"))

