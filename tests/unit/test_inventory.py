"""Tests for coordinator.node.inventory's NVML source.

NVML is faked at the pynvml *function* level, reusing pynvml's real exception classes, and every name
the fake offers (or the code touches) is checked against the real module so the fake cannot drift.
"""
from __future__ import annotations

import inspect
import logging
import sys
from typing import Any

import pynvml
import pytest

from coordinator.node.inventory import (
    MIB,
    GpuSource,
    NvmlGpuSource,
    NvmlScanError,
    NvmlUnavailable,
    open_gpu_source,
)
from coordinator.records import GpuInfo, GpuProcess
from tests.support.fake_nvml import FakeNvml, four_gpus, nvml_error

GIB = 1024 * MIB


class Recorder:
    """Wraps a fake and records every attribute the code under test reads from the nvml module."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.seen: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        self.seen.add(name)
        return getattr(self._inner, name)


# ------------------------------------------------------------------------------ the fake vs the real API

def fake_function_names() -> list[str]:
    return sorted(n for n in vars(FakeNvml) if n.startswith("nvml") and callable(getattr(FakeNvml, n)))


def test_fake_functions_exist_in_real_pynvml_with_compatible_signatures() -> None:
    names = fake_function_names()
    assert len(names) == 16
    for name in names:
        assert hasattr(pynvml, name), f"pynvml has no {name}: the fake drifted from the real API"
        real = getattr(pynvml, name)
        assert callable(real)
        # The fake's positional parameters (minus self) must bind to the real function's signature.
        fake_params = list(inspect.signature(getattr(FakeNvml, name)).parameters)[1:]
        inspect.signature(real).bind(*fake_params)


def test_code_only_touches_names_that_real_pynvml_has() -> None:
    nvml = four_gpus()
    nvml.devices[1].fail["nvmlDeviceGetComputeRunningProcesses"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    rec = Recorder(nvml)
    src = NvmlGpuSource(rec)
    src.gpus()
    src.usage()
    src.close()
    assert rec.seen, "the recorder saw nothing"
    for name in rec.seen:
        assert hasattr(pynvml, name), f"the code uses pynvml.{name}, which the real module lacks"
    # Every function the code calls is one the fake implements (so the tests exercise it).
    assert {n for n in rec.seen if n.startswith("nvml")} <= set(fake_function_names())


def test_real_exception_classes_map_from_codes() -> None:
    assert type(nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)) is pynvml.NVMLError_GpuIsLost
    assert type(nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)) is pynvml.NVMLError_NotSupported
    assert type(nvml_error(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)) is pynvml.NVMLError_LibraryNotFound


# ------------------------------------------------------------------------------ NvmlGpuSource

def test_four_gpus_static_description() -> None:
    nvml = four_gpus()
    src = NvmlGpuSource(nvml)
    assert isinstance(src, GpuSource)
    assert src.simulated is False
    assert src.gpus() == (
        GpuInfo(0, "GPU-aaaa-0000", "NVIDIA A100-SXM4-80GB", 81920),
        GpuInfo(1, "GPU-bbbb-1111", "NVIDIA GeForce RTX 4090", 24576),
        GpuInfo(2, "GPU-cccc-2222", "NVIDIA H100 80GB HBM3", 81920),
        GpuInfo(3, "GPU-dddd-3333", "Tesla T4", 15360),
    )
    for g in src.gpus():
        assert isinstance(g.uuid, str) and isinstance(g.name, str)


def test_four_gpus_usage_and_processes() -> None:
    src = NvmlGpuSource(four_gpus())
    u = src.usage()
    assert [x.index for x in u] == [0, 1, 2, 3]
    assert [x.uuid for x in u] == ["GPU-aaaa-0000", "GPU-bbbb-1111", "GPU-cccc-2222", "GPU-dddd-3333"]
    assert (u[0].vram_used_mb, u[0].vram_free_mb) == (1024, 80 * 1024 - 1024)
    assert u[0].processes == (GpuProcess(pid=111, used_mb=512),)
    assert (u[1].vram_used_mb, u[1].vram_free_mb) == (0, 24576)  # 24 GiB + 123 bytes floors to 24576
    assert (u[2].vram_used_mb, u[2].vram_free_mb) == (3072, 81920 - 3073)  # floors on both sides
    # usedGpuMemory None (e.g. WDDM, or no permission) reads as 0, not a crash.
    assert u[3].processes == (GpuProcess(pid=7, used_mb=0), GpuProcess(pid=8, used_mb=2048))


def test_gpu_lost_mid_scan_skips_only_that_gpu(caplog: pytest.LogCaptureFixture) -> None:
    nvml = four_gpus()
    nvml.devices[2].fail["nvmlDeviceGetMemoryInfo"] = pynvml.NVML_ERROR_GPU_IS_LOST
    src = NvmlGpuSource(nvml)
    with caplog.at_level(logging.WARNING, logger="coordinator.node.nvml"):
        gpus = src.gpus()
        usage = src.usage()
    assert [g.index for g in gpus] == [0, 1, 3]
    assert [x.index for x in usage] == [0, 1, 3]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, "a GPU that stays lost warns once, not on every scan"
    msg = warnings[0].getMessage()
    assert "GPU 2" in msg and "GpuIsLost" in msg


@pytest.mark.parametrize("call", [
    "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetUUID", "nvmlDeviceGetName", "nvmlDeviceGetMemoryInfo",
])
@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_UNKNOWN,
                                  pynvml.NVML_ERROR_RESET_REQUIRED])
def test_any_per_device_nvml_error_skips_that_gpu(call: str, code: int) -> None:
    nvml = four_gpus()
    nvml.devices[0].fail[call] = code
    src = NvmlGpuSource(nvml)
    assert [g.index for g in src.gpus()] == [1, 2, 3]
    assert [u.index for u in src.usage()] == [1, 2, 3]


def test_partial_scan_is_not_cached_and_recovery_is_seen(caplog: pytest.LogCaptureFixture) -> None:
    nvml = four_gpus()
    nvml.devices[2].fail["nvmlDeviceGetMemoryInfo"] = pynvml.NVML_ERROR_GPU_IS_LOST
    src = NvmlGpuSource(nvml)
    assert len(src.gpus()) == 3
    del nvml.devices[2].fail["nvmlDeviceGetMemoryInfo"]
    with caplog.at_level(logging.INFO, logger="coordinator.node.nvml"):
        assert len(src.gpus()) == 4
    assert any("GPU 2" in r.getMessage() and "again" in r.getMessage() for r in caplog.records)


def test_gpus_cached_after_complete_scan_but_usage_rereads() -> None:
    nvml = four_gpus()
    src = NvmlGpuSource(nvml)
    first = src.gpus()
    nvml.calls.clear()
    assert src.gpus() == first
    assert nvml.calls == [], "the static list is cached"
    # usage() reads live state every time and reports only GPUs readable now.
    nvml.devices[0].used = 10 * GIB
    nvml.devices[3].fail["nvmlDeviceGetUUID"] = pynvml.NVML_ERROR_GPU_IS_LOST
    u = src.usage()
    assert [x.index for x in u] == [0, 1, 2]
    assert u[0].vram_used_mb == 10240
    assert src.gpus() == first  # the static description is unaffected


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_NO_PERMISSION])
def test_process_query_error_keeps_gpu_without_processes(code: int) -> None:
    nvml = four_gpus()
    nvml.devices[0].fail["nvmlDeviceGetComputeRunningProcesses"] = code
    src = NvmlGpuSource(nvml)
    u = src.usage()
    assert [x.index for x in u] == [0, 1, 2, 3]
    assert u[0].processes == ()
    assert u[0].vram_used_mb == 1024
    assert u[3].processes != ()


def test_device_count_failure_raises_scan_error() -> None:
    nvml = four_gpus()
    src = NvmlGpuSource(nvml)
    nvml.count_error = pynvml.NVML_ERROR_UNKNOWN
    with pytest.raises(NvmlScanError) as ei:
        src.gpus()
    assert isinstance(ei.value.__cause__, pynvml.NVMLError_Unknown)
    with pytest.raises(NvmlScanError):
        src.usage()
    nvml.count_error = None  # transient: the daemon's retry then succeeds
    assert len(src.gpus()) == 4


def test_zero_gpus_is_not_an_error() -> None:
    src = NvmlGpuSource(FakeNvml([]))
    assert src.gpus() == ()
    assert src.usage() == ()


@pytest.mark.parametrize("error", [
    nvml_error(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND),
    nvml_error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED),
    nvml_error(pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH),
    OSError("libnvidia-ml.so.1: cannot open shared object file"),
])
def test_init_failure_raises_nvml_unavailable_with_hint(error: BaseException) -> None:
    nvml = four_gpus()
    nvml.init_error = error
    with pytest.raises(NvmlUnavailable) as ei:
        NvmlGpuSource(nvml)
    assert ei.value.__cause__ is error
    assert "--fake-gpus SPEC (e.g. 4x80GiB)" in str(ei.value)
    assert "NVML" in str(ei.value)


def test_missing_pynvml_module_raises_nvml_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    with pytest.raises(NvmlUnavailable) as ei:
        NvmlGpuSource()
    assert isinstance(ei.value.__cause__, ImportError)
    assert "--fake-gpus" in str(ei.value)


def _real_nvml_loads() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.mark.skipif(_real_nvml_loads(), reason="this machine has a working NVML")
def test_real_pynvml_without_library_raises_nvml_unavailable() -> None:
    with pytest.raises(NvmlUnavailable) as ei:
        NvmlGpuSource()
    assert isinstance(ei.value.__cause__, pynvml.NVMLError_LibraryNotFound)
    assert "--fake-gpus SPEC (e.g. 4x80GiB) to simulate GPUs" in str(ei.value)
    with pytest.raises(NvmlUnavailable):
        open_gpu_source(None, "h1")


def test_close_calls_shutdown_once_and_ignores_errors() -> None:
    nvml = four_gpus()
    nvml.shutdown_error = pynvml.NVML_ERROR_UNINITIALIZED
    src = NvmlGpuSource(nvml)
    src.close()
    src.close()
    assert nvml.calls.count("nvmlShutdown") == 1
