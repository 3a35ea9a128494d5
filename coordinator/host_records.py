"""The stored inventory of a host (``hosts/<host>``) and the live GPU use a node reports: plain records, read
defensively (``InvalidRecord`` naming the field). ``records.py`` re-exports them."""
from __future__ import annotations

import dataclasses

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
    process list (NVML listed them; false when it cannot, and for simulated GPUs without processes)."""

    index: int
    uuid: str
    vram_used_mb: int
    vram_free_mb: int
    processes: tuple[GpuProcess, ...] = ()
    processes_visible: bool = True


@dataclasses.dataclass(frozen=True)
class HostInventory:
    """What a node daemon publishes under ``hosts/<host>``."""

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

    def gpu(self, ref: int | str) -> GpuInfo | None:
        """Find a GPU by index or uuid (an all-digit string counts as an index)."""
        if isinstance(ref, str) and ref.isdigit():
            ref = int(ref)
        for g in self.gpus:
            if (isinstance(ref, int) and g.index == ref) or g.uuid == ref:
                return g
        return None

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)

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
        )


@dataclasses.dataclass(frozen=True)
class CordonRecord:
    """``cordons/<host>``: the host gets no new grant while the key exists (README "Cordon and drain").
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
