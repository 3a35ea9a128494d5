"""Why a request waits, and until when (issue 31 point 5, docs/policies.md "Why a request waits"): pure, no I/O, no clock.

``explain(scene)`` answers, for every entry of a host's queue (``queue/<host>/<rank>``, in rank order), a
``WaitReason``: its position (1 = the head), the blockers that hold it back now, a one-line reason naming them,
and an estimated start (unix seconds; None when it is unknowable).

Blockers, in this order (``Blocker.kind``):

* ``cordon``: the host is cordoned or draining (the cordon's reason); nothing is granted until it is uncordoned,
  so no estimate is given;
* ``never``: it can never fit here (no GPU of its partition is large enough, or the GPUs it names are not
  allowed): the planner will take it out of the queue;
* ``team``: its team's limit holds it back (the planner's reason, naming the team and the limit); the team's
  use spans the fleet, so no estimate is given;
* ``ahead``: a request ranked before it that waits for some of the same GPUs (G2: it is served first);
* ``partition``: on every GPU it may use, its agent's own leases hold the partition's cap;
* ``lease``: a lease on a GPU it may use where it does not fit now: its id, agent, GPU and VRAM, and its end
  when known (its time limit, or its eviction notice's deadline: ``WaitScene.ends``);
* ``departing`` / ``untracked``: VRAM that an ended lease's processes still hold, or that processes without a
  lease use (NVML): neither has a known end.

The estimate replays the host's queue against the known ends of its leases: at each end (from ``now``), in
rank order, every entry is placed as the planner places it (best fit for one GPU, the tightest GPUs for a gang;
an entry that does not fit holds back every GPU it may use from the entries after it, G2), and an entry placed
becomes a lease that ends after its own time limit (never, without one). The estimate of an entry is the first
end at which it is placed; None when no sequence of known ends places it (a blocking lease without a time
limit, a cordon, a team limit, untracked or departing VRAM that is in the way). It assumes what the queue is
now: no new request ranked before it, no release before its end, no eviction it has not asked for yet; its
victims' notices are ends like any other. Topology is not modelled: a gang asking for ``numa`` or ``nvlink``
gets no estimate.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from coordinator.policy.admission import GpuView
from coordinator.records import QueueEntry


@dataclasses.dataclass(frozen=True)
class Blocker:
    kind: str                       # cordon | never | team | ahead | partition | lease | departing | untracked
    detail: str                     # one phrase, for people
    lease_id: str = ""              # lease: the blocking lease; ahead: the waiting request's lease id
    agent: str = ""
    gpus: tuple[int, ...] = ()      # the GPU indexes it concerns
    vram_mb: int = 0
    ends_at: float | None = None    # lease: its known end (unix seconds), None: unknown
    rank: str = ""                  # ahead: the entry's rank
    priority: int = 0


@dataclasses.dataclass(frozen=True)
class WaitReason:
    rank: str
    position: int                   # 1: the head of the host's queue
    reason: str
    blockers: tuple[Blocker, ...]
    estimated_start: float | None   # unix seconds; None: unknowable


@dataclasses.dataclass(frozen=True)
class WaitScene:
    """A host's queue and what it waits for, as one snapshot shows it. ``caps``: each waiting agent's VRAM cap
    per GPU uuid (its partition's; an agent missing or with none can never be placed); ``ends``: the known end
    of a lease (unix seconds), by id; ``team``: the team-limit reason of an entry, by its lease id; ``cordon``:
    why the host is cordoned, None when it is not."""

    host: str
    gpus: Sequence[GpuView]
    entries: Sequence[QueueEntry]
    caps: Mapping[str, Mapping[str, int]]
    ends: Mapping[str, float]
    now: float
    team: Mapping[str, str] = dataclasses.field(default_factory=dict)
    cordon: str | None = None


@dataclasses.dataclass
class _Gpu:
    """A GPU in the replay: what holds it, as (lease id, agent, vram_mb, end or None)."""

    uuid: str
    index: int
    usable_mb: int
    fixed_mb: int          # untracked + departing VRAM: no known end
    holds: list[tuple[str, str, int, float | None]]

    def room(self, agent: str, cap_mb: int) -> int:
        held = self.fixed_mb + sum(h[2] for h in self.holds)
        mine = sum(h[2] for h in self.holds if h[1] == agent)
        return min(self.usable_mb - held, cap_mb - mine)


def candidates(entry: QueueEntry, gpus: Sequence[GpuView], caps: Mapping[str, int]) -> list[GpuView]:
    """The GPUs the entry may use: those its partition allows, among those it names (by index or uuid)."""
    named = set(entry.gpus) | ({entry.gpu} if entry.gpu else set())
    return [g for g in sorted(gpus, key=lambda g: g.index)
            if g.uuid in caps and (not named or g.uuid in named or str(g.index) in named)]


def never_fits(entry: QueueEntry, gpus: Sequence[GpuView], caps: Mapping[str, int]) -> str | None:
    """Why the entry can never be placed on this host even with every GPU empty, or None."""
    cands = candidates(entry, gpus, caps)
    need = max(1, entry.gpu_count)
    able = [g for g in cands if entry.exclusive or entry.vram_mb <= min(g.usable_mb, caps[g.uuid])]
    if len(able) >= need:
        return None
    if not cands:
        return "no GPU it may use on this host (its partition, or the GPUs it names)"
    what = "whole GPUs" if entry.exclusive else f"{entry.vram_mb} MiB"
    return f"{what} on {need} GPU{'s' if need > 1 else ''}: only {len(able)} of its GPUs could ever hold that"


def _need(entry: QueueEntry, g: _Gpu) -> int:
    return g.usable_mb if entry.exclusive else entry.vram_mb


def _fits(entry: QueueEntry, g: _Gpu, caps: Mapping[str, int]) -> bool:
    if entry.exclusive and (g.holds or g.fixed_mb):
        return False
    return _need(entry, g) <= g.room(entry.agent, caps.get(g.uuid, 0))


def _place(entry: QueueEntry, gpus: list[_Gpu], caps: Mapping[str, int]) -> list[_Gpu] | None:
    """Best fit: the fitting GPUs with the least room left after placing, lowest index first on ties."""
    fitting = [g for g in gpus if _fits(entry, g, caps)]
    need = max(1, entry.gpu_count)
    if len(fitting) < need:
        return None
    fitting.sort(key=lambda g: (g.room(entry.agent, caps.get(g.uuid, 0)) - _need(entry, g), g.index))
    return fitting[:need]


def replay(scene: WaitScene) -> dict[str, float | None]:
    """The estimated start of every entry, by rank (see the module's docstring)."""
    out: dict[str, float | None] = {e.rank: None for e in scene.entries}
    if scene.cordon is not None:
        return out
    gpus = {g.uuid: _Gpu(g.uuid, g.index, g.usable_mb, g.untracked_mb + g.departing_mb,
                         [(x.id, x.agent, x.vram_mb, scene.ends.get(x.id)) for x in g.leases])
            for g in scene.gpus}
    pending = list(scene.entries)
    t = scene.now
    for _ in range(sum(max(1, e.gpu_count) for e in pending) + sum(len(g.holds) for g in gpus.values()) + 2):
        blocked: set[str] = set()
        for e in list(pending):
            caps = scene.caps.get(e.agent, {})
            if e.lease_id in scene.team or (e.gpu_count > 1 and e.topology != "any"):
                pending.remove(e)      # unknowable: it holds nothing back (a team's wait) and is never placed
                continue
            mine = [gpus[g.uuid] for g in candidates(e, scene.gpus, caps)]
            chosen = _place(e, [g for g in mine if g.uuid not in blocked], caps)
            if chosen is None:
                blocked |= {g.uuid for g in mine}
                continue
            pending.remove(e)
            out[e.rank] = t
            for g in chosen:
                end = t + e.time_limit_s if e.time_limit_s else None
                g.holds.append((e.lease_id, e.agent, _need(e, g), end))
        if not pending:
            break
        upcoming = [h[3] for g in gpus.values() for h in g.holds if h[3] is not None]
        if not upcoming:
            break
        t = max(t, min(upcoming))
        for g in gpus.values():
            g.holds = [h for h in g.holds if h[3] is None or h[3] > t]
    return out


def blockers(scene: WaitScene, n: int) -> list[Blocker]:
    """What holds the ``n``-th entry back now (see the module's docstring for the kinds and their order)."""
    e = scene.entries[n]
    caps = scene.caps.get(e.agent, {})
    out: list[Blocker] = []
    if scene.cordon is not None:
        out.append(Blocker("cordon", scene.cordon))
    never = never_fits(e, scene.gpus, caps)
    if never is not None:
        return out + [Blocker("never", f"never fits on host {scene.host}: {never}")]
    if e.lease_id in scene.team:
        out.append(Blocker("team", scene.team[e.lease_id]))
    mine = candidates(e, scene.gpus, caps)
    uuids = {g.uuid for g in mine}
    for a in scene.entries[:n]:
        theirs = {g.uuid for g in candidates(a, scene.gpus, scene.caps.get(a.agent, {}))}
        if theirs & uuids and a.lease_id not in scene.team:
            shared = tuple(g.index for g in mine if g.uuid in theirs)
            out.append(Blocker("ahead", f"request of {a.agent} (priority {a.priority}) ranked before it",
                               a.lease_id, a.agent, shared, a.vram_mb, rank=a.rank, priority=a.priority))
    full = [g for g in mine if not _fits(e, _Gpu(g.uuid, g.index, g.usable_mb, g.untracked_mb + g.departing_mb,
                                                  [(x.id, x.agent, x.vram_mb, None) for x in g.leases]), caps)]
    if full and all(g.usable_mb - g.held_mb - g.untracked_mb >= e.vram_mb > caps[g.uuid] - g.agent_mb(e.agent)
                    for g in full) and not e.exclusive:
        out.append(Blocker("partition", f"agent {e.agent} holds its partition's cap on GPU "
                           f"{','.join(str(g.index) for g in full)}", agent=e.agent,
                           gpus=tuple(g.index for g in full)))
    for g in full:
        for x in sorted(g.leases, key=lambda x: (scene.ends.get(x.id, float("inf")), x.id)):
            end = scene.ends.get(x.id)
            when = f"ends in {max(0.0, end - scene.now):.1f} s" if end is not None else "no known end"
            out.append(Blocker("lease", f"lease {x.id} of {x.agent} holds {x.vram_mb} MiB on GPU {g.index} "
                               f"({when})", x.id, x.agent, (g.index,), x.vram_mb, end, priority=x.priority))
        if g.departing_mb:
            out.append(Blocker("departing", f"{g.departing_mb} MiB on GPU {g.index} held by ended leases' "
                               "processes", gpus=(g.index,), vram_mb=g.departing_mb))
        if g.untracked_mb:
            out.append(Blocker("untracked", f"{g.untracked_mb} MiB on GPU {g.index} used outside gpucoord",
                               gpus=(g.index,), vram_mb=g.untracked_mb))
    return out


def reason_text(position: int, total: int, host: str, found: Sequence[Blocker], start: float | None,
                now: float) -> str:
    """The one-line reason: position, the blockers (the first few, with a count of the rest), the estimate."""
    head = f"position {position} of {total} on host {host}"
    shown = [b.detail for b in found[:4]] + ([f"{len(found) - 4} more"] if len(found) > 4 else [])
    why = "; ".join(shown) if shown else "nothing holds it back: it is granted in the next round"
    when = (f"estimated start in {max(0.0, start - now):.1f} s" if start is not None
            else "no estimated start (a blocker has no known end)")
    return f"{head}: {why}; {when}"


def explain(scene: WaitScene) -> list[WaitReason]:
    """A ``WaitReason`` for every entry of the scene's queue, in rank order. Deterministic: the same scene gives
    the same answer."""
    starts = replay(scene)
    out = []
    for n, e in enumerate(scene.entries):
        found = blockers(scene, n)
        start = starts[e.rank]
        if any(b.kind in ("cordon", "never", "team") for b in found):
            start = None
        out.append(WaitReason(e.rank, n + 1, reason_text(n + 1, len(scene.entries), scene.host, found, start,
                                                          scene.now), tuple(found), start))
    return out
