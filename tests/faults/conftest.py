"""Fixtures of the fault tier: ``etcd3``, a 3-member etcd cluster of the test's own (``tests.support.etcd3.Etcd3``)."""
from __future__ import annotations

from typing import Iterator

import pytest

from tests.support.etcd3 import Etcd3


@pytest.fixture
def etcd3() -> Iterator[Etcd3]:
    e = Etcd3()
    e.cluster.start()
    try:
        yield e
    finally:
        e.close()
