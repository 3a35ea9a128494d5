"""The real GPUs, through NVML (module ``pynvml`` of the ``nvidia-ml-py`` distribution).

A GPU that fails mid-scan (fell off the bus, reset, ...) is skipped with a warning, so one sick device
never hides the healthy ones. A failure of the whole library raises ``NvmlScanError``, which the daemon
retries.

Topology, read once with the static description:

* NUMA node: ``nvmlDeviceGetNumaNodeId`` where the driver has it, else the PCI device's ``numa_node`` in
  sysfs (``/sys/bus/pci/devices/<bus id>/numa_node``; -1 there means unknown).
* NVLink peers: for every link up to ``NVML_NVLINK_MAX_LINKS``, ``nvmlDeviceGetNvLinkState`` and, for an
  active link, the remote end's PCI bus id (``nvmlDeviceGetNvLinkRemotePciInfo``, which pynvml implements
  with NVML's ``..._v2``). A remote end that is another GPU of this host makes it a peer; GPUs whose links
  reach the same NVSwitch (``nvmlDeviceGetNvLinkRemoteDeviceType``) are peers of each other.

Every topology call may fail (NotSupported on GPUs without NVLink, FunctionNotFound on older drivers, or
any other NVML error): the answer is then "unknown" (no NUMA node) or no peers, never a skipped GPU.
"""
from __future__ import annotations

import importlib
import logging
import threading
from typing import Callable, Sequence, SupportsInt

from coordinator import clock
from coordinator.keys import valid_name
from coordinator.node.nvml_api import (
    _DEFAULT_MAX_LINKS,
    _MAX_LINKS_CEILING,
    NVLINK_DEVICE_TYPE_SWITCH,
    NVML_ERROR_FUNCTION_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_FEATURE_ENABLED,
    Handle,
    MemoryInfo,
    Nvml,
    PciBusId,
    _err_text,
    _error_code,
    _mib,
    _nvml_error_types,
    _text,
    parse_pci_bus_id,
    sysfs_numa_node,
)
from coordinator.node.source import (
    _FAKE_HINT,
    MAX_GPU_NAME,
    NvmlScanError,
    NvmlUnavailable,
)
from coordinator.node.utilization import gpu_utilization, process_utilization
from coordinator.records import GpuInfo, GpuProcess, GpuUsage

log = logging.getLogger(__name__)


class NvmlGpuSource:
    """Real GPUs through NVML.

    ``nvml`` defaults to the ``pynvml`` module; tests pass an object with the same functions.
    """

    simulated: bool = False

    def __init__(self, nvml: Nvml | None = None, sysfs_root: str = "/sys") -> None:
        if nvml is None:
            try:
                nvml = importlib.import_module("pynvml")
            except ImportError as e:
                raise NvmlUnavailable(
                    f"NVML is not available: the pynvml module (nvidia-ml-py) cannot be imported ({e}); "
                    f"{_FAKE_HINT}"
                ) from e
        self._nvml: Nvml = nvml
        self._sysfs_root = sysfs_root
        self._errors = _nvml_error_types(nvml)
        self._topology_errors: tuple[type[BaseException], ...] = (*self._errors, TypeError, ValueError)
        init_errors: tuple[type[BaseException], ...] = (*self._errors, OSError)  # OSError: dlopen failed
        try:
            nvml.nvmlInit()
        except init_errors as e:
            raise NvmlUnavailable(
                f"NVML is not available: library not found or init failed ({_err_text(e)}). "
                f"Is the NVIDIA driver installed and loaded? On a host without NVIDIA GPUs, {_FAKE_HINT}"
            ) from e
        self._lock = threading.Lock()
        self._static: tuple[GpuInfo, ...] | None = None
        self._topology_logged = ""
        self._bad: dict[int, str] = {}  # index -> last error, so a lost GPU warns once, not every second
        self._no_procs: dict[int, str] = {}  # index -> why its process list is unavailable
        self._closed = False
        self._sampled_us: dict[int, int] = {}   # index -> NVML time stamp of the last per-process sample read

    # -- scanning -----------------------------------------------------------------------------------

    def _count(self) -> int:
        try:
            return int(self._nvml.nvmlDeviceGetCount())
        except self._errors as e:
            raise NvmlScanError(f"NVML scan failed: nvmlDeviceGetCount: {_err_text(e)}") from e

    def _gpu_failed(self, index: int, call: str, e: BaseException) -> None:
        """Log a GPU that became unreadable: a warning on the first failure, debug while it stays so."""
        why = f"{call}: {_err_text(e)}"
        with self._lock:
            first = self._bad.get(index) != why
            self._bad[index] = why
        if first:
            log.warning("GPU %d is unreadable (%s); skipping it and continuing with the others", index, why)
        else:
            log.debug("GPU %d still unreadable (%s)", index, why)

    def _gpu_ok(self, index: int) -> None:
        with self._lock:
            was = self._bad.pop(index, None)
        if was is not None:
            log.info("GPU %d is readable again (it failed with %s)", index, was)

    def _read_one(self, index: int) -> tuple[Handle, GpuInfo, MemoryInfo] | None:
        """Handle, static info and memory info of one GPU, or None (logged) when any call fails."""
        nvml = self._nvml
        call = "nvmlDeviceGetHandleByIndex"
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            call = "nvmlDeviceGetUUID"
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            call = "nvmlDeviceGetName"
            name = _text(nvml.nvmlDeviceGetName(handle))[:MAX_GPU_NAME]
            call = "nvmlDeviceGetMemoryInfo"
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            total_mb = _mib(mem.total)
        except self._errors as e:
            self._gpu_failed(index, call, e)
            return None
        if not valid_name(uuid):
            # It would be an etcd key segment (gpus/<host>/<uuid>): a GPU that cannot be named is not offered.
            self._gpu_failed(index, "nvmlDeviceGetUUID", ValueError(
                f"uuid {uuid[:40]!r} is not a valid name ([A-Za-z0-9._:@-], at most 128 characters)"))
            return None
        self._gpu_ok(index)
        return handle, GpuInfo(index=index, uuid=uuid, name=name, vram_total_mb=total_mb), mem

    def _processes(self, index: int, handle: Handle) -> tuple[tuple[GpuProcess, ...], bool]:
        """Compute and graphics processes on one GPU (one row per pid), and whether that is the whole list:
        not when NVML cannot list them (NotSupported, no permission...)."""
        rows: dict[int, int] = {}
        failed = False
        for call in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            fn = getattr(self._nvml, call, None)
            if fn is None:
                continue
            try:
                procs = fn(handle)
            except self._errors as e:
                why = f"{call}: {_err_text(e)}"
                with self._lock:
                    first = self._no_procs.get(index) != why
                    self._no_procs[index] = why
                # Expected on some devices and drivers; it only costs per-process detail, so no warning.
                log.log(logging.INFO if first else logging.DEBUG,
                        "GPU %d: cannot list processes (%s); reporting none from it", index, why)
                failed = True
                continue
            for p in procs or ():
                pid = int(p.pid)
                rows[pid] = max(rows.get(pid, 0), _mib(getattr(p, "usedGpuMemory", None)))
        if not failed:
            with self._lock:
                self._no_procs.pop(index, None)
        return tuple(GpuProcess(pid=pid, used_mb=mb) for pid, mb in rows.items()), not failed

    # -- GpuSource ------------------------------------------------------------------------------------

    def gpus(self) -> tuple[GpuInfo, ...]:
        """The GPUs' static description.

        Cached after the first complete scan, since it cannot change while the driver is loaded. A scan
        that had to skip a GPU is returned but not cached, so a GPU that recovers shows up later.
        Raises :class:`NvmlScanError` when NVML itself fails.
        """
        cached = self._static
        if cached is not None:
            return cached
        count = self._count()
        found: list[tuple[Handle, GpuInfo]] = []
        for index in range(count):
            one = self._read_one(index)
            if one is not None:
                found.append((one[0], one[1]))
        result = self._with_topology(found)
        if len(result) == count:
            self._static = result
        return result

    # -- topology ---------------------------------------------------------------------------------------

    def _with_topology(self, found: Sequence[tuple[Handle, GpuInfo]]) -> tuple[GpuInfo, ...]:
        """The GPUs with their NUMA node and NVLink peers (among the GPUs offered here)."""
        bus_of = {info.index: bus for handle, info in found if (bus := self._pci_bus_id(handle)) is not None}
        index_of_bus = {bus: index for index, bus in bus_of.items()}
        peers: dict[int, set[int]] = {info.index: set() for _, info in found}
        switches: dict[PciBusId, set[int]] = {}
        for handle, info in found:
            for kind, remote in self._nvlinks(info.index, handle):
                peer = index_of_bus.get(remote)
                if kind == NVLINK_DEVICE_TYPE_SWITCH:
                    switches.setdefault(remote, set()).add(info.index)
                elif peer is not None and peer != info.index:   # the remote bus id is one of our GPUs
                    peers[info.index].add(peer)
        for members in switches.values():   # GPUs on one NVSwitch all reach each other
            for index in members:
                peers[index] |= members - {index}
        out = tuple(
            GpuInfo(index=info.index, uuid=info.uuid, name=info.name, vram_total_mb=info.vram_total_mb,
                    numa_node=self._numa_node(handle, bus_of.get(info.index)),
                    nvlink_peers=tuple(sorted(peers[info.index])))
            for handle, info in found)
        text = ", ".join(f"GPU {g.index}: NUMA {'?' if g.numa_node is None else g.numa_node}, NVLink "
                         f"{'+'.join(str(p) for p in g.nvlink_peers) or 'none'}" for g in out)
        if text != self._topology_logged:
            self._topology_logged = text
            log.info("GPU topology: %s", text or "no GPUs")
        return out

    def _optional(self, name: str) -> Callable[..., object] | None:
        """An NVML function that older pynvml builds may lack: None then."""
        fn = getattr(self._nvml, name, None)
        return fn if callable(fn) else None

    def _optional_int(self, name: str) -> Callable[..., SupportsInt] | None:
        """An optional NVML function that answers a number (a state, a type, a node)."""
        fn = getattr(self._nvml, name, None)
        return fn if callable(fn) else None

    def _pci_bus_id(self, handle: Handle) -> PciBusId | None:
        fn = self._optional("nvmlDeviceGetPciInfo")
        if fn is None:
            return None
        try:
            info = fn(handle)
        except self._errors as e:
            log.debug("nvmlDeviceGetPciInfo failed (%s): no PCI bus id", _err_text(e))
            return None
        return parse_pci_bus_id(getattr(info, "busId", None) or getattr(info, "busIdLegacy", ""))

    def _numa_node(self, handle: Handle, bus: PciBusId | None) -> int | None:
        fn = self._optional_int("nvmlDeviceGetNumaNodeId")
        if fn is not None:
            try:
                node = int(fn(handle))
            except self._topology_errors as e:
                log.debug("nvmlDeviceGetNumaNodeId failed (%s); trying sysfs", _err_text(e))
            else:
                if node >= 0:
                    return node
        return sysfs_numa_node(self._sysfs_root, bus) if bus is not None else None

    def _nvlinks(self, index: int, handle: Handle) -> list[tuple[int | None, PciBusId]]:
        """(remote device type or None when unknown, remote PCI bus id) of each active NVLink of a GPU."""
        state = self._optional_int("nvmlDeviceGetNvLinkState")
        remote_pci = self._optional("nvmlDeviceGetNvLinkRemotePciInfo")
        remote_type = self._optional_int("nvmlDeviceGetNvLinkRemoteDeviceType")
        if state is None or remote_pci is None:
            return []
        try:
            max_links = min(int(getattr(self._nvml, "NVML_NVLINK_MAX_LINKS", _DEFAULT_MAX_LINKS)), _MAX_LINKS_CEILING)
        except (TypeError, ValueError):
            max_links = _DEFAULT_MAX_LINKS
        out: list[tuple[int | None, PciBusId]] = []
        for link in range(max_links):
            try:
                if int(state(handle, link)) != NVML_FEATURE_ENABLED:
                    continue
                info = remote_pci(handle, link)
            except self._topology_errors as e:
                if _error_code(e) in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND):
                    log.debug("GPU %d: no NVLink (%s)", index, _err_text(e))
                    break
                continue   # a link this GPU does not have (InvalidArgument past its last one), or unreadable
            remote = parse_pci_bus_id(getattr(info, "busId", None) or getattr(info, "busIdLegacy", ""))
            if remote is None:
                continue
            kind: int | None = None
            if remote_type is not None:
                try:
                    kind = int(remote_type(handle, link))
                except self._topology_errors:
                    kind = None
            out.append((kind, remote))
        return out

    def usage(self) -> tuple[GpuUsage, ...]:
        """Live VRAM use, re-read on every call; only GPUs readable right now are reported.

        Raises :class:`NvmlScanError` when NVML itself fails.
        """
        out: list[GpuUsage] = []
        for index in range(self._count()):
            one = self._read_one(index)
            if one is None:
                continue
            handle, info, mem = one
            processes, visible = self._processes(index, handle)
            now_us = int(clock.wall() * 1e6)
            per_process = process_utilization(self._nvml, handle, self._errors, self._sampled_us.get(index, 0))
            self._sampled_us[index] = now_us
            out.append(
                GpuUsage(
                    index=index,
                    uuid=info.uuid,
                    vram_used_mb=_mib(mem.used),
                    vram_free_mb=_mib(mem.free),
                    processes=processes,
                    processes_visible=visible,
                    utilization_pct=gpu_utilization(self._nvml, handle, self._errors),
                    process_sm_pct=per_process,
                )
            )
        return tuple(out)

    def close(self) -> None:
        """Shut NVML down once; errors are ignored because the daemon is exiting anyway."""
        if self._closed:
            return
        self._closed = True
        try:
            self._nvml.nvmlShutdown()
        except Exception as e:  # noqa: BLE001 - best effort on the way out
            log.debug("nvmlShutdown failed (ignored): %s", _err_text(e))
