"""``FakeNvml``/``FakeDevice``: the pynvml module at its function level, with real pynvml errors."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pynvml

from coordinator.node.inventory import MIB


def nvml_error(code: int) -> pynvml.NVMLError:
    """A real pynvml error; NVMLError.__new__ maps the code to its subclass (e.g. NVMLError_GpuIsLost)."""
    return pynvml.NVMLError(code)


class FakeDevice:
    """One GPU of a FakeNvml. Topology: ``bus_id`` (None: nvmlDeviceGetPciInfo is NotSupported), ``numa``
    (None: nvmlDeviceGetNumaNodeId is NotSupported) and ``links``, per NVLink (active: 0/1, the remote end's
    PCI bus id, its NVML_NVLINK_DEVICE_TYPE_*), None for a GPU without NVLink (NotSupported); a link
    number past the list is InvalidArgument, as NVML answers past a GPU's last link."""

    def __init__(self, uuid: str | bytes, name: str | bytes, total: int, used: int = 0,
                 procs: list[Any] | None = None, graphics: list[Any] | None = None,
                 bus_id: str | bytes | None = None, numa: int | None = None,
                 links: list[tuple[int, str | bytes, int]] | None = None, utilization: int | None = None,
                 process_util: list[tuple[int, int]] | None = None) -> None:
        self.uuid = uuid
        self.name = name
        self.total = total
        self.used = used
        self.procs: list[Any] = procs or []
        self.graphics: list[Any] = graphics or []
        self.bus_id = bus_id
        self.numa = numa
        self.links = links
        # Utilization: nvmlDeviceGetUtilizationRates' .gpu (None: NotSupported); (pid, smUtil) samples of
        # nvmlDeviceGetProcessUtilization (None: NotSupported; []: NotFound, no sample since the time stamp).
        self.utilization = utilization
        self.process_util = process_util
        # call name -> error code to raise from that call on this device
        self.fail: dict[str, int] = {}


class FakeNvml:
    """Stands in for the pynvml module: same function names, real exception classes (tests/unit/
    test_inventory.py checks every name against the real module, so the fake cannot drift)."""

    NVMLError = pynvml.NVMLError
    NVML_NVLINK_MAX_LINKS = pynvml.NVML_NVLINK_MAX_LINKS

    def __init__(self, devices: list[FakeDevice]) -> None:
        self.devices = devices
        self.init_error: BaseException | None = None
        self.count_error: int | None = None
        self.shutdown_error: int | None = None
        self.calls: list[str] = []

    def _dev(self, handle: Any, call: str) -> FakeDevice:
        self.calls.append(call)
        dev: FakeDevice = handle.dev
        if call in dev.fail:
            raise nvml_error(dev.fail[call])
        return dev

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.calls.append("nvmlShutdown")
        if self.shutdown_error is not None:
            raise nvml_error(self.shutdown_error)

    def nvmlDeviceGetCount(self) -> int:
        self.calls.append("nvmlDeviceGetCount")
        if self.count_error is not None:
            raise nvml_error(self.count_error)
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self.calls.append("nvmlDeviceGetHandleByIndex")
        dev = self.devices[index]
        if "nvmlDeviceGetHandleByIndex" in dev.fail:
            raise nvml_error(dev.fail["nvmlDeviceGetHandleByIndex"])
        return SimpleNamespace(dev=dev)

    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes:
        return self._dev(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetName(self, handle: Any) -> str | bytes:
        return self._dev(handle, "nvmlDeviceGetName").name

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        d = self._dev(handle, "nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(total=d.total, used=d.used, free=d.total - d.used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        return list(self._dev(handle, "nvmlDeviceGetComputeRunningProcesses").procs)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[Any]:
        return list(self._dev(handle, "nvmlDeviceGetGraphicsRunningProcesses").graphics)

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        d = self._dev(handle, "nvmlDeviceGetUtilizationRates")
        if d.utilization is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(gpu=d.utilization, memory=0)

    def nvmlDeviceGetProcessUtilization(self, handle: Any, timeStamp: int) -> list[Any]:
        d = self._dev(handle, "nvmlDeviceGetProcessUtilization")
        if d.process_util is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not d.process_util:
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return [SimpleNamespace(pid=pid, timeStamp=timeStamp + 1, smUtil=sm, memUtil=0, encUtil=0, decUtil=0)
                for pid, sm in d.process_util]

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        d = self._dev(handle, "nvmlDeviceGetPciInfo")
        if d.bus_id is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(busId=d.bus_id)

    def nvmlDeviceGetNumaNodeId(self, handle: Any) -> int:
        d = self._dev(handle, "nvmlDeviceGetNumaNodeId")
        if d.numa is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return d.numa

    def _link(self, handle: Any, link: int, call: str) -> tuple[int, str | bytes, int]:
        d = self._dev(handle, call)
        if d.links is None:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not 0 <= link < len(d.links):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return d.links[link]

    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int:
        return self._link(handle, link, "nvmlDeviceGetNvLinkState")[0]

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: Any, link: int) -> Any:
        return SimpleNamespace(busId=self._link(handle, link, "nvmlDeviceGetNvLinkRemotePciInfo")[1])

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle: Any, link: int) -> int:
        return self._link(handle, link, "nvmlDeviceGetNvLinkRemoteDeviceType")[2]


def four_gpus() -> FakeNvml:
    """Four GPUs of mixed models: bytes and str names and uuids, processes with and without a known size, and
    an odd byte count that floors."""
    gib = 1024 * MIB
    return FakeNvml([
        FakeDevice(b"GPU-aaaa-0000", b"NVIDIA A100-SXM4-80GB", 80 * gib, used=1 * gib,
                   procs=[SimpleNamespace(pid=111, usedGpuMemory=512 * MIB)]),
        FakeDevice("GPU-bbbb-1111", "NVIDIA GeForce RTX 4090", 24 * gib + 123),  # odd byte count floors
        FakeDevice(b"GPU-cccc-2222", "NVIDIA H100 80GB HBM3", 80 * gib, used=3 * gib + MIB - 1),
        FakeDevice("GPU-dddd-3333", b"Tesla T4", 15360 * MIB,
                   procs=[SimpleNamespace(pid=7, usedGpuMemory=None),
                          SimpleNamespace(pid=8, usedGpuMemory=2 * gib)]),
    ])
