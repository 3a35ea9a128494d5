"""Builders for the tests of coordinator.policy.placement (``host``, ``gang``, ``holder``), and ``Case``/``cases``:
random host snapshots and requests for its Hypothesis properties, with a brute-force oracle written from the
module's documented rule: topology, exclusive and per-GPU capacity respected, the chosen set optimal, victims
minimal, in G3's order and optimal over the sets."""
from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from typing import Callable, Sequence

from hypothesis import strategies as st

from coordinator.node.fake import parse_fake_gpus
from coordinator.policy.admission import GpuView
from coordinator.policy.gang import holders_from_views, slots_from_views
from coordinator.policy.placement import GangRequest, GpuSlot
from coordinator.policy.victims import Holder
from coordinator.records import GpuInfo, GpuLedger, HostInventory, VramLease

GIB = 1024


# -- builders ---------------------------------------------------------------------------------------

def host(spec: str, free: dict[int, int] | None = None) -> list[GpuSlot]:
    """Slots of a ``--fake-gpus`` spec; ``free``: GPU index -> free GiB (those GPUs hold a lease)."""
    free = free or {}
    return [GpuSlot(g.index, g.uuid, g.vram_total_mb, free.get(g.index, g.vram_total_mb // GIB) * GIB,
                    leased=g.index in free, numa_node=g.numa_node, nvlink_peers=g.nvlink_peers)
            for g in parse_fake_gpus(spec, "h")]


def caps(slots: Sequence[GpuSlot], cap: int | None = None) -> dict[str, int]:
    return {s.uuid: s.usable_mb if cap is None else cap for s in slots}


def gang(slots: Sequence[GpuSlot], count: int, vram_gib: int = 0, *, exclusive: bool = False, topology: str = "any",
         gpus: tuple[int | str, ...] | None = None, caps_mb: dict[str, int] | None = None) -> GangRequest:
    return GangRequest(count, vram_gib * GIB, caps(slots) if caps_mb is None else caps_mb, exclusive=exclusive,
                       topology=topology, gpus=gpus)


def holder(hid: str, priority: int, on: dict[int, int], *, agent: str = "b", preemptible: bool = True,
           created_at: float = 0.0, token: int = 0) -> Holder:
    return Holder(hid, agent, priority, preemptible, created_at, token, tuple((i, mb * GIB) for i, mb in on.items()))


QUADS = "8x80GiB:nvlink=0-3,4-7"


class Case:
    """A random host snapshot (GpuViews with leases, some of them gangs over several GPUs), its topology, and
    a request; with the brute-force oracle of the module's rule."""

    def __init__(self, views: list[GpuView], inventory: HostInventory, agent: str, request: GangRequest,
                 priority: int, unavailable: frozenset[int], evicting: frozenset[str],
                 idle: frozenset[str] = frozenset()) -> None:
        self.views, self.inventory, self.agent, self.request = views, inventory, agent, request
        self.priority, self.unavailable, self.evicting, self.idle = priority, unavailable, evicting, idle
        self.info = {g.index: g for g in inventory.gpus}
        self.n = len(views)

    def __repr__(self) -> str:
        return (f"Case(request={self.request}, priority={self.priority}, agent={self.agent!r}, "
                f"unavailable={set(self.unavailable)}, evicting={set(self.evicting)}, idle={set(self.idle)},\n  gpus=" + "\n    ".join(
                    f"{v.index}: usable={v.usable_mb} free={v.free_mb} numa={self.info[v.index].numa_node} "
                    f"peers={self.info[v.index].nvlink_peers} leases="
                    + str([(x.id, x.agent, x.vram_mb, x.priority, x.preemptible, x.created_at, x.token)
                           for x in v.leases]) for v in self.views))

    def slots(self) -> tuple[GpuSlot, ...]:
        return slots_from_views(self.views, self.agent, self.inventory)

    # the rule, written again from the docstring
    def linked(self, i: int, j: int) -> bool:
        return j in self.info[i].nvlink_peers and i in self.info[j].nvlink_peers

    def topology_ok(self, gpus: Sequence[int]) -> bool:
        t = self.request.topology
        if t == "numa":
            nodes = {self.info[i].numa_node for i in gpus}
            return None not in nodes and len(nodes) == 1
        if t == "nvlink":
            return all(self.linked(i, j) for i, j in itertools.combinations(gpus, 2))
        return True

    def cap(self, v: GpuView) -> int:
        return self.request.caps[v.uuid]

    def holds_now(self, v: GpuView) -> bool:
        r = self.request
        if r.exclusive:
            return not v.leases and v.free_mb == v.usable_mb and self.cap(v) >= v.usable_mb
        return r.vram_mb <= v.free_mb and v.agent_mb(self.agent) + r.vram_mb <= self.cap(v)

    def could_ever(self, v: GpuView) -> bool:
        r = self.request
        return self.cap(v) >= v.usable_mb if r.exclusive else r.vram_mb <= min(v.usable_mb, self.cap(v))

    def allowed(self) -> list[GpuView] | None:
        """The GPUs the request may use, or None when its exact list is malformed."""
        r = self.request
        mine = [v for v in self.views if v.uuid in r.caps]
        if r.gpus is None:
            return mine
        named = sorted({int(i) for i in r.gpus})  # the strategies name GPUs by index
        if len(named) != len(r.gpus) or len(named) != r.gpu_count or any(i >= self.n for i in named):
            return None
        if any(self.views[i].uuid not in r.caps for i in named):
            return None
        return [self.views[i] for i in named]

    def ever_sets(self) -> list[tuple[int, ...]]:
        allowed = self.allowed() or []
        ok = [v.index for v in allowed if self.could_ever(v)]
        return [s for s in itertools.combinations(ok, self.request.gpu_count) if self.topology_ok(s)]

    def now_sets(self) -> list[tuple[int, ...]]:
        return [s for s in self.ever_sets()
                if not set(s) & self.unavailable and all(self.holds_now(self.views[i]) for i in s)]

    def key(self, chosen: tuple[int, ...]) -> tuple[object, ...]:
        r = self.request
        after_free = {v.index: v.free_mb for v in self.views}
        for i in chosen:
            after_free[i] = 0 if r.exclusive else self.views[i].free_mb - r.vram_mb
        idle = [v.index for v in self.views if v.index not in chosen and not v.leases and v.free_mb == v.usable_mb]
        partly = sum(1 for v in self.views if v.index not in idle and after_free[v.index] > 0)
        clique = max((len(c) for size in range(len(idle) + 1) for c in itertools.combinations(idle, size)
                      if all(self.linked(a, b) for a, b in itertools.combinations(c, 2))), default=0)
        numa = max(Counter(self.info[i].numa_node for i in idle if self.info[i].numa_node is not None).values(),
                   default=0)
        return (sum(after_free[i] for i in chosen), partly, -clique, -numa, chosen)

    # victims, written again from the docstring
    def holders(self) -> dict[str, Holder]:
        return {h.id: h for h in holders_from_views(self.views, self.evicting, self.idle)}

    def after_views(self) -> list[GpuView]:
        # Leases being evicted are gone with their processes' memory: what NVML reports beside the leases stays
        # untracked, no more (``GpuView.without``).
        return [v.without(self.evicting) for v in self.views]

    def sufficient(self, chosen: tuple[int, ...], victims: Sequence[Holder]) -> bool:
        r, views = self.request, self.after_views()
        gone = {h.id for h in victims}
        for i in chosen:
            v = views[i]
            freed = sum(x.vram_mb for x in v.leases if x.id in gone)
            own = sum(x.vram_mb for x in v.leases if x.id in gone and x.agent == self.agent)
            if r.exclusive:
                if any(x.id not in gone for x in v.leases) or v.free_mb + freed < v.usable_mb:
                    return False
                if self.cap(v) < v.usable_mb:
                    return False
            elif v.free_mb + freed < r.vram_mb or v.agent_mb(self.agent) - own + r.vram_mb > self.cap(v):
                return False
        return True

    def candidates(self, chosen: tuple[int, ...]) -> list[Holder]:
        """The preemptible holders of lower priority on the set, in G3's order."""
        return sorted((h for h in self.holders().values()
                       if any(i in chosen for i, _ in h.vram) and h.preemptible and h.priority < self.priority),
                      key=lambda h: (h.priority, h.id not in self.idle, -h.created_at, -h.token))

    def g3_victims(self) -> tuple[tuple[int, ...], list[Holder]] | None:
        """G3 over all candidates, written again from the docstring: every preemptible holder of lower
        priority, in G3's order over all of them, taken until the request is sufficient on some available set,
        then each spared that can be, in that order; with the set of lowest indexes they free."""
        sets = [s for s in self.ever_sets() if not set(s) & self.unavailable]
        cands = sorted((h for h in self.holders().values() if h.preemptible and h.priority < self.priority),
                       key=lambda h: (h.priority, h.id not in self.idle, -h.created_at, -h.token))

        def somewhere(vs: list[Holder]) -> list[tuple[int, ...]]:
            return [s for s in sets if self.sufficient(s, vs)]
        n = next((n for n in range(len(cands) + 1) if somewhere(cands[:n])), None)
        if n is None:
            return None
        vs = cands[:n]
        for c in cands[:n]:
            if somewhere([v for v in vs if v is not c]):
                vs = [v for v in vs if v is not c]
        return min(somewhere(vs)), vs

    def set_victims(self, chosen: tuple[int, ...]) -> list[Holder] | None:
        """Over every subset: the sufficient one whose last victim in G3 order is earliest, then whose
        indicator vector in that order is smallest (what taking in order, then sparing in order, yields)."""
        cands = self.candidates(chosen)
        best: tuple[tuple[object, ...], list[Holder]] | None = None
        for mask in range(1 << len(cands)):
            vs = [c for n, c in enumerate(cands) if mask >> n & 1]
            if not self.sufficient(chosen, vs):
                continue
            key = (max((n for n in range(len(cands)) if mask >> n & 1), default=-1),
                   tuple(mask >> n & 1 for n in range(len(cands))))
            if best is None or key < best[0]:
                best = (key, vs)
        return None if best is None else best[1]


AGENTS = ("a", "b")


@dataclasses.dataclass(frozen=True)
class Knobs:
    """How a kind of host and request is drawn."""

    gpus: tuple[int, int] = (1, 6)
    sizes: tuple[int, ...] = (1000, 2000, 4000)
    topology_known: tuple[str, ...] = ("none", "numa", "nvlink", "both")
    leases: tuple[int, int] = (0, 6)           # random leases, each over up to ``span`` GPUs
    span: int = 3
    lease_mb: tuple[int, ...] = (250, 500, 1000, 1500, 2000)
    fill: bool = False                         # then fill each GPU up with single leases
    full: bool = False                         # every GPU full of 1, 2 or 4 equal leases
    preemptible_odds: int = 3                  # preemptible unless a draw of 0..odds is 0
    caps_allowed_odds: int = 9                 # a GPU is allowed unless a draw of 0..odds is 0
    caps: tuple[str, ...] = ("u", "u", "u", "u", "half", "big")
    counts: tuple[int, ...] = (1, 1, 2, 2, 3, 4, -1)    # -1: every GPU
    exclusive_odds: int = 2                    # exclusive when a draw of 0..odds is 0 (-1: never)
    vram: tuple[int, ...] = (250, 500, 500, 1000, 1000, 1500, 2000, 3000)
    topologies: tuple[str, ...] = ("any", "numa", "nvlink")
    exact_odds: int = 7                        # an exact GPU list when a draw of 0..odds is 0 (-1: never)
    unavailable_odds: int = 1                  # some GPUs held by earlier waiters when a draw is 0 (-1: never)
    evicting: bool = True
    priority: tuple[int, int] = (0, 5)


MODES = {
    # anything, refusals included
    "mixed": Knobs(),
    # few leases: placement has choices to rank
    "roomy": Knobs(leases=(0, 3), counts=(1, 1, 2, 2, 3, 4), exact_odds=-1, unavailable_odds=4),
    # several partly used GPUs and known topology: the rule's criteria decide between many sets
    "placing": Knobs(gpus=(3, 6), sizes=(4000, 4000, 4000, 2000), topology_known=("none", "numa", "nvlink", "both",
                     "both"), leases=(1, 5), span=2, lease_mb=(250, 500, 1000, 1500), caps_allowed_odds=1000,
                     caps=("u", "u", "u", "half"), counts=(1, 2, 2, 3), exclusive_odds=3, vram=(250, 500, 1000),
                     exact_odds=-1, unavailable_odds=4),
    # idle GPUs of one size joined by NVLink or on NUMA nodes: the blocks left decide
    "blocks": Knobs(gpus=(3, 6), sizes=(4000,), topology_known=("nvlink", "both", "both", "numa"), leases=(0, 2),
                    span=1, lease_mb=(4000, 4000, 250), caps_allowed_odds=1000, caps=("u",), counts=(1, 1, 2, 3),
                    vram=(1000, 2000, 4000), exact_odds=-1, unavailable_odds=4),
    # busy GPUs and a request of high priority: eviction has work to do
    "crowded": Knobs(fill=True, lease_mb=(250, 250, 500, 1000, 1500, 2000), preemptible_odds=7,
                     caps_allowed_odds=1000, caps=("u", "big"), counts=(1, 1, 2, 2, 3, 4), exclusive_odds=4,
                     topologies=("any", "any", "any", "any", "numa", "nvlink"), exact_odds=20, unavailable_odds=4,
                     priority=(3, 5)),
    # every GPU full of equal leases, a request for whole GPUs: the sets' victims differ in count and rank
    "full": Knobs(gpus=(2, 6), sizes=(2000,), leases=(0, 0), full=True, preemptible_odds=7, caps_allowed_odds=1000,
                  caps=("u", "big"), counts=(1, 1, 2), vram=(2000,), exact_odds=-1, unavailable_odds=-1,
                  evicting=False, priority=(5, 5)),
    # one-GPU requests and one-GPU leases, as admission.py knows them
    "single": Knobs(span=1, fill=True, lease_mb=(250, 250, 500, 1000, 1500, 2000), preemptible_odds=7,
                    counts=(1,), exclusive_odds=-1, topologies=("any",), exact_odds=-1, unavailable_odds=4,
                    priority=(3, 5)),
    "single-roomy": Knobs(leases=(0, 3), span=1, counts=(1,), exclusive_odds=-1, topologies=("any",), exact_odds=-1,
                          unavailable_odds=4),
}


def odds(draw: st.DrawFn, n: int) -> bool:
    """True once in n + 1 draws; never for n = -1."""
    return n >= 0 and draw(st.integers(0, n)) == 0


@st.composite
def cases(draw: st.DrawFn, mode: str = "mixed") -> Case:
    """A host snapshot and a request, drawn as ``MODES[mode]`` says."""
    k = MODES[mode]
    n = draw(st.integers(*k.gpus))
    sizes = st.sampled_from(k.sizes)
    usable = [draw(sizes)] * n if draw(st.integers(0, 2)) > 0 else [draw(sizes) for _ in range(n)]
    known = draw(st.sampled_from(k.topology_known))
    numa = [draw(st.sampled_from([None, 0, 0, 1, 1])) if known in ("numa", "both") else None for _ in range(n)]
    peers: dict[int, set[int]] = {i: set() for i in range(n)}
    if known in ("nvlink", "both"):
        for i, j in itertools.combinations(range(n), 2):
            if draw(st.booleans()):
                peers[i].add(j)
                peers[j].add(i)
            elif draw(st.booleans()):
                a, b = draw(st.sampled_from([(i, j), (j, i)]))
                peers[a].add(b)                   # listed by one end only: not a link
    leases: list[list[VramLease]] = [[] for _ in range(n)]
    held = [0] * n
    tokens = itertools.count(1)

    def lease_on(span: list[int], mb: int, h: str) -> None:
        agent = draw(st.sampled_from(AGENTS + ("c",)))
        prio, created = draw(st.integers(-1, 3)), float(draw(st.integers(0, 3)))
        pre = not odds(draw, k.preemptible_odds)
        for i in span:
            held[i] += mb
            leases[i].append(VramLease(id=h, host="h", gpu_uuid=f"GPU-{i}", gpu_index=i, agent=agent, session_id="1",
                                       vram_mb=mb, priority=prio, preemptible=pre, request_id=h, token=next(tokens),
                                       created_at=created))

    for h in range(draw(st.integers(*k.leases))):
        span = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=k.span, unique=True))
        mb = draw(st.sampled_from(k.lease_mb))
        if all(held[i] + mb <= usable[i] for i in span):
            lease_on(span, mb, f"L{h}")
    for i in range(n):
        if k.full:
            m = draw(st.sampled_from([1, 2, 4]))
            for h in range(m):
                lease_on([i], usable[i] // m, f"W{i}.{h}")
        elif k.fill:
            for h in range(draw(st.integers(0, 4))):
                mb = draw(st.sampled_from(k.lease_mb))
                if held[i] + mb <= usable[i]:
                    lease_on([i], mb, f"F{i}.{h}")
    views = []
    for i in range(n):
        nvml = None if draw(st.booleans()) else held[i] + draw(st.sampled_from([0, 0, 250, 500]))
        views.append(GpuView(f"GPU-{i}", i, usable[i] + 100, usable[i], GpuLedger(usable[i], 0, 1), leases[i], nvml))
    inventory = HostInventory("h", "", 1, (0,), 1, "/", 1, tuple(
        GpuInfo(i, f"GPU-{i}", "sim", usable[i] + 100, numa[i], tuple(sorted(peers[i]))) for i in range(n)))
    agent = draw(st.sampled_from(AGENTS))
    cap_of: dict[str, Callable[[int], int]] = {"u": lambda u: u, "half": lambda u: u // 2, "big": lambda u: 10_000}
    capv = {f"GPU-{i}": cap_of[draw(st.sampled_from(k.caps))](usable[i])
            for i in range(n) if not odds(draw, k.caps_allowed_odds)}
    count = draw(st.sampled_from(k.counts))
    count = n if count < 0 else min(n, count)
    exclusive = odds(draw, k.exclusive_odds)
    vram = 0 if exclusive else draw(st.sampled_from(k.vram))
    topology = draw(st.sampled_from(k.topologies))
    exact: tuple[int | str, ...] | None = None
    if odds(draw, k.exact_odds):
        exact = tuple(draw(st.lists(st.integers(0, n - 1), min_size=count, max_size=count,
                                    unique=draw(st.integers(0, 3)) > 0)))
    unavailable = frozenset(draw(st.sets(st.integers(0, n - 1), max_size=2)) if odds(draw, k.unavailable_odds)
                            else ())
    all_ids = sorted({x.id for ls in leases for x in ls})
    evicting = (frozenset(draw(st.sets(st.sampled_from(all_ids), max_size=2))) if all_ids and k.evicting
                else frozenset())
    request = GangRequest(count, vram, capv, exclusive=exclusive, topology=topology, gpus=exact)
    idle = frozenset(draw(st.sets(st.sampled_from(all_ids), max_size=3))) if all_ids else frozenset()
    return Case(views, inventory, agent, request, draw(st.integers(*k.priority)), unavailable, evicting, idle)


any_case = st.one_of(cases("mixed"), cases("roomy"), cases("placing"), cases("placing"), cases("blocks"),
                     cases("crowded"))
