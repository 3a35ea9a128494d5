"""The real GPUs, through NVML (module ``pynvml`` of the ``nvidia-ml-py`` distribution).

A GPU that fails mid-scan (fell off the bus, reset, ...) is skipped with a warning, so one sick device
never hides the healthy ones. A failure of the whole library raises ``NvmlScanError``, which the daemon
retries.
"""
from __future__ import annotations

import importlib
import logging
import threading
from typing import Any

from coordinator.keys import valid_name
from coordinator.node.source import (_FAKE_HINT, _NVML_VALUE_NOT_AVAILABLE, MAX_GPU_NAME, MIB, NvmlScanError,
                                     NvmlUnavailable)
from coordinator.records import GpuInfo, GpuProcess, GpuUsage

log = logging.getLogger(__name__)




def _text(value: object) -> str:
    """NVML strings: older pynvml returns bytes, newer returns str."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _mib(value: Any) -> int:
    """Bytes (possibly None or NVML's "not available" marker) to whole MiB, never negative."""
    if value is None:
        return 0
    b = int(value)
    if b < 0 or b >= _NVML_VALUE_NOT_AVAILABLE:
        return 0
    return b // MIB


def _nvml_error_types(nvml: Any) -> tuple[type[BaseException], ...]:
    """The NVMLError base class(es) to catch: the given module's, and the real pynvml's if importable.

    Looking them up on the module object (rather than importing pynvml here) lets tests inject a
    fake module that reuses pynvml's exception classes.
    """
    found: list[type[BaseException]] = []
    candidates: list[Any] = [nvml]
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


class NvmlGpuSource:
    """Real GPUs through NVML.

    ``nvml`` defaults to the ``pynvml`` module; tests pass an object with the same functions.
    """

    simulated: bool = False

    def __init__(self, nvml: Any = None) -> None:
        if nvml is None:
            try:
                nvml = importlib.import_module("pynvml")
            except ImportError as e:
                raise NvmlUnavailable(
                    f"NVML is not available: the pynvml module (nvidia-ml-py) cannot be imported ({e}); "
                    f"{_FAKE_HINT}"
                ) from e
        self._nvml: Any = nvml
        self._errors = _nvml_error_types(nvml)
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
        self._bad: dict[int, str] = {}  # index -> last error, so a lost GPU warns once, not every second
        self._no_procs: dict[int, str] = {}  # index -> why its process list is unavailable
        self._closed = False

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

    def _read_one(self, index: int) -> tuple[Any, GpuInfo, Any] | None:
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

    def _processes(self, index: int, handle: Any) -> tuple[tuple[GpuProcess, ...], bool]:
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
        found: list[GpuInfo] = []
        for index in range(count):
            one = self._read_one(index)
            if one is not None:
                found.append(one[1])
        result = tuple(found)
        if len(result) == count:
            self._static = result
        return result

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
            out.append(
                GpuUsage(
                    index=index,
                    uuid=info.uuid,
                    vram_used_mb=_mib(mem.used),
                    vram_free_mb=_mib(mem.free),
                    processes=processes,
                    processes_visible=visible,
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


