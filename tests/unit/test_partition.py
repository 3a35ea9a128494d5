"""Tests of coordinator.policy.partition: spec parsing, the three modes, every rejection rule, properties."""
from __future__ import annotations

import json
import pickle
import tomllib
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.policy.partition import (
    KINDS,
    MODES,
    AgentAllocation,
    AllocationSpec,
    Partition,
    PartitionError,
    PartitionSpec,
    Reserved,
    compute_partition,
    default_partition,
    load_spec_file,
    parse_size,
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


# -- the other rejection rules, one each ---------------------------------------------------------


def test_reject_host_mismatch() -> None:
    e = rejected(inventory(host="gpu-node-2"), {"host": HOST, "mode": "shared"})
    assert e.field == "host"


@pytest.mark.parametrize("kind, value, inv_kw", [
    ("mem", 65 * GiB, {"mem": 64 * GiB}),
    ("disk", "2TiB", {"disk": 1024 * GiB}),
    ("vram_headroom", "40GiB", {"gpus": [81920, 40000]}),  # compared with the smallest GPU
])
def test_reject_reserved_above_total(kind: str, value: Any, inv_kw: dict[str, Any]) -> None:
    e = rejected(inventory(**inv_kw), {"host": HOST, "mode": "auto-split", "agents": ["agent-a"],
                                       "reserved": {kind: value}})
    assert e.field == f"reserved.{kind}"


def test_reserved_equal_to_total_mem_disk_headroom_is_accepted() -> None:
    inv = inventory(mem=8 * GiB, disk=8 * GiB, gpus=[1024])
    p = compute_partition(inv, spec(mode="shared", reserved={"mem": "8GiB", "disk": "8GiB", "vram_headroom": "1GiB"}))
    assert all(a.mem_bytes == 0 and a.disk_bytes == 0 and a.vram_caps_mb == ((uuid_of(0), 0),)
               for a in p.allocations)


def test_reject_reserving_every_core() -> None:
    e = rejected(inventory(cores=8), {"host": HOST, "mode": "shared", "reserved": {"cpu": 8}})
    assert e.field == "reserved.cpu"


def test_reject_auto_split_with_fewer_cores_than_agents() -> None:
    e = rejected(inventory(cores=4), {"host": HOST, "mode": "auto-split", "agents": ["agent-a", "agent-b"],
                                      "reserved": {"cpu": 3}})
    assert e.field == "agents"


@pytest.mark.parametrize("mode", ["auto-split", "manual"])
def test_reject_no_agents_in_non_shared_mode(mode: str) -> None:
    with pytest.raises(PartitionError) as ei:
        parse_spec({"host": HOST, "mode": mode, "agents": []})
    assert ei.value.field == "agents"


@pytest.mark.parametrize("kind", ["mem", "disk"])
def test_reject_manual_sum_above_available(kind: str) -> None:
    inv = inventory(mem=64 * GiB, disk=64 * GiB)
    # 32 + 32 would fit 64, but 1GiB is reserved.
    e = rejected(inv, manual({"agent-a": {kind: "32GiB"}, "agent-b": {kind: "32GiB"}}, reserved={kind: "1GiB"}))
    assert e.field == f"allocations.agent-b.{kind}"
    p = compute_partition(inv, parse_spec(manual({"agent-a": {kind: "32GiB"}, "agent-b": {kind: "31GiB"}},
                                                 reserved={kind: "1GiB"})))
    assert [getattr(a, f"{kind}_bytes") for a in p.allocations] == [32 * GiB, 31 * GiB]


def test_reject_manual_core_that_does_not_exist() -> None:
    e = rejected(inventory(cores=8), manual({"agent-a": {"cores": [1, 8]}, "agent-b": {"cores": [2]}}))
    assert e.field == "allocations.agent-a.cores[1]"


def test_reject_manual_core_that_is_reserved() -> None:
    e = rejected(inventory(cores=8), manual({"agent-a": {"cores": [0, 1]}, "agent-b": {"cores": [2]}},
                                            reserved={"cpu": 1}))
    assert e.field == "allocations.agent-a.cores[0]"


def test_reject_manual_cores_overlapping() -> None:
    e = rejected(inventory(cores=8), manual({"agent-a": {"cores": [1, 2]}, "agent-b": {"cores": [3, 2]}}))
    assert e.field == "allocations.agent-b.cores[1]"


def test_reject_gpu_given_whole_to_two_agents() -> None:
    # agent-a names GPU 1 by index, agent-b by uuid: still the same device.
    e = rejected(inventory(gpus=[81920] * 2),
                 manual({"agent-a": {"gpus": [1]}, "agent-b": {"gpus": [uuid_of(1)]}}))
    assert e.field == "allocations.agent-b.gpus[0]"


def test_reject_gpu_given_whole_and_capped_for_another() -> None:
    e = rejected(inventory(gpus=[81920] * 2),
                 manual({"agent-a": {"gpus": [0], "vram": {}}, "agent-b": {"gpus": [], "vram": {"0": "10GiB"}}}))
    assert e.field == "allocations.agent-b.vram.0"


def test_reject_gpu_given_whole_and_capped_for_the_same_agent() -> None:
    e = rejected(inventory(gpus=[81920] * 2),
                 manual({"agent-a": {"gpus": [0], "vram": {uuid_of(0): "10GiB"}}}))
    assert e.field == f"allocations.agent-a.vram.{uuid_of(0)}"


def test_reject_vram_cap_above_usable() -> None:
    inv = inventory(gpus=[81920])
    e = rejected(inv, manual({"agent-a": {"vram": {uuid_of(0): "80GiB"}}}, reserved={"vram_headroom": "1MiB"}))
    assert e.field == f"allocations.agent-a.vram.{uuid_of(0)}"
    p = compute_partition(inv, parse_spec(manual({"agent-a": {"vram": {uuid_of(0): "81919MiB"}}},
                                                 reserved={"vram_headroom": "1MiB"})))
    assert p.gpu_caps("agent-a", inv) == {uuid_of(0): 81919}


def test_reject_unknown_gpu_index() -> None:
    e = rejected(inventory(gpus=[81920] * 2), manual({"agent-a": {"gpus": [0, 2]}}))
    assert e.field == "allocations.agent-a.gpus[1]"


def test_reject_unknown_gpu_uuid() -> None:
    e = rejected(inventory(gpus=[81920] * 2), manual({"agent-a": {"vram": {"GPU-nope": "1GiB"}}}))
    assert e.field == "allocations.agent-a.vram.GPU-nope"


@pytest.mark.parametrize("data, field", [
    (manual({"agent-a": {"cpu": -1}}), "allocations.agent-a.cpu"),
    (manual({"agent-a": {"mem": -5}}), "allocations.agent-a.mem"),
    (manual({"agent-a": {"disk": "-1GiB"}}), "allocations.agent-a.disk"),
    (manual({"agent-a": {"cores": [-1]}}), "allocations.agent-a.cores[0]"),
    (manual({"agent-a": {"gpus": [-1]}}), "allocations.agent-a.gpus[0]"),
    (manual({"agent-a": {"vram": {"0": -1}}}), "allocations.agent-a.vram.0"),
    ({"host": HOST, "reserved": {"cpu": -1}}, "reserved.cpu"),
    ({"host": HOST, "reserved": {"mem": -1}}, "reserved.mem"),
    ({"host": HOST, "reserved": {"disk": -1.0}}, "reserved.disk"),
    ({"host": HOST, "reserved": {"vram_headroom": "-512MiB"}}, "reserved.vram_headroom"),
])
def test_reject_negative_values(data: dict[str, Any], field: str) -> None:
    with pytest.raises(PartitionError) as ei:
        parse_spec(data)
    assert ei.value.field == field
    assert "negative" in ei.value.message


def test_reject_duplicate_agents() -> None:
    with pytest.raises(PartitionError) as ei:
        parse_spec({"host": HOST, "mode": "auto-split", "agents": ["agent-a", "agent-b", "agent-a"]})
    assert ei.value.field == "agents[2]"


def test_reject_unknown_mode() -> None:
    with pytest.raises(PartitionError) as ei:
        parse_spec({"host": HOST, "mode": "autosplit", "agents": ["agent-a"]})
    assert ei.value.field == "mode"


def test_reject_allocations_in_non_manual_mode() -> None:
    for mode in ("shared", "auto-split"):
        with pytest.raises(PartitionError) as ei:
            parse_spec({"host": HOST, "mode": mode, "agents": ["agent-a"], "allocations": {"agent-a": {"cpu": 1}}})
        assert ei.value.field == "allocations.agent-a"


def test_reject_manual_agent_without_allocation() -> None:
    with pytest.raises(PartitionError) as ei:
        parse_spec(manual({"agent-a": {"cpu": 1}}, agents=("agent-a", "agent-b")))
    assert ei.value.field == "allocations.agent-b"


def test_reject_allocation_for_agent_not_listed() -> None:
    with pytest.raises(PartitionError) as ei:
        parse_spec(manual({"agent-a": {"cpu": 1}, "agent-z": {"cpu": 1}}, agents=("agent-a",)))
    assert ei.value.field == "allocations.agent-z"


def test_reject_agents_naming_different_kinds() -> None:
    with pytest.raises(PartitionError) as ei:
        parse_spec(manual({"agent-a": {"cpu": 2, "mem": "1GiB"}, "agent-b": {"cpu": 2, "gpus": [0]}}))
    assert ei.value.field == "allocations.agent-b"
    # cpu and cores are one kind
    parse_spec(manual({"agent-a": {"cpu": 2}, "agent-b": {"cores": [5, 6]}}))


@pytest.mark.parametrize("data, field", [
    ({"mode": "shared"}, "host"),
    ({"host": "bad/host"}, "host"),
    ({"host": HOST, "colour": "red"}, "colour"),
    ({"host": HOST, "reserved": {"gpu": 1}}, "reserved.gpu"),
    ({"host": HOST, "reserved": {"cpu": "2"}}, "reserved.cpu"),
    ({"host": HOST, "reserved": {"cpu": True}}, "reserved.cpu"),
    ({"host": HOST, "reserved": []}, "reserved"),
    ({"host": HOST, "agents": "agent-a"}, "agents"),
    ({"host": HOST, "agents": ["agent-a", "bad name"]}, "agents[1]"),
    ({"host": HOST, "agents": [7]}, "agents[0]"),
    (manual({"agent-a": {"cpu": 1, "vrma": {}}}), "allocations.agent-a.vrma"),
    (manual({"agent-a": {"cpu": 1, "cores": [1]}}), "allocations.agent-a.cores"),
    (manual({"agent-a": {"cpu": 0}}), "allocations.agent-a.cpu"),
    (manual({"agent-a": {"cpu": 1.5}}), "allocations.agent-a.cpu"),
    (manual({"agent-a": {"cores": []}}), "allocations.agent-a.cores"),
    (manual({"agent-a": {"cores": [1, 1]}}), "allocations.agent-a.cores[1]"),
    (manual({"agent-a": {"gpus": [0, "0"]}}), "allocations.agent-a.gpus[1]"),
    (manual({"agent-a": {"gpus": [None]}}), "allocations.agent-a.gpus[0]"),
    (manual({"agent-a": {"vram": {"1": 20480}}}), "allocations.agent-a.vram.1"),  # bytes, not MiB
    (manual({"agent-a": {"vram": ["1"]}}), "allocations.agent-a.vram"),
    (manual({"agent-a": "4 cores"}), "allocations.agent-a"),
    ({"host": HOST, "reserved": {"cpu": 10**5000}}, "reserved.cpu"),  # too large, and no crash formatting it
    ({"host": HOST, "reserved": {"mem": 2**63}}, "reserved.mem"),
    ({"host": HOST, "mode": "x" * 100_000}, "mode"),
    ("not a table", "spec"),
])
def test_reject_malformed_specs(data: Any, field: str) -> None:
    with pytest.raises(PartitionError) as ei:
        parse_spec(data)
    assert ei.value.field == field
    assert ei.value.message


def test_hand_built_spec_is_revalidated() -> None:
    bad = PartitionSpec(host=HOST, mode="manual", agents=("agent-a",), reserved=Reserved(),
                        allocations=(("agent-a", AllocationSpec(cpu=-3)),))
    with pytest.raises(PartitionError) as ei:
        compute_partition(inventory(), bad)
    assert ei.value.field == "allocations.agent-a.cpu"


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


# -- parsing ---------------------------------------------------------------------------------------

DESIGN_EXAMPLE = '''
host = "gpu-node-1"
mode = "auto-split"            # shared | auto-split | manual
agents = ["agent-a", "agent-b", "agent-c"]

[reserved]                     # taken off the top before splitting
cpu = 1
mem = "1GiB"
disk = "8GiB"
vram_headroom = "512MiB"       # per GPU

[allocations.agent-a]          # manual mode only
cpu = 4                        # or explicit core ids: cores = [0, 1, 2, 3]
mem = "16GiB"
disk = "100GiB"
gpus = [0, 1]                  # whole devices, by index or uuid
vram = { 2 = "20GiB" }         # a VRAM cap on a shared device
'''


def test_design_example_verbatim_is_rejected_because_allocations_need_manual_mode() -> None:
    # The design brief's example (quoted above) shows every key at once; its allocations table is "manual
    # mode only".
    with pytest.raises(PartitionError) as ei:
        parse_spec(tomllib.loads(DESIGN_EXAMPLE))
    assert ei.value.field == "allocations.agent-a"


def test_design_example_auto_split_part() -> None:
    text = DESIGN_EXAMPLE.split("[allocations.agent-a]")[0]
    s = parse_spec(tomllib.loads(text))
    assert s == PartitionSpec(host="gpu-node-1", mode="auto-split", agents=("agent-a", "agent-b", "agent-c"),
                              reserved=Reserved(cpu=1, mem=GiB, disk=8 * GiB, vram_headroom_mb=512),
                              allocations=())
    inv = inventory(cores=16, mem=64 * GiB, disk=1024 * GiB, gpus=[81920] * 3)
    p = compute_partition(inv, s)
    assert [len(a.cores) for a in p.allocations] == [5, 5, 5]
    assert all(dict(a.vram_caps_mb) == {a.whole_gpus[0]: 81408} for a in p.allocations)


def test_design_example_as_manual() -> None:
    text = DESIGN_EXAMPLE.replace('mode = "auto-split"', 'mode = "manual"').replace(
        'agents = ["agent-a", "agent-b", "agent-c"]', 'agents = ["agent-a"]')
    s = parse_spec(tomllib.loads(text))
    assert s.allocations == (("agent-a", AllocationSpec(cpu=4, mem=16 * GiB, disk=100 * GiB, gpus=(0, 1),
                                                        vram=((2, 20480),))),)
    inv = inventory(cores=16, mem=64 * GiB, disk=1024 * GiB, gpus=[81920] * 3)
    p = compute_partition(inv, s)
    (a,) = p.allocations
    assert a.cores == (1, 2, 3, 4) and a.mem_bytes == 16 * GiB and a.disk_bytes == 100 * GiB
    assert a.whole_gpus == (uuid_of(0), uuid_of(1))
    assert a.vram_caps_mb == ((uuid_of(0), 81408), (uuid_of(1), 81408), (uuid_of(2), 20480))
    assert parse_spec(json_roundtrip(s.to_json())) == s
    assert Partition.from_json(json_roundtrip(p.to_json())) == p


def test_load_spec_file(tmp_path: Any) -> None:
    f = tmp_path / "spec.toml"
    f.write_text(DESIGN_EXAMPLE.split("[allocations.agent-a]")[0])
    assert load_spec_file(str(f)).reserved.vram_headroom_mb == 512
    f.write_text("host = ")
    with pytest.raises(PartitionError) as ei:
        load_spec_file(str(f))
    assert ei.value.field == str(f)


@pytest.mark.parametrize("value, expected", [
    (0, 0),
    (123, 123),
    ("123", 123),
    ("1KiB", 1024),
    ("512MiB", 512 * MiB),
    ("16GiB", 16 * GiB),
    ("2TiB", 2 << 40),
    ("16GB", 16 * 10**9),
    ("512MB", 512 * 10**6),
    ("1kb", 1000),
    ("16gib", 16 * GiB),
    ("16 GiB", 16 * GiB),
    (" 8GiB ", 8 * GiB),
    ("1.5GiB", 1610612736),
    ("0.3KiB", 307),  # 307.2 rounds down
    ("10Gi", 10 * GiB),
    ("7B", 7),
    (3.9, 3),
])
def test_parse_size(value: Any, expected: int) -> None:
    assert parse_size(value, "x") == expected


@pytest.mark.parametrize("value", [-1, "-1GiB", "", "GiB", "16G", "16 g", "1.2.3GiB", "16 GiBs", "16XB",
                                   "1e9", True, None, [1], float("nan"), float("inf"), -0.5, 2**63, "9" * 30,
                                   "１６GiB", "16GiB\n5"])
def test_parse_size_rejects(value: Any) -> None:
    with pytest.raises(PartitionError) as ei:
        parse_size(value, "reserved.mem")
    assert ei.value.field == "reserved.mem" and ei.value.message


def test_partition_error_shape_and_pickle() -> None:
    e = PartitionError("allocations.agent-a.cpu", "too many")
    assert (e.field, e.message, str(e)) == ("allocations.agent-a.cpu", "too many", "allocations.agent-a.cpu: too many")
    assert isinstance(e, ValueError)
    e2 = pickle.loads(pickle.dumps(e))
    assert (e2.field, e2.message) == (e.field, e.message)


def test_round_trips_of_every_mode() -> None:
    inv = inventory(cores=16, gpus=[81920, 81920, 40960])
    for s in (
        spec(mode="shared", reserved={"cpu": 1, "vram_headroom": "1GiB"}),
        spec(mode="shared", agents=()),
        spec(),
        parse_spec(manual({"agent-b": {"cores": [3, 2], "vram": {uuid_of(2): "1GiB", "0": "2GiB"}},
                           "agent-a": {"cpu": 1, "vram": {}}}, agents=("agent-a", "agent-b"))),
    ):
        assert parse_spec(json_roundtrip(s.to_json())) == s
        p = compute_partition(inv, s)
        assert Partition.from_json(json_roundtrip(p.to_json())) == p
        assert Partition.from_json(p.to_json()) == p


@pytest.mark.parametrize("data", [
    {}, {"host": HOST, "mode": "nope"}, {"host": HOST, "mode": "shared", "allocations": [{"agent": 3}]},
    {"host": HOST, "mode": "shared", "allocations": [{"agent": "a", "vram_caps_mb": [["u"]]}]},
    {"host": HOST, "mode": "shared", "headroom_mb": "x"}, {"host": HOST, "mode": "shared", "spec": {"host": 1}},
])
def test_partition_from_json_rejects_garbage(data: dict[str, Any]) -> None:
    with pytest.raises(PartitionError):
        Partition.from_json(data)


# -- properties ------------------------------------------------------------------------------------

AGENT_NAMES = ["agent-a", "agent-b", "agent-c", "agent-d", "agent-e", "agent-f"]
PROPS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def inventories(draw: st.DrawFn) -> HostInventory:
    n = draw(st.integers(1, 64))
    if draw(st.booleans()):
        core_ids = tuple(range(n))
    else:
        core_ids = tuple(sorted(draw(st.sets(st.integers(0, 255), min_size=n, max_size=n))))
    ngpu = draw(st.integers(0, 8))
    sizes = draw(st.lists(st.sampled_from([1, 512, 16384, 24576, 40960, 81920, 143771]) | st.integers(1, 200_000),
                          min_size=ngpu, max_size=ngpu))
    return HostInventory(
        host=HOST, address="127.0.0.1:7071", cpu_count=n, core_ids=core_ids,
        mem_bytes=draw(st.integers(0, 2 << 40)), disk_path="/", disk_bytes=draw(st.integers(0, 64 << 40)),
        gpus=tuple(GpuInfo(index=i, uuid=uuid_of(i), name="sim", vram_total_mb=t) for i, t in enumerate(sizes)),
    )


def _size(draw: st.DrawFn, hi: int) -> Any:
    """A size up to about ``hi`` bytes, as an int or a string."""
    n = draw(st.integers(0, max(0, hi)))
    form = draw(st.sampled_from(["int", "str", "mib"]))
    if form == "int":
        return n
    if form == "str":
        return str(n)
    return f"{n // MiB}MiB"


@st.composite
def raw_specs(draw: st.DrawFn, inv: HostInventory) -> Any:
    """Random specs: some valid, many not (wrong host, oversized, overlapping, malformed)."""
    garbage: st.SearchStrategy[Any] = st.sampled_from([-1, "-3GiB", "lots", None, [], 1.5, True])
    maybe_bad = draw(st.sampled_from([False] * 9 + [True]))
    ncores = len(inv.core_ids)
    mode = draw(st.sampled_from(MODES) | st.just("bogus")) if maybe_bad else draw(st.sampled_from(MODES))
    agents = draw(st.lists(st.sampled_from(AGENT_NAMES), min_size=0 if maybe_bad else 1, max_size=6,
                           unique=not maybe_bad))
    host = draw(st.sampled_from([HOST] * 19 + ["other-host"]))
    data: dict[str, Any] = {"host": host, "mode": mode, "agents": agents}
    reserved: dict[str, Any] = {}
    if draw(st.booleans()):
        reserved["cpu"] = draw(st.integers(0, ncores + 1))
    if draw(st.booleans()):
        reserved["mem"] = _size(draw, inv.mem_bytes + GiB)
    if draw(st.booleans()):
        reserved["disk"] = _size(draw, inv.disk_bytes + GiB)
    if draw(st.booleans()):
        top = min([g.vram_total_mb for g in inv.gpus], default=1024)
        reserved["vram_headroom"] = f"{draw(st.integers(0, top + 10))}MiB"
    if maybe_bad and draw(st.booleans()):
        reserved[draw(st.sampled_from(["cpu", "mem", "disk", "vram_headroom", "gpu"]))] = draw(garbage)
    data["reserved"] = reserved
    if mode == "manual" or (maybe_bad and agents):
        kinds = draw(st.sets(st.sampled_from(KINDS)))
        n = max(1, len(agents))
        allocs: dict[str, Any] = {}
        for agent in agents:
            k = kinds if not maybe_bad else draw(st.sets(st.sampled_from(KINDS)))
            a: dict[str, Any] = {}
            if "cpu" in k:
                if draw(st.booleans()):
                    a["cpu"] = draw(st.integers(1, max(1, 2 * ncores // n)))
                else:
                    pool = list(inv.core_ids) + [max(inv.core_ids) + 1]
                    a["cores"] = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=max(1, 2 * ncores // n),
                                               unique=True))
            if "mem" in k:
                a["mem"] = _size(draw, 2 * inv.mem_bytes // n)
            if "disk" in k:
                a["disk"] = _size(draw, 2 * inv.disk_bytes // n)
            refs = st.integers(0, len(inv.gpus)) | st.sampled_from([g.uuid for g in inv.gpus] + ["GPU-unknown"])
            if "gpus" in k:
                a["gpus"] = draw(st.lists(refs, max_size=3, unique=True))
            if "vram" in k:
                caps = draw(st.dictionaries(refs.map(str), st.integers(1, 200_000).map(lambda m: f"{m}MiB"),
                                            max_size=3))
                a["vram"] = caps
            if maybe_bad and draw(st.booleans()):
                a[draw(st.sampled_from(["cpu", "cores", "mem", "gpus", "vram", "bogus"]))] = draw(garbage)
            allocs[agent] = a
        if maybe_bad and draw(st.booleans()):
            allocs["agent-zz"] = {}
        data["allocations"] = allocs
    return data


@st.composite
def valid_specs(draw: st.DrawFn, inv: HostInventory) -> PartitionSpec:
    """Specs built to fit ``inv``: compute_partition must accept every one."""
    cores = sorted(set(inv.core_ids))
    mode = draw(st.sampled_from(MODES))
    rcpu = draw(st.integers(0, len(cores) - 1))
    avail = cores[rcpu:]
    if mode == "auto-split":
        nagents = draw(st.integers(1, min(len(avail), len(AGENT_NAMES))))
    elif mode == "manual":
        nagents = draw(st.integers(1, len(AGENT_NAMES)))
    else:
        nagents = draw(st.integers(0, len(AGENT_NAMES)))
    agents = draw(st.permutations(AGENT_NAMES))[:nagents]
    rmem = draw(st.integers(0, inv.mem_bytes))
    rdisk = draw(st.integers(0, inv.disk_bytes))
    headroom = draw(st.integers(0, min([g.vram_total_mb for g in inv.gpus], default=4096)))
    data: dict[str, Any] = {"host": inv.host, "mode": mode, "agents": agents,
                            "reserved": {"cpu": rcpu, "mem": rmem, "disk": rdisk, "vram_headroom": f"{headroom}MiB"}}
    if mode == "manual":
        kinds = draw(st.sets(st.sampled_from(KINDS)))
        if len(avail) < nagents:
            kinds.discard("cpu")
        allocs: dict[str, dict[str, Any]] = {a: {} for a in agents}
        if "cpu" in kinds:
            # split a random number of the available cores into nonempty chunks, one per agent
            take = draw(st.integers(nagents, len(avail)))
            shuffled = draw(st.permutations(avail))[:take]
            cuts = sorted(draw(st.sets(st.integers(1, take - 1), min_size=nagents - 1, max_size=nagents - 1))) \
                if nagents > 1 else []
            chunks = [shuffled[i:j] for i, j in zip([0, *cuts], [*cuts, take])]
            for a, chunk in zip(agents, chunks):
                if draw(st.booleans()):
                    allocs[a]["cores"] = chunk
                else:
                    allocs[a]["cpu"] = len(chunk)
        for kind, total in (("mem", inv.mem_bytes - rmem), ("disk", inv.disk_bytes - rdisk)):
            if kind in kinds:
                left = total
                for a in agents:
                    share = draw(st.integers(0, left))
                    allocs[a][kind] = share
                    left -= share
        owned: set[int] = set()
        if "gpus" in kinds:
            for a in agents:
                allocs[a]["gpus"] = []
            for g in inv.gpus:
                who = draw(st.sampled_from([None, *agents]))
                if who is not None:
                    allocs[who]["gpus"].append(g.index if draw(st.booleans()) else g.uuid)
                    owned.add(g.index)
        if "vram" in kinds:
            for a in agents:
                caps: dict[str, str] = {}
                for g in inv.gpus:
                    usable = g.vram_total_mb - headroom
                    if g.index not in owned and usable >= 1 and draw(st.booleans()):
                        key = str(g.index) if draw(st.booleans()) else g.uuid
                        caps[key] = f"{draw(st.integers(1, usable))}MiB"
                allocs[a]["vram"] = caps
        data["allocations"] = allocs
    return parse_spec(data)


def check_fits(inv: HostInventory, p: Partition) -> None:
    """Every invariant of an accepted partition."""
    assert p.spec is not None
    s = p.spec
    r = s.reserved
    cores = sorted(set(inv.core_ids))
    reserved_cores, avail = set(cores[: r.cpu]), cores[r.cpu:]
    avail_mem, avail_disk = inv.mem_bytes - r.mem, inv.disk_bytes - r.disk
    assert avail and avail_mem >= 0 and avail_disk >= 0
    usable = {g.uuid: max(0, g.vram_total_mb - r.vram_headroom_mb) for g in inv.gpus}
    assert (p.host, p.mode, p.agents, p.headroom_mb) == (inv.host, s.mode, s.agents, r.vram_headroom_mb)
    assert [a.agent for a in p.allocations] == list(s.agents)

    for a in p.allocations:
        assert len(set(a.cores)) == len(a.cores)
        assert set(a.cores) <= set(avail) and not set(a.cores) & reserved_cores
        assert 0 <= a.mem_bytes <= avail_mem and 0 <= a.disk_bytes <= avail_disk
        caps = dict(a.vram_caps_mb)
        assert len(caps) == len(a.vram_caps_mb)
        for uuid, cap in caps.items():
            assert 0 <= cap <= usable[uuid]
        for uuid in a.whole_gpus:
            assert caps[uuid] == usable[uuid]
        assert p.allows(a.agent)
        assert p.gpu_caps(a.agent, inv) == (usable if s.mode == "shared" else caps)

    # no GPU given whole twice, and a whole GPU is nobody else's
    whole = [u for a in p.allocations for u in a.whole_gpus]
    assert len(whole) == len(set(whole))
    for a in p.allocations:
        for b in p.allocations:
            if a.agent != b.agent:
                assert not set(a.whole_gpus) & set(dict(b.vram_caps_mb))

    named = p.allocations and s.allocations and s.allocations[0][1].kinds() or frozenset()
    split_cpu = s.mode == "auto-split" or "cpu" in named
    split_mem = s.mode == "auto-split" or "mem" in named
    split_disk = s.mode == "auto-split" or "disk" in named
    all_cores = [c for a in p.allocations for c in a.cores]
    if split_cpu:
        assert len(all_cores) == len(set(all_cores)) <= len(cores) - r.cpu
        assert all(a.cores for a in p.allocations)
    else:
        assert all(list(a.cores) == avail for a in p.allocations)
    if split_mem:
        assert sum(a.mem_bytes for a in p.allocations) <= avail_mem
    else:
        assert all(a.mem_bytes == avail_mem for a in p.allocations)
    if split_disk:
        assert sum(a.disk_bytes for a in p.allocations) <= avail_disk
    else:
        assert all(a.disk_bytes == avail_disk for a in p.allocations)
    if s.mode == "shared":
        assert p.allows("stranger") and p.gpu_caps("stranger", inv) == usable
        assert all(a.whole_gpus == () and dict(a.vram_caps_mb) == usable for a in p.allocations)
    else:
        assert not p.allows("stranger") and p.gpu_caps("stranger", inv) == {}

    assert Partition.from_json(json_roundtrip(p.to_json())) == p
    assert parse_spec(json_roundtrip(s.to_json())) == s


@PROPS
@given(data=st.data())
def test_property_random_specs_fit_or_are_rejected_cleanly(data: st.DataObject) -> None:
    inv = data.draw(inventories())
    raw = data.draw(raw_specs(inv))
    try:
        p = compute_partition(inv, parse_spec(raw))
    except PartitionError as e:
        assert isinstance(e.field, str) and e.field
        assert isinstance(e.message, str) and e.message
        assert str(e) == f"{e.field}: {e.message}"
        return
    check_fits(inv, p)


@PROPS
@given(data=st.data())
def test_property_valid_specs_are_accepted_and_fit(data: st.DataObject) -> None:
    inv = data.draw(inventories())
    s = data.draw(valid_specs(inv))
    p = compute_partition(inv, s)
    assert p.spec == s
    check_fits(inv, p)
    if s.mode == "manual":
        for (_agent, want), got in zip(s.allocations, p.allocations):
            if want.cpu_count() is not None:
                assert len(got.cores) == want.cpu_count()
            if want.cores is not None:
                assert set(got.cores) == set(want.cores)
            if want.mem is not None:
                assert got.mem_bytes == want.mem
            if want.disk is not None:
                assert got.disk_bytes == want.disk
            if want.gpus is not None:
                assert len(got.whole_gpus) == len(want.gpus)


@PROPS
@given(inv=inventories(), nagents=st.integers(1, 6), rcpu=st.integers(0, 8), headroom=st.integers(0, 600))
def test_property_auto_split_shares_differ_by_at_most_one(inv: HostInventory, nagents: int, rcpu: int,
                                                          headroom: int) -> None:
    s = spec(agents=tuple(AGENT_NAMES[:nagents]), reserved={"cpu": rcpu, "vram_headroom": f"{headroom}MiB"})
    try:
        p = compute_partition(inv, s)
    except PartitionError as e:
        assert e.field in ("agents", "reserved.cpu", "reserved.vram_headroom")
        return
    check_fits(inv, p)
    for measure in (lambda a: len(a.cores), lambda a: a.mem_bytes, lambda a: a.disk_bytes,
                    lambda a: len(a.whole_gpus)):
        values = [measure(a) for a in p.allocations]
        assert max(values) - min(values) <= 1
        assert values == sorted(values, reverse=True)  # remainders go to the first agents
    assert sum(len(a.cores) for a in p.allocations) == len(inv.core_ids) - rcpu
    assert sum(a.mem_bytes for a in p.allocations) == inv.mem_bytes
    if len(inv.gpus) >= nagents:
        assert sorted(u for a in p.allocations for u in a.whole_gpus) == sorted(g.uuid for g in inv.gpus)
    else:
        for a in p.allocations:
            assert a.whole_gpus == ()
            assert dict(a.vram_caps_mb) == {g.uuid: p.usable_mb(g) // nagents for g in inv.gpus}


@PROPS
@given(value=st.one_of(st.integers(), st.text(max_size=20), st.floats(), st.none(), st.booleans(),
                       st.lists(st.integers(), max_size=2)))
def test_property_parse_size_never_crashes(value: Any) -> None:
    try:
        n = parse_size(value, "f")
    except PartitionError as e:
        assert e.field == "f" and e.message
    else:
        assert isinstance(n, int) and 0 <= n < 2**63


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 300) | st.text(max_size=8) | st.sampled_from(
        ["host", "mode", "agents", "reserved", "allocations", "cpu", "cores", "mem", "gpus", "vram", "manual",
         "16GiB", "agent-a", HOST]),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.sampled_from(["host", "mode", "agents", "reserved", "allocations", "agent-a", "cpu", "cores", "mem",
                         "disk", "gpus", "vram", "vram_headroom", "0", "x"]), children, max_size=5),
    max_leaves=20,
)


@PROPS
@given(raw=json_values)
def test_property_garbage_never_crashes(raw: Any) -> None:
    inv = inventory(gpus=[81920, 40960])
    try:
        p = compute_partition(inv, parse_spec(raw))
    except PartitionError as e:
        assert e.field and e.message
    else:
        check_fits(inv, p)
    try:
        Partition.from_json(raw)
    except PartitionError as e:
        assert e.field and e.message
