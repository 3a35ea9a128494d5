"""GPU utilization (issue 31, docs/policies.md "Idle GPUs"), the node's side: NVML faked at the pynvml function level (as
tests/unit/test_inventory.py does), the simulated GPUs' settable utilization (``--fake-processes``'s
``"utilization"`` entry and ``set_utilization``), and what ``usage/<host>`` carries. Unknown stays -1, never 0."""
from __future__ import annotations

import json
import pathlib
from typing import Any

import pynvml
import pytest

from coordinator.node.daemon import utilization_doc
from coordinator.node.fake import (
    FakeGpuSource,
    parse_fake_processes,
    parse_fake_utilization,
)
from coordinator.node.inventory import NvmlGpuSource
from coordinator.record_fields import check_usage
from coordinator.records import GpuUsage, InvalidRecord
from tests.support.fake_nvml import four_gpus

pytestmark = pytest.mark.unit


def test_nvml_utilization_is_read_per_gpu_and_unknown_where_nvml_cannot_say() -> None:
    nvml = four_gpus()
    nvml.devices[0].utilization, nvml.devices[0].process_util = 37, [(111, 30), (111, 35), (112, 2)]
    nvml.devices[1].utilization = None                 # NotSupported: unknown
    nvml.devices[2].utilization, nvml.devices[2].process_util = 0, []   # a known 0; NotFound: no samples
    nvml.devices[3].utilization = 12
    nvml.devices[3].fail["nvmlDeviceGetUtilizationRates"] = pynvml.NVML_ERROR_GPU_IS_LOST
    by_index = {u.index: u for u in NvmlGpuSource(nvml).usage()}
    assert [by_index[i].utilization_pct for i in range(4)] == [37, -1, 0, -1]
    assert by_index[0].process_sm_pct == ((111, 35), (112, 2))   # the highest sample per pid
    assert by_index[2].process_sm_pct == ()
    assert by_index[1].process_sm_pct is None and by_index[3].process_sm_pct is None   # NotSupported
    assert by_index[3].vram_used_mb == 0 and len(by_index) == 4   # the GPU itself is still reported


def test_a_pynvml_without_the_utilization_functions_reports_unknown() -> None:
    class Older:
        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> Any:
            if name in ("nvmlDeviceGetUtilizationRates", "nvmlDeviceGetProcessUtilization"):
                raise AttributeError(name)
            return getattr(self._inner, name)

    usage = NvmlGpuSource(Older(four_gpus())).usage()
    assert {u.utilization_pct for u in usage} == {-1} and {u.process_sm_pct for u in usage} == {None}


def test_nvml_answers_out_of_range_are_unknown() -> None:
    nvml = four_gpus()
    nvml.devices[0].utilization = 101
    nvml.devices[1].utilization = 2**32 - 1
    by_index = {u.index: u for u in NvmlGpuSource(nvml).usage()}
    assert by_index[0].utilization_pct == -1 and by_index[1].utilization_pct == -1


def test_the_process_utilization_is_asked_since_the_previous_scan() -> None:
    nvml = four_gpus()
    nvml.devices[0].process_util = [(111, 50)]
    asked: list[int] = []
    real = nvml.nvmlDeviceGetProcessUtilization

    def spy(handle: Any, stamp: int) -> Any:
        asked.append(stamp)
        return real(handle, stamp)

    nvml.nvmlDeviceGetProcessUtilization = spy   # type: ignore[method-assign, assignment]
    src = NvmlGpuSource(nvml)
    src.usage()
    src.usage()
    first, second = asked[0], asked[len(asked) // 2]
    assert first == 0 and second > 0   # the whole buffer, then only what came since the previous scan


def write(tmp_path: pathlib.Path, doc: Any) -> str:
    path = tmp_path / "procs.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_simulated_gpus_are_unknown_until_the_file_or_set_utilization_says(tmp_path: pathlib.Path) -> None:
    src = FakeGpuSource("3x16GiB", "h1")
    assert [u.utilization_pct for u in src.usage()] == [-1, -1, -1]
    src.set_utilization(2, 0)
    path = write(tmp_path, {"utilization": {"0": 50, "1": 0}, "0": {"1": 100}})
    with_file = FakeGpuSource("3x16GiB", "h1", path)
    with_file.set_utilization(1, 90)   # the file wins where it names the GPU
    with_file.set_utilization(2, 7)
    assert [u.utilization_pct for u in src.usage()] == [-1, -1, 0]
    assert [u.utilization_pct for u in with_file.usage()] == [50, 0, 7]
    with pytest.raises(ValueError, match="out of range"):
        src.set_utilization(0, 101)


@pytest.mark.parametrize("doc, words", [
    ({"utilization": [50]}, "expected an object"),
    ({"utilization": {"3": 1}}, "GPU '3'"),
    ({"utilization": {"0": 101}}, "0..100"),
    ({"utilization": {"0": 5.5}}, "whole percent"),
    ({"utilization": {"0": True}}, "whole percent"),
])
def test_a_bad_utilization_entry_is_refused_naming_it(doc: Any, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_fake_utilization(doc, 3)


def test_a_malformed_file_leaves_the_utilization_unknown(tmp_path: pathlib.Path) -> None:
    src = FakeGpuSource("1x16GiB", "h1", write(tmp_path, {"utilization": {"0": "busy"}}))
    (u,) = src.usage()
    assert u.utilization_pct == -1 and not u.processes_visible   # ignored as a whole, as before


def test_the_utilization_entry_is_not_a_gpu_of_the_process_table() -> None:
    assert parse_fake_processes({"utilization": {"0": 5}, "0": {"7": 10}}, 1)[0][0].used_mb == 10


def test_usage_carries_the_utilization_and_readers_check_it() -> None:
    u = GpuUsage(index=0, uuid="GPU-1", vram_used_mb=1, vram_free_mb=2, utilization_pct=3,
                 process_sm_pct=((9, 1), (8, 70)))
    doc = utilization_doc(u)
    assert doc == {"utilization_pct": 3, "process_sm_pct": [{"pid": 8, "sm_pct": 70}, {"pid": 9, "sm_pct": 1}]}
    assert utilization_doc(GpuUsage(index=0, uuid="GPU-1", vram_used_mb=1, vram_free_mb=2)) == {"utilization_pct": -1}
    check_usage({"gpus": [{"uuid": "GPU-1", "vram_used_mb": 1, **doc}]})
    for bad in (-2, 101, "5", True):
        with pytest.raises(InvalidRecord, match="utilization_pct"):
            check_usage({"gpus": [{"uuid": "GPU-1", "vram_used_mb": 1, "utilization_pct": bad}]})


def test_the_node_inventory_rpc_message_has_the_utilization() -> None:
    from agent_client.api import node_pb2
    assert node_pb2.NodeGpu(utilization_percent=-1).utilization_percent == -1

