"""Multi-host gangs larger than etcd's default transaction (issue 30, G12): a gang is one transaction of a record
and a ledger per GPU, so etcd's ``--max-txn-ops`` (default 128) bounds it at about 7 hosts x 8 GPUs. A site
that raises it (``gpucoord up`` runs its etcd with 1024) tells the coordinators (``etcd_max_txn_ops``): a
10-host x 8-GPU gang is then granted whole and released whole, one revision each. Without the setting the same
request is refused FAILED_PRECONDITION naming ``hosts`` and writes nothing; with the setting above what etcd
accepts, etcd's refusal comes back as FAILED_PRECONDITION naming ``etcd_max_txn_ops`` and nothing is written
either. Against a real etcd of the module's own, started with ``--max-txn-ops 1024``."""
from __future__ import annotations

from typing import Iterator

import pytest

from agent_client import Client, errors
from coordinator.etcd.process import EtcdCluster, EtcdOptions
from coordinator.etcd.session import EtcdSession
from coordinator.node.fake_hosts import register_fake_hosts
from coordinator.records import MAX_GANG_HOSTS
from tests.history import check_store
from tests.support.cluster import Cluster, EtcdEndpoint, events_since, revision
from tests.support.waiting import LIVENESS_S, wait_for

pytestmark = pytest.mark.integration
HOSTS, GPUS = 10, 8
MAX_TXN_OPS = 1024


@pytest.fixture(scope="module")
def large_etcd() -> Iterator[list[str]]:
    own = EtcdCluster(1, options=EtcdOptions(max_txn_ops=MAX_TXN_OPS)).start()
    try:
        yield own.endpoints
    finally:
        own.stop()


@pytest.fixture
def cluster(large_etcd: list[str], prefix: str) -> Iterator[Cluster]:
    c = Cluster(large_etcd, prefix)
    try:
        yield c
    finally:
        c.close()


# What a gang's grant, wait or reservation writes (the leader's own duties and sessions may write meanwhile).
GANG_KINDS = (b"/leases/", b"/gpus/", b"/queue/", b"/gangqueue/", b"/teamledgers/", b"/evictions/")


def _gang_writes(cluster: Cluster, before: int) -> list[bytes]:
    own = cluster.keys.prefix.encode()     # (the shared etcd holds other tests' keys too)
    return [key for _, key, _ in events_since(cluster, before)
            if key.startswith(own) and any(k in key[len(own) - 1:] for k in GANG_KINDS)]


def _fleet(cluster: Cluster, hosts: int = HOSTS, **config: object) -> tuple[str, EtcdSession]:
    addr = cluster.start_coordinator(**config)
    registration = cluster.lt.run(register_fake_hosts(cluster.store, cluster.keys, "big", hosts, f"{GPUS}x80GiB"))
    svc = cluster.coordinators[addr][1]
    wait_for(lambda: svc.mirror.get(cluster.keys.usage(f"big-{hosts - 1:04d}")) is not None, LIVENESS_S,
             "the simulated hosts in the mirror")
    return addr, registration


def _refused(cluster: Cluster, hosts: int, **config: object) -> errors.FailedPrecondition:
    """A gang of ``hosts`` x 8 whole GPUs asked on a fleet of that many simulated hosts: the refusal (FAILED_
    PRECONDITION), after which nothing of a gang was written."""
    addr, registration = _fleet(cluster, hosts, **config)
    try:
        with Client(addr, agent="agent-big", host="big-0000") as c:
            before = revision(cluster)
            with pytest.raises(errors.FailedPrecondition) as refused:
                c.acquire(exclusive=True, gpu_count=GPUS, hosts=hosts)
            assert not _gang_writes(cluster, before)
            return refused.value
    finally:
        cluster.lt.run(registration.close())


@pytest.mark.usefixtures("history_checked")
def test_a_gang_beyond_the_default_transaction_is_granted_and_released_whole_when_etcd_allows_it(
        cluster: Cluster) -> None:
    addr, registration = _fleet(cluster, etcd_max_txn_ops=MAX_TXN_OPS)
    try:
        with Client(addr, agent="agent-big", host="big-0000") as c:
            before = revision(cluster)
            lease = c.acquire(exclusive=True, gpu_count=GPUS, hosts=HOSTS)
            records = cluster.get_prefix(cluster.keys.leases())
            assert len(records) == HOSTS * GPUS
            assert len({lease.part(r).host for r in range(HOSTS)}) == HOSTS
            assert lease.release()
            assert not cluster.get_prefix(cluster.keys.leases())
            keys = {kv.key for kv in records}
            events = [(kind, rev) for kind, key, rev in events_since(cluster, before) if key in keys]
            puts = {rev for kind, rev in events if kind == "PUT"}
            deletes = {rev for kind, rev in events if kind == "DELETE"}
            print(f"{HOSTS} x {GPUS} gang: granted at revision {puts}, released at {deletes}")
            assert len(puts) == 1 and len(deletes) == 1, (puts, deletes)
    finally:
        cluster.lt.run(registration.close())


@pytest.mark.usefixtures("history_checked")
def test_a_gang_beyond_the_configured_transaction_is_refused_naming_hosts_and_writes_nothing(
        cluster: Cluster) -> None:
    refused = _refused(cluster, HOSTS)      # etcd_max_txn_ops left at etcd's default, 128
    assert refused.field == "hosts", refused
    assert "etcd_max_txn_ops" in str(refused)


def test_a_setting_above_what_etcd_accepts_is_refused_naming_it_and_writes_nothing(etcd: EtcdEndpoint,
                                                                                   prefix: str) -> None:
    """etcd_max_txn_ops 1024 against an etcd left at its default (128): etcd's refusal of the 10 x 8 gang's
    transaction comes back as FAILED_PRECONDITION naming the setting, and nothing is written."""
    cluster = Cluster(etcd.endpoints, prefix + "default-etcd/")
    try:
        refused = _refused(cluster, HOSTS, etcd_max_txn_ops=MAX_TXN_OPS)
        assert refused.field == "etcd_max_txn_ops", refused
        assert not cluster.get_prefix(cluster.keys.leases())
        cluster.lt.run(check_store(cluster.store, cluster.keys), timeout=240).assert_ok()
    finally:
        cluster.close()


@pytest.mark.usefixtures("history_checked")
def test_a_gang_whose_records_would_pass_etcds_request_size_is_refused_naming_hosts(cluster: Cluster) -> None:
    """Each GPU's record lists every part, so a gang's grant grows with (GPUs x hosts) squared: 64 hosts x 8 GPUs
    would be megabytes, past etcd's --max-request-bytes (1.5 MiB), whatever etcd_max_txn_ops allows."""
    refused = _refused(cluster, MAX_GANG_HOSTS, etcd_max_txn_ops=4 * MAX_TXN_OPS)
    assert refused.field == "hosts", refused
    assert "bytes" in str(refused)
