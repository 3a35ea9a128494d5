"""``etcd/removals.remove_entries`` against a real etcd: many conditional deletes in few transactions.

300 keys (more than one transaction may hold: etcd refuses more than 128 operations) are removed, each
only if it was not written since the revision given; keys changed or deleted meanwhile are reported as
such and left alone, and a failing common compare (a deposed leader's fence) removes nothing.
"""
from __future__ import annotations

import pytest

from coordinator.etcd.removals import Removal, remove_entries
from coordinator.txn import Absent, Exists
from tests.support.cluster import Cluster

pytestmark = pytest.mark.integration


def test_many_conditional_removals_report_each_outcome(cluster: Cluster) -> None:
    root = cluster.keys.root()
    keys = [root + f"q/{i:04d}".encode() for i in range(300)]

    async def run() -> None:
        store = cluster.store
        revisions = [await store.put(k, b"v") for k in keys]
        changed = await store.put(keys[7], b"w")         # rewritten since: kept, reported with its value
        await store.delete(keys[150])                    # gone since: reported gone
        outcomes = await remove_entries(store, [Removal(k, r) for k, r in zip(keys, revisions)])
        for i, out in enumerate(outcomes):
            if i == 7:
                assert out.removed is None and out.current is not None and out.current.mod_revision == changed
            elif i == 150:
                assert out.removed is None and out.current is None
            else:
                assert out.removed is not None and out.removed.key == keys[i] and out.removed.value == b"v", i
        left = (await store.get_prefix(root + b"q/")).kvs
        assert [kv.key for kv in left] == [keys[7]]

        # A common compare that fails (a fence) removes nothing; one that holds lets them all go.
        more = [root + f"r/{i:04d}".encode() for i in range(200)]
        revisions = [await store.put(k, b"v") for k in more]
        fence_gone = [Exists(root + b"no-such-candidacy")]
        outcomes = await remove_entries(store, [Removal(k, r) for k, r in zip(more, revisions)], common=fence_gone)
        assert all(o.removed is None and o.current is not None for o in outcomes)
        assert len((await store.get_prefix(root + b"r/")).kvs) == 200
        fence_held = [Absent(root + b"no-such-candidacy")]
        outcomes = await remove_entries(store, [Removal(k, r) for k, r in zip(more, revisions)], common=fence_held)
        assert all(o.removed is not None for o in outcomes)
        assert (await store.get_prefix(root + b"r/")).kvs == ()
    cluster.lt.run(run())
