"""Simulated GPUs for development hosts and tests without NVIDIA hardware: ``--fake-gpus 4x80GiB``, and
simulated processes on them with ``--fake-processes FILE``.

The spec's grammar (whitespace around its parts is ignored)::

    SPEC     := SIZES (':' TOPOLOGY)*          at most one numa= part and one nvlink= part
    SIZES    := GROUP (',' GROUP)*             GROUP := [COUNT 'x'] SIZE ('GiB' | 'MiB')
    TOPOLOGY := 'numa=' SETS | 'nvlink=' SETS
    SETS     := SET (',' SET)*                 SET := ITEM ('+' ITEM)*, ITEM := N | N '-' M (GPU indexes)

``numa=``: the i-th set (from 0) is NUMA node i; sets must not overlap; a GPU in no set has an unknown NUMA
node. ``nvlink=``: every pair of GPUs in one set is joined by NVLink; sets may overlap (a GPU's peers are the
union). Without ``numa=`` every NUMA node is unknown; without ``nvlink=`` no GPU has peers. Examples:
``8x80GiB:numa=0-3,4-7:nvlink=0-3,4-7`` (two NVLink quads, one per socket), ``8x80GiB:nvlink=0-7`` (an
NVSwitch), ``8x16GiB:nvlink=0-3,4-7,0+4,1+5,2+6,3+7`` (a hybrid cube mesh).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import re
import threading
from typing import Any, Callable

import psutil

from coordinator import clock
from coordinator.records import GpuInfo, GpuProcess, GpuUsage

log = logging.getLogger(__name__)


MAX_FAKE_GPUS = 64
MAX_FAKE_SIZE_MB = 1024 * 1024  # 1 TiB
_FAKE_FORMAT = (
    "expected COUNTxSIZE[,COUNTxSIZE...] with COUNT 1..64 and SIZE a whole number of GiB or MiB "
    "(1MiB..1024GiB), e.g. '4x80GiB', '2x24GiB,1x80GiB', '1x16384MiB' or just '80GiB', optionally followed "
    "by topology ':numa=SETS' and ':nvlink=SETS', SETS being GPU index sets like '0-3,4-7' or '0+4,1-2', "
    "e.g. '8x80GiB:numa=0-3,4-7:nvlink=0-3,4-7'"
)
_GROUP_RE = re.compile(r"^(?:([0-9]{1,9})\s*[xX]\s*)?([0-9]{1,12})\s*([GgMm][Ii][Bb])$", re.ASCII)
_ITEM_RE = re.compile(r"^([0-9]{1,3})(?:\s*-\s*([0-9]{1,3}))?$", re.ASCII)
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
    """Parse a ``--fake-gpus`` spec (grammar in the module's docstring) into GPUs; a ValueError quotes the
    spec, names the part that is wrong and shows the format."""

    def bad(reason: str) -> ValueError:
        return ValueError(f"invalid --fake-gpus spec {spec!r}: {reason}; {_FAKE_FORMAT}")

    if not isinstance(spec, str) or not spec.strip():
        raise bad("it is empty")
    sizes, *topology = spec.split(":")
    gpus: list[GpuInfo] = []
    for group in sizes.split(","):
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
    numa: dict[int, int] = {}
    peers: dict[int, set[int]] = {g.index: set() for g in gpus}
    seen: set[str] = set()
    for part in topology:
        p = part.strip()
        key, eq, value = p.partition("=")
        key = key.strip()
        if not p:
            raise bad("it has an empty topology part (two ':' in a row, or one at the end)")
        if not eq or key not in ("numa", "nvlink"):
            raise bad(f"cannot read topology part {p[:40]!r}: expected numa=SETS or nvlink=SETS")
        if key in seen:
            raise bad(f"{key}= is given twice")
        seen.add(key)
        sets = _index_sets(value, key, len(gpus), bad)
        if key == "numa":
            for node, (text, members) in enumerate(sets):
                for i in members:
                    if i in numa:
                        raise bad(f"numa set {text!r} names GPU {i}, which is already on NUMA node {numa[i]}")
                    numa[i] = node
        else:
            for _, members in sets:
                for i in members:
                    peers[i] |= members - {i}
    return tuple(dataclasses.replace(g, numa_node=numa.get(g.index), nvlink_peers=tuple(sorted(peers[g.index])))
                 for g in gpus)


def _index_sets(value: str, key: str, gpu_count: int,
                bad: Callable[[str], ValueError]) -> list[tuple[str, set[int]]]:
    """The sets of a ``numa=``/``nvlink=`` part: each set's text and its GPU indexes."""
    out: list[tuple[str, set[int]]] = []
    for text in value.split(","):
        t = text.strip()
        if not t:
            raise bad(f"{key}= has an empty set")
        members: set[int] = set()
        for item in t.split("+"):
            m = _ITEM_RE.match(item.strip())
            if m is None:
                raise bad(f"cannot read {key} set {t[:40]!r}: expected indexes like 0-3 or 0+4")
            lo = int(m.group(1))
            hi = int(m.group(2)) if m.group(2) is not None else lo
            if hi < lo:
                raise bad(f"{key} set {t!r}: the range {item.strip()!r} runs backwards")
            if hi >= gpu_count:
                raise bad(f"{key} set {t!r} names GPU {hi}, but the spec has {gpu_count} GPUs (0..{gpu_count - 1})")
            members.update(range(lo, hi + 1))
        out.append((t, members))
    return out


@dataclasses.dataclass(frozen=True)
class FakeProcess:
    """A row of ``--fake-processes``: ``pid`` uses ``used_mb`` on the GPU while it runs, or, with ``until``
    (unix seconds), until then whether it runs or not (a driver that frees a process's memory late)."""

    pid: int
    used_mb: int
    until: float | None = None

    def listed(self, now: float) -> bool:
        return now < self.until if self.until is not None else _process_alive(self.pid)


UTILIZATION_KEY = "utilization"


def parse_fake_utilization(doc: Any, gpu_count: int) -> dict[int, int]:
    """The ``"utilization"`` entry of a ``--fake-processes`` document: ``{"<GPU index>": percent, ...}``, a whole
    number 0..100 per simulated GPU (docs/policies.md "Idle GPUs"); a GPU it does not name keeps its utilization unknown
    (-1), or what ``set_utilization`` gave it. Raises ValueError naming the bad entry."""
    if not isinstance(doc, dict) or UTILIZATION_KEY not in doc:
        return {}
    rates = doc[UTILIZATION_KEY]
    if not isinstance(rates, dict):
        raise ValueError('utilization: expected an object {"<GPU index>": percent}')
    out: dict[int, int] = {}
    for key, pct in rates.items():
        if not str(key).isdigit() or not 0 <= int(key) < gpu_count:
            raise ValueError(f"utilization: GPU {key!r}: not a simulated GPU index (have 0..{gpu_count - 1})")
        if isinstance(pct, bool) or not isinstance(pct, int) or not 0 <= pct <= 100:
            raise ValueError(f"utilization: GPU {key}: expected a whole percent 0..100, got {pct!r}")
        out[int(key)] = pct
    return out


def parse_fake_processes(doc: Any, gpu_count: int) -> dict[int, tuple[FakeProcess, ...]]:
    """A ``--fake-processes`` document: ``{"<GPU index>": {"<pid>": MiB, ...}, ...}``, where a MiB may also be
    ``{"mib": MiB, "until": unix_seconds}``, and optionally ``"utilization": {"<GPU index>": percent}``
    (``parse_fake_utilization``).

    Raises ValueError naming the bad entry.
    """
    if not isinstance(doc, dict):
        raise ValueError("expected a JSON object mapping GPU index to {pid: MiB}")
    out: dict[int, tuple[FakeProcess, ...]] = {}
    for key, procs in doc.items():
        if key == UTILIZATION_KEY:
            continue
        if not str(key).isdigit() or not 0 <= int(key) < gpu_count:
            raise ValueError(f"GPU {key!r}: not a simulated GPU index (have 0..{gpu_count - 1})")
        if not isinstance(procs, dict):
            raise ValueError(f"GPU {key}: expected an object {{pid: MiB}}")
        rows = []
        for pid, value in procs.items():
            if not str(pid).isdigit() or int(pid) < 1:
                raise ValueError(f"GPU {key}: {pid!r} is not a pid")
            until = None
            mb = value
            if isinstance(value, dict):
                if set(value) - {"mib", "until"} or "mib" not in value:
                    raise ValueError(f"GPU {key}, pid {pid}: expected MiB or {{\"mib\": MiB, \"until\": unix "
                                     f"seconds}}, got keys {sorted(value)}")
                mb, until = value["mib"], value.get("until")
                if until is not None and (isinstance(until, bool) or not isinstance(until, (int, float))
                                          or not math.isfinite(until)):
                    raise ValueError(f"GPU {key}, pid {pid}: until must be unix seconds, got {until!r}")
            if isinstance(mb, bool) or not isinstance(mb, int) or mb < 0:
                raise ValueError(f"GPU {key}, pid {pid}: MiB must be a whole number >= 0, got {mb!r}")
            rows.append(FakeProcess(pid=int(pid), used_mb=mb, until=None if until is None else float(until)))
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
    tests and demos put real processes on simulated GPUs. Rows of processes that no longer run (or are
    zombies) are dropped, as NVML would; a row ``{"mib": N, "until": T}`` is listed until the unix time T
    instead, whether its process runs or not. A file that is missing counts as empty; a malformed one is
    ignored with a warning. The GPUs' process lists count as visible (``processes_visible``) only with a
    ``processes_file``: without one the simulator cannot tell which processes use them. A GPU's utilization is
    unknown (-1) unless ``set_utilization`` or the file's ``"utilization": {"<GPU index>": percent}`` sets it.
    """

    simulated: bool = True

    def __init__(self, spec: str, host: str, processes_file: str | None = None) -> None:
        self._gpus = parse_fake_gpus(spec, host)
        self._lock = threading.Lock()  # the daemon's usage loop and a demo may run in different threads
        self._used: dict[int, tuple[int, tuple[GpuProcess, ...]]] = {g.index: (0, ()) for g in self._gpus}
        self._utilization: dict[int, int] = {}   # index -> percent (absent: unknown)
        self.processes_file = processes_file
        self._file_error = ""

    def _file_processes(self) -> tuple[dict[int, tuple[GpuProcess, ...]] | None, dict[int, int]]:
        """The file's processes now listed on each GPU (None when the file cannot be read: then the GPUs'
        process lists are not known) and the utilization it sets per GPU."""
        if not self.processes_file:
            return None, {}
        try:
            with open(self.processes_file, encoding="utf-8") as f:
                doc = json.load(f)
            found = parse_fake_processes(doc, len(self._gpus))
            rates = parse_fake_utilization(doc, len(self._gpus))
        except FileNotFoundError:
            return {}, {}
        except (OSError, ValueError) as e:
            why = f"--fake-processes {self.processes_file}: {e}; ignoring it"
            if why != self._file_error:
                log.warning("%s", why)
                self._file_error = why
            return None, {}
        self._file_error = ""
        now = clock.wall()
        return ({i: tuple(GpuProcess(p.pid, p.used_mb) for p in rows if p.listed(now)) for i, rows in found.items()},
                rates)

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

    def set_utilization(self, index: int, pct: int) -> None:
        """Simulate the GPU's utilization (0..100; -1: unknown, the default). The ``--fake-processes`` file's
        ``"utilization"`` entry, where it names the GPU, wins."""
        if index not in self._used:
            raise ValueError(f"no simulated GPU with index {index} (have 0..{len(self._gpus) - 1})")
        if not -1 <= pct <= 100:
            raise ValueError(f"utilization {pct} is out of range -1..100 for GPU {index}")
        with self._lock:
            self._utilization[index] = int(pct)

    def usage(self) -> tuple[GpuUsage, ...]:
        with self._lock:
            used = dict(self._used)
            rates = dict(self._utilization)
        listed, file_rates = self._file_processes()
        rates.update(file_rates)
        extra = listed or {}
        out = []
        for g in self._gpus:
            base, procs = used[g.index]
            rows = extra.get(g.index, ())
            total = min(g.vram_total_mb, base + sum(p.used_mb for p in rows))
            out.append(GpuUsage(index=g.index, uuid=g.uuid, vram_used_mb=total,
                                vram_free_mb=g.vram_total_mb - total, processes=procs + rows,
                                processes_visible=listed is not None, utilization_pct=rates.get(g.index, -1)))
        return tuple(out)

    def close(self) -> None:
        """Nothing to release."""
