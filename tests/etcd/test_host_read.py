"""One host's snapshot has one shape whoever builds it: the named ``HostSnapshot`` that ``view.read_host``
reads from etcd equals the one the replica's watch-fed mirror builds at the same revision (the admission
round decides from either, so a difference would be a decision that depends on the path)."""
from __future__ import annotations

import pytest

from coordinator.etcd.store import Store
from coordinator.keys import Keys
from coordinator.replica.mirror import Mirror
from coordinator.replica.view import read_host
from tests.support.cluster import EtcdEndpoint
from tests.support.waiting import LoopThread

pytestmark = pytest.mark.integration


def test_the_mirrors_host_snapshot_equals_the_one_read_from_etcd(etcd: EtcdEndpoint, prefix: str,
                                                                 lt: LoopThread) -> None:
    keys = Keys(prefix)
    u = "GPU-0"
    session_live, session_gone = keys.session("a", "s1"), keys.session("a", "s2")

    async def go() -> None:
        async with Store(etcd.endpoints) as s:
            for key in [keys.host("h1"), keys.usage("h1"), keys.partition("h1"), keys.gpu("h1", u),
                        keys.lease("h1", u, "l1"), keys.lease("h1", u, "l2"), keys.queue_entry("h1", "0000001-1-r"),
                        keys.departing("h1", u, "l3"), session_live,
                        # another host's keys stay out of h1's snapshot
                        keys.host("h2"), keys.lease("h2", u, "l9"), keys.queue_entry("h2", "0000002-1-r")]:
                await s.put(key, b"{}")
            read = await read_host(s, keys, "h1", [session_live, session_gone])
            root = await s.get_prefix(keys.root())
            mirror = Mirror(keys)
            mirror.reset(root.kvs, root.revision)
            assert root.revision == read.revision
            assert mirror.host_snapshot("h1", [session_live, session_gone]) == read
            # every field is filled, so the equality compares something in each
            assert read.host and read.usage and read.partition and read.ledgers and read.queue and read.departing
            assert len(read.leases) == 2 and read.extra[0] is not None and read.extra[1] is None
    lt.run(go())
