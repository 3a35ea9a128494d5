"""The admission decision: pure functions over plain data, no I/O.

The coordinator takes one etcd snapshot of a host (ledgers, leases, usage, partition, queue), builds
``GpuView``s from it, and asks these functions what to do. They answer; the caller commits the answer in
one transaction that compares every revision the decision read.
"""
from __future__ import annotations

import dataclasses
from typing import Collection, Iterable, Mapping, Sequence

from coordinator.records import GpuLedger, VramLease


@dataclasses.dataclass(frozen=True)
class Departing:
    """A lease bound to processes that ended under an eviction notice while the node still reports some of
    its processes on the GPU: until they are gone (or the kill margin has passed) its VRAM counts as held,
    by its agent (G3: the victim is gone first)."""

    lease_id: str
    agent: str
    vram_mb: int


@dataclasses.dataclass
class GpuView:
    """One GPU as admission sees it in a snapshot. Mutable: a batch updates it as it decides."""

    uuid: str
    index: int
    total_mb: int
    usable_mb: int
    ledger: GpuLedger
    leases: list[VramLease]
    nvml_used_mb: int | None = None  # None: unknown or stale, then untracked counts as 0
    seq: int = 0
    departing: list[Departing] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.seq = self.ledger.seq

    @property
    def leased_mb(self) -> int:
        return sum(lease.vram_mb for lease in self.leases)

    @property
    def departing_mb(self) -> int:
        return sum(d.vram_mb for d in self.departing)

    @property
    def held_mb(self) -> int:
        """VRAM that live leases, and ended leases whose processes are still reported, account for."""
        return self.leased_mb + self.departing_mb

    @property
    def untracked_mb(self) -> int:
        """VRAM used outside gpucoord: NVML's used memory beyond what leases account for."""
        if self.nvml_used_mb is None:
            return 0
        return max(0, self.nvml_used_mb - self.held_mb)

    @property
    def free_mb(self) -> int:
        return self.usable_mb - self.held_mb - self.untracked_mb

    def without(self, gone: Collection[str]) -> GpuView:
        """This GPU once the leases ``gone`` (ids) are, their processes having freed their memory: NVML's used
        memory drops by what those leases held, so the untracked part (memory of processes without a lease)
        stays what it was. Evicting a lease frees its VRAM, nothing more (as ``choose_victims`` counts it);
        dropping its records alone would count its processes' memory as untracked, and no eviction would ever
        seem to help a request while the node reports their use."""
        freed = sum(x.vram_mb for x in self.leases if x.id in gone)
        nvml = None if self.nvml_used_mb is None else max(0, self.nvml_used_mb - freed)
        out = dataclasses.replace(self, leases=[x for x in self.leases if x.id not in gone], nvml_used_mb=nvml)
        out.seq = self.seq
        return out

    def agent_mb(self, agent: str) -> int:
        return (sum(lease.vram_mb for lease in self.leases if lease.agent == agent)
                + sum(d.vram_mb for d in self.departing if d.agent == agent))


@dataclasses.dataclass(frozen=True)
class Placement:
    gpu: GpuView | None
    reason: str = ""  # why nothing fits, when gpu is None


def room_for(gpu: GpuView, agent: str, cap_mb: int) -> int:
    """How much this agent could still take on this GPU now: the GPU's free VRAM, within its cap."""
    return min(gpu.free_mb, cap_mb - gpu.agent_mb(agent))


def never_fits(vram_mb: int, gpus: Sequence[GpuView], caps: Mapping[str, int]) -> str | None:
    """Why the request can never be admitted on any of these GPUs (even with all of them empty), or None."""
    candidates = [g for g in gpus if g.uuid in caps]
    if not candidates:
        return "no GPU is allowed"
    if all(vram_mb > g.usable_mb for g in candidates):
        best = max(g.usable_mb for g in candidates)
        return f"vram_mb: {vram_mb} MiB is more than the usable VRAM of every allowed GPU (largest: {best} MiB)"
    if all(vram_mb > min(caps[g.uuid], g.usable_mb) for g in candidates):
        best = max(min(caps[g.uuid], g.usable_mb) for g in candidates)
        return f"vram_mb: {vram_mb} MiB is more than the partition's cap on every allowed GPU (largest: {best} MiB)"
    return None


def best_fit(vram_mb: int, agent: str, gpus: Iterable[GpuView], caps: Mapping[str, int]) -> Placement:
    """Best fit: the allowed GPU with the least free VRAM left after placing; ties go to the lowest index."""
    fitting = [g for g in gpus if g.uuid in caps and vram_mb <= room_for(g, agent, caps[g.uuid])]
    if not fitting:
        return Placement(None, f"vram_mb: {vram_mb} MiB does not fit now on any allowed GPU")
    return Placement(min(fitting, key=lambda g: (g.free_mb - vram_mb, g.index)))


def choose_victims(vram_mb: int, priority: int, agent: str, gpu: GpuView, cap_mb: int) -> list[VramLease] | None:
    """G3: the fewest preemptible leases of priority < ``priority`` on ``gpu`` whose removal makes the request fit.

    Victims are taken lowest priority first, then newest first. Returns None when no such set exists
    (evicting every candidate would still not make it fit), and [] when it fits already.
    """
    if vram_mb <= room_for(gpu, agent, cap_mb):
        return []
    candidates = sorted(
        (lease for lease in gpu.leases if lease.preemptible and lease.priority < priority),
        key=lambda lease: (lease.priority, -lease.created_at, -lease.token),
    )
    victims: list[VramLease] = []
    freed = 0
    freed_own = 0
    need_gpu = vram_mb - gpu.free_mb
    need_cap = vram_mb - (cap_mb - gpu.agent_mb(agent))
    for lease in candidates:
        if freed >= need_gpu and freed_own >= need_cap:
            break
        victims.append(lease)
        freed += lease.vram_mb
        if lease.agent == agent:
            freed_own += lease.vram_mb
    if freed >= need_gpu and freed_own >= need_cap:
        # Drop victims that turned out unnecessary (a later, larger one covered them), keeping order.
        for lease in list(victims):
            rest = [v for v in victims if v is not lease]
            rest_freed = sum(v.vram_mb for v in rest)
            rest_own = sum(v.vram_mb for v in rest if v.agent == agent)
            if rest_freed >= need_gpu and rest_own >= need_cap:
                victims = rest
        return victims
    return None


def plan_eviction(gpus: list[GpuView], caps: dict[str, int], vram: int, priority: int, agent: str,
                   evicting: set[str], idle: Collection[str] = ()) -> list[VramLease]:
    """G3 over every allowed GPU, counting leases that are already being evicted as gone: the preemptible
    leases of priority < ``priority`` on all of them, taken in G3's order over all of them (lowest priority
    first, then the leases judged ``idle`` before the others, then newest first) until the request fits on one GPU, then every victim that can be spared dropped
    in that order (a lease over several GPUs is one victim, freeing each of its records). [] when nothing
    needs evicting (or nothing would help). ``victims.choose_gang_victims`` makes the same choice over slots."""
    after = [g.without(evicting) for g in gpus if g.uuid in caps]

    def fits(gone: set[str]) -> bool:   # what the victims free, as choose_victims counts it
        return any(sum(x.vram_mb for x in g.leases if x.id in gone) >= vram - g.free_mb
                   and sum(x.vram_mb for x in g.leases if x.id in gone and x.agent == agent)
                   >= vram - (caps[g.uuid] - g.agent_mb(agent)) for g in after)

    if fits(set()):
        return []   # pending evictions will make room: wait for them
    order: dict[str, VramLease] = {}
    for lease in sorted((x for g in after for x in g.leases if x.preemptible and x.priority < priority),
                        key=lambda x: (x.priority, x.id not in idle, -x.created_at, -x.token)):
        order.setdefault(lease.id, lease)    # a lease over several GPUs: one victim, its newest record
    victims: list[VramLease] = []
    for lease in order.values():
        if fits({v.id for v in victims}):
            break
        victims.append(lease)
    if not fits({v.id for v in victims}):
        return []
    for lease in list(victims):
        rest = [v for v in victims if v is not lease]
        if fits({v.id for v in rest}):
            victims = rest
    return victims
