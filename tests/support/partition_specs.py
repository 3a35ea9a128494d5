"""Builders for the tests of coordinator.policy.partition: a host inventory, a spec, a manual spec, and a
rejection that must name its field."""
from __future__ import annotations

import json
from typing import Any

import pytest

from coordinator.policy.partition import (
    AgentAllocation,
    Partition,
    PartitionError,
    PartitionSpec,
    compute_partition,
    parse_spec,
)
from coordinator.records import GpuInfo, HostInventory, dumps

GiB = 1 << 30
MiB = 1 << 20
HOST = "gpu-node-1"


def uuid_of(i: int) -> str:
    return f"GPU-{i:04d}-5e1f-4c8a-9d0e-00000000{i:04d}"


def inventory(cores: int = 16, mem: int = 64 * GiB, disk: int = 1024 * GiB,
              gpus: list[int] | None = None, host: str = HOST) -> HostInventory:
    """``gpus`` is a list of VRAM totals in MiB, one per GPU, in index order."""
    return HostInventory(
        host=host, address="127.0.0.1:7071", cpu_count=cores, core_ids=tuple(range(cores)),
        mem_bytes=mem, disk_path="/", disk_bytes=disk,
        gpus=tuple(GpuInfo(index=i, uuid=uuid_of(i), name="NVIDIA H100", vram_total_mb=t)
                   for i, t in enumerate(gpus or [])),
    )


def spec(mode: str = "auto-split", agents: tuple[str, ...] = ("agent-a", "agent-b", "agent-c"),
         reserved: dict[str, Any] | None = None, allocations: dict[str, Any] | None = None,
         host: str = HOST) -> PartitionSpec:
    data: dict[str, Any] = {"host": host, "mode": mode, "agents": list(agents)}
    if reserved is not None:
        data["reserved"] = reserved
    if allocations is not None:
        data["allocations"] = allocations
    return parse_spec(data)


def rejected(inv: HostInventory, data: dict[str, Any]) -> PartitionError:
    """Parse and compute ``data``; it must be rejected. Returns the error."""
    with pytest.raises(PartitionError) as ei:
        compute_partition(inv, parse_spec(data))
    e = ei.value
    assert e.field and e.message and str(e) == f"{e.field}: {e.message}"
    return e


def manual(allocations: dict[str, Any], reserved: dict[str, Any] | None = None,
           agents: tuple[str, ...] | None = None) -> dict[str, Any]:
    return {"host": HOST, "mode": "manual", "agents": list(agents or tuple(allocations)),
            "reserved": reserved or {}, "allocations": allocations}


def by_agent(p: Partition) -> dict[str, AgentAllocation]:
    return {a.agent: a for a in p.allocations}


def gpu_indexes(uuids: tuple[str, ...], inv: HostInventory) -> list[int]:
    idx = {g.uuid: g.index for g in inv.gpus}
    return [idx[u] for u in uuids]


def json_roundtrip(obj: dict[str, Any]) -> dict[str, Any]:
    """As etcd stores it: compact sorted-key JSON."""
    out: dict[str, Any] = json.loads(dumps(obj))
    return out
