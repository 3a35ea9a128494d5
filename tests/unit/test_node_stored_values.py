"""What the node daemon stores in etcd is bounded, whatever NVML answers (pure: a fake NVML module)."""
from __future__ import annotations

import json

from coordinator.node.daemon import MAX_PROCESSES_STORED, _stored_processes
from coordinator.node.inventory import MAX_GPU_NAME, MIB, NvmlGpuSource
from coordinator.records import GpuProcess, GpuUsage
from tests.unit.test_inventory import FakeDevice, FakeNvml


def test_a_long_gpu_name_is_cut_and_a_gpu_without_a_usable_uuid_is_not_offered() -> None:
    nvml = FakeNvml([
        FakeDevice("GPU-aaaa", "N" * 100_000, 1024 * MIB),
        FakeDevice("GPU-with/slash", "NVIDIA T4", 1024 * MIB),
        FakeDevice("G" * 129, "NVIDIA T4", 1024 * MIB),
        FakeDevice("GPU-dddd", "NVIDIA T4", 1024 * MIB),
    ])
    source = NvmlGpuSource(nvml)
    gpus = source.gpus()
    assert [g.uuid for g in gpus] == ["GPU-aaaa", "GPU-dddd"]
    assert gpus[0].name == "N" * MAX_GPU_NAME
    assert [u.uuid for u in source.usage()] == ["GPU-aaaa", "GPU-dddd"]


def test_usage_stores_the_largest_processes_and_counts_the_rest() -> None:
    procs = tuple(GpuProcess(pid=1000 + i, used_mb=i) for i in range(5000))
    stored = _stored_processes(GpuUsage(0, "GPU-a", 0, 0, procs))
    assert len(stored["processes"]) == MAX_PROCESSES_STORED
    assert stored["processes"][0] == {"pid": 1000 + 4999, "used_mb": 4999}
    assert stored["processes_omitted"] == 5000 - MAX_PROCESSES_STORED
    assert len(json.dumps(stored)) < 4096
    few = _stored_processes(GpuUsage(0, "GPU-a", 0, 0, procs[:3]))
    assert "processes_omitted" not in few and len(few["processes"]) == 3
