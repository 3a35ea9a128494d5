"""GPU topology from the node (issue 21, item 5): NUMA node and NVLink peers per GPU, from NVML (faked at the
pynvml function level, with pynvml's real exception classes), from sysfs, and from ``--fake-gpus``; and how
the ``hosts/<host>`` record carries them (old records read as unknown topology)."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pynvml
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.node import nvml_api as nvml_module
from coordinator.node.inventory import (
    MIB,
    FakeGpuSource,
    NvmlGpuSource,
    parse_fake_gpus,
    read_inventory,
)
from coordinator.node.nvml_api import parse_pci_bus_id, sysfs_numa_node
from coordinator.records import GpuInfo, HostInventory, dumps, loads
from tests.support.fake_nvml import FakeDevice, FakeNvml

GIB = 1024 * MIB
GPU, NPU, SWITCH = (pynvml.NVML_NVLINK_DEVICE_TYPE_GPU, pynvml.NVML_NVLINK_DEVICE_TYPE_IBMNPU,
                    pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH)


def bus(n: int) -> str:
    """NVML's spelling of a PCI bus id (8-digit domain, upper case)."""
    return f"00000000:{n:02X}:00.0"


def device(i: int, **topology: Any) -> FakeDevice:
    return FakeDevice(f"GPU-{i:04d}", "NVIDIA H100", 80 * GIB, bus_id=bus(0x10 + i), **topology)


def topology(src: NvmlGpuSource) -> list[tuple[int | None, tuple[int, ...]]]:
    return [(g.numa_node, g.nvlink_peers) for g in src.gpus()]


# ------------------------------------------------------------------------------ NVML

def test_nvml_constants_the_code_uses_are_pynvmls() -> None:
    assert nvml_module.NVML_ERROR_NOT_SUPPORTED == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert nvml_module.NVML_ERROR_FUNCTION_NOT_FOUND == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    assert nvml_module.NVML_FEATURE_ENABLED == pynvml.NVML_FEATURE_ENABLED
    assert nvml_module.NVLINK_DEVICE_TYPE_SWITCH == pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH


def test_direct_nvlinks_map_remote_bus_ids_to_peer_indexes_and_numa_comes_from_nvml() -> None:
    # Two NVLink pairs (0-1 over two links, 2-3 over one), one pair per NUMA node; an inactive link to GPU 2
    # and a link to a POWER9 NPU do not count. Bus ids come in either spelling, bytes or str, any case.
    nvml = FakeNvml([
        device(0, numa=0, links=[(1, bus(0x11), GPU), (1, bus(0x11).lower(), GPU), (0, bus(0x12), GPU)]),
        device(1, numa=0, links=[(1, b"0000:10:00.0", GPU), (1, bus(0x10), GPU)]),
        device(2, numa=1, links=[(1, bus(0x13), GPU), (1, "00000000:04:00.0", NPU)]),
        device(3, numa=1, links=[(1, bus(0x12).encode(), GPU)]),
    ])
    assert topology(NvmlGpuSource(nvml)) == [(0, (1,)), (0, (0,)), (1, (3,)), (1, (2,))]


def test_gpus_on_one_nvswitch_are_all_peers() -> None:
    # HGX: every GPU's links go to the same NVSwitches, none to another GPU.
    nvml = FakeNvml([device(i, numa=i // 2, links=[(1, bus(0xA0 + s), SWITCH) for s in range(6)])
                     for i in range(4)])
    assert topology(NvmlGpuSource(nvml)) == [(0, (1, 2, 3)), (0, (0, 2, 3)), (1, (0, 1, 3)), (1, (0, 1, 2))]


def test_a_link_seen_from_one_side_only_is_reported_by_that_side() -> None:
    # GPU 1 cannot list its links (any NVML error): GPU 0 still reports its link; placement only counts a
    # pair as linked when both ends list each other.
    nvml = FakeNvml([device(0, links=[(1, bus(0x11), GPU)]), device(1, links=[(1, bus(0x10), GPU)])])
    nvml.devices[1].fail["nvmlDeviceGetNvLinkState"] = pynvml.NVML_ERROR_UNKNOWN
    assert topology(NvmlGpuSource(nvml)) == [(None, (1,)), (None, ())]


def test_a_peer_that_is_not_offered_is_not_listed() -> None:
    nvml = FakeNvml([device(0, links=[(1, bus(0x11), GPU)]), device(1, links=[(1, bus(0x10), GPU)])])
    nvml.devices[1].uuid = "GPU-with/slash"          # not a valid key segment: GPU 1 is not offered
    src = NvmlGpuSource(nvml)
    assert [(g.index, g.nvlink_peers) for g in src.gpus()] == [(0, ())]


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
                                  pynvml.NVML_ERROR_UNKNOWN, pynvml.NVML_ERROR_GPU_IS_LOST,
                                  pynvml.NVML_ERROR_NO_PERMISSION])
@pytest.mark.parametrize("call", ["nvmlDeviceGetPciInfo", "nvmlDeviceGetNumaNodeId", "nvmlDeviceGetNvLinkState",
                                  "nvmlDeviceGetNvLinkRemotePciInfo", "nvmlDeviceGetNvLinkRemoteDeviceType"])
def test_any_failing_topology_call_gives_unknown_topology_never_a_lost_gpu(call: str, code: int) -> None:
    nvml = FakeNvml([device(i, numa=0, links=[(1, bus(0x10 + (1 - i)), GPU)]) for i in range(2)])
    for d in nvml.devices:
        d.fail[call] = code
    src = NvmlGpuSource(nvml, sysfs_root="/nonexistent")
    gpus = src.gpus()
    assert [g.index for g in gpus] == [0, 1]
    assert [u.index for u in src.usage()] == [0, 1]
    expected_numa = None if call in ("nvmlDeviceGetNumaNodeId",) else 0
    expected_peers: tuple[tuple[int, ...], ...] = ((1,), (0,))
    if call in ("nvmlDeviceGetPciInfo", "nvmlDeviceGetNvLinkState", "nvmlDeviceGetNvLinkRemotePciInfo"):
        expected_peers = ((), ())     # without either end's bus id, or without the links, no peer is known
    assert [g.numa_node for g in gpus] == [expected_numa] * 2
    assert tuple(g.nvlink_peers for g in gpus) == expected_peers


def test_a_gpu_without_nvlink_stops_at_not_supported_and_costs_one_call() -> None:
    nvml = FakeNvml([device(0, numa=0, links=None)])
    src = NvmlGpuSource(nvml)
    assert topology(src) == [(0, ())]
    assert nvml.calls.count("nvmlDeviceGetNvLinkState") == 1


def test_links_past_the_gpus_last_one_are_skipped_up_to_nvml_nvlink_max_links() -> None:
    nvml = FakeNvml([device(0, links=[(0, bus(0x11), GPU)] * 3 + [(1, bus(0x11), GPU)]),
                     device(1, links=[(1, bus(0x10), GPU)])])
    src = NvmlGpuSource(nvml)
    assert topology(src) == [(None, (1,)), (None, (0,))]
    assert nvml.calls.count("nvmlDeviceGetNvLinkState") == 2 * pynvml.NVML_NVLINK_MAX_LINKS


class OldPynvml:
    """A pynvml build without the topology functions (drivers and bindings before NVLink)."""

    def __init__(self, inner: FakeNvml) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        if "NvLink" in name or "Numa" in name or "PciInfo" in name or name == "NVML_NVLINK_MAX_LINKS":
            raise AttributeError(name)
        return getattr(self._inner, name)


def test_a_pynvml_without_the_topology_functions_reports_unknown_topology() -> None:
    src = NvmlGpuSource(OldPynvml(FakeNvml([device(0, numa=1, links=[(1, bus(0x11), GPU)]), device(1, numa=1)])))
    assert topology(src) == [(None, ()), (None, ())]


def write_numa(root: Path, name: str, text: str) -> None:
    d = root / "bus" / "pci" / "devices" / name
    d.mkdir(parents=True)
    (d / "numa_node").write_text(text)


def test_numa_node_falls_back_to_sysfs_where_nvml_has_none(tmp_path: Path) -> None:
    write_numa(tmp_path, "0000:10:00.0", "1\n")
    write_numa(tmp_path, "0000:11:00.0", "-1\n")      # the kernel's "unknown"
    write_numa(tmp_path, "0000:12:00.0", "garbage")
    nvml = FakeNvml([device(i) for i in range(4)])    # NumaNodeId NotSupported; GPU 3 has no sysfs entry
    nvml.devices[2].numa = -1                         # some drivers answer -1 rather than NotSupported
    src = NvmlGpuSource(nvml, sysfs_root=str(tmp_path))
    assert [g.numa_node for g in src.gpus()] == [1, None, None, None]


def test_nvml_numa_node_wins_over_sysfs(tmp_path: Path) -> None:
    write_numa(tmp_path, "0000:10:00.0", "1\n")
    src = NvmlGpuSource(FakeNvml([device(0, numa=0)]), sysfs_root=str(tmp_path))
    assert [g.numa_node for g in src.gpus()] == [0]


@pytest.mark.parametrize("text, parsed", [
    ("00000000:07:00.0", (0, 7, 0, 0)), ("0000:07:00.0", (0, 7, 0, 0)), (b"00000001:AB:1F.7", (1, 0xAB, 0x1F, 7)),
    ("00000000:07:00.0\0\0", (0, 7, 0, 0)), ("", None), ("../../etc/passwd", None), ("0000:07:00.8", None),
    ("0000:07:00", None), ("000000000:07:00.0", None),
])
def test_pci_bus_ids_parse_only_when_well_formed(text: str | bytes, parsed: tuple[int, ...] | None) -> None:
    assert parse_pci_bus_id(text) == parsed


def test_sysfs_lookup_uses_the_kernels_spelling(tmp_path: Path) -> None:
    write_numa(tmp_path, "0001:ab:1f.7", "3")
    assert sysfs_numa_node(str(tmp_path), (1, 0xAB, 0x1F, 7)) == 3


def test_topology_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    nvml = FakeNvml([device(0, numa=0, links=[(1, bus(0x11), GPU)]), device(1, numa=0, links=[(1, bus(0x10), GPU)])])
    nvml.devices[1].fail["nvmlDeviceGetMemoryInfo"] = pynvml.NVML_ERROR_GPU_IS_LOST   # partial: not cached
    src = NvmlGpuSource(nvml)
    with caplog.at_level(logging.INFO, logger="coordinator.node.nvml"):
        src.gpus()
        src.gpus()
    lines = [r.getMessage() for r in caplog.records if "topology" in r.getMessage()]
    assert lines == ["GPU topology: GPU 0: NUMA 0, NVLink none"]


# ------------------------------------------------------------------------------ --fake-gpus

def test_fake_spec_states_numa_nodes_and_nvlink_sets() -> None:
    gpus = parse_fake_gpus("8x80GiB:numa=0-3,4-7:nvlink=0-3,4-7", "h")
    assert [g.numa_node for g in gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [g.nvlink_peers for g in gpus] == [(1, 2, 3), (0, 2, 3), (0, 1, 3), (0, 1, 2),
                                              (5, 6, 7), (4, 6, 7), (4, 5, 7), (4, 5, 6)]
    assert [g.vram_total_mb for g in gpus] == [81920] * 8


@pytest.mark.parametrize("spec, numa, peers", [
    ("4x80GiB", [None] * 4, [()] * 4),
    ("4x80GiB:nvlink=0-3", [None] * 4, [(1, 2, 3), (0, 2, 3), (0, 1, 3), (0, 1, 2)]),
    (" 2x24GiB , 2x80GiB : numa = 0+2 , 1+3 ", [0, 1, 0, 1], [()] * 4),
    ("4x80GiB:numa=2-3", [None, None, 0, 0], [()] * 4),                  # unnamed GPUs: unknown
    ("4x16GiB:nvlink=0+1,1+2,2+3,3+0", [None] * 4, [(1, 3), (0, 2), (1, 3), (0, 2)]),   # a ring
    ("4x16GiB:nvlink=0-1,0-1", [None] * 4, [(1,), (0,), (), ()]),          # a set given twice is harmless
    ("2x16GiB:nvlink=0,1", [None] * 2, [(), ()]),                         # single GPUs: no pairs
    ("2x16GiB:nvlink=0-1:numa=0-1", [0, 0], [(1,), (0,)]),                # either order
])
def test_fake_spec_topology_grammar(spec: str, numa: list[int | None], peers: list[tuple[int, ...]]) -> None:
    gpus = parse_fake_gpus(spec, "h")
    assert [g.numa_node for g in gpus] == numa
    assert [g.nvlink_peers for g in gpus] == peers


@pytest.mark.parametrize("spec, names", [
    ("8x80GiB:", "empty topology part"),
    ("8x80GiB::nvlink=0-1", "empty topology part"),
    ("8x80GiB:numa", "'numa'"),
    ("8x80GiB:nvlnk=0-3", "'nvlnk=0-3'"),
    ("8x80GiB:numa=0-3:numa=4-7", "numa= is given twice"),
    ("8x80GiB:nvlink=0-8", "nvlink set '0-8' names GPU 8, but the spec has 8 GPUs (0..7)"),
    ("8x80GiB:numa=0-3,3-7", "numa set '3-7' names GPU 3, which is already on NUMA node 0"),
    ("8x80GiB:nvlink=3-1", "the range '3-1' runs backwards"),
    ("8x80GiB:nvlink=0-3,,4-7", "nvlink= has an empty set"),
    ("8x80GiB:nvlink=", "nvlink= has an empty set"),
    ("8x80GiB:nvlink=a-b", "nvlink set 'a-b'"),
    ("8x80GiB:nvlink=0+", "nvlink set '0+'"),
    ("8x80GiB:numa=-1", "numa set '-1'"),
    ("8x80GiB:nvlink=0-3x", "nvlink set '0-3x'"),
    ("8x80GiB:nvlink=1000-1001", "nvlink set '1000-1001'"),
    ("8x80GiB:nvlink=9" + "9" * 50, "nvlink set '9999"),
    ("8x80:nvlink=0-3", "cannot read group '8x80'"),
])
def test_bad_fake_topology_is_refused_naming_the_part(spec: str, names: str) -> None:
    with pytest.raises(ValueError) as ei:
        parse_fake_gpus(spec, "h")
    msg = str(ei.value)
    assert repr(spec) in msg and names in msg, msg
    assert "numa=SETS" in msg and "nvlink=SETS" in msg, "the message shows the topology format"


sets = st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=8, unique=True), min_size=1, max_size=4)


@given(st.integers(1, 8), sets)
@settings(max_examples=200, deadline=None)
def test_fake_nvlink_sets_link_exactly_the_pairs_within_a_set(count: int, groups: list[list[int]]) -> None:
    groups = [[i for i in g if i < count] or [0] for g in groups]
    spec = f"{count}x1GiB:nvlink=" + ",".join("+".join(str(i) for i in g) for g in groups)
    gpus = parse_fake_gpus(spec, "h")
    for g in gpus:
        expected = {j for grp in groups if g.index in grp for j in grp} - {g.index}
        assert set(g.nvlink_peers) == expected
        assert all(g.index in gpus[p].nvlink_peers for p in g.nvlink_peers), "links are symmetric"


@given(st.text(alphabet="0123456789-+,:=abcdeilmnuvx GiB", max_size=40))
@settings(max_examples=300, deadline=None)
def test_fake_spec_with_topology_never_crashes(spec: str) -> None:
    try:
        gpus = parse_fake_gpus("4x1GiB:" + spec, "h")
    except ValueError as e:
        assert "invalid --fake-gpus spec" in str(e)
        return
    for g in gpus:
        assert g.numa_node is None or 0 <= g.numa_node < len(gpus)
        assert all(0 <= p < len(gpus) and p != g.index for p in g.nvlink_peers)


def test_fake_source_reports_the_spec_topology() -> None:
    src = FakeGpuSource("4x80GiB:numa=0-1,2-3:nvlink=0-1,2-3", "h")
    assert [(g.numa_node, g.nvlink_peers) for g in src.gpus()] == [(0, (1,)), (0, (0,)), (1, (3,)), (1, (2,))]


# ------------------------------------------------------------------------------ the hosts/<host> record

def test_inventory_with_topology_round_trips_through_stored_json() -> None:
    inv = read_inventory("h", "127.0.0.1:1", FakeGpuSource("4x80GiB:numa=0-1,2-3:nvlink=0-3", "h"), "/", "1")
    stored = loads(dumps(inv.to_json()))
    assert stored["gpus"][0]["numa_node"] == 0 and stored["gpus"][0]["nvlink_peers"] == [1, 2, 3]
    assert HostInventory.from_json(stored) == inv


def test_a_record_without_topology_reads_as_unknown_topology() -> None:
    # What a node of the previous release wrote: gpus without numa_node / nvlink_peers.
    old = {"host": "h", "address": "a", "cpu_count": 2, "core_ids": [0, 1], "mem_bytes": 1, "disk_path": "/",
           "disk_bytes": 1, "version": "0.1", "simulated": True,
           "gpus": [{"index": 0, "uuid": "GPU-0", "name": "T4", "vram_total_mb": 15360}]}
    inv = HostInventory.from_json(json.loads(json.dumps(old)))
    assert inv.gpus == (GpuInfo(0, "GPU-0", "T4", 15360, numa_node=None, nvlink_peers=()),)


def test_a_record_from_a_newer_node_with_unknown_gpu_fields_still_reads() -> None:
    g = {"index": 1, "uuid": "GPU-1", "name": "H100", "vram_total_mb": 81920, "numa_node": None,
         "nvlink_peers": [3, 1, 0, 3], "pcie_root": "future"}
    assert GpuInfo.from_json(g) == GpuInfo(1, "GPU-1", "H100", 81920, None, (0, 3))   # sorted, no self, no dups


@pytest.mark.parametrize("field, value", [("numa_node", -1), ("numa_node", "0"), ("numa_node", True),
                                          ("numa_node", 1.5), ("nvlink_peers", "0,1"), ("nvlink_peers", [0, -1]),
                                          ("nvlink_peers", [True]), ("nvlink_peers", None), ("nvlink_peers", {"0": 1})])
def test_malformed_topology_in_a_record_is_refused_naming_the_field(field: str, value: Any) -> None:
    g = {"index": 0, "uuid": "GPU-0", "name": "T4", "vram_total_mb": 1, field: value}
    with pytest.raises(ValueError, match=field):
        GpuInfo.from_json(g)
