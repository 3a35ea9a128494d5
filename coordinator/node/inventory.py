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

import hashlib
import importlib
import json
import logging
import os
import re
import threading
from typing import Any, Protocol, runtime_checkable

import psutil

from coordinator.keys import valid_name
from coordinator.records import GpuInfo, GpuProcess, GpuUsage, HostInventory

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


# --------------------------------------------------------------------------------------------------
# NVML


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

    def _processes(self, index: int, handle: Any) -> tuple[GpuProcess, ...]:
        """Compute and graphics processes on one GPU (one row per pid); () when NVML cannot list them
        (NotSupported, no permission...)."""
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
        return tuple(GpuProcess(pid=pid, used_mb=mb) for pid, mb in rows.items())

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
            out.append(
                GpuUsage(
                    index=index,
                    uuid=info.uuid,
                    vram_used_mb=_mib(mem.used),
                    vram_free_mb=_mib(mem.free),
                    processes=self._processes(index, handle),
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


# --------------------------------------------------------------------------------------------------
# Simulated GPUs

MAX_FAKE_GPUS = 64
MAX_FAKE_SIZE_MB = 1024 * 1024  # 1 TiB
_FAKE_FORMAT = (
    "expected COUNTxSIZE[,COUNTxSIZE...] with COUNT 1..64 and SIZE a whole number of GiB or MiB "
    "(1MiB..1024GiB), e.g. '4x80GiB', '2x24GiB,1x80GiB', '1x16384MiB' or just '80GiB'"
)
_GROUP_RE = re.compile(r"^(?:([0-9]{1,9})\s*[xX]\s*)?([0-9]{1,12})\s*([GgMm][Ii][Bb])$", re.ASCII)
_UNSAFE_RE = re.compile(r"[^A-Za-z0-9._:@-]")
_MAX_KEY_SEGMENT = 128  # coordinator/keys.py accepts names up to 128 characters


def _size_text(mb: int) -> str:
    return f"{mb // 1024}GiB" if mb % 1024 == 0 else f"{mb}MiB"


def _fake_uuid(host: str, index: int) -> str:
    """A deterministic uuid that is a safe etcd key segment: [A-Za-z0-9._:@-], at most 128 characters.

    A host name too long to fit is shortened, with a hash of the full name so uuids stay distinct.
    """
    safe = _UNSAFE_RE.sub("_", host)
    uuid = f"GPU-sim-{safe}-{index}"
    if len(uuid) > _MAX_KEY_SEGMENT:
        digest = hashlib.sha256(host.encode()).hexdigest()[:8]
        room = _MAX_KEY_SEGMENT - len(f"GPU-sim--{digest}-{index}")
        uuid = f"GPU-sim-{safe[:room]}-{digest}-{index}"
    return uuid


def parse_fake_gpus(spec: str, host: str) -> tuple[GpuInfo, ...]:
    """Parse a ``--fake-gpus`` spec into GPUs; a ValueError quotes the spec and shows the format."""

    def bad(reason: str) -> ValueError:
        return ValueError(f"invalid --fake-gpus spec {spec!r}: {reason}; {_FAKE_FORMAT}")

    if not isinstance(spec, str) or not spec.strip():
        raise bad("it is empty")
    gpus: list[GpuInfo] = []
    for group in spec.split(","):
        g = group.strip()
        m = _GROUP_RE.match(g)
        if m is None:
            raise bad(f"cannot read group {g!r}" if g else "it has an empty group")
        count = int(m.group(1)) if m.group(1) is not None else 1
        size = int(m.group(2))
        size_mb = size * 1024 if m.group(3).lower() == "gib" else size
        if not 1 <= count <= MAX_FAKE_GPUS:
            raise bad(f"count {count} in {g!r} is out of range 1..{MAX_FAKE_GPUS}")
        if not 1 <= size_mb <= MAX_FAKE_SIZE_MB:
            raise bad(f"size in {g!r} is out of range 1MiB..1TiB")
        if len(gpus) + count > MAX_FAKE_GPUS:
            raise bad(f"more than {MAX_FAKE_GPUS} GPUs in total")
        for _ in range(count):
            index = len(gpus)
            gpus.append(
                GpuInfo(
                    index=index,
                    uuid=_fake_uuid(host, index),
                    name=f"Simulated GPU {_size_text(size_mb)}",
                    vram_total_mb=size_mb,
                )
            )
    return tuple(gpus)


def parse_fake_processes(doc: Any, gpu_count: int) -> dict[int, tuple[GpuProcess, ...]]:
    """A ``--fake-processes`` document: ``{"<GPU index>": {"<pid>": MiB, ...}, ...}``.

    Raises ValueError naming the bad entry.
    """
    if not isinstance(doc, dict):
        raise ValueError("expected a JSON object mapping GPU index to {pid: MiB}")
    out: dict[int, tuple[GpuProcess, ...]] = {}
    for key, procs in doc.items():
        if not str(key).isdigit() or not 0 <= int(key) < gpu_count:
            raise ValueError(f"GPU {key!r}: not a simulated GPU index (have 0..{gpu_count - 1})")
        if not isinstance(procs, dict):
            raise ValueError(f"GPU {key}: expected an object {{pid: MiB}}")
        rows = []
        for pid, mb in procs.items():
            if not str(pid).isdigit() or int(pid) < 1:
                raise ValueError(f"GPU {key}: {pid!r} is not a pid")
            if isinstance(mb, bool) or not isinstance(mb, int) or mb < 0:
                raise ValueError(f"GPU {key}, pid {pid}: MiB must be a whole number >= 0, got {mb!r}")
            rows.append(GpuProcess(pid=int(pid), used_mb=mb))
        out[int(key)] = tuple(rows)
    return out


def _process_alive(pid: int) -> bool:
    """NVML lists only running processes: a simulated row of an exited (or zombie) process is dropped."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


class FakeGpuSource:
    """Simulated GPUs for hosts without NVIDIA hardware.

    Memory use is whatever :meth:`set_used` says, plus the processes of ``processes_file``
    (``--fake-processes``): JSON mapping a GPU index to ``{pid: MiB}``, re-read on every scan, so that
    tests and demos put real processes on simulated GPUs. Rows of processes that no longer run are
    dropped, as NVML would. A file that is missing counts as empty; a malformed one is ignored with a
    warning.
    """

    simulated: bool = True

    def __init__(self, spec: str, host: str, processes_file: str | None = None) -> None:
        self._gpus = parse_fake_gpus(spec, host)
        self._lock = threading.Lock()  # the daemon's usage loop and a demo may run in different threads
        self._used: dict[int, tuple[int, tuple[GpuProcess, ...]]] = {g.index: (0, ()) for g in self._gpus}
        self.processes_file = processes_file
        self._file_error = ""

    def _file_processes(self) -> dict[int, tuple[GpuProcess, ...]]:
        if not self.processes_file:
            return {}
        try:
            with open(self.processes_file, encoding="utf-8") as f:
                doc = json.load(f)
            found = parse_fake_processes(doc, len(self._gpus))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            why = f"--fake-processes {self.processes_file}: {e}; ignoring it"
            if why != self._file_error:
                log.warning("%s", why)
                self._file_error = why
            return {}
        self._file_error = ""
        return {i: tuple(p for p in rows if _process_alive(p.pid)) for i, rows in found.items()}

    def gpus(self) -> tuple[GpuInfo, ...]:
        return self._gpus

    def set_used(self, index: int, used_mb: int, processes: tuple[GpuProcess, ...] = ()) -> None:
        """Simulate VRAM used outside gpucoord (tests, demos of untracked memory)."""
        if index not in self._used:
            raise ValueError(f"no simulated GPU with index {index} (have 0..{len(self._gpus) - 1})")
        total = self._gpus[index].vram_total_mb
        if not 0 <= used_mb <= total:
            raise ValueError(f"used_mb {used_mb} is out of range 0..{total} for GPU {index}")
        with self._lock:
            self._used[index] = (int(used_mb), tuple(processes))

    def usage(self) -> tuple[GpuUsage, ...]:
        with self._lock:
            used = dict(self._used)
        extra = self._file_processes()
        out = []
        for g in self._gpus:
            base, procs = used[g.index]
            rows = extra.get(g.index, ())
            total = min(g.vram_total_mb, base + sum(p.used_mb for p in rows))
            out.append(GpuUsage(index=g.index, uuid=g.uuid, vram_used_mb=total,
                                vram_free_mb=g.vram_total_mb - total, processes=procs + rows))
        return tuple(out)

    def close(self) -> None:
        """Nothing to release."""


# --------------------------------------------------------------------------------------------------
# Host resources and the published inventory


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


def open_gpu_source(fake_gpus: str | None, host: str, nvml: Any = None,
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
