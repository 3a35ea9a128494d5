"""Acquire and release through agent_client against a real etcd and a real coordinator."""
from __future__ import annotations

import pytest

from agent_client import Client, errors
from tests.harness import Cluster
from tests.history import check_store

pytestmark = pytest.mark.integration


def test_acquire_release_roundtrip(cluster: Cluster) -> None:
    cluster.start_node("h1", "2x16GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="agent-a", host="h1") as c:
        with c.acquire(vram_mb=4096) as lease:
            assert lease.vram_mb == 4096 and lease.token == 1 and lease.gpu_uuid.startswith("GPU-sim-h1-")
            (stored,) = cluster.leases()
            assert stored.id == lease.id and stored.session_id == c.session_id
        assert cluster.leases() == []
        assert c.release(lease.id) is False  # idempotent
    cluster.lt.run(check_store(cluster.store, cluster.keys)).assert_ok()


def test_best_fit_places_on_the_fullest_gpu_that_fits(cluster: Cluster) -> None:
    cluster.start_node("h1", "3x16GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="agent-a", host="h1") as c:
        a = c.acquire(10_000, gpu=1)
        b = c.acquire(4_000, gpu=2)
        # Free: GPU 0 16384, GPU 1 6384, GPU 2 12384. 5000 fits everywhere; best fit leaves the least: GPU 1.
        x = c.acquire(5_000)
        assert x.gpu_index == 1
        # Free: GPU 0 16384, GPU 1 1384, GPU 2 12384. 6000 fits on 0 and 2: GPU 2.
        y = c.acquire(6_000)
        assert y.gpu_index == 2
        for lease in (a, b, x, y):
            lease.release()


def test_tokens_strictly_increase_per_gpu(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="agent-a", host="h1") as c:
        tokens = []
        for _ in range(5):
            lease = c.acquire(1000)
            tokens.append(lease.token)
            lease.release()
        assert tokens == sorted(tokens) and len(set(tokens)) == 5


def test_same_request_id_returns_the_same_lease(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="agent-a", host="h1") as c:
        first = c.acquire(4000, request_id="job-42")
        again = c.acquire(4000, request_id="job-42")
        assert again.id == first.id and again.token == first.token
        assert len(cluster.leases()) == 1
    cluster.lt.run(check_store(cluster.store, cluster.keys)).assert_ok()


def test_refused_when_full_and_invalid_when_it_can_never_fit(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="agent-a", host="h1") as c:
        c.acquire(4000)
        c.acquire(4000)
        with pytest.raises(errors.ResourceExhausted, match="vram_mb"):
            c.acquire(4000)
        with pytest.raises(errors.InvalidArgument, match="vram_mb"):
            c.acquire(9000)


def test_session_close_releases_everything(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    c = Client(addr, agent="agent-a", host="h1").connect()
    c.acquire(1000)
    c.acquire(2000)
    assert len(cluster.leases()) == 2
    c.close()
    assert cluster.leases() == []
    assert cluster.get_prefix(cluster.keys.sessions()) == []


def test_no_admission_on_a_host_whose_node_is_gone(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="agent-a", host="h1") as c:
        c.acquire(1000)
        cluster.stop_node("h1")
        with pytest.raises(errors.FailedPrecondition, match="host"):
            c.acquire(1000)


def test_same_request_id_from_another_session_is_refused(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="agent-a", host="h1") as first, Client(addr, agent="agent-a", host="h1") as second:
        lease = first.acquire(1000, request_id="job-7")
        before = cluster.state()
        with pytest.raises(errors.FailedPrecondition, match="request_id"):
            second.acquire(1000, request_id="job-7")
        assert cluster.state() == before and [x.id for x in cluster.leases()] == [lease.id]
