"""The computed partition: one ``AgentAllocation`` per agent, and the host's ``Partition``."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from coordinator.policy.partition.spec import (
    GpuRef,
    PartitionSpec,
    _parse_int,
    _parse_list,
    _parse_table,
    parse_spec,
)
from coordinator.policy.partition.units import MODES, PartitionError, _show
from coordinator.records import GpuInfo, HostInventory

# -- the computed partition ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AgentAllocation:
    """One agent's concrete share of a host."""

    agent: str
    cores: tuple[int, ...]
    mem_bytes: int
    disk_bytes: int
    whole_gpus: tuple[str, ...]  # uuids given whole to this agent
    vram_caps_mb: tuple[tuple[str, int], ...]  # (gpu uuid, cap MiB) for every GPU the agent may lease on

    def to_json(self) -> dict[str, object]:
        return {
            "agent": self.agent,
            "cores": list(self.cores),
            "mem_bytes": self.mem_bytes,
            "disk_bytes": self.disk_bytes,
            "whole_gpus": list(self.whole_gpus),
            # A list of pairs, not an object: the order (GPU index) survives sorted-key JSON.
            "vram_caps_mb": [[uuid, mb] for uuid, mb in self.vram_caps_mb],
        }

    @classmethod
    def from_json(cls, d: object) -> AgentAllocation:
        t = _parse_table(d, "allocation")
        agent = t.get("agent")
        if not isinstance(agent, str):
            raise PartitionError("allocation.agent", f"expected a string, got {_show(agent)}")
        base = f"allocation[{agent}]"
        caps: list[tuple[str, int]] = []
        for i, pair in enumerate(_parse_list(t.get("vram_caps_mb", []), f"{base}.vram_caps_mb", "pairs")):
            f = f"{base}.vram_caps_mb[{i}]"
            p = _parse_list(pair, f, "[uuid, MiB]")
            if len(p) != 2 or not isinstance(p[0], str):
                raise PartitionError(f, "expected [uuid, MiB]")
            caps.append((p[0], _parse_int(p[1], f)))
        listed = _parse_list(t.get("whole_gpus", []), f"{base}.whole_gpus", "uuids")
        whole = [u for u in listed if isinstance(u, str)]
        if len(whole) != len(listed):
            raise PartitionError(f"{base}.whole_gpus", "expected a list of uuids")
        return cls(
            agent=agent,
            cores=tuple(_parse_int(c, f"{base}.cores")
                        for c in _parse_list(t.get("cores", []), f"{base}.cores", "core ids")),
            mem_bytes=_parse_int(t.get("mem_bytes", 0), f"{base}.mem_bytes"),
            disk_bytes=_parse_int(t.get("disk_bytes", 0), f"{base}.disk_bytes"),
            whole_gpus=tuple(whole),
            vram_caps_mb=tuple(caps),
        )


@dataclasses.dataclass(frozen=True)
class Partition:
    """What each agent on a host may use. ``agents`` and ``spec`` are empty for the implicit default."""

    host: str
    mode: str
    agents: tuple[str, ...]
    headroom_mb: int  # per GPU
    allocations: tuple[AgentAllocation, ...]
    spec: PartitionSpec | None

    def allows(self, agent: str) -> bool:
        """Shared mode: any agent. Otherwise only the listed agents."""
        return self.mode == "shared" or agent in self.agents

    def allocation(self, agent: str) -> AgentAllocation | None:
        for a in self.allocations:
            if a.agent == agent:
                return a
        return None

    def usable_mb(self, gpu: GpuInfo) -> int:
        return max(0, gpu.vram_total_mb - self.headroom_mb)

    def gpu_caps(self, agent: str, inventory: HostInventory) -> dict[str, int]:
        """uuid -> cap (MiB) on every GPU of ``inventory`` that ``agent`` may lease on.

        Shared mode: every GPU at ``usable``, listed agent or not. Otherwise the agent's allocation,
        restricted to the GPUs still present and clamped to their current usable VRAM; ``{}`` for an
        agent that is not allowed.
        """
        if self.mode == "shared":
            return {g.uuid: self.usable_mb(g) for g in sorted(inventory.gpus, key=lambda g: g.index)}
        if not self.allows(agent):
            return {}
        alloc = self.allocation(agent)
        if alloc is None:
            return {}
        present = {g.uuid: g for g in inventory.gpus}
        return {uuid: min(cap, self.usable_mb(present[uuid]))
                for uuid, cap in alloc.vram_caps_mb if uuid in present}

    def to_json(self) -> dict[str, object]:
        return {
            "host": self.host,
            "mode": self.mode,
            "agents": list(self.agents),
            "headroom_mb": self.headroom_mb,
            "allocations": [a.to_json() for a in self.allocations],
            "spec": self.spec.to_json() if self.spec is not None else None,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, object]) -> Partition:
        """The inverse of ``to_json``. Malformed input raises ``PartitionError``."""
        t = _parse_table(d, "partition")
        host = t.get("host")
        if not isinstance(host, str):
            raise PartitionError("partition.host", f"expected a string, got {_show(host)}")
        mode = t.get("mode")
        if not isinstance(mode, str) or mode not in MODES:
            raise PartitionError("partition.mode", f"must be one of {', '.join(MODES)}; got {_show(mode)}")
        listed = _parse_list(t.get("agents", []), "partition.agents", "agent names")
        agents = [a for a in listed if isinstance(a, str)]
        if len(agents) != len(listed):
            raise PartitionError("partition.agents", "expected a list of agent names")
        allocs = _parse_list(t.get("allocations", []), "partition.allocations", "allocations")
        raw_spec = t.get("spec")
        return cls(
            host=host,
            mode=mode,
            agents=tuple(agents),
            headroom_mb=_parse_int(t.get("headroom_mb", 0), "partition.headroom_mb"),
            allocations=tuple(AgentAllocation.from_json(a) for a in allocs),
            spec=parse_spec(raw_spec) if raw_spec is not None else None,
        )


def default_partition(inventory: HostInventory) -> Partition:
    """The partition of a host with no spec: shared, no reservation, open to any agent."""
    return Partition(host=inventory.host, mode="shared", agents=(), headroom_mb=0, allocations=(), spec=None)


def _host_cores(inventory: HostInventory) -> tuple[int, ...]:
    """The host's core ids, ascending. ``core_ids`` is authoritative; ``range(cpu_count)`` if it is empty."""
    if inventory.core_ids:
        return tuple(sorted(set(inventory.core_ids)))
    return tuple(range(max(0, inventory.cpu_count)))


def _split(total: int, n: int) -> list[int]:
    """divmod split; the remainder goes to the first shares."""
    q, r = divmod(total, n)
    return [q + (1 if i < r else 0) for i in range(n)]


def _find_gpu(gpus: Sequence[GpuInfo], ref: GpuRef) -> GpuInfo | None:
    """A GPU by index (int) or uuid (str); refs come normalized from ``_parse_gpu_ref``."""
    for g in gpus:
        if (g.index == ref) if isinstance(ref, int) else (g.uuid == ref):
            return g
    return None


def _fmt_cores(cores: Sequence[int]) -> str:
    """'0-3,8,10-11'."""
    out: list[str] = []
    i = 0
    while i < len(cores):
        j = i
        while j + 1 < len(cores) and cores[j + 1] == cores[j] + 1:
            j += 1
        out.append(str(cores[i]) if i == j else f"{cores[i]}-{cores[j]}")
        i = j + 1
    return ",".join(out) or "none"
