"""What a GPU source is (real NVML or simulated), and the errors of reading one."""
from __future__ import annotations

import logging
from typing import Protocol, runtime_checkable

from coordinator.records import GpuInfo, GpuUsage

log = logging.getLogger(__name__)

MIB = 1024 * 1024
"""Bytes per MiB: NVML reports bytes, gpucoord counts VRAM in MiB."""

_FAKE_HINT = "pass --fake-gpus SPEC (e.g. 4x80GiB) to simulate GPUs"

MAX_GPU_NAME = 128
"""Characters of a GPU's name that are kept (and stored in etcd): NVML's names are short, but unbounded."""

# pynvml maps "not available" to None already; guard against a raw 2**64-1 from other builds anyway.
_NVML_VALUE_NOT_AVAILABLE = 2**64 - 1


class NvmlUnavailable(RuntimeError):
    """NVML cannot be loaded or initialised on this host; the daemon turns this into an exit message."""


class NvmlScanError(RuntimeError):
    """NVML as a whole failed during a scan (e.g. nvmlDeviceGetCount); transient, so the daemon retries."""


@runtime_checkable
class GpuSource(Protocol):
    """Where the node daemon gets its GPUs from: real NVML or a simulation."""

    simulated: bool

    def gpus(self) -> tuple[GpuInfo, ...]:
        """Static description of the GPUs (index, uuid, name, total VRAM)."""
        ...

    def usage(self) -> tuple[GpuUsage, ...]:
        """Live VRAM use of the GPUs that are readable right now."""
        ...

    def close(self) -> None:
        """Release the underlying library; safe to call more than once."""
        ...
