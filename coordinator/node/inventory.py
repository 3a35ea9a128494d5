"""The node daemon's view of its host: GPUs (through NVML or simulated) and CPU, memory, disk.

Two GPU sources share one small protocol, so the daemon never cares which one it has:

* :class:`NvmlGpuSource` reads the real GPUs through ``pynvml`` (the ``nvidia-ml-py`` distribution).
  A GPU that fails mid-scan (fell off the bus, reset, ...) is skipped with a warning, so one sick
  device never hides the healthy ones. A failure of the whole library raises :class:`NvmlScanError`,
  which the daemon retries.
* :class:`FakeGpuSource` simulates GPUs from a ``--fake-gpus`` spec such as ``4x80GiB``, for
  development hosts and tests without NVIDIA hardware.

Units follow :mod:`coordinator.records`: VRAM in MiB (floor of NVML's bytes), host memory and disk in bytes.
"""
from __future__ import annotations

import os

import psutil

from coordinator.node.fake import FakeGpuSource, parse_fake_gpus, parse_fake_processes
from coordinator.node.nvml import NvmlGpuSource
from coordinator.node.nvml_api import Nvml
from coordinator.node.source import (
    MAX_GPU_NAME,
    MIB,
    GpuSource,
    NvmlScanError,
    NvmlUnavailable,
)
from coordinator.records import HostInventory


def host_resources(disk_path: str) -> tuple[int, tuple[int, ...], int, int]:
    """(logical cpu count, usable core ids, memory bytes, disk bytes at ``disk_path``).

    Core ids come from the process's CPU affinity where the OS has it, so a daemon confined to a
    cpuset only offers the cores it can actually hand out.
    """
    cpu_count = psutil.cpu_count(logical=True) or os.cpu_count() or 1
    affinity = getattr(os, "sched_getaffinity", None)
    core_ids: tuple[int, ...]
    if affinity is not None:
        core_ids = tuple(sorted(affinity(0)))
    else:
        core_ids = tuple(range(cpu_count))
    mem_bytes = int(psutil.virtual_memory().total)
    disk_bytes = int(psutil.disk_usage(disk_path).total)
    return int(cpu_count), core_ids, mem_bytes, disk_bytes


def read_inventory(host: str, address: str, source: GpuSource, disk_path: str, version: str) -> HostInventory:
    """What the node publishes under ``hosts/<host>``: host resources plus the source's GPUs."""
    cpu_count, core_ids, mem_bytes, disk_bytes = host_resources(disk_path)
    return HostInventory(
        host=host,
        address=address,
        cpu_count=cpu_count,
        core_ids=core_ids,
        mem_bytes=mem_bytes,
        disk_path=disk_path,
        disk_bytes=disk_bytes,
        gpus=source.gpus(),
        version=version,
        simulated=bool(source.simulated),
    )


def open_gpu_source(fake_gpus: str | None, host: str, nvml: Nvml | None = None,
                    fake_processes: str | None = None) -> GpuSource:
    """Simulated GPUs when ``--fake-gpus`` is given, else real NVML.

    Raises :class:`NvmlUnavailable` when NVML is missing, and ValueError for a bad spec; never falls
    back silently, since a node publishing fake GPUs on a real host would be worse than refusing.
    """
    if fake_gpus is not None:
        return FakeGpuSource(fake_gpus, host, fake_processes)
    if fake_processes is not None:
        raise ValueError("--fake-processes needs --fake-gpus: it simulates processes on simulated GPUs")
    return NvmlGpuSource(nvml)


__all__ = [
    "MAX_GPU_NAME",
    "MIB",
    "FakeGpuSource",
    "GpuSource",
    "NvmlGpuSource",
    "NvmlScanError",
    "NvmlUnavailable",
    "host_resources",
    "open_gpu_source",
    "parse_fake_gpus",
    "parse_fake_processes",
    "read_inventory",
]
