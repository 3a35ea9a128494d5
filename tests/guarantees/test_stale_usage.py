"""Stale usage fails closed: when the node's NVML scan hangs, admission keeps the last reported untracked
VRAM (never less) and ``status`` marks the host "usage stale". Before, stale usage counted as 0 untracked:
12,000 MiB were granted on a 16 GiB GPU that last reported 10,000 MiB used outside leases."""
from __future__ import annotations

import threading

import pytest

from agent_client import Client, errors
from coordinator.cli.common import fetch_status
from tests.support.cluster import Cluster
from tests.support.waiting import wait_for


def _host(addr: str) -> dict:  # type: ignore[type-arg]
    return fetch_status(addr, "h1")["hosts"][0]


def test_a_hung_scan_keeps_the_last_untracked_vram_and_status_says_stale(cluster: Cluster) -> None:
    daemon = cluster.start_node("h1", "1x16GiB", heartbeat_s=0.3)
    source = cluster.nodes["h1"][2]
    addr = cluster.start_coordinator()
    source.set_used(0, 10000)     # 10,000 MiB used by processes that hold no lease
    wait_for(lambda: int(_host(addr)["gpus"][0]["untracked_mb"]) == 10000, 10, "the usage report")
    assert not _host(addr)["usage_stale"]

    hang = threading.Event()
    real_usage = source.usage
    source.usage = lambda: (hang.wait(), real_usage())[1]   # type: ignore[method-assign]
    try:
        with Client(addr, agent="a", host="h1") as c:
            wait_for(lambda: _host(addr)["usage_stale"], 10, "status to mark the usage stale")
            assert daemon.session is not None and not daemon.session.done.is_set()   # the host stays alive
            host = _host(addr)
            assert host["alive"] and int(host["gpus"][0]["untracked_mb"]) == 10000
            with pytest.raises(errors.ResourceExhausted):
                c.acquire(12000)
            lease = c.acquire(6000)       # what the last report leaves room for is still granted
            assert int(_host(addr)["gpus"][0]["untracked_mb"]) == 10000   # never less, with a lease added
            lease.release()
    finally:
        hang.set()
    wait_for(lambda: not _host(addr)["usage_stale"], 10, "fresh usage after the scan returns")
