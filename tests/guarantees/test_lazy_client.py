"""The client opens its session on the first call that needs one: no ``with`` or ``connect()`` required."""
from __future__ import annotations

import asyncio

import pytest

from agent_client import AsyncClient, Client, errors
from coordinator.etcd.process import free_port
from tests.support.cluster import Cluster

pytestmark = pytest.mark.integration


def test_client_acquires_without_with_or_connect(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    c = Client(addr, agent="agent-a", host="h1")
    try:
        lease = c.acquire(vram_mb=1)
        assert c.session_id and {x.id for x in cluster.leases()} == {lease.id}
        assert lease.release() and not cluster.leases()
    finally:
        c.close()
    assert not cluster.get_prefix(cluster.keys.sessions()), "close() did not end the lazily opened session"


def test_async_client_opens_one_session_for_concurrent_first_calls(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()

    async def go() -> None:
        c = AsyncClient(addr, agent="agent-a", host="h1")
        try:
            leases = await asyncio.gather(*(c.acquire(vram_mb=10) for _ in range(8)))
            stored = cluster.leases()   # the cluster's loop is another thread: a blocking read is fine here
            assert {lease.id for lease in leases} == {x.id for x in stored}
            assert {x.session_id for x in stored} == {c.session_id}
            assert len(cluster.get_prefix(cluster.keys.sessions())) == 1
        finally:
            await c.close()
    asyncio.run(go())


def test_the_error_of_a_failed_first_call_names_the_address() -> None:
    addr = f"127.0.0.1:{free_port()}"
    c = Client(addr, agent="agent-a", host="h1", retry_for=0.2)
    try:
        with pytest.raises(errors.Unavailable) as info:
            c.acquire(vram_mb=1)
        assert f"cannot open a session at {addr}" in info.value.message
    finally:
        c.close()
