"""Gang placement, as pure policy: which GPUs of one host a request for N GPUs gets, and which leases to evict
to make room for it. Plain data in, a decision out; no I/O (the planner commits the decision).

Inputs
======
``GpuSlot``: one GPU as a snapshot shows it: index, uuid, usable and free VRAM (free = usable − leased −
untracked, as ``admission.GpuView.free_mb``), whether any lease is on it, the requesting agent's leased VRAM
on it (its cap counts that), its NUMA node (None: unknown) and its NVLink peers (indexes).
``GangRequest``: ``gpu_count``; ``vram_mb`` per GPU, or ``exclusive`` (whole GPUs, ``vram_mb`` 0); ``topology``
``any`` | ``numa`` | ``nvlink``; optionally the exact ``gpus`` (indexes or uuids); and ``caps``: the agent's
allowed GPUs (by uuid) with the most VRAM it may hold on each (its partition).
``unavailable``: GPUs that count for "could it ever fit" but may not be chosen now (an earlier-ranked waiter
holds them, G2).

Feasibility
===========
A GPU **can hold** the request now: shared: ``vram_mb ≤ min(free, cap − the agent's VRAM there)`` (as
``admission.room_for``); exclusive: no lease on it, nothing used (free = usable) and ``cap ≥ usable``.
It **could ever** hold it (every lease gone): shared: ``vram_mb ≤ min(usable, cap)``; exclusive:
``cap ≥ usable``. A set of GPUs **satisfies the topology**: ``any``: always; ``numa``: every GPU's NUMA node
is known and all are the same (a one-GPU set too: its node must be known); ``nvlink``: every pair is joined,
each GPU listing the other as a peer (a one-GPU set has no pair).

``place`` answers ``Refused`` (an ``errors`` instance naming the field) when no set of the allowed GPUs could
ever satisfy the request: ``gpu_count``, ``gpus``, ``vram_mb``, ``exclusive`` or, when only the topology
stands in the way (or the host's topology is unknown), ``topology``. It answers ``Wait`` when some set could
once leases go but none can now, and ``Chosen`` with the best set otherwise.

The best-fit rule
=================
Among the sets of ``gpu_count`` GPUs that can all hold the request now and satisfy the topology, the one with
the smallest key, compared left to right:

1. the free VRAM left on the chosen GPUs after placing, summed (``Σ free − vram_mb``; exclusive: 0):
   docs/agents.md's best fit, "the least free VRAM left after placing", over the whole gang;
2. the number of the host's GPUs left *partly used*, neither idle (no lease, free = usable) nor full
   (free = 0): the fewest fragmented GPUs;
3. minus the size of the largest NVLink block of idle GPUs left (a set of idle GPUs every pair of which is
   joined): keep the largest block whole;
4. minus the largest number of idle GPUs left on one known NUMA node;
5. the chosen indexes, ascending, compared as tuples: the lowest indexes.

The key is total, so the choice is deterministic. Examples (each one is a test in
``tests/unit/test_placement_*.py``), on ``8x80GiB:nvlink=0-3,4-7`` unless said otherwise:

* all idle, 2 × 40 GiB ``nvlink``: GPUs (0, 1); a pair inside a quad leaves the other quad whole.
* GPU 4 holds a lease, 2 GPUs ``exclusive``: (5, 6) rather than (0, 1): it leaves the quad 0-3 whole.
* GPUs 4 and 5 full, 1 × 10 GiB: GPU 6, not 0: GPUs 0-3 stay a whole block of four.
* on ``4x80GiB:numa=0-1,2-3`` with GPU 2 full, 1 × 10 GiB: GPU 3, not 0: node 0 keeps two idle GPUs.
* GPU 3 has 50 GiB free, 1 × 40 GiB: GPU 3 (10 GiB left beats 40 GiB on an idle GPU).
* 4 ``exclusive`` ``nvlink`` while GPU 5 holds a lease: (0, 1, 2, 3); 5 GPUs ``nvlink``: refused, ``topology``.
* on ``1x24GiB,1x80GiB`` with 20 GiB leased on the 80 GiB GPU, 1 × 20 GiB: the 24 GiB GPU (4 GiB left
  rather than 40): the 60 GiB block stays for a larger request.

With ``gpu_count == 1`` criterion 1 is exactly ``admission.best_fit``'s; on a host whose GPUs are all the same
size and whose topology is unknown (every host before topology was reported) the choice is exactly
``best_fit``'s, ties included. Elsewhere only ties of criterion 1 may go another way than the lowest index
(to keep an idle block whole, or not to fragment an idle GPU).

Victims: ``policy/victims.py`` (G3 over GPU sets).

Bounds
======
Sets are enumerated within blocks (all allowed GPUs for ``any``, each NUMA node, each maximal NVLink
clique), at most ``MAX_SETS`` (20,000) sets per decision. Every host of up to 16 GPUs is searched
exhaustively (C(16, 8) = 12,870; an 8-GPU host has at most C(8, 4) = 70 sets). On larger hosts, past the
bound, each block's sets are taken in order of preference (least free VRAM first for placement), and each
block's best set by criterion 1 is always among them; the rest of the key and the victim choice are then
the best of the sets seen. Maximal NVLink cliques are found with Bron–Kerbosch within ``MAX_CLIQUE_STEPS``
(real topologies, NVLink pairs, quads, cube meshes and NVSwitches, take a few dozen); an ``nvlink`` request
that finds no clique before the bound is refused naming ``topology`` and the bound.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Collection, Iterator, Mapping, Sequence

from coordinator import errors
from coordinator.records import TOPOLOGIES

MAX_SETS = 20_000
MAX_CLIQUE_STEPS = 100_000


@dataclasses.dataclass(frozen=True)
class GpuSlot:
    """One GPU of the host, as placement sees it in a snapshot."""

    index: int
    uuid: str
    usable_mb: int
    free_mb: int
    leased: bool = False               # any lease on it
    agent_mb: int = 0                  # the requesting agent's leased VRAM on it
    numa_node: int | None = None       # None: unknown
    nvlink_peers: tuple[int, ...] = ()

    @property
    def idle(self) -> bool:
        return not self.leased and self.free_mb >= self.usable_mb


@dataclasses.dataclass(frozen=True)
class GangRequest:
    gpu_count: int
    vram_mb: int                       # per GPU; 0 with exclusive
    caps: Mapping[str, int]            # allowed GPUs (uuid) -> the agent's cap there
    exclusive: bool = False
    topology: str = "any"
    gpus: tuple[int | str, ...] | None = None   # the exact GPUs, by index or uuid


@dataclasses.dataclass(frozen=True)
class Chosen:
    gpus: tuple[int, ...]              # indexes, ascending


@dataclasses.dataclass(frozen=True)
class Wait:
    reason: str


@dataclasses.dataclass(frozen=True)
class Refused:
    error: errors.GpucoordError        # its ``field`` names what stands in the way

    @property
    def field(self) -> str:
        return self.error.field or ""

    @property
    def reason(self) -> str:
        return self.error.message


Placement = Chosen | Wait | Refused


# -- the host's shape ----------------------------------------------------------------------------------

class HostShape:
    """The slots of a host with their topology as bit masks (bit i: the i-th slot in index order)."""

    def __init__(self, slots: Sequence[GpuSlot]) -> None:
        self.slots = tuple(sorted(slots, key=lambda s: s.index))
        self.pos = {s.index: n for n, s in enumerate(self.slots)}
        peers = [{self.pos[p] for p in s.nvlink_peers if p in self.pos and p != s.index} for s in self.slots]
        # Joined: each end lists the other (a link seen from one side only is not trusted).
        self.adj = [sum(1 << j for j in peers[i] if i in peers[j]) for i in range(len(self.slots))]
        self.numa_blocks = [sum(1 << n for n, s in enumerate(self.slots) if s.numa_node == node)
                            for node in sorted({s.numa_node for s in self.slots if s.numa_node is not None})]
        self._cliques: dict[int, tuple[list[int], bool]] = {}

    def cliques(self, within: int) -> tuple[list[int], bool]:
        """The maximal NVLink cliques among the slots of mask ``within`` (Bron–Kerbosch with pivot), and
        whether the list is complete (False when ``MAX_CLIQUE_STEPS`` ran out)."""
        if within in self._cliques:
            return self._cliques[within]
        found: list[int] = []
        steps = 0

        def expand(r: int, p: int, x: int) -> bool:
            nonlocal steps
            steps += 1
            if steps > MAX_CLIQUE_STEPS:
                return False
            if not p and not x:
                found.append(r)
                return True
            pivot = max(bits(p | x), key=lambda u: (self.adj[u] & p).bit_count())
            for v in bits(p & ~self.adj[pivot]):
                if not expand(r | 1 << v, p & self.adj[v], x & self.adj[v]):
                    return False
                p &= ~(1 << v)
                x |= 1 << v
            return True

        complete = expand(0, within, 0) if within else True
        self._cliques[within] = (found, complete)
        return found, complete

    def satisfies(self, members: int, topology: str) -> bool:
        if topology == "numa":
            return any(members & block == members for block in self.numa_blocks)
        if topology == "nvlink":
            return all(members & ~(1 << i) & ~self.adj[i] == 0 for i in bits(members))
        return True

    def blocks(self, eligible: int, topology: str) -> tuple[list[int], bool]:
        """Masks within which every set satisfies the topology (and every satisfying set lies in one)."""
        if topology == "numa":
            return [b & eligible for b in self.numa_blocks if b & eligible], True
        if topology == "nvlink":
            return self.cliques(eligible)
        return ([eligible] if eligible else []), True


def bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def gpu_sets(host: HostShape, blocks: list[int], k: int, order: Mapping[int, tuple[int, ...]]) -> Iterator[int]:
    """Every k-subset of the blocks, each once, at most ``MAX_SETS``. Within a block, slots go in ``order``
    (a preference key per slot position), so each block's first set is its k most preferred slots."""
    ranked = [sorted(bits(b), key=lambda n: order[n]) for b in blocks]
    seen: set[int] = set()
    firsts = [r[:k] for r in ranked if len(r) >= k]
    combos = itertools.chain(firsts, *(itertools.combinations(r, k) for r in ranked))
    for combo in combos:
        mask = sum(1 << n for n in combo)
        if mask in seen:
            continue
        seen.add(mask)
        yield mask
        if len(seen) >= MAX_SETS:
            return


# -- placement -------------------------------------------------------------------------------------------

def place(slots: Sequence[GpuSlot], request: GangRequest, unavailable: Collection[int] = (),
          max_charge: int | None = None) -> Placement:
    """The best set of GPUs for ``request`` under the module's rule, or why none (see the module's docstring).
    ``max_charge``: only sets whose charge (``set_charge``) is at most this may be chosen (what the team's limit
    leaves: an exclusive gang takes the smaller GPUs that fit the limit rather than wait)."""
    host = HostShape(slots)
    checked = check_request(host, request, unavailable)
    if isinstance(checked, Refused):
        return checked
    candidates = checked
    k = request.gpu_count
    now = sum(1 << n for n in bits(candidates) if _holds_now(host.slots[n], request))
    blocks, _ = host.blocks(now, request.topology)
    order = {n: (host.slots[n].free_mb, host.slots[n].index) for n in range(len(host.slots))}
    best: tuple[tuple[object, ...], int] | None = None
    for mask in gpu_sets(host, blocks, k, order):
        if max_charge is not None and set_charge(host, mask, request) > max_charge:
            continue
        key = _key(host, mask, request)
        if best is None or key < best[0]:
            best = (key, mask)
    if best is not None:
        return Chosen(tuple(host.slots[n].index for n in bits(best[1])))
    return Wait(f"no {_gang(request)} fits now on the GPUs free for it; one will once leases go")


def set_charge(host: HostShape, mask: int, r: GangRequest) -> int:
    """What placing ``r`` on the slots of ``mask`` charges its team: each GPU's usable VRAM if exclusive."""
    return sum(host.slots[n].usable_mb for n in bits(mask)) if r.exclusive else r.vram_mb * mask.bit_count()


def _gang(r: GangRequest) -> str:
    what = "whole GPUs" if r.exclusive else f"GPUs with {r.vram_mb} MiB each"
    where = {"any": "", "numa": " on one NUMA node", "nvlink": " all joined by NVLink"}[r.topology]
    return f"set of {r.gpu_count} {what}{where}"


def _holds_now(s: GpuSlot, r: GangRequest) -> bool:
    cap = r.caps[s.uuid]
    if r.exclusive:
        return not s.leased and s.free_mb >= s.usable_mb and cap >= s.usable_mb
    return r.vram_mb <= min(s.free_mb, cap - s.agent_mb)


def _could_ever_hold(s: GpuSlot, r: GangRequest) -> bool:
    cap = r.caps[s.uuid]
    return cap >= s.usable_mb if r.exclusive else r.vram_mb <= min(s.usable_mb, cap)


def _key(host: HostShape, mask: int, r: GangRequest) -> tuple[object, ...]:
    """The best-fit key of placing ``r`` on the slots of ``mask`` (smaller is better)."""
    left = 0
    partly = 0
    idle = 0
    for n, s in enumerate(host.slots):
        if mask >> n & 1:
            free = 0 if r.exclusive else s.free_mb - r.vram_mb
            left += free
            partly += 0 < free   # a slot that held the request is no longer idle: partly used or full
        else:
            if s.idle:
                idle |= 1 << n
            elif s.free_mb > 0:
                partly += 1
    cliques, _ = host.cliques((1 << len(host.slots)) - 1)
    nvlink_block = max(((c & idle).bit_count() for c in cliques), default=0)
    numa_block = max(((b & idle).bit_count() for b in host.numa_blocks), default=0)
    return (left, partly, -nvlink_block, -numa_block, tuple(host.slots[n].index for n in bits(mask)))


def check_request(host: HostShape, r: GangRequest, unavailable: Collection[int]) -> Refused | int:
    """The slots (a mask) the request may take: allowed, available and able to hold it once leases go, when
    some set of the allowed slots could ever satisfy it; else why none ever can."""
    k = r.gpu_count
    count = len(host.slots)
    if r.topology not in TOPOLOGIES:
        return Refused(errors.InvalidArgument(
            f"topology: {str(r.topology)[:32]!r} is not one of {', '.join(TOPOLOGIES)}", "topology"))
    if not 1 <= k <= max(count, 1):
        return Refused(errors.InvalidArgument(
            f"gpu_count: {k} is not within 1..{count} (the host's GPUs)", "gpu_count"))
    if r.exclusive and r.vram_mb != 0:
        return Refused(errors.InvalidArgument(
            "vram_mb: must be 0 with exclusive (the lease takes each GPU's whole usable VRAM)", "vram_mb"))
    if not r.exclusive and r.vram_mb < 1:
        return Refused(errors.InvalidArgument(f"vram_mb: {r.vram_mb} is not a positive amount of MiB", "vram_mb"))
    allowed = [n for n, s in enumerate(host.slots) if s.uuid in r.caps]
    if r.gpus is not None:
        named: list[int] = []
        for ref in r.gpus:
            n = _resolve(host, ref)
            if n is None:
                return Refused(errors.NotFound(f"gpus: the host has no GPU {str(ref)[:32]!r}", "gpus"))
            if host.slots[n].uuid not in r.caps:
                return Refused(errors.NotOwner(
                    f"gpus: GPU {host.slots[n].index} is outside the agent's partition", "gpus"))
            named.append(n)
        if len(set(named)) != len(named) or len(named) != k:
            return Refused(errors.InvalidArgument(
                f"gpus: must name {k} distinct GPUs (gpu_count), got {len(named)} "
                f"({len(set(named))} distinct)", "gpus"))
        allowed = sorted(named)
    if len(allowed) < k:
        return Refused(errors.FailedPrecondition(
            f"gpu_count: {k} GPUs asked, but the agent's partition allows {len(allowed)} on this host",
            "gpu_count"))
    if r.exclusive:
        whole = [n for n in allowed if _could_ever_hold(host.slots[n], r)]
        if len(whole) < k:
            return Refused(errors.FailedPrecondition(
                f"exclusive: {k} whole GPUs asked, but the agent's partition caps all but {len(whole)} of its "
                "GPUs below their usable VRAM", "exclusive"))
    else:
        big = [n for n in allowed if r.vram_mb <= host.slots[n].usable_mb]
        if len(big) < k:
            return Refused(errors.InvalidArgument(
                f"vram_mb: {r.vram_mb} MiB is more than the usable VRAM of all but {len(big)} of the allowed GPUs "
                f"({k} needed)", "vram_mb"))
        whole = [n for n in big if _could_ever_hold(host.slots[n], r)]
        if len(whole) < k:
            return Refused(errors.FailedPrecondition(
                f"vram_mb: {r.vram_mb} MiB is more than the partition's cap on all but {len(whole)} of the "
                f"allowed GPUs ({k} needed)", "vram_mb"))
    ever = sum(1 << n for n in whole)
    blocks, complete = host.blocks(ever, r.topology)
    if not any(b.bit_count() >= k for b in blocks):
        return Refused(errors.FailedPrecondition(_no_topology(host, r, ever, complete), "topology"))
    if r.gpus is not None and not host.satisfies(ever, r.topology):
        return Refused(errors.FailedPrecondition(
            f"topology: GPUs {', '.join(str(host.slots[n].index) for n in bits(ever))} are not "
            f"{'on one NUMA node' if r.topology == 'numa' else 'all joined by NVLink'}", "topology"))
    blocked = {host.pos[i] for i in unavailable if i in host.pos}
    return sum(1 << n for n in bits(ever) if n not in blocked)


def _resolve(host: HostShape, ref: int | str) -> int | None:
    if isinstance(ref, str) and ref.isdigit():
        ref = int(ref)
    for n, s in enumerate(host.slots):
        if (isinstance(ref, int) and not isinstance(ref, bool) and s.index == ref) or s.uuid == ref:
            return n
    return None


def _no_topology(host: HostShape, r: GangRequest, ever: int, complete: bool) -> str:
    k = r.gpu_count
    if r.topology == "numa":
        if not any(host.slots[n].numa_node is not None for n in bits(ever)):
            return "topology: numa asked, but the NUMA nodes of this host's GPUs are unknown"
        return f"topology: no {k} GPUs the agent may use are on one NUMA node"
    if not complete:
        return (f"topology: no {k} GPUs joined by NVLink were found within the search bound "
                f"({MAX_CLIQUE_STEPS} steps)")
    if not any(host.adj[n] for n in bits(ever)):
        return "topology: nvlink asked, but no NVLink peers are known on this host's GPUs"
    return f"topology: no {k} GPUs the agent may use are all joined by NVLink"
