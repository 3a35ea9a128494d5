"""Reading stored values field by field: the checks every record of ``records.py`` is built with.

A stored value is untrusted: each reader here returns the field with its declared type and bounds, or raises
``InvalidRecord`` naming the field. No I/O, nothing of etcd's client.
"""
from __future__ import annotations

import json
import math
import re

import orjson

from coordinator.keys import valid_name

# The largest number a stored record may hold where an amount is expected (VRAM in MiB, bytes, tokens): above
# it a value is no amount but a corruption, and the record is refused rather than trusted.
MAX_STORED_INT = 2**62

# The stored formats of lease and queue records this release reads: 1, the records of the releases before
# gangs (no ``format`` field), and 2 (gangs: ``gang``/``exclusive``/``topology``). Records that need none of
# format 2's fields are still written in format 1, so that a replica of the previous release reads them
# during a rolling upgrade; a record of a format above ``FORMAT`` is refused (``NewerFormat``). Format 3
# (teams' reclaim, issue 22) adds ``min_runtime_s`` (a lease's and a waiting request's minimum runtime before
# it may be reclaimed) and a lease's ``over_quota`` mark; only records that carry one of them are written in it.
# Format 4 (time limits, issue 31) adds ``time_limit_s`` and ``time_limit_warning_s`` (a lease's limit, its end
# being ``created_at`` + the limit, and how long before it its holder is warned); only records with a limit
# are written in it, and a record without them (an earlier release's) has no limit.
# Format 5 (multi-host gangs, issue 30) adds a lease's ``hosts`` (every host's part, in rank order: [host,
# [gpu uuids]]) and a queue entry's ``hosts``/``same``/``prefer``/``reserve`` (a multi-host gang's request and,
# on a host's queue, the GPUs it reserves there); only multi-host records are written in it.
FORMAT = 5


class InvalidRecord(ValueError):
    """A stored value that is not what its key's schema says (``keys.py``): the message says why, naming the
    field. Every ``from_kv``/``from_json`` of ``records.py`` raises it (and only it) for a malformed value, so
    that a reader can set one record (or one host) aside and carry on with the rest."""


class NewerFormat(InvalidRecord):
    """A record written by a newer release than this one, in a format it does not know: refused (its host
    fails closed) rather than misread."""


def fail(field: str, why: str) -> InvalidRecord:
    return InvalidRecord(f"{field}: {why}")


def _get(d: object, field: str, default: object) -> object:
    return d.get(field, default) if isinstance(d, dict) else None


def int_of(d: object, field: str, lo: int = 0, hi: int = MAX_STORED_INT, default: int | None = None) -> int:
    v = _get(d, field, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise fail(field, f"expected an integer, got {type(v).__name__}")
    if not lo <= v <= hi:
        raise fail(field, f"{str(v)[:24]} is outside [{lo}, {hi}]")
    return v


def num_of(d: object, field: str, default: float | None = None) -> float:
    v = _get(d, field, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise fail(field, f"expected a finite number, got {type(v).__name__}")
    return float(v)


def seconds_of(d: dict[str, object], field: str) -> float:
    """A record's duration field (0 when absent): seconds, at least 0."""
    v = num_of(d, field, 0.0)
    if v < 0:
        raise fail(field, "expected seconds, at least 0")
    return v


def str_of(d: object, field: str, default: str | None = None, name: bool = False) -> str:
    v = _get(d, field, default)
    if not isinstance(v, str):
        raise fail(field, f"expected a string, got {type(v).__name__}")
    if name and not valid_name(v):
        raise fail(field, "not a valid name")
    return v


def bool_of(d: object, field: str, default: bool | None = None) -> bool:
    v = _get(d, field, default)
    if not isinstance(v, bool):
        raise fail(field, f"expected true or false, got {type(v).__name__}")
    return v


def list_of(d: object, field: str, default: object = None) -> list[object]:
    v = _get(d, field, default)
    if not isinstance(v, (list, tuple)):   # a tuple: a record's own to_json before it is stored
        raise fail(field, f"expected a list, got {type(v).__name__}")
    return list(v)


def dict_of(v: object, field: str) -> dict[str, object]:
    if not isinstance(v, dict):
        raise fail(field, f"expected an object, got {type(v).__name__}")
    return v


def ints_of(d: object, field: str, hi: int, what: str, most: int = 1 << 16) -> tuple[int, ...]:
    """A list of whole numbers in [0, hi), at most ``most`` of them."""
    v = list_of(d, field, [])
    if len(v) > most or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < hi for x in v):
        raise fail(field, f"expected a list of {what}")
    return tuple(x for x in v if isinstance(x, int))


def format_of(d: dict[str, object], kind: str) -> int:
    """The record's format: 1 when it names none (the releases before formats); ``NewerFormat`` above
    ``FORMAT``."""
    v = int_of(d, "format", 1, MAX_STORED_INT, default=1)
    if v > FORMAT:
        raise NewerFormat(f"format: this {kind} record is of format {v}, newer than this release reads "
                          f"(up to {FORMAT}); upgrade this replica before it serves the host")
    return v


def unknown_fields(d: dict[str, object], known: frozenset[str]) -> None:
    unknown = set(d) - known
    if unknown:
        raise fail(sorted(unknown)[0][:32], "unknown field")


def loads(value: bytes) -> object:
    """A stored JSON value. orjson decodes gpucoord's small documents several times faster than json; what it
    refuses (the NaN and Infinity that json.dumps may write) is decoded by json, with json's errors."""
    try:
        return orjson.loads(value)
    except orjson.JSONDecodeError:
        return json.loads(value)


def dumps(obj: object) -> bytes:
    """JSON as stored in etcd: compact, sorted, so `etcdctl get` reads well and diffs are stable."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def load_record(value: bytes, field: str = "value") -> dict[str, object]:
    """A stored JSON object; InvalidRecord for anything else (bad JSON, another type, nesting too deep)."""
    try:
        doc = loads(value)
    except (ValueError, RecursionError) as e:
        raise fail(field, f"not valid JSON ({str(e)[:60]})") from None
    return dict_of(doc, field)


def check_usage(doc: object) -> dict[str, object]:
    """``usage/<host>`` as readers use it, checked: per GPU a uuid and vram_used_mb (and untracked_mb,
    processes_visible, processes_omitted), and the processes and leases lists status shows. Fields it does not
    read may be anything. InvalidRecord else."""
    checked = dict_of(doc, "usage")
    if "interval_s" in checked and not 0 < num_of(checked, "interval_s") < 1e6:
        raise fail("interval_s", "must be > 0")
    for i, g in enumerate(list_of(checked, "gpus", [])):
        try:
            g = dict_of(g, "gpu")
            str_of(g, "uuid")
            int_of(g, "vram_used_mb", hi=1 << 30)
            if "untracked_mb" in g:
                int_of(g, "untracked_mb", hi=1 << 30)
            if "processes_visible" in g:
                bool_of(g, "processes_visible")
            if "utilization_pct" in g:
                int_of(g, "utilization_pct", lo=-1, hi=100)
            if "processes_omitted" in g:
                int_of(g, "processes_omitted", hi=1 << 32)
            for j, p in enumerate(list_of(g, "processes", [])):
                p = p if isinstance(p, dict) else dict_of(p, f"processes[{j}]")   # (the name made on an error only)
                int_of(p, "pid", hi=1 << 32)
                int_of(p, "used_mb", hi=1 << 30)
                str_of(p, "state", "")
                str_of(p, "lease_id", "")
            for j, u in enumerate(list_of(g, "leases", [])):
                u = u if isinstance(u, dict) else dict_of(u, f"leases[{j}]")
                str_of(u, "lease_id")
                str_of(u, "agent", "")
                int_of(u, "vram_mb", hi=1 << 30, default=0)
                int_of(u, "used_mb", hi=1 << 30, default=0)
                bool_of(u, "over_use", False)
                ints_of(u, "pids", 1 << 32, "process ids", most=1 << 62)
        except InvalidRecord as e:
            raise fail(f"gpus[{i}]", str(e)) from None
    return checked


# The end of a usage report as its daemon writes it (stored values have sorted keys, compact): ``,"ts":<a JSON
# number>}``.
_TS = b',"ts":'
_TS_TAIL = re.compile(rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?}")


def without_ts(value: bytes) -> bytes:
    """A stored usage report less its last member when that is its ``ts`` (the value itself else). A daemon
    rewrites its report every few seconds, most often with a new ``ts`` alone: what a reader derives from the rest
    is kept by this content, not by each version. It is valid JSON, and a valid report, exactly when the whole
    is."""
    at = value.rfind(_TS)
    if at > 1 and value[at - 1] not in b"{ \t\r\n" and _TS_TAIL.fullmatch(value, at + len(_TS)):
        return value[:at] + b"}"
    return value
