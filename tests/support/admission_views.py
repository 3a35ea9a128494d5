"""Builders for the tests of coordinator.policy.admission: leases (``mk_lease``), GPU views (``mk_gpu``) and a
view once some leases are gone (``without``)."""
from __future__ import annotations

import itertools
from typing import Sequence

from coordinator.policy.admission import GpuView
from coordinator.records import GpuLedger, VramLease

_ids = itertools.count(1)


def mk_lease(vram_mb: int, *, agent: str = "a", priority: int = 0, preemptible: bool = True,
             created_at: float = 0.0, token: int | None = None, gpu_uuid: str = "GPU-0",
             gpu_index: int = 0, lease_id: str | None = None) -> VramLease:
    n = next(_ids)
    return VramLease(
        id=lease_id or f"l{n}", host="h", gpu_uuid=gpu_uuid, gpu_index=gpu_index, agent=agent,
        session_id="1f", vram_mb=vram_mb, priority=priority, preemptible=preemptible,
        request_id=f"r{n}", token=n if token is None else token, created_at=created_at)


def mk_gpu(index: int, usable_mb: int, leases: Sequence[VramLease] = (), *, total_mb: int | None = None,
           nvml_used_mb: int | None = None, uuid: str | None = None, seq: int = 0) -> GpuView:
    return GpuView(
        uuid=uuid or f"GPU-{index}", index=index, total_mb=usable_mb if total_mb is None else total_mb,
        usable_mb=usable_mb, ledger=GpuLedger(capacity_mb=usable_mb, seq=seq, mod_revision=1),
        leases=list(leases), nvml_used_mb=nvml_used_mb)


def without(gpu: GpuView, removed: Sequence[VramLease]) -> GpuView:
    """The GPU once ``removed`` are gone, their holders having freed their memory (``GpuView.without``)."""
    return gpu.without({x.id for x in removed})
