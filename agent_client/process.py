"""How ``gpucoord run`` starts and limits a command: the partition as limits (CPU affinity, cgroup v2
``memory.max`` / ``cpu.max``), the command's environment under its lease, and its exit status."""
from __future__ import annotations

import dataclasses
import pathlib
import signal
from typing import Any, Iterable, Mapping, Protocol, Sequence

CPU_PERIOD_US = 100_000


def core_ranges(ids: Iterable[int]) -> str:
    """[0,1,2,5] -> '0-2,5'."""
    out: list[list[int]] = []
    for i in sorted(set(ids)):
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out) or "none"


@dataclasses.dataclass(frozen=True)
class LimitPlan:
    """What of an agent's partition applies to its process: a pure function of the allocation."""

    cores: tuple[int, ...]      # CPU affinity to set; () for none
    mem_bytes: int              # memory.max; 0 for none
    cpu_max: str                # cpu.max ("quota period"); "" for none
    notes: tuple[str, ...]      # limits that cannot be enforced, and why


def plan_limits(allocation: Mapping[str, Any] | None, available_cores: Iterable[int]) -> LimitPlan:
    """The limits of ``allocation`` (an agent's share from ``client.partition()["mine"]``; None in a
    shared partition, which limits nothing) on a machine whose usable cores are ``available_cores``."""
    if allocation is None:
        return LimitPlan((), 0, "", ())
    cores = sorted({int(c) for c in allocation.get("cores", ())})
    avail = set(available_cores)
    usable = tuple(c for c in cores if c in avail)
    notes: list[str] = []
    if cores and not usable:
        notes.append(f"CPU affinity (cores {core_ranges(cores)}) is not enforced: none of these cores is available "
                     f"here (this process may use cores {core_ranges(avail)})")
    elif len(usable) < len(cores):
        notes.append(f"CPU affinity is enforced on cores {core_ranges(usable)} only: cores "
                     f"{core_ranges(set(cores) - avail)} of the partition are not available here")
    mem = max(0, int(allocation.get("mem_bytes", 0)))
    cpu_max = f"{len(cores) * CPU_PERIOD_US} {CPU_PERIOD_US}" if cores else ""
    return LimitPlan(usable, mem, cpu_max, tuple(notes))


def prepare_cgroup(root: str | None, name: str, mem_bytes: int, cpu_max: str) -> tuple[pathlib.Path | None, list[str]]:
    """Create ``root/name`` with ``memory.max`` and ``cpu.max`` where the cgroup v2 ``root`` allows it.

    Returns the directory (None when nothing could be set) and what is not enforced, with the reason.
    """
    wanted: dict[str, tuple[str, str, str]] = {}   # controller -> (file, value, readable limit)
    if mem_bytes:
        wanted["memory"] = ("memory.max", str(mem_bytes), f"the memory limit (memory.max = {mem_bytes} B)")
    if cpu_max:
        wanted["cpu"] = ("cpu.max", cpu_max, f"the CPU limit (cpu.max = {cpu_max})")
    if not wanted:
        return None, []
    if not root:
        return None, [f"{w[2]} is not enforced: no --cgroup-root (a writable cgroup v2 directory, e.g. a delegated "
                      "systemd slice) was given" for w in wanted.values()]
    base = pathlib.Path(root)
    try:
        controllers = set((base / "cgroup.controllers").read_text().split())
    except OSError as e:
        return None, [f"{w[2]} is not enforced: {root} is not a cgroup v2 directory "
                      f"({e.strerror or e})" for w in wanted.values()]
    try:
        enabled = set((base / "cgroup.subtree_control").read_text().split())
    except OSError:
        enabled = set()
    notes: list[str] = []
    usable: dict[str, tuple[str, str, str]] = {}
    for ctl, w in wanted.items():
        if ctl not in controllers:
            notes.append(f"{w[2]} is not enforced: the {ctl} controller is not available in {root} "
                         f"(cgroup.controllers: {' '.join(sorted(controllers)) or 'none'})")
            continue
        if ctl not in enabled:
            try:
                (base / "cgroup.subtree_control").write_text(f"+{ctl}")
            except OSError as e:
                notes.append(f"{w[2]} is not enforced: cannot enable the {ctl} controller for the children of "
                             f"{root} ({e.strerror or e})")
                continue
        usable[ctl] = w
    if not usable:
        return None, notes
    path = base / name
    try:
        path.mkdir(exist_ok=True)
    except OSError as e:
        return None, notes + [f"{w[2]} is not enforced: cannot create {path} ({e.strerror or e})"
                              for w in usable.values()]
    for w in usable.values():
        try:
            (path / w[0]).write_text(w[1])
        except OSError as e:
            notes.append(f"{w[2]} is not enforced: cannot write {path / w[0]} ({e.strerror or e})")
    return path, notes


class GrantedGpu(Protocol):
    """One GPU of a gang lease (``agent_client.lease.LeaseGpu`` has it)."""

    @property
    def uuid(self) -> str: ...

    @property
    def vram_mb(self) -> int: ...


class GrantedLease(Protocol):
    """What the command's environment names of its lease (``AsyncLease`` has it)."""

    id: str
    gpu_uuid: str
    token: int
    vram_mb: int

    @property
    def gpus(self) -> Sequence[GrantedGpu]: ...


def child_env(base: Mapping[str, str], lease: GrantedLease) -> dict[str, str]:
    """The command's environment: ``base`` plus the lease's GPUs and identity. A gang's GPUs go into
    ``CUDA_VISIBLE_DEVICES`` by uuid in index order (stable: the command's device 0 is the gang's lowest
    index), with one MPS memory limit per device."""
    env = dict(base)
    gpus = list(lease.gpus)
    uuids = ",".join(g.uuid for g in gpus) if gpus else lease.gpu_uuid
    # MPS names devices by ordinal as the client sees them: 0.. in CUDA_VISIBLE_DEVICES order.
    limits = ",".join(f"{n}={g.vram_mb}M" for n, g in enumerate(gpus)) if gpus else f"0={lease.vram_mb}M"
    env.update({
        "CUDA_VISIBLE_DEVICES": uuids,
        "GPUCOORD_LEASE_ID": lease.id,
        "GPUCOORD_TOKEN": str(lease.token),
        "GPUCOORD_GPU_UUID": lease.gpu_uuid,
        "GPUCOORD_GPU_UUIDS": uuids,
        "GPUCOORD_VRAM_MB": str(lease.vram_mb),
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": limits,
    })
    return env


def exit_status(returncode: int) -> int:
    """A shell's exit status: the code, or 128+N for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name} (status {exit_status(returncode)})"
    return f"exited with status {returncode}"
