"""Upgrades (issue 21, item 9): records written by the previous release (captured with its code into
``tests/fixtures/records_v1.json``) are put into a real etcd, under a live session of their agent, and this
release's replica serves them: the leases are held and released, the ledgers' fencing tokens continue, and a
higher-priority request evicts one of them; a record of a newer format than this release knows makes its
host fail closed (FAILED_PRECONDITION naming ``host``), the other hosts carrying on."""
from __future__ import annotations

import json
import pathlib
import threading
from typing import Any

import pytest

from agent_client import Client, errors
from coordinator.keys import etcd_lease_from_session_id
from coordinator.records import FORMAT, dumps
from tests.support.cluster import Cluster
from tests.support.waiting import LIVENESS_S, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]
FIXTURE = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "records_v1.json"


def v1(kind: str) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = json.loads(FIXTURE.read_text())["records"]
    return [r for r in records if r["kind"] == kind]


def put_v1_records(cluster: Cluster, holder: Client) -> list[dict[str, Any]]:
    """The fixture's ledgers and leases, the leases moved onto ``holder``'s live session."""
    etcd_lease = etcd_lease_from_session_id(holder.session_id)
    for r in v1("gpus"):
        cluster.lt.run(cluster.store.put((cluster.prefix + r["key"]).encode(), dumps(r["value"])))
    leases = []
    for r in v1("leases"):
        value = {**r["value"], "session_id": holder.session_id, "agent": "agent-a"}
        cluster.lt.run(cluster.store.put((cluster.prefix + r["key"]).encode(), dumps(value), etcd_lease))
        leases.append(value)
    return leases


def test_the_new_replica_serves_releases_and_evicts_the_previous_releases_leases(cluster: Cluster) -> None:
    cluster.start_node("h1", "2x16GiB")                  # the host the fixture was captured on
    addr = cluster.start_coordinator(eviction_grace_s=0.5)
    with Client(addr, agent="agent-a", host="h1") as a, Client(addr, agent="agent-b", host="h1") as b:
        a.status()                                       # opens agent-a's session
        on0, on1 = sorted(put_v1_records(cluster, a), key=lambda x: x["gpu_index"])
        # Served: the previous release's lease on GPU 1 is released by its holder, and the GPU's next
        # lease continues its ledger's tokens.
        assert a.release(on1["id"]) is True
        fresh = a.acquire(vram_mb=4000, gpu=1)
        assert fresh.token == on1["token"] + 1
        # Evicted: a higher-priority request needs GPU 0, held by the previous release's lease (8000 MiB);
        # its holder ignores the notice, the leader revokes it at the deadline, then the request is granted.
        result: dict[str, Any] = {}
        t = threading.Thread(target=lambda: result.update(
            lease=b.acquire(vram_mb=12_000, gpu=0, priority=5, wait=20)), daemon=True)
        t.start()
        wait_for(lambda: cluster.get_prefix(cluster.keys.eviction(on0["id"])), 10, "the eviction notice")
        t.join(20)
        assert "lease" in result, "the request for the evicted lease's room was not granted"
        assert result["lease"].token == on0["token"] + 1
        assert not cluster.get_prefix(cluster.keys.lease("h1", on0["gpu_uuid"], on0["id"]))


def test_a_record_of_a_newer_format_fails_its_host_closed(cluster: Cluster) -> None:
    cluster.start_node("h1", "2x16GiB")
    cluster.start_node("h2", "1x16GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="agent-a", host="h1") as a, Client(addr, agent="agent-a", host="h2") as other:
        a.status()
        (record,) = [r for r in v1("leases") if r["value"]["gpu_index"] == 1]
        newer = {**record["value"], "session_id": a.session_id, "format": FORMAT + 1, "shape": "unknown"}
        cluster.lt.run(cluster.store.put((cluster.prefix + record["key"]).encode(), dumps(newer),
                                         etcd_lease_from_session_id(a.session_id)))
        with pytest.raises(errors.FailedPrecondition, match="host") as e:
            wait_for(lambda: a.acquire(vram_mb=1000, gpu=0) and None, LIVENESS_S, "the newer record to be seen")
        assert "format" in str(e.value) and "newer" in str(e.value), e.value
        assert other.acquire(vram_mb=1000).gpu_index == 0        # another host carries on
        status = a.status("h1")
        assert "format" in status.hosts[0].invalid
