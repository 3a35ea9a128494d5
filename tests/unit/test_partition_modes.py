"""coordinator.policy.partition: what the shared, auto-split and manual modes give each agent."""
from __future__ import annotations

from coordinator.policy.partition import (
    Partition,
    compute_partition,
    default_partition,
    parse_spec,
)
from tests.support.partition_specs import (
    GiB,
    by_agent,
    inventory,
    json_roundtrip,
    manual,
    spec,
    uuid_of,
)

# -- modes ---------------------------------------------------------------------------------------


def test_default_partition_is_shared_and_open() -> None:
    inv = inventory(gpus=[81920, 40960])
    p = default_partition(inv)
    assert (p.mode, p.agents, p.headroom_mb, p.allocations, p.spec) == ("shared", (), 0, (), None)
    assert p.allows("anyone")
    assert p.gpu_caps("anyone", inv) == {uuid_of(0): 81920, uuid_of(1): 40960}
    assert Partition.from_json(json_roundtrip(p.to_json())) == p


def test_shared_mode_gives_everyone_the_whole_host_minus_reserved() -> None:
    inv = inventory(cores=8, mem=32 * GiB, disk=100 * GiB, gpus=[81920, 81920])
    p = compute_partition(inv, spec(mode="shared", agents=("agent-a", "agent-b"),
                                    reserved={"cpu": 2, "mem": "2GiB", "disk": "10GiB", "vram_headroom": "1GiB"}))
    for a in p.allocations:
        assert a.cores == (2, 3, 4, 5, 6, 7)
        assert a.mem_bytes == 30 * GiB and a.disk_bytes == 90 * GiB
        assert a.whole_gpus == ()
        assert dict(a.vram_caps_mb) == {uuid_of(0): 80896, uuid_of(1): 80896}
    assert p.allows("stranger")
    assert p.gpu_caps("stranger", inv) == {uuid_of(0): 80896, uuid_of(1): 80896}
    assert p.usable_mb(inv.gpus[0]) == 80896


def test_non_shared_partition_refuses_strangers() -> None:
    inv = inventory(gpus=[81920] * 3)
    p = compute_partition(inv, spec())
    assert not p.allows("stranger")
    assert p.gpu_caps("stranger", inv) == {}
    assert p.allocation("stranger") is None


def test_gpu_caps_skip_gpus_that_left_the_inventory() -> None:
    inv = inventory(gpus=[81920] * 4)
    p = compute_partition(inv, spec(agents=("agent-a", "agent-b")))
    smaller = inventory(gpus=[81920] * 3)
    assert p.gpu_caps("agent-b", smaller) == {uuid_of(2): 81920}


def test_manual_cpu_counts_become_core_ids_in_order() -> None:
    inv = inventory(cores=12)
    p = compute_partition(inv, parse_spec(manual(
        {"agent-a": {"cpu": 3}, "agent-b": {"cores": [4, 5]}, "agent-c": {"cpu": 4}}, reserved={"cpu": 2})))
    got = by_agent(p)
    assert got["agent-a"].cores == (2, 3, 6)  # 4 and 5 are named explicitly by agent-b
    assert got["agent-b"].cores == (4, 5)
    assert got["agent-c"].cores == (7, 8, 9, 10)


def test_manual_kind_not_named_is_not_partitioned() -> None:
    inv = inventory(cores=8, mem=32 * GiB, disk=100 * GiB, gpus=[81920] * 3)
    p = compute_partition(inv, parse_spec(manual({"agent-a": {"cpu": 2}, "agent-b": {"cpu": 3}},
                                                 reserved={"cpu": 1, "mem": "2GiB", "vram_headroom": "1GiB"})))
    for a in p.allocations:
        assert a.mem_bytes == 30 * GiB and a.disk_bytes == 100 * GiB
        assert a.whole_gpus == ()
        assert dict(a.vram_caps_mb) == {uuid_of(i): 80896 for i in range(3)}


def test_manual_whole_gpus_named_vram_not_named_shares_the_rest() -> None:
    inv = inventory(gpus=[81920] * 4)
    p = compute_partition(inv, parse_spec(manual({"agent-a": {"gpus": [0]}, "agent-b": {"gpus": [uuid_of(1)]}})))
    a, b = p.allocations
    assert a.whole_gpus == (uuid_of(0),) and b.whole_gpus == (uuid_of(1),)
    assert a.vram_caps_mb == ((uuid_of(0), 81920), (uuid_of(2), 81920), (uuid_of(3), 81920))
    assert b.vram_caps_mb == ((uuid_of(1), 81920), (uuid_of(2), 81920), (uuid_of(3), 81920))


def test_manual_gpus_and_vram_named() -> None:
    inv = inventory(gpus=[81920] * 4)
    p = compute_partition(inv, parse_spec(manual({
        "agent-a": {"gpus": [0, 1], "vram": {"2": "20GiB"}},
        "agent-b": {"gpus": [], "vram": {"2": "60GiB", uuid_of(3): "1GiB"}},
    })))
    assert p.gpu_caps("agent-a", inv) == {uuid_of(0): 81920, uuid_of(1): 81920, uuid_of(2): 20480}
    assert p.gpu_caps("agent-b", inv) == {uuid_of(2): 61440, uuid_of(3): 1024}
    assert by_agent(p)["agent-b"].whole_gpus == ()
