"""What the node daemon stores in etcd is bounded, whatever NVML answers (pure: a fake NVML module)."""
from __future__ import annotations

import json

from coordinator.node.daemon import MAX_LISTED, bounded_usage
from coordinator.node.inventory import MAX_GPU_NAME, MIB, NvmlGpuSource
from tests.support.fake_nvml import FakeDevice, FakeNvml


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


def test_usage_stores_the_largest_processes_and_leases_and_counts_the_rest() -> None:
    doc = {"processes": [{"pid": 1000 + i, "used_mb": i, "state": "untracked", "lease_id": ""} for i in range(5000)],
           "leases": [{"lease_id": f"l{i}", "agent": "a", "vram_mb": 1, "used_mb": i, "over_use": False,
                       "pids": list(range(i * 10, i * 10 + 200))} for i in range(300)]}
    stored = bounded_usage(doc)
    assert len(stored["processes"]) == MAX_LISTED and stored["processes_omitted"] == 5000 - MAX_LISTED
    assert stored["processes"][0]["pid"] == 1000 + 4999
    assert len(stored["leases"]) == MAX_LISTED and stored["leases_omitted"] == 300 - MAX_LISTED
    assert stored["leases"][0]["lease_id"] == "l299"
    assert all(len(x["pids"]) == MAX_LISTED and x["pids_omitted"] == 200 - MAX_LISTED for x in stored["leases"])
    assert len(json.dumps(stored)) < 64 * 1024
    few = bounded_usage({"processes": doc["processes"][:3], "leases": []})
    assert set(few) == {"processes", "leases"} and len(few["processes"]) == 3
