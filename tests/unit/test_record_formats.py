"""Stored records across releases (issue 21, upgrades): the records the previous release wrote (captured
with its code into ``tests/fixtures/records_v1.json`` by ``tests/fixtures/capture_records.py``) are read by
this release as they were meant; a record of a newer format than this release knows is refused
(``NewerFormat``, an ``InvalidRecord``) rather than misread."""
from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from coordinator.etcd.types import KV
from coordinator.keys import Keys
from coordinator.records import EvictionRecord, GpuLedger, QueueEntry, VramLease

pytestmark = pytest.mark.unit
FIXTURE = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "records_v1.json"
KEYS = Keys("/gpucoord/")


def v1_records() -> list[dict[str, Any]]:
    doc = json.loads(FIXTURE.read_text())
    records: list[dict[str, Any]] = doc["records"]
    return records


def kv_of(record: dict[str, Any], mod_revision: int = 7, etcd_lease: int = 0) -> KV:
    key = (KEYS.root().decode() + record["key"]).encode()
    return KV(key, json.dumps(record["value"]).encode(), mod_revision, mod_revision, 1, etcd_lease)


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [r for r in v1_records() if r["kind"] == kind]


def test_the_fixture_holds_every_kind_of_admission_record() -> None:
    assert {r["kind"] for r in v1_records()} == {"gpus", "leases", "queue", "evictions"}


def test_previous_release_leases_read_as_single_gpu_leases() -> None:
    for r in of_kind("leases"):
        lease = VramLease.from_kv(kv_of(r, etcd_lease=5))
        v = r["value"]
        assert (lease.id, lease.gpu_uuid, lease.gpu_index, lease.vram_mb, lease.token, lease.agent) == (
            v["id"], v["gpu_uuid"], v["gpu_index"], v["vram_mb"], v["token"], v["agent"])
        assert lease.etcd_lease == 5 and lease.mod_revision == 7


def test_previous_release_ledgers_queue_entries_and_notices_read() -> None:
    for r in of_kind("gpus"):
        ledger = GpuLedger.from_kv(kv_of(r))
        assert (ledger.capacity_mb, ledger.seq) == (r["value"]["capacity_mb"], r["value"]["seq"])
    for r in of_kind("queue"):
        entry = QueueEntry.from_kv(kv_of(r))
        assert (entry.vram_mb, entry.gpu, entry.victims) == (
            r["value"]["vram_mb"], r["value"]["gpu"], tuple(r["value"]["victims"]))
    for r in of_kind("evictions"):
        notice = EvictionRecord.from_kv(kv_of(r))
        assert notice.lease_id == r["value"]["lease_id"]
