"""Tests for coordinator.node.inventory: ``--fake-gpus`` specs parsed (and properties of the parser), the fake
GPU source, the host's own resources, the inventory read, and how ``open_gpu_source`` chooses a source."""
from __future__ import annotations

import os
import re
from typing import Any, Callable

import pynvml
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.node.inventory import (
    FakeGpuSource,
    GpuSource,
    NvmlGpuSource,
    NvmlUnavailable,
    host_resources,
    open_gpu_source,
    parse_fake_gpus,
    read_inventory,
)
from coordinator.records import GpuProcess, HostInventory
from tests.support.fake_nvml import four_gpus, nvml_error

# ------------------------------------------------------------------------------ parse_fake_gpus

@pytest.mark.parametrize("spec, sizes", [
    ("4x80GiB", [81920] * 4),
    ("2x24GiB,1x80GiB", [24576, 24576, 81920]),
    ("1x16384MiB", [16384]),
    ("80GiB", [81920]),
    (" 2 x 24GiB , 80GiB ", [24576, 24576, 81920]),
    ("1X1mib", [1]),
    ("64x1GiB", [1024] * 64),
    ("1x1024GiB", [1024 * 1024]),
    ("1x1048576MiB", [1024 * 1024]),
])
def test_parse_fake_gpus_valid(spec: str, sizes: list[int]) -> None:
    gpus = parse_fake_gpus(spec, "node-1")
    assert [g.vram_total_mb for g in gpus] == sizes
    assert [g.index for g in gpus] == list(range(len(sizes)))  # consecutive across groups
    assert [g.uuid for g in gpus] == [f"GPU-sim-node-1-{i}" for i in range(len(sizes))]
    assert parse_fake_gpus(spec, "node-1") == gpus  # deterministic


def test_parse_fake_gpus_names() -> None:
    gpus = parse_fake_gpus("1x80GiB,1x16384MiB,1x1000MiB", "h")
    assert [g.name for g in gpus] == ["Simulated GPU 80GiB", "Simulated GPU 16GiB", "Simulated GPU 1000MiB"]


@pytest.mark.parametrize("spec", [
    "", "   ", "4x", "x80GiB", "4x80", "4x80GB", "4x80TiB", "0x80GiB", "65x1GiB", "40x1GiB,25x1GiB",
    "1x0MiB", "1x1025GiB", "1x1048577MiB", "4x80GiB,", ",4x80GiB", "4x80GiB;2x24GiB", "-1x80GiB",
    "4x-80GiB", "4x80.5GiB", "four x 80GiB", "4x80GiB x2", "１x80GiB", "9" * 5000 + "x1GiB",
])
def test_parse_fake_gpus_invalid(spec: str) -> None:
    with pytest.raises(ValueError) as ei:
        parse_fake_gpus(spec, "h")
    msg = str(ei.value)
    assert repr(spec) in msg, "the message quotes the spec"
    assert "COUNTxSIZE" in msg and "4x80GiB" in msg, "the message shows the format"


@pytest.mark.parametrize("host", ["gpu node/1", "héllo", "a" * 200, "", "x/../y"])
def test_fake_uuid_is_a_safe_key_segment(host: str) -> None:
    gpus = parse_fake_gpus("3x1GiB", host)
    uuids = [g.uuid for g in gpus]
    assert len(set(uuids)) == 3
    for u in uuids:
        assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}", u), u


def test_fake_uuids_of_long_hosts_stay_distinct() -> None:
    a = parse_fake_gpus("1GiB", "a" * 200 + "1")[0].uuid
    b = parse_fake_gpus("1GiB", "a" * 200 + "2")[0].uuid
    assert a != b


group = st.tuples(st.integers(1, 8), st.integers(1, 1024), st.sampled_from(["GiB", "MiB"]))


@given(st.lists(group, min_size=1, max_size=8))
@settings(max_examples=200, deadline=None)
def test_parse_fake_gpus_roundtrip(groups: list[tuple[int, int, str]]) -> None:
    spec = ",".join(f"{c}x{s}{u}" for c, s, u in groups)
    gpus = parse_fake_gpus(spec, "h")
    expected = [s * 1024 if u == "GiB" else s for c, s, u in groups for _ in range(c)]
    assert [g.vram_total_mb for g in gpus] == expected
    assert [g.index for g in gpus] == list(range(len(expected)))


@given(st.text(max_size=40))
@settings(max_examples=300, deadline=None)
def test_parse_fake_gpus_never_crashes(spec: str) -> None:
    try:
        gpus = parse_fake_gpus(spec, "h")
    except ValueError:
        return
    assert 1 <= len(gpus) <= 64
    assert all(1 <= g.vram_total_mb <= 1024 * 1024 for g in gpus)


# ------------------------------------------------------------------------------ FakeGpuSource

def test_fake_source_defaults_and_set_used() -> None:
    src = FakeGpuSource("2x24GiB,1x80GiB", "h1")
    assert isinstance(src, GpuSource)
    assert src.simulated is True
    assert [g.vram_total_mb for g in src.gpus()] == [24576, 24576, 81920]
    u = src.usage()
    assert [(x.vram_used_mb, x.vram_free_mb, x.processes) for x in u] == [
        (0, 24576, ()), (0, 24576, ()), (0, 81920, ())]
    assert [x.uuid for x in u] == [g.uuid for g in src.gpus()]

    procs = (GpuProcess(pid=42, used_mb=3000),)
    src.set_used(2, 5000, procs)
    u = src.usage()
    assert (u[2].vram_used_mb, u[2].vram_free_mb, u[2].processes) == (5000, 76920, procs)
    assert u[0].vram_used_mb == 0
    src.set_used(2, 0)
    assert src.usage()[2].processes == ()
    src.close()


@pytest.mark.parametrize("index, used", [(3, 0), (-1, 0), (0, -1), (0, 24577)])
def test_fake_source_set_used_rejects_bad_values(index: int, used: int) -> None:
    src = FakeGpuSource("2x24GiB,1x80GiB", "h1")
    with pytest.raises(ValueError):
        src.set_used(index, used)


def test_fake_source_bad_spec_raises_value_error() -> None:
    with pytest.raises(ValueError, match="'4x80GB'"):
        FakeGpuSource("4x80GB", "h1")


# ------------------------------------------------------------------------------ host / inventory

def test_host_resources_from_psutil(tmp_path: Any) -> None:
    cpu, cores, mem, disk = host_resources(str(tmp_path))
    assert cpu > 0 and mem > 0 and disk > 0
    assert len(cores) > 0 and list(cores) == sorted(cores)
    if hasattr(os, "sched_getaffinity"):
        assert set(cores) == os.sched_getaffinity(0)


def test_host_resources_missing_disk_path(tmp_path: Any) -> None:
    with pytest.raises(OSError):
        host_resources(str(tmp_path / "does-not-exist"))


@pytest.mark.parametrize("make_source", [
    lambda: FakeGpuSource("4x80GiB", "node-1"),
    lambda: NvmlGpuSource(four_gpus()),
])
def test_read_inventory(make_source: Callable[[], GpuSource]) -> None:
    source = make_source()
    inv = read_inventory("node-1", "10.0.0.1:7071", source, "/", "0.1.0")
    assert isinstance(inv, HostInventory)
    assert (inv.host, inv.address, inv.disk_path, inv.version) == ("node-1", "10.0.0.1:7071", "/", "0.1.0")
    assert inv.cpu_count > 0 and inv.mem_bytes > 0 and inv.disk_bytes > 0 and inv.core_ids
    assert inv.gpus == source.gpus() and len(inv.gpus) == 4
    assert inv.simulated is source.simulated
    assert HostInventory.from_json(inv.to_json()) == inv  # what the node publishes round-trips


# ------------------------------------------------------------------------------ open_gpu_source

def test_open_gpu_source_fake() -> None:
    src = open_gpu_source("2x24GiB", "h1")
    assert isinstance(src, FakeGpuSource)
    assert src.simulated and len(src.gpus()) == 2


def test_open_gpu_source_empty_fake_spec_is_an_error_not_nvml() -> None:
    with pytest.raises(ValueError):
        open_gpu_source("", "h1", nvml=four_gpus())


def test_open_gpu_source_nvml() -> None:
    src = open_gpu_source(None, "h1", nvml=four_gpus())
    assert isinstance(src, NvmlGpuSource)
    assert not src.simulated and len(src.gpus()) == 4


def test_open_gpu_source_nvml_missing() -> None:
    nvml = four_gpus()
    nvml.init_error = nvml_error(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    with pytest.raises(NvmlUnavailable, match="--fake-gpus"):
        open_gpu_source(None, "h1", nvml=nvml)
