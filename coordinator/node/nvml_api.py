"""NVML's surface as the node uses it: the handle and answer types, the return codes and NVLink constants the
code reads, PCI bus ids (NVML's and sysfs's spelling) with the sysfs NUMA fallback, and NVML error helpers.
``coordinator.node.nvml`` reads the GPUs through it."""
from __future__ import annotations

import importlib
import logging
import os
import re
from typing import NewType, Protocol, SupportsInt

from coordinator.node.source import _NVML_VALUE_NOT_AVAILABLE, MIB

log = logging.getLogger(__name__)

Handle = NewType("Handle", object)   # an NVML device handle: opaque, only ever handed back to NVML


class MemoryInfo(Protocol):
    """``nvmlDeviceGetMemoryInfo``'s answer, in bytes."""

    total: SupportsInt
    used: SupportsInt
    free: SupportsInt


class Nvml(Protocol):
    """The NVML functions every source uses (the ``pynvml`` module, or a test's stand-in); the optional ones
    (topology, process lists) are looked up by name, as older pynvml builds may lack them."""

    def nvmlInit(self) -> None: ...

    def nvmlShutdown(self) -> None: ...

    def nvmlDeviceGetCount(self) -> SupportsInt: ...

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Handle: ...

    def nvmlDeviceGetUUID(self, handle: Handle) -> str | bytes: ...

    def nvmlDeviceGetName(self, handle: Handle) -> str | bytes: ...

    def nvmlDeviceGetMemoryInfo(self, handle: Handle) -> MemoryInfo: ...

# NVML's return codes and NVLink remote device types (stable numbers of nvml.h; a test checks them against
# pynvml's): the code reads them here rather than from the module, so a fake module needs none of them.
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_FEATURE_ENABLED = 1
NVLINK_DEVICE_TYPE_SWITCH = 2
_DEFAULT_MAX_LINKS = 18          # NVML_NVLINK_MAX_LINKS of older pynvml builds that lack the constant
_MAX_LINKS_CEILING = 64          # whatever the module says, never more calls than this per GPU

_PCI_BUS_ID_RE = re.compile(r"^([0-9A-Fa-f]{1,8}):([0-9A-Fa-f]{1,2}):([0-9A-Fa-f]{1,2})\.([0-7])$", re.ASCII)

PciBusId = tuple[int, int, int, int]
"""(domain, bus, device, function): NVML writes ``00000000:07:00.0``, sysfs ``0000:07:00.0``."""


def parse_pci_bus_id(value: object) -> PciBusId | None:
    """A PCI bus id as NVML or sysfs writes it, or None when it is not one."""
    m = _PCI_BUS_ID_RE.match(_text(value).strip().rstrip("\0"))
    if m is None:
        return None
    return int(m.group(1), 16), int(m.group(2), 16), int(m.group(3), 16), int(m.group(4))


def sysfs_pci_name(bus: PciBusId) -> str:
    """The PCI device's directory name under /sys/bus/pci/devices."""
    return f"{bus[0]:04x}:{bus[1]:02x}:{bus[2]:02x}.{bus[3]:x}"


def sysfs_numa_node(sysfs_root: str, bus: PciBusId) -> int | None:
    """The NUMA node sysfs gives the PCI device, or None (no such file, unreadable, or -1: unknown)."""
    path = os.path.join(sysfs_root, "bus", "pci", "devices", sysfs_pci_name(bus), "numa_node")
    try:
        with open(path, encoding="ascii") as f:
            node = int(f.read(32).strip())
    except (OSError, ValueError) as e:
        log.debug("no NUMA node for PCI device %s from sysfs (%s)", sysfs_pci_name(bus), e)
        return None
    return node if node >= 0 else None


def _error_code(e: BaseException) -> int | None:
    value = getattr(e, "value", None)
    return value if isinstance(value, int) else None


def _text(value: object) -> str:
    """NVML strings: older pynvml returns bytes, newer returns str."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _mib(value: SupportsInt | None) -> int:
    """Bytes (possibly None or NVML's "not available" marker) to whole MiB, never negative."""
    if value is None:
        return 0
    b = int(value)
    if b < 0 or b >= _NVML_VALUE_NOT_AVAILABLE:
        return 0
    return b // MIB


def _nvml_error_types(nvml: object) -> tuple[type[BaseException], ...]:
    """The NVMLError base class(es) to catch: the given module's, and the real pynvml's if importable.

    Looking them up on the module object (rather than importing pynvml here) lets tests inject a
    fake module that reuses pynvml's exception classes.
    """
    found: list[type[BaseException]] = []
    candidates: list[object] = [nvml]
    try:
        candidates.append(importlib.import_module("pynvml"))
    except Exception:  # noqa: BLE001 - pynvml missing or broken: nothing more to catch
        pass
    for mod in candidates:
        t = getattr(mod, "NVMLError", None)
        if isinstance(t, type) and issubclass(t, BaseException) and t not in found:
            found.append(t)
    return tuple(found)


def _err_text(e: BaseException) -> str:
    """A readable name for an NVML error, e.g. ``NVMLError_GpuIsLost: GPU is lost``."""
    try:
        msg = str(e)
    except Exception:  # noqa: BLE001 - pynvml's __str__ may itself call into the library
        msg = repr(e)
    return f"{type(e).__name__}: {msg}"
