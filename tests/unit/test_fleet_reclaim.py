"""Reclaim over host sets for a multi-host gang (``policy/fleet_reclaim.py``, G11, issue 30 point 4): the set of
hosts whose parts free with the fewest other teams' over-quota leases, the whole gang charged to its team, no
in-quota lease ever taken; and a Hypothesis property over random fleets."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.policy.fleet import FleetHost, FleetRequest
from coordinator.policy.fleet_reclaim import plan_gang_reclaim
from coordinator.policy.placement import GpuSlot
from coordinator.policy.teams import Charge, Membership, Team, in_quota

GPU_MB = 10
TEAMS = Membership([Team("a", quota_mb=3 * GPU_MB, members=("a-*",)), Team("b", quota_mb=3 * GPU_MB, members=("b-*",))])
REQ = FleetRequest(hosts=2, gpu_count=1, vram_mb=0, exclusive=True)


def _fleet(held: dict[tuple[str, int], tuple[str, int]], gpus: int = 1,
           names: tuple[str, ...] = ("h1", "h2", "h3", "h4")) -> tuple[list[FleetHost], list[Charge]]:
    """``held``: (host, index) -> (team, age) of an exclusive lease there (the same age on two hosts: one lease)."""
    hosts = []
    for n in names:
        slots = tuple(GpuSlot(i, f"{n}-{i}", GPU_MB, 0 if (n, i) in held else GPU_MB, (n, i) in held)
                      for i in range(gpus))
        hosts.append(FleetHost(n, {}, slots, {s.uuid: GPU_MB for s in slots}))
    by_lease: dict[tuple[str, int], list[str]] = {}
    for (n, i), owner in held.items():
        by_lease.setdefault(owner, []).append(f"{n}-{i}")
    charges = [Charge(id=f"{team}{age}", team=team, vram_mb=GPU_MB, gpus=tuple(g), created_at=float(age))
               for (team, age), g in by_lease.items()]
    return hosts, charges


def test_the_set_with_the_fewest_over_quota_victims_is_reclaimed() -> None:
    # Team a holds every GPU: ages 0-2 are in its quota (h1), ages 3.. over it.
    held = {("h1", 0): ("a", 0), ("h1", 1): ("a", 1), ("h2", 0): ("a", 2), ("h2", 1): ("a", 3),
            ("h3", 0): ("a", 4), ("h3", 1): ("a", 5), ("h4", 0): ("a", 6), ("h4", 1): ("a", 7)}
    hosts, charges = _fleet(held, gpus=2)
    got = plan_gang_reclaim(REQ, hosts, "b", charges, TEAMS, {}, now=100.0)
    assert got is not None
    assert len(got.victims) == 2 and not {"a0", "a1", "a2"} & set(got.victims)
    # Every set of two hosts takes two victims: reclaim's order decides (the newest first): h3's and h4's GPU 1.
    assert got.victims == ("a7", "a5") and got.reserve == (("h3", (1,)), ("h4", (1,)))


def test_a_victim_holding_parts_on_two_hosts_is_counted_once() -> None:
    held = {("h1", 0): ("a", 0), ("h2", 0): ("a", 1), ("h3", 0): ("a", 2),        # in quota (3 GPUs)
            ("h4", 0): ("a", 5)}
    hosts, charges = _fleet(held, names=("h1", "h2", "h3", "h4", "h5", "h6"))
    # one lease of team a over two hosts, over quota: h5 and h6
    hosts = [h if h.host not in ("h5", "h6") else FleetHost(h.host, {}, (GpuSlot(0, f"{h.host}-0", GPU_MB, 0, True),),
                                                                  h.caps) for h in hosts]
    charges.append(Charge(id="a9", team="a", vram_mb=GPU_MB, gpus=("h5-0", "h6-0"), created_at=9.0))
    got = plan_gang_reclaim(REQ, hosts, "b", charges, TEAMS, {}, now=100.0)
    assert got is not None and got.victims == ("a9",) and [h for h, _ in got.reserve] == ["h5", "h6"]


def test_a_team_the_gang_would_take_over_its_quota_reclaims_nothing() -> None:
    held = {("h1", 0): ("a", 0), ("h2", 0): ("a", 1), ("h3", 0): ("a", 2), ("h4", 0): ("a", 3)}
    hosts, charges = _fleet(held)
    big = FleetRequest(hosts=4, gpu_count=1, vram_mb=0, exclusive=True)    # 4 GPUs > b's quota of 3
    assert plan_gang_reclaim(big, hosts, "b", charges, TEAMS, {}, now=100.0) is None


def test_in_quota_leases_are_never_reclaimed() -> None:
    held = {("h1", 0): ("a", 0), ("h2", 0): ("a", 1), ("h3", 0): ("a", 2)}   # all in a's quota
    hosts, charges = _fleet(held, names=("h1", "h2", "h3"))
    assert plan_gang_reclaim(REQ, hosts, "b", charges, TEAMS, {}, now=100.0) is None


@settings(max_examples=500, deadline=None)
@given(owners=st.lists(st.one_of(st.none(), st.sampled_from(["a", "b"])), min_size=8, max_size=8),
       hosts_wanted=st.integers(2, 3))
def test_reclaim_takes_only_other_teams_over_quota_leases_and_frees_every_part(owners: list[str | None],
                                                                               hosts_wanted: int) -> None:
    held = {(f"h{n // 2 + 1}", n % 2): (team, n) for n, team in enumerate(owners) if team is not None}
    hosts, charges = _fleet(held, gpus=2)
    req = FleetRequest(hosts=hosts_wanted, gpu_count=1, vram_mb=0, exclusive=True)
    got = plan_gang_reclaim(req, hosts, "b", charges, TEAMS, {}, now=100.0)
    if got is None:
        return
    marks = in_quota(charges, TEAMS)
    by_id = {c.id: c for c in charges}
    assert len(got.reserve) == hosts_wanted and len({h for h, _ in got.reserve}) == hosts_wanted
    for v in got.victims:
        assert by_id[v].team != "b" and not marks[v], f"{v} is b's own or in its team's quota"
    gone = {g for v in got.victims for g in by_id[v].gpus}
    used_by_b = sum(c.charge_mb for c in charges if c.team == "b")
    assert not got.victims or used_by_b + hosts_wanted * GPU_MB <= 3 * GPU_MB, "reclaimed for a gang that takes b over its quota"
    for host, idx in got.reserve:
        h = next(x for x in hosts if x.host == host)
        for s in h.slots:
            if s.index in idx:
                assert not s.leased or s.uuid in gone, f"{s.uuid} stays held after the reclaim"
    assert len(got.victims) == len(set(got.victims))
