"""coordinator.policy.partition on the worked examples of the design brief: auto-split shares and the manual
limits, with their numbers."""
from __future__ import annotations

from coordinator.policy.partition import compute_partition, parse_spec
from tests.support.partition_specs import (
    HOST,
    GiB,
    gpu_indexes,
    inventory,
    manual,
    rejected,
    spec,
    uuid_of,
)

# -- the numbers of the design brief's worked examples (the brief is not in this repository) ----


def test_auto_split_memory_three_agents_on_16_gib() -> None:
    inv = inventory(mem=16 * GiB)
    assert inv.mem_bytes == 17179869184
    p = compute_partition(inv, spec())
    assert [a.mem_bytes for a in p.allocations] == [5726623062, 5726623061, 5726623061]
    assert [a.agent for a in p.allocations] == ["agent-a", "agent-b", "agent-c"]


def test_auto_split_five_gpus_three_agents() -> None:
    inv = inventory(gpus=[81920] * 5)
    p = compute_partition(inv, spec())
    assert [gpu_indexes(a.whole_gpus, inv) for a in p.allocations] == [[0, 1], [2, 3], [4]]
    for a in p.allocations:
        assert dict(a.vram_caps_mb) == {u: 81920 for u in a.whole_gpus}


def test_auto_split_eight_gpus_two_agents() -> None:
    inv = inventory(gpus=[81920] * 8)
    p = compute_partition(inv, spec(agents=("agent-a", "agent-b")))
    assert [gpu_indexes(a.whole_gpus, inv) for a in p.allocations] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_auto_split_cores_16_reserved_4_two_agents() -> None:
    inv = inventory(cores=16)
    p = compute_partition(inv, spec(agents=("agent-a", "agent-b"), reserved={"cpu": 4}))
    a, b = p.allocations
    assert len(a.cores) == 6 and len(b.cores) == 6
    assert not set(a.cores) & set(b.cores)
    assert not (set(a.cores) | set(b.cores)) & {0, 1, 2, 3}  # the first core ids are the reserved ones
    assert a.cores == (4, 5, 6, 7, 8, 9) and b.cores == (10, 11, 12, 13, 14, 15)


def test_auto_split_one_80_gib_gpu_three_agents() -> None:
    inv = inventory(gpus=[80 * 1024])
    p = compute_partition(inv, spec(reserved={"vram_headroom": 0}))
    for a in p.allocations:
        assert a.whole_gpus == ()
        assert a.vram_caps_mb == ((uuid_of(0), 27306),)
        assert p.gpu_caps(a.agent, inv) == {uuid_of(0): 27306}


def test_auto_split_shared_gpus_respect_headroom() -> None:
    inv = inventory(gpus=[81920, 40960])
    p = compute_partition(inv, spec(reserved={"vram_headroom": "512MiB"}))
    assert p.headroom_mb == 512
    for a in p.allocations:
        assert a.vram_caps_mb == ((uuid_of(0), (81920 - 512) // 3), (uuid_of(1), (40960 - 512) // 3))


def test_auto_split_remainders_go_to_first_agents() -> None:
    inv = inventory(cores=11, mem=10, disk=7)
    p = compute_partition(inv, spec(reserved={"cpu": 1}))
    assert [len(a.cores) for a in p.allocations] == [4, 3, 3]
    assert [a.mem_bytes for a in p.allocations] == [4, 3, 3]
    assert [a.disk_bytes for a in p.allocations] == [3, 2, 2]


def test_manual_8_plus_9_cores_on_16_rejected() -> None:
    e = rejected(inventory(cores=16), manual({"agent-a": {"cpu": 8}, "agent-b": {"cpu": 9}}))
    assert e.field == "allocations.agent-b.cpu"
    assert "17" in e.message and "16" in e.message


def test_manual_8_plus_8_cores_on_16_with_reserved_1_rejected() -> None:
    # Backend.AI's defect allowed up to total + (N-1) * reserved; we allow total - reserved.
    e = rejected(inventory(cores=16), manual({"agent-a": {"cpu": 8}, "agent-b": {"cpu": 8}}, reserved={"cpu": 1}))
    assert e.field == "allocations.agent-b.cpu"


def test_manual_8_plus_7_cores_on_16_with_reserved_1_accepted() -> None:
    p = compute_partition(inventory(cores=16),
                          parse_spec(manual({"agent-a": {"cpu": 8}, "agent-b": {"cpu": 7}}, reserved={"cpu": 1})))
    a, b = p.allocations
    assert a.cores == tuple(range(1, 9)) and b.cores == tuple(range(9, 16))


def test_reserved_cpu_10_on_8_cores_rejected() -> None:
    e = rejected(inventory(cores=8), {"host": HOST, "mode": "shared", "reserved": {"cpu": 10}})
    assert e.field == "reserved.cpu"
