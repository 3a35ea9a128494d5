"""coordinator.policy.partition: every rejection rule, one test each, the error naming its field."""
from __future__ import annotations

from typing import Any

import pytest

from coordinator.policy.partition import (
    AllocationSpec,
    PartitionError,
    PartitionSpec,
    Reserved,
    compute_partition,
    parse_spec,
)
from tests.support.partition_specs import (
    HOST,
    GiB,
    inventory,
    manual,
    rejected,
    spec,
    uuid_of,
)

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
