"""The stored inventory of a host (``hosts/<host>``) and the live GPU use a node reports: plain records, read
defensively (``InvalidRecord`` naming the field). ``records.py`` re-exports them."""
from __future__ import annotations

import dataclasses
import re
from typing import Iterable

from coordinator.limits import quote
from coordinator.record_fields import (
    InvalidRecord,
    bool_of,
    dict_of,
    fail,
    int_of,
    ints_of,
    list_of,
    num_of,
    str_of,
    unknown_fields,
)

MAX_LABELS = 32
"""Labels of one host (``gpucoord node --label KEY=VALUE``, repeatable)."""

# Kubernetes' label grammar: KEY is NAME or PREFIX/NAME, NAME 1-63 of [a-z0-9._-] beginning and ending with a
# letter or digit, PREFIX a DNS subdomain of at most 253 characters; VALUE 1-63 of [A-Za-z0-9._-] beginning and
# ending with a letter or digit.
_LABEL_NAME = re.compile(r"[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?")
_LABEL_PREFIX = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*")
_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")


def label_error(key: object, value: object) -> str:
    """Why (KEY, VALUE) is no label; "" when it is one."""
    if not isinstance(key, str) or not isinstance(value, str):
        return "a label's key and value are strings"
    prefix, slash, name = key.rpartition("/")
    if not _LABEL_NAME.fullmatch(name) or (slash and (len(prefix) > 253 or not _LABEL_PREFIX.fullmatch(prefix))):
        return f"the key {quote(key)} is not NAME or PREFIX/NAME"
    if not _LABEL_VALUE.fullmatch(value):
        return f"the value {quote(value)} of {quote(key)} is not 1-63 of A-Z a-z 0-9 . _ - (letters or digits at the ends)"
    return ""


def check_labels(pairs: Iterable[tuple[object, object]]) -> tuple[tuple[str, str], ...]:
    """The labels, sorted by key; ValueError saying why when one is malformed, a key repeats or there are
    more than MAX_LABELS."""
    out: dict[str, str] = {}
    for key, value in pairs:
        why = label_error(key, value)
        if why:
            raise ValueError(why)
        assert isinstance(key, str) and isinstance(value, str)
        if key in out:
            raise ValueError(f"the key {quote(key)} is given twice")
        out[key] = value
        if len(out) > MAX_LABELS:
            raise ValueError(f"more than {MAX_LABELS} labels")
    return tuple(sorted(out.items()))


def parse_labels(args: Iterable[str], flag: str = "--label") -> tuple[tuple[str, str], ...]:
    """``--label KEY=VALUE`` flags as labels; ValueError naming ``flag`` when one is malformed."""
    pairs = []
    for arg in args:
        key, eq, value = arg.partition("=")
        if not eq:
            raise ValueError(f"{flag} {quote(arg)}: expected KEY=VALUE")
        pairs.append((key, value))
    try:
        return check_labels(pairs)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


def labels_of(d: dict[str, object]) -> tuple[tuple[str, str], ...]:
    """A stored inventory's ``labels`` (an object KEY: VALUE; absent in the releases before labels: none);
    InvalidRecord naming the field when malformed."""
    v = d.get("labels", {})
    if not isinstance(v, dict):
        raise fail("labels", f"expected an object, got {type(v).__name__}")
    if len(v) > MAX_LABELS:
        raise fail("labels", f"{len(v)} labels, above the limit of {MAX_LABELS}")
    try:
        return check_labels(v.items())
    except ValueError as e:
        raise fail("labels", str(e)) from None


@dataclasses.dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML (or ``--fake-gpus``) describes it.

    Topology: ``numa_node`` is the NUMA node the GPU sits on, None when unknown; ``nvlink_peers`` are the
    indexes of the GPUs it reaches over an active NVLink (directly or through an NVSwitch), sorted, () when
    it has none or they are unknown. Records written before these fields existed read as unknown.
    """

    index: int
    uuid: str
    name: str
    vram_total_mb: int
    numa_node: int | None = None
    nvlink_peers: tuple[int, ...] = ()

    @classmethod
    def from_json(cls, d: dict[str, object]) -> GpuInfo:
        """Parse a stored GPU (InvalidRecord naming the field when malformed); fields this release does not
        know are ignored, missing topology is unknown."""
        index = int_of(d, "index", hi=1 << 16)
        numa = d.get("numa_node")
        if numa is not None and (isinstance(numa, bool) or not isinstance(numa, int) or not 0 <= numa < 1 << 16):
            raise fail("numa_node", "expected a whole number >= 0 or null")
        peers = ints_of(d, "nvlink_peers", 1 << 16, "GPU indexes")
        return cls(index=index, uuid=str_of(d, "uuid", name=True), name=str_of(d, "name", ""),
                   vram_total_mb=int_of(d, "vram_total_mb", hi=1 << 30), numa_node=numa,
                   nvlink_peers=tuple(sorted(set(peers) - {index})))


@dataclasses.dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_mb: int


@dataclasses.dataclass(frozen=True)
class GpuUsage:
    """Live VRAM use of one GPU, as NVML reports it. ``processes_visible``: ``processes`` is the GPU's whole
    process list (NVML listed them; false when it cannot, and for simulated GPUs without processes).
    ``utilization_pct``: NVML's GPU utilization, -1 when unknown (never 0 for "cannot tell"); ``process_sm_pct``:
    (pid, SM percent) per sampled process, None when the driver cannot tell (docs/policies.md "Idle GPUs")."""

    index: int
    uuid: str
    vram_used_mb: int
    vram_free_mb: int
    processes: tuple[GpuProcess, ...] = ()
    processes_visible: bool = True
    utilization_pct: int = -1
    process_sm_pct: tuple[tuple[int, int], ...] | None = None


@dataclasses.dataclass(frozen=True)
class HostInventory:
    """What a node daemon publishes under ``hosts/<host>``. ``labels``: (key, value) pairs sorted by key, set
    by the node's ``--label`` flags (stored as an object; an inventory of the releases before labels has none)."""

    host: str
    address: str
    cpu_count: int
    core_ids: tuple[int, ...]
    mem_bytes: int
    disk_path: str
    disk_bytes: int
    gpus: tuple[GpuInfo, ...]
    version: str = ""
    simulated: bool = False
    labels: tuple[tuple[str, str], ...] = ()

    def label(self, key: str) -> str | None:
        """The value of the host's label ``key``; None when it has no such label."""
        return dict(self.labels).get(key)

    def gpu(self, ref: int | str) -> GpuInfo | None:
        """Find a GPU by index or uuid (an all-digit string counts as an index)."""
        if isinstance(ref, str) and ref.isdigit():
            ref = int(ref)
        for g in self.gpus:
            if (isinstance(ref, int) and g.index == ref) or g.uuid == ref:
                return g
        return None

    def to_json(self) -> dict[str, object]:
        return {**dataclasses.asdict(self), "labels": dict(self.labels)}

    @classmethod
    def from_json(cls, d: dict[str, object]) -> HostInventory:
        """The inventory as stored; InvalidRecord (naming the field) when it is malformed."""
        d = dict_of(d, "inventory")
        cpu_count = int_of(d, "cpu_count", hi=1 << 20)
        if "core_ids" not in d:
            d = {**d, "core_ids": list(range(cpu_count))}
        cores = ints_of(d, "core_ids", 1 << 20, "core ids", most=1 << 20)
        gpus = []
        for i, g in enumerate(list_of(d, "gpus", [])[:1024]):
            try:
                g = dict_of(g, "gpu")
                gpus.append(GpuInfo.from_json(g))
            except InvalidRecord as e:
                raise fail(f"gpus[{i}]", str(e)) from None
        if len({g.index for g in gpus}) != len(gpus) or len({g.uuid for g in gpus}) != len(gpus):
            raise fail("gpus", "two GPUs with one index or one uuid")   # the host fails closed (INVALID)
        return cls(
            host=str_of(d, "host"),
            address=str_of(d, "address", ""),
            cpu_count=cpu_count,
            core_ids=tuple(cores),
            mem_bytes=int_of(d, "mem_bytes"),
            disk_path=str_of(d, "disk_path", "/"),
            disk_bytes=int_of(d, "disk_bytes"),
            gpus=tuple(gpus),
            version=str_of(d, "version", ""),
            simulated=bool_of(d, "simulated", False),
            labels=labels_of(d),
        )


@dataclasses.dataclass(frozen=True)
class CordonRecord:
    """``cordons/<host>``: the host gets no new grant while the key exists (docs/policies.md "Cordon and drain").
    ``drain``: it was cordoned by ``host drain``, whose eviction notices (reason ``drain``, ``grace_s``) went to
    every lease the host held then."""

    host: str
    reason: str
    drain: bool = False
    grace_s: float = 0.0
    asked_by: str = ""
    created_at: float = 0.0

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, object]) -> CordonRecord:
        """InvalidRecord (naming the field) for a malformed value."""
        unknown_fields(d, _CORDON_KEYS)
        return cls(host=str_of(d, "host", name=True), reason=str_of(d, "reason", ""),
                   drain=bool_of(d, "drain", False), grace_s=num_of(d, "grace_s", 0.0),
                   asked_by=str_of(d, "asked_by", ""), created_at=num_of(d, "created_at", 0.0))


_CORDON_KEYS = frozenset(f.name for f in dataclasses.fields(CordonRecord))
