"""coordinator.policy.partition: spec files and sizes parsed, errors pickled, partitions round-tripped through
JSON."""
from __future__ import annotations

import pickle
import tomllib
from typing import Any

import pytest

from coordinator.policy.partition import (
    AllocationSpec,
    Partition,
    PartitionError,
    PartitionSpec,
    Reserved,
    compute_partition,
    load_spec_file,
    parse_size,
    parse_spec,
)
from tests.support.partition_specs import (
    HOST,
    GiB,
    MiB,
    inventory,
    json_roundtrip,
    manual,
    spec,
    uuid_of,
)

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


def test_a_partition_refusal_quotes_at_most_32_characters_of_a_value() -> None:
    """Issue 29: partition refusals quoted up to 60 characters of a value or key; every refusal quotes at most 32."""
    from coordinator.policy.partition.units import _key, _show
    for shown in (_show("x" * 200), _show(["y" * 200]), _key("a b" * 100)):
        assert len(shown.removesuffix("...")) <= 32, shown
