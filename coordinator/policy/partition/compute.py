"""Turning a spec and a host inventory into a ``Partition`` (shared, auto-split, manual)."""
from __future__ import annotations

from collections.abc import Sequence

from coordinator.policy.partition.model import (
    AgentAllocation,
    Partition,
    _find_gpu,
    _fmt_cores,
    _host_cores,
    _split,
)
from coordinator.policy.partition.spec import (
    AllocationSpec,
    PartitionSpec,
    _fld,
    parse_spec,
)
from coordinator.policy.partition.units import PartitionError, _human, _show
from coordinator.records import GpuInfo, HostInventory


def compute_partition(inventory: HostInventory, spec: PartitionSpec) -> Partition:
    """Check ``spec`` against ``inventory`` and compute every agent's allocation.

    Raises ``PartitionError`` naming the field (``host``, ``reserved.cpu``, ``agents``,
    ``allocations.agent-a.cpu``, ``allocations.agent-b.gpus[0]``, ...).
    """
    # Re-validate the structure, so that a hand-built PartitionSpec gets the same checks.
    spec = parse_spec(spec.to_json())
    if spec.host != inventory.host:
        raise PartitionError("host", f"the spec is for host {_show(spec.host)}, "
                                     f"but this inventory is {_show(inventory.host)}")

    r = spec.reserved
    cores = _host_cores(inventory)
    if r.cpu > len(cores):
        raise PartitionError("reserved.cpu", f"reserves {r.cpu} cores, but the host has only {len(cores)}")
    if cores and r.cpu == len(cores):
        raise PartitionError("reserved.cpu", f"reserves all {len(cores)} cores, leaving none for the agents")
    if r.mem > inventory.mem_bytes:
        raise PartitionError("reserved.mem",
                             f"reserves {_human(r.mem)}, but the host has only {_human(inventory.mem_bytes)}")
    if r.disk > inventory.disk_bytes:
        raise PartitionError("reserved.disk",
                             f"reserves {_human(r.disk)}, but the host has only {_human(inventory.disk_bytes)}")
    gpus = sorted(inventory.gpus, key=lambda g: g.index)
    if gpus:
        smallest = min(gpus, key=lambda g: g.vram_total_mb)
        if r.vram_headroom_mb > smallest.vram_total_mb:
            raise PartitionError("reserved.vram_headroom",
                                 f"{r.vram_headroom_mb} MiB per GPU is more than GPU {smallest.index} has "
                                 f"({smallest.vram_total_mb} MiB)")

    reserved_cores = cores[: r.cpu]
    avail_cores = cores[r.cpu:]
    avail_mem = max(0, inventory.mem_bytes - r.mem)
    avail_disk = max(0, inventory.disk_bytes - r.disk)
    headroom = r.vram_headroom_mb
    usable = {g.uuid: max(0, g.vram_total_mb - headroom) for g in gpus}

    if spec.mode == "shared":
        every_gpu = tuple((g.uuid, usable[g.uuid]) for g in gpus)
        allocations = tuple(
            AgentAllocation(agent=a, cores=avail_cores, mem_bytes=avail_mem, disk_bytes=avail_disk,
                            whole_gpus=(), vram_caps_mb=every_gpu)
            for a in spec.agents)
    elif spec.mode == "auto-split":
        allocations = _auto_split(spec, avail_cores, avail_mem, avail_disk, gpus, usable)
    else:
        allocations = _manual(inventory, spec, cores, reserved_cores, avail_cores, avail_mem, avail_disk,
                              gpus, usable)

    return Partition(host=spec.host, mode=spec.mode, agents=spec.agents, headroom_mb=headroom,
                     allocations=allocations, spec=spec)


def _auto_split(spec: PartitionSpec, avail_cores: tuple[int, ...], avail_mem: int, avail_disk: int,
                gpus: list[GpuInfo], usable: dict[str, int]) -> tuple[AgentAllocation, ...]:
    n = len(spec.agents)
    if n == 0:
        raise PartitionError("agents", "auto-split needs at least one agent")
    if len(avail_cores) < n:
        raise PartitionError("agents", f"{n} agents but only {len(avail_cores)} available cores: "
                                       "auto-split would hand out empty core sets")
    core_shares = _split(len(avail_cores), n)
    mem_shares = _split(avail_mem, n)
    disk_shares = _split(avail_disk, n)

    whole: list[list[GpuInfo]] = [[] for _ in range(n)]
    caps: list[list[tuple[str, int]]] = [[] for _ in range(n)]
    if len(gpus) >= n:
        start = 0
        for i, k in enumerate(_split(len(gpus), n)):
            whole[i] = gpus[start:start + k]
            caps[i] = [(g.uuid, usable[g.uuid]) for g in whole[i]]
            start += k
    else:
        for i in range(n):
            caps[i] = [(g.uuid, usable[g.uuid] // n) for g in gpus]

    out: list[AgentAllocation] = []
    start = 0
    for i, agent in enumerate(spec.agents):
        out.append(AgentAllocation(
            agent=agent,
            cores=avail_cores[start:start + core_shares[i]],
            mem_bytes=mem_shares[i],
            disk_bytes=disk_shares[i],
            whole_gpus=tuple(g.uuid for g in whole[i]),
            vram_caps_mb=tuple(caps[i]),
        ))
        start += core_shares[i]
    return tuple(out)


def _check_sum(allocs: Sequence[tuple[str, AllocationSpec]], amounts: Sequence[int | None], key: Sequence[str],
               available: int, describe: str) -> None:
    """Reject at the first agent whose share pushes the running sum above ``available``."""
    total = sum(a for a in amounts if a is not None)
    if total <= available:
        return
    running = 0
    for (agent, _), amount, k in zip(allocs, amounts, key):
        running += amount or 0
        if running > available:
            raise PartitionError(_fld("allocations", agent, k),
                                 f"the agents ask for {total} in all, more than the {describe}")


def _manual(inventory: HostInventory, spec: PartitionSpec, cores: tuple[int, ...], reserved_cores: tuple[int, ...],
            avail_cores: tuple[int, ...], avail_mem: int, avail_disk: int, gpus: list[GpuInfo],
            usable: dict[str, int]) -> tuple[AgentAllocation, ...]:
    allocs = spec.allocations
    if not allocs:
        raise PartitionError("agents", "manual mode needs at least one agent")
    r = spec.reserved
    kinds = allocs[0][1].kinds()  # parse_spec made sure every agent names the same kinds

    # -- cpu
    assigned_cores: dict[str, tuple[int, ...]] = {a: avail_cores for a, _ in allocs}
    if "cpu" in kinds:
        counts = [a.cpu_count() for _, a in allocs]
        keys = ["cpu" if a.cpu is not None else "cores" for _, a in allocs]
        total = sum(c or 0 for c in counts)
        if total > len(avail_cores):
            _check_sum(allocs, counts, keys, len(avail_cores),
                       f"{len(avail_cores)} available cores ({len(cores)} cores - {r.cpu} reserved)")
        host_set, reserved_set = set(cores), set(reserved_cores)
        taken: dict[int, str] = {}
        for agent, a in allocs:
            for i, c in enumerate(a.cores or ()):
                f = f"allocations.{agent}.cores[{i}]"
                if c not in host_set:
                    raise PartitionError(f, f"core {c} does not exist on the host (cores {_fmt_cores(cores)})")
                if c in reserved_set:
                    raise PartitionError(f, f"core {c} is reserved (reserved.cpu = {r.cpu} reserves core ids "
                                            f"{_fmt_cores(reserved_cores)})")
                if c in taken:
                    raise PartitionError(f, f"core {c} is already given to {taken[c]}")
                taken[c] = agent
        free = [c for c in avail_cores if c not in taken]
        pos = 0
        for agent, a in allocs:
            if a.cores is not None:
                assigned_cores[agent] = tuple(sorted(a.cores))
            else:
                n = a.cpu or 0
                assigned_cores[agent] = tuple(free[pos:pos + n])
                pos += n

    # -- mem, disk
    mem_of: dict[str, int] = {a: avail_mem for a, _ in allocs}
    disk_of: dict[str, int] = {a: avail_disk for a, _ in allocs}
    if "mem" in kinds:
        amounts = [a.mem for _, a in allocs]
        _check_sum(allocs, amounts, ["mem"] * len(allocs), avail_mem,
                   f"{_human(avail_mem)} available ({_human(inventory.mem_bytes)} - {_human(r.mem)} reserved)")
        mem_of = {agent: a.mem or 0 for agent, a in allocs}
    if "disk" in kinds:
        amounts = [a.disk for _, a in allocs]
        _check_sum(allocs, amounts, ["disk"] * len(allocs), avail_disk,
                   f"{_human(avail_disk)} available ({_human(inventory.disk_bytes)} - {_human(r.disk)} reserved)")
        disk_of = {agent: a.disk or 0 for agent, a in allocs}

    # -- GPUs
    known = ", ".join(f"{g.index}={g.uuid}" for g in gpus) or "none"
    owner: dict[str, str] = {}  # uuid -> agent it is given whole to
    whole_of: dict[str, list[GpuInfo]] = {a: [] for a, _ in allocs}
    for agent, a in allocs:
        for i, ref in enumerate(a.gpus or ()):
            f = f"allocations.{agent}.gpus[{i}]"
            g = _find_gpu(gpus, ref)
            if g is None:
                raise PartitionError(f, f"unknown GPU {_show(ref)} (the host has: {known})")
            if g.uuid in owner:
                who = "this agent already" if owner[g.uuid] == agent else owner[g.uuid]
                raise PartitionError(f, f"GPU {g.index} ({g.uuid}) is already given whole to {who}")
            owner[g.uuid] = agent
            whole_of[agent].append(g)

    shared_caps: dict[str, dict[str, int]] = {a: {} for a, _ in allocs}
    for agent, a in allocs:
        for ref, mb in a.vram or ():
            f = _fld("allocations", agent, "vram", ref)
            g = _find_gpu(gpus, ref)
            if g is None:
                raise PartitionError(f, f"unknown GPU {_show(ref)} (the host has: {known})")
            if g.uuid in owner:
                raise PartitionError(f, f"GPU {g.index} ({g.uuid}) is given whole to {owner[g.uuid]}; "
                                        "it cannot also carry a VRAM cap")
            if g.uuid in shared_caps[agent]:
                raise PartitionError(f, f"GPU {g.index} ({g.uuid}) is capped twice for this agent")
            if mb > usable[g.uuid]:
                raise PartitionError(f, f"cap {mb} MiB is above GPU {g.index}'s usable {usable[g.uuid]} MiB "
                                        f"({g.vram_total_mb} MiB - {r.vram_headroom_mb} MiB headroom)")
            shared_caps[agent][g.uuid] = mb
    if "vram" not in kinds:
        unowned = {g.uuid: usable[g.uuid] for g in gpus if g.uuid not in owner}
        shared_caps = {a: dict(unowned) for a, _ in allocs}

    out: list[AgentAllocation] = []
    for agent, _ in allocs:
        mine = {g.uuid for g in whole_of[agent]}
        caps = tuple((g.uuid, usable[g.uuid]) if g.uuid in mine else (g.uuid, shared_caps[agent][g.uuid])
                     for g in gpus if g.uuid in mine or g.uuid in shared_caps[agent])
        out.append(AgentAllocation(
            agent=agent,
            cores=assigned_cores[agent],
            mem_bytes=mem_of[agent],
            disk_bytes=disk_of[agent],
            whole_gpus=tuple(g.uuid for g in sorted(whole_of[agent], key=lambda g: g.index)),
            vram_caps_mb=caps,
        ))
    return tuple(out)
