"""Why a request waits, and until when (``policy/waiting.py``): examples and Hypothesis properties, no I/O."""
from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.policy.admission import GpuView
from coordinator.policy.waiting import WaitScene, explain, replay
from coordinator.records import GpuLedger, QueueEntry, VramLease

NOW = 1000.0


def gpu(index: int, usable: int = 8000, leases: tuple[VramLease, ...] = (), used: int | None = None) -> GpuView:
    return GpuView(f"GPU-{index}", index, usable, usable, GpuLedger(usable, 1, 1), list(leases), used)


def lease(lid: str, index: int, vram: int, agent: str = "holder", priority: int = 0) -> VramLease:
    return VramLease(lid, "h1", f"GPU-{index}", index, agent, "s", vram, priority, True, lid, 1, NOW - 1)


def entry(rank: str, vram: int, agent: str = "waiter", gpu_ref: str = "", limit: float = 0.0,
          count: int = 1, exclusive: bool = False) -> QueueEntry:
    return QueueEntry(rank, agent, "s", 1, vram, gpu_ref, 0, True, rank, f"L{rank}", NOW + 60, "r", wait_s=60,
                      gpu_count=count, exclusive=exclusive, time_limit_s=limit)


def caps(*agents: str, n: int = 2, cap: int = 8000) -> dict[str, dict[str, int]]:
    return {a: {f"GPU-{i}": cap for i in range(n)} for a in agents}


def test_a_lease_with_a_time_limit_blocks_the_head_and_ends_at_its_end() -> None:
    held = lease("A", 0, 6000)
    scene = WaitScene("h1", [gpu(0, leases=(held,))], [entry("r1", 4000)], caps("waiter", n=1), {"A": NOW + 5}, NOW)
    [w] = explain(scene)
    assert w.position == 1 and w.estimated_start == NOW + 5
    [b] = [b for b in w.blockers if b.kind == "lease"]
    assert (b.lease_id, b.agent, b.gpus, b.ends_at) == ("A", "holder", (0,), NOW + 5)
    assert "lease A of holder" in w.reason and "estimated start in 5.0 s" in w.reason


def test_no_known_end_no_estimate_and_enough_of_them_is_the_earliest_sufficient_end() -> None:
    a, b, c = lease("A", 0, 3000), lease("B", 0, 3000), lease("C", 0, 2000)
    scene = WaitScene("h1", [gpu(0, leases=(a, b, c))], [entry("r1", 5000)], caps("waiter", n=1),
                      {"A": NOW + 9, "B": NOW + 4}, NOW)
    assert explain(scene)[0].estimated_start == NOW + 9   # B alone frees 3000: A is needed too; C never ends
    scene = dataclasses.replace(scene, ends={"C": NOW + 2})
    assert explain(scene)[0].estimated_start is None


def test_an_entry_ahead_takes_the_room_first_and_its_own_limit_counts() -> None:
    held = lease("A", 0, 8000)
    first, second = entry("r1", 8000, agent="first", limit=10), entry("r2", 8000)
    scene = WaitScene("h1", [gpu(0, leases=(held,))], [first, second], caps("first", "waiter", n=1),
                      {"A": NOW + 3}, NOW)
    w1, w2 = explain(scene)
    assert (w1.estimated_start, w2.estimated_start) == (NOW + 3, NOW + 13)
    assert w2.position == 2 and [b.rank for b in w2.blockers if b.kind == "ahead"] == ["r1"]


def test_cordon_team_and_never_fits_name_themselves_and_give_no_estimate() -> None:
    g = gpu(0)
    scene = WaitScene("h1", [g], [entry("r1", 1000)], caps("waiter", n=1), {}, NOW, cordon="host h1 is cordoned")
    w = explain(scene)[0]
    assert w.blockers[0].kind == "cordon" and w.estimated_start is None and "cordoned" in w.reason
    scene = WaitScene("h1", [g], [entry("r1", 1000)], caps("waiter", n=1), {}, NOW, team={"Lr1": "team: t over"})
    assert [b.kind for b in explain(scene)[0].blockers] == ["team"] and explain(scene)[0].estimated_start is None
    scene = WaitScene("h1", [g], [entry("r1", 9000)], caps("waiter", n=1), {}, NOW)
    assert [b.kind for b in explain(scene)[0].blockers] == ["never"]


def test_the_partition_cap_names_the_agents_own_leases() -> None:
    mine = lease("M", 0, 3000, agent="waiter")
    scene = WaitScene("h1", [gpu(0, leases=(mine,))], [entry("r1", 2000)], caps("waiter", n=1, cap=4000),
                      {"M": NOW + 7}, NOW)
    w = explain(scene)[0]
    assert [b.kind for b in w.blockers] == ["partition", "lease"] and w.blockers[1].lease_id == "M"
    assert w.estimated_start == NOW + 7


def test_untracked_vram_is_a_blocker_without_an_end() -> None:
    scene = WaitScene("h1", [gpu(0, used=7000)], [entry("r1", 2000)], caps("waiter", n=1), {}, NOW)
    w = explain(scene)[0]
    assert [b.kind for b in w.blockers] == ["untracked"] and w.estimated_start is None


# -- properties -------------------------------------------------------------------------------------------

@st.composite
def scenes(draw: st.DrawFn) -> WaitScene:
    n = draw(st.integers(1, 3))
    leases, ends = [], {}
    for i in range(draw(st.integers(0, 6))):
        x = lease(f"A{i}", draw(st.integers(0, n - 1)), draw(st.sampled_from([1000, 2000, 4000])),
                  agent=draw(st.sampled_from(["a", "b", "holder"])))
        leases.append(x)
        if draw(st.booleans()):
            ends[x.id] = NOW + draw(st.integers(-2, 20))
    per = [gpu(i, leases=tuple(x for x in leases if x.gpu_index == i)) for i in range(n)]
    entries = [entry(f"r{k}", draw(st.sampled_from([1000, 3000, 6000])), agent=draw(st.sampled_from(["a", "b"])),
                     gpu_ref=draw(st.sampled_from(["", "0"])), limit=draw(st.sampled_from([0, 5])),
                     count=draw(st.sampled_from([1, 1, 2])) if n > 1 else 1)
               for k in range(draw(st.integers(1, 4)))]
    return WaitScene("h1", per, entries, caps("a", "b", n=n, cap=draw(st.sampled_from([8000, 5000]))), ends, NOW)


@settings(max_examples=300, deadline=None)
@given(scenes())
def test_deterministic_positions_and_every_named_lease_exists(scene: WaitScene) -> None:
    first, again = explain(scene), explain(scene)
    assert first == again
    assert [w.position for w in first] == list(range(1, len(scene.entries) + 1))
    live = {x.id: x for g in scene.gpus for x in g.leases}
    for w in first:
        assert w.estimated_start is None or w.estimated_start >= NOW
        for b in w.blockers:
            if b.kind == "lease":
                assert b.lease_id in live and b.ends_at == scene.ends.get(b.lease_id)
                assert live[b.lease_id].gpu_index in b.gpus


@settings(max_examples=300, deadline=None)
@given(scenes())
def test_the_heads_estimate_is_the_first_known_end_at_which_it_fits(scene: WaitScene) -> None:
    """For the head of the queue alone: at its estimate it fits once the leases that ended by then are gone,
    and at no earlier known end (nor now) does it."""
    head = scene.entries[0]
    alone = dataclasses.replace(scene, entries=[head])
    start = replay(alone)[head.rank]
    times = sorted({NOW} | {max(NOW, t) for t in scene.ends.values()})

    def fits_at(t: float) -> bool:
        gone = {i for i, end in scene.ends.items() if end <= t}
        after = [g.without(gone) for g in scene.gpus]
        after = [dataclasses.replace(g, leases=[x for x in g.leases if x.id not in gone]) for g in after]
        ok = [g for g in after if g.index == 0 or not head.gpu
              if head.vram_mb <= min(g.free_mb, 8000 if head.agent not in scene.caps else
                                     scene.caps[head.agent][g.uuid] - g.agent_mb(head.agent))]
        return len(ok) >= head.gpu_count

    fitting = [t for t in times if fits_at(t)]
    assert start == (fitting[0] if fitting else None)
