"""Fixtures of the fault tier: ``etcd3``, a 3-member etcd cluster of the test's own (``tests.support.etcd3.Etcd3``).

At the end of every test that used it, the members' HashKV is compared at one revision (etcd's own corruption
check): a member that drifted from the others fails the test, named, and the terminal summary prints every
comparison."""
from __future__ import annotations

from typing import Iterator

import pytest

from tests.support.etcd3 import Etcd3


@pytest.fixture
def etcd3(request: pytest.FixtureRequest) -> Iterator[Etcd3]:
    e = Etcd3()
    e.cluster.start()
    try:
        yield e
        e.check_consistent(request.node.nodeid)
    finally:
        e.close()
