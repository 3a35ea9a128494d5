"""The history checker reads a test's history from where its prefix was known empty, not from revision 1 of the
etcd the whole run shares (each check scanned every earlier test's history, and under load ran past its
deadline). Starting there loses nothing: every event under the prefix comes after it."""
from __future__ import annotations

import pytest

from tests.history import history_start, read_history
from tests.support.cluster import Cluster, EtcdEndpoint, revision

pytestmark = pytest.mark.integration


def test_a_new_prefix_is_read_from_where_it_was_empty_and_loses_no_event(etcd: EtcdEndpoint, prefix: str) -> None:
    elsewhere = Cluster(etcd.endpoints, prefix + "elsewhere/")
    try:
        for i in range(20):                       # earlier history of the shared etcd, under another prefix
            elsewhere.lt.run(elsewhere.store.put(elsewhere.keys.root() + b"k%d" % i, b"{}"))
        before = revision(elsewhere)
    finally:
        elsewhere.close()
    cluster = Cluster(etcd.endpoints, prefix + "mine/")
    try:
        root = cluster.keys.root()
        assert history_start(root) == before + 1 and history_start(cluster.keys.leases()) == before + 1
        written = [cluster.lt.run(cluster.store.put(root + b"a%d" % i, b"{}")) for i in range(5)]
        cluster.lt.run(cluster.store.delete(root + b"a0"))
        events = cluster.lt.run(read_history(cluster.store, root))
        assert [ev.kv.mod_revision for ev in events if ev.kind == "PUT"] == written
        assert [ev.kv.key for ev in events if ev.kind == "DELETE"] == [root + b"a0"]
    finally:
        cluster.close()


def test_a_prefix_that_already_holds_keys_is_read_from_revision_1(etcd: EtcdEndpoint, prefix: str) -> None:
    first = Cluster(etcd.endpoints, prefix)
    try:
        first.lt.run(first.store.put(first.keys.root() + b"kept", b"{}"))
    finally:
        first.close()
    again = Cluster(etcd.endpoints, prefix)        # the same prefix, not empty: its whole history is needed
    try:
        events = again.lt.run(read_history(again.store, again.keys.root()))
        assert again.keys.root() + b"kept" in [ev.kv.key for ev in events]
        assert again.lt.run(again.store.get_prefix(again.keys.root())).kvs
    finally:
        again.close()

