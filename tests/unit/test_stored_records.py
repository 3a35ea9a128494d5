"""Every record read from etcd is parsed defensively (pure, Hypothesis): whatever bytes a key holds (truncated
JSON, wrong types, huge numbers, deep nesting, no JSON at all), a parser either returns a record whose fields
have their declared types or raises ``InvalidRecord`` naming the field, never anything else; and a host view
built over one malformed value is INVALID, with the other records still read."""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.etcd.types import KV
from coordinator.keys import Keys
from coordinator.records import (
    DepartingRecord,
    EvictionRecord,
    GpuLedger,
    HostInventory,
    InvalidRecord,
    QueueEntry,
    VramLease,
    check_usage,
    dumps,
    load_record,
)
from coordinator.replica.view import HostSnapshot, host_snapshot_of, host_view

pytestmark = pytest.mark.unit
KEYS = Keys("/gpucoord/")
UUID = "GPU-0000"

LEASE = {"id": "l1", "host": "h1", "gpu_uuid": UUID, "gpu_index": 0, "agent": "a", "session_id": "1f",
         "vram_mb": 100, "priority": 0, "preemptible": True, "request_id": "r", "token": 3, "created_at": 1.5}
QUEUE = {"agent": "a", "session_id": "1f", "etcd_lease": 31, "vram_mb": 100, "gpu": "", "priority": 0,
         "preemptible": True, "request_id": "r", "lease_id": "l2", "deadline_unix": 9.5, "replica": "x",
         "victims": [], "wait_s": 1.0}
HOST = {"inventory": {"host": "h1", "address": "127.0.0.1:1", "cpu_count": 2, "core_ids": [0, 1], "mem_bytes": 10,
                      "disk_path": "/", "disk_bytes": 10, "version": "1",
                      "gpus": [{"index": 0, "uuid": UUID, "name": "T4", "vram_total_mb": 16384}]}}
USAGE = {"ts": 1.0, "interval_s": 5.0, "gpus": [{"index": 0, "uuid": UUID, "vram_used_mb": 10, "untracked_mb": 10,
                                                 "processes": [{"pid": 7, "used_mb": 10, "state": "untracked",
                                                                "lease_id": ""}], "leases": [],
                                                 "processes_visible": True, "processes_omitted": 0}]}
LEDGER = {"capacity_mb": 16384, "seq": 3}
EVICTION = {"lease_id": "l1", "host": "h1", "gpu_uuid": UUID, "agent": "a", "session_id": "1f", "victim_priority": 0,
            "requested_by": "b/r", "requester_priority": 5, "reason": "x", "deadline_unix": 2.0, "created_at": 1.0,
            "revoke": False}
DEPARTING = {"lease_id": "l3", "host": "h1", "gpu_uuid": UUID, "agent": "a", "vram_mb": 100, "pids": [7], "pgid": 7,
             "requested_by": "operator", "reason": "x", "created_at": 1.0, "bound_unix": 3.0, "forced": False,
             "revoke": True}


def kv(key: bytes, value: bytes) -> KV:
    return KV(key, value, 1, 2, 1, 0)


PARSERS: dict[str, tuple[dict[str, Any], Callable[[bytes], Any]]] = {
    "lease": (LEASE, lambda v: VramLease.from_kv(kv(KEYS.lease("h1", UUID, "l1"), v))),
    "queue": (QUEUE, lambda v: QueueEntry.from_kv(kv(KEYS.queue_entry("h1", "0000001-1-r"), v))),
    "host": (HOST, lambda v: HostInventory.from_json(load_record(v).get("inventory"))),  # type: ignore[arg-type]
    "usage": (USAGE, lambda v: check_usage(load_record(v))),
    "ledger": (LEDGER, lambda v: GpuLedger.from_kv(kv(KEYS.gpu("h1", UUID), v))),
    "eviction": (EVICTION, lambda v: EvictionRecord.from_kv(kv(KEYS.eviction("l1"), v))),
    "departing": (DEPARTING, lambda v: DepartingRecord.from_kv(kv(KEYS.departing("h1", UUID, "l3"), v))),
}

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-2**70, 2**70),
                         st.sampled_from([2**63, -2**63, 10**30, 1e308]), st.floats(), st.text(max_size=20))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                                 st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=3)), max_leaves=8)


def paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += paths(v, prefix + (i,))
    return out


def replaced(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    doc = json.loads(json.dumps(doc))
    target = doc
    for step in path[:-1]:
        target = target[step]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return doc


_DELETE = object()


@st.composite
def malformed(draw: st.DrawFn, kind: str) -> bytes:
    good = PARSERS[kind][0]
    how = draw(st.sampled_from(["field", "delete", "truncate", "bytes", "deep", "other-json"]))
    if how in ("field", "delete"):
        path = draw(st.sampled_from(paths(good)))
        if how == "delete" and not isinstance(path[-1], str):
            how = "field"
        doc = replaced(good, path, _DELETE if how == "delete" else draw(json_values))
        return json.dumps(doc, allow_nan=True).encode()
    if how == "truncate":
        raw = dumps(good)
        return raw[:draw(st.integers(0, len(raw) - 1))]
    if how == "deep":
        n = draw(st.integers(100, 50_000))
        return b"[" * n + b"]" * n
    if how == "other-json":
        return json.dumps(draw(json_values), allow_nan=True).encode()
    return draw(st.binary(max_size=64))


@pytest.mark.parametrize("kind", sorted(PARSERS))
def test_a_good_record_parses(kind: str) -> None:
    good, parse = PARSERS[kind]
    assert parse(dumps(good)) is not None


@pytest.mark.parametrize("kind", sorted(PARSERS))
def test_a_malformed_record_raises_invalid_record_naming_a_field_or_parses_typed(kind: str) -> None:
    good, parse = PARSERS[kind]

    @settings(max_examples=300, deadline=None, database=None, derandomize=True)
    @given(value=malformed(kind))
    def one(value: bytes) -> None:
        try:
            record = parse(value)
        except InvalidRecord as e:
            assert str(e) and ": " in str(e) and len(str(e)) < 400, str(e)
            return
        # Accepted: then every field has the type its dataclass declares.
        if dataclasses.is_dataclass(record):
            for f in dataclasses.fields(record):
                v = getattr(record, f.name)
                assert v is None or isinstance(v, (int, float, str, bool, tuple)), (f.name, v)
                if f.type in ("int", "bool", "str"):
                    assert type(v).__name__ == f.type, (f.name, v)
    one()


def _snapshot(values: dict[str, bytes]) -> HostSnapshot:
    keys = {"hosts": KEYS.host("h1"), "usage": KEYS.usage("h1"), "gpus": KEYS.gpu("h1", UUID),
            "leases": KEYS.lease("h1", UUID, "l1"), "queue": KEYS.queue_entry("h1", "0000001-1-r"),
            "departing": KEYS.departing("h1", UUID, "l3")}
    return host_snapshot_of(7, "h1", {name: [kv(keys[name], value)] for name, value in values.items()})


GOOD = {"hosts": dumps(HOST), "usage": dumps(USAGE), "gpus": dumps(LEDGER), "leases": dumps(LEASE),
        "queue": dumps(QUEUE), "departing": dumps(DEPARTING)}


@pytest.mark.parametrize("kind", sorted(GOOD))
def test_a_host_view_over_a_malformed_value_is_invalid_and_reads_the_rest(kind: str) -> None:
    assert host_view(KEYS, "h1", _snapshot(GOOD), untracked=True).invalid == ""
    bad = {**GOOD, kind: b'{"truncated": '}
    view = host_view(KEYS, "h1", _snapshot(bad), untracked=True)
    assert view.invalid.startswith(f"{kind}/h1") and "not valid JSON" in view.invalid, view.invalid
    assert view.invalid_kinds == {kind}
    if kind != "hosts":
        assert view.inventory is not None and UUID in view.gpus
    if kind != "leases":
        assert "l1" in view.leases
    if kind != "departing":
        assert [d.lease_id for d in view.departing] == ["l3"]


@pytest.mark.parametrize("kind, path, value, field", [
    ("eviction", ("revoke",), "yes", "revoke"),
    ("departing", ("forced",), 1, "forced"),
    ("departing", ("pids",), ["7"], "pids"),
    ("departing", ("bound_unix",), None, "bound_unix"),
    ("departing", ("surprise",), 1, "surprise"),
    ("usage", ("gpus", 0, "processes_visible"), "true", "processes_visible"),
])
def test_the_eviction_fields_are_parsed_strictly_naming_the_field(kind: str, path: tuple[Any, ...], value: Any,
                                                                  field: str) -> None:
    """The fields of a revoke notice, a departing lease and a usage report's process visibility: a wrong type
    (or a field the record does not have) is InvalidRecord naming it, not a record carrying it."""
    good, parse = PARSERS[kind]
    with pytest.raises(InvalidRecord, match=field):
        parse(json.dumps(replaced(good, path, value)).encode())
