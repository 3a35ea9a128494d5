"""Plain records shared by the node daemon, the coordinator and the pure logic.

No I/O here. Units: VRAM in MiB (``*_mb``), host memory and disk in bytes.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any


@dataclasses.dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML (or ``--fake-gpus``) describes it."""

    index: int
    uuid: str
    name: str
    vram_total_mb: int


@dataclasses.dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_mb: int


@dataclasses.dataclass(frozen=True)
class GpuUsage:
    """Live VRAM use of one GPU, as NVML reports it."""

    index: int
    uuid: str
    vram_used_mb: int
    vram_free_mb: int
    processes: tuple[GpuProcess, ...] = ()


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

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> HostInventory:
        return cls(
            host=d["host"],
            address=d.get("address", ""),
            cpu_count=int(d["cpu_count"]),
            core_ids=tuple(int(c) for c in d.get("core_ids", range(int(d["cpu_count"])))),
            mem_bytes=int(d["mem_bytes"]),
            disk_path=d.get("disk_path", "/"),
            disk_bytes=int(d["disk_bytes"]),
            gpus=tuple(GpuInfo(**g) for g in d.get("gpus", ())),
            version=d.get("version", ""),
            simulated=bool(d.get("simulated", False)),
        )


def dumps(obj: Any) -> bytes:
    """JSON as stored in etcd: compact, sorted, so `etcdctl get` reads well and diffs are stable."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
