"""Stored records across releases (issue 21, upgrades): the records the previous release wrote (captured
with its code into ``tests/fixtures/records_v1.json`` by ``tests/fixtures/capture_records.py``) are read by
this release as they were meant; a record of a newer format than this release knows is refused
(``NewerFormat``, an ``InvalidRecord``) rather than misread."""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import pytest

from coordinator.etcd.types import KV
from coordinator.keys import Keys
from coordinator.records import (
    FORMAT,
    EvictionRecord,
    GpuLedger,
    InvalidRecord,
    NewerFormat,
    QueueEntry,
    VramLease,
)

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


GANG = ("GPU-sim-h1-0", "GPU-sim-h1-1")


def lease(**kw: Any) -> VramLease:
    base: dict[str, Any] = dict(id="l1", host="h1", gpu_uuid=GANG[0], gpu_index=0, agent="a", session_id="1f",
                                vram_mb=100, priority=0, preemptible=True, request_id="r", token=3, created_at=1.5)
    base.update(kw)
    return VramLease(**base)


def stored(doc: dict[str, Any], key: str = "leases/h1/GPU-sim-h1-0/l1") -> KV:
    return kv_of({"key": key, "value": doc})


def test_a_plain_single_gpu_lease_is_still_written_in_the_previous_format() -> None:
    """So that a replica of the previous release reads it during a rolling upgrade."""
    doc = lease().to_json()
    assert "format" not in doc and "gang" not in doc
    assert set(doc) == set(of_kind("leases")[0]["value"])


def test_a_gang_lease_round_trips_in_format_2() -> None:
    gang = lease(gang=GANG, exclusive=True, topology="nvlink", vram_mb=16000)
    doc = gang.to_json()
    assert doc["format"] == 2 and doc["gang"] == list(GANG)
    back = VramLease.from_kv(stored(doc))
    assert (back.gang, back.exclusive, back.topology, back.gpus) == (GANG, True, "nvlink", GANG)


def test_a_gang_queue_entry_round_trips_and_a_plain_one_stays_in_format_1() -> None:
    plain = QueueEntry.from_kv(kv_of(of_kind("queue")[0]))
    assert "format" not in plain.to_json() and "gpu_count" not in plain.to_json()
    gang = dataclasses.replace(plain, gpu_count=4, exclusive=True, vram_mb=0, topology="nvlink", gpus=("0", "1", "2", "3"))
    back = QueueEntry.from_kv(stored(gang.to_json(), "queue/h1/" + plain.rank))
    assert (back.gpu_count, back.exclusive, back.vram_mb, back.topology, back.gpus, back.format) == (
        4, True, 0, "nvlink", ("0", "1", "2", "3"), 2)


@pytest.mark.parametrize("kind", ["leases", "queue"])
def test_a_record_of_a_newer_format_is_refused_naming_the_format(kind: str) -> None:
    record = of_kind(kind)[0]
    newer = {**record, "value": {**record["value"], "format": FORMAT + 1}}
    parse = VramLease.from_kv if kind == "leases" else QueueEntry.from_kv
    with pytest.raises(NewerFormat, match=r"^format: .*newer than this release reads"):
        parse(kv_of(newer))


@pytest.mark.parametrize("field,value", [("gang", ["GPU-sim-h1-0"]), ("gang", ["GPU-x", "GPU-y"]),
                                         ("gang", ["GPU-sim-h1-0", "GPU-sim-h1-0"]), ("topology", "ring"),
                                         ("exclusive", "yes")])
def test_malformed_gang_fields_are_refused_naming_the_field(field: str, value: Any) -> None:
    doc = lease(gang=GANG).to_json()
    doc[field] = value
    with pytest.raises(InvalidRecord, match=f"^{field}: "):
        VramLease.from_kv(stored(doc))


def test_format_1_records_may_not_carry_gang_fields() -> None:
    doc = {**of_kind("leases")[0]["value"], "gang": list(GANG)}
    with pytest.raises(InvalidRecord, match="^gang: unknown field"):
        VramLease.from_kv(kv_of({"key": of_kind("leases")[0]["key"], "value": doc}))


# Multi-host gangs (issue 30): format 5. Only a multi-host record is written in it; a single-host record keeps
# the format of the release that introduced what it carries, so a replica of the previous release (formats up
# to 4) still reads it during a rolling upgrade.
OTHER = ("GPU-sim-h2-0", "GPU-sim-h2-1")


def test_a_multi_host_lease_round_trips_in_format_5() -> None:
    part = lease(gang=GANG, exclusive=True, vram_mb=16000, hosts=(("h2", OTHER), ("h1", GANG)))
    doc = part.to_json()
    assert doc["format"] == 5 and doc["hosts"] == [["h2", list(OTHER)], ["h1", list(GANG)]]
    back = VramLease.from_kv(stored(json.loads(json.dumps(doc))))
    assert dataclasses.replace(back, mod_revision=0) == part
    assert (back.rank, back.parts, back.gpus) == (1, (("h2", OTHER), ("h1", GANG)), GANG)


def test_a_multi_host_queue_entry_and_its_reservation_round_trip_in_format_5() -> None:
    plain = QueueEntry.from_kv(kv_of(of_kind("queue")[0]))
    gang = dataclasses.replace(plain, gpu_count=2, exclusive=True, vram_mb=0, hosts=2, same="rack", prefer="block")
    doc = gang.to_json()
    assert doc["format"] == 5 and (doc["hosts"], doc["same"], doc["prefer"], doc["reserve"]) == (2, "rack", "block", [])
    waiting = QueueEntry.from_kv(stored(doc, "gangqueue/" + plain.rank))
    assert dataclasses.replace(waiting, mod_revision=0) == dataclasses.replace(gang, mod_revision=0)
    assert waiting.multi_host and waiting.format == 5
    # Its reservation on a host: the same entry under queue/<host>/<rank>, listing the GPUs it holds back.
    reservation = dataclasses.replace(gang, reserve=GANG)
    back = QueueEntry.from_kv(stored(reservation.to_json(), "queue/h1/" + plain.rank))
    assert (back.rank, back.reserve, back.hosts, back.same) == (plain.rank, GANG, 2, "rack")


def test_single_host_records_are_still_written_in_their_earlier_formats() -> None:
    """A gang of one host stays format 2, one with a time limit format 4: no ``hosts`` field in either."""
    for one_host, expected in ((lease(gang=GANG, exclusive=True, vram_mb=16000), 2),
                               (lease(time_limit_s=60.0, time_limit_warning_s=10.0), 4)):
        doc = one_host.to_json()
        assert doc["format"] == expected and "hosts" not in doc
        assert VramLease.from_kv(stored(doc)).hosts == ()
    plain = QueueEntry.from_kv(kv_of(of_kind("queue")[0]))
    doc = dataclasses.replace(plain, gpu_count=2, exclusive=True, vram_mb=0).to_json()
    assert doc["format"] == 2 and not {"hosts", "same", "prefer", "reserve"} & set(doc)


@pytest.mark.parametrize("kind", ["leases", "queue"])
def test_a_record_below_format_5_may_not_carry_multi_host_fields(kind: str) -> None:
    if kind == "leases":
        doc = {**lease(time_limit_s=60.0).to_json(), "hosts": [["h1", [GANG[0]]], ["h2", [OTHER[0]]]]}
        parse, key = VramLease.from_kv, "leases/h1/GPU-sim-h1-0/l1"
    else:
        record = of_kind("queue")[0]
        doc, parse, key = {**record["value"], "hosts": 2}, QueueEntry.from_kv, record["key"]
    with pytest.raises(InvalidRecord, match="^hosts: unknown field"):
        parse(stored(doc, key))
