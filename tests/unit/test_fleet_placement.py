"""Multi-host gangs as pure policy (``coordinator/policy/fleet.py``, G12): examples and properties."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.policy.fleet import (
    FleetGrant,
    FleetHost,
    FleetRequest,
    FleetWait,
    plan_gang,
    plan_gang_eviction,
)
from coordinator.policy.gang import could_use
from coordinator.policy.placement import GpuSlot, Refused
from coordinator.policy.victims import Holder

GIB = 1024


def _host(name: str, gpus: int = 4, free: tuple[int, ...] | None = None, labels: dict[str, str] | None = None,
          **kw: object) -> FleetHost:
    free = free if free is not None else (16 * GIB,) * gpus
    slots = tuple(GpuSlot(index=n, uuid=f"{name}-g{n}", usable_mb=16 * GIB, free_mb=f, leased=f < 16 * GIB)
                  for n, f in enumerate(free))
    return FleetHost(name, labels or {}, slots, {s.uuid: 16 * GIB for s in slots}, **kw)  # type: ignore[arg-type]


def _racks() -> list[FleetHost]:
    return [_host("a", labels={"rack": "r1"}), _host("b", labels={"rack": "r1"}), _host("c", labels={"rack": "r2"})]


def test_same_rack_gets_the_two_hosts_that_share_it() -> None:
    got = plan_gang(FleetRequest(hosts=2, gpu_count=4, vram_mb=0, exclusive=True, same="rack"), _racks())
    assert got == FleetGrant((("a", (0, 1, 2, 3)), ("b", (0, 1, 2, 3))))


def test_same_rack_for_more_hosts_than_any_rack_has_is_refused_naming_same() -> None:
    got = plan_gang(FleetRequest(hosts=3, gpu_count=4, vram_mb=0, exclusive=True, same="rack"), _racks())
    assert isinstance(got, Refused) and got.field == "same"


def test_more_hosts_than_the_fleet_has_is_refused_naming_hosts() -> None:
    got = plan_gang(FleetRequest(hosts=4, gpu_count=1, vram_mb=GIB), _racks())
    assert isinstance(got, Refused) and got.field == "hosts"


def test_prefer_takes_hosts_of_one_value_when_one_has_enough() -> None:
    hosts = [_host("a", labels={"rack": "r1"}), _host("b", labels={"rack": "r2"}), _host("c", labels={"rack": "r2"})]
    assert plan_gang(FleetRequest(hosts=2, gpu_count=1, vram_mb=GIB, prefer="rack"), hosts) == \
        FleetGrant((("b", (0,)), ("c", (0,))))
    # Without prefer, best fit then names: a and b.
    assert plan_gang(FleetRequest(hosts=2, gpu_count=1, vram_mb=GIB), hosts) == FleetGrant((("a", (0,)), ("b", (0,))))


def test_a_busy_host_makes_it_wait_and_reserve_the_set_that_frees_soonest() -> None:
    hosts = [_host("a"), _host("b", free=(0, 0, 0, 0)), _host("c", free=(16 * GIB, 16 * GIB, 16 * GIB, 8 * GIB))]
    got = plan_gang(FleetRequest(hosts=2, gpu_count=4, vram_mb=0, exclusive=True), hosts)
    assert isinstance(got, FleetWait)
    assert got.reserve == (("a", (0, 1, 2, 3)), ("c", (0, 1, 2, 3)))   # c holds less than b


def test_a_reservation_is_kept_while_it_could_still_be_granted() -> None:
    hosts = [_host("a"), _host("b", free=(0, 16 * GIB, 16 * GIB, 16 * GIB)), _host("c", free=(0, 0, 0, 0))]
    got = plan_gang(FleetRequest(hosts=2, gpu_count=4, vram_mb=0, exclusive=True), hosts, reserved=("b", "c"))
    assert isinstance(got, FleetWait) and [h for h, _ in got.reserve] == ["b", "c"]


def test_blocked_gpus_and_cordoned_hosts_are_never_granted() -> None:
    hosts = [_host("a", blocked=frozenset({0})), _host("b", cordoned=True), _host("c")]
    got = plan_gang(FleetRequest(hosts=2, gpu_count=4, vram_mb=0, exclusive=True), hosts)
    assert isinstance(got, FleetWait) and got.reserve == (("a", (0, 1, 2, 3)), ("c", (0, 1, 2, 3)))
    got = plan_gang(FleetRequest(hosts=2, gpu_count=3, vram_mb=0, exclusive=True), hosts)
    assert got == FleetGrant((("a", (1, 2, 3)), ("c", (0, 1, 2))))


# -- properties ----------------------------------------------------------------------------------------------
_free = st.sampled_from([0, 4 * GIB, 8 * GIB, 16 * GIB])
_fleet = st.lists(st.tuples(st.lists(_free, min_size=1, max_size=4), st.sampled_from(["r1", "r2", None]),
                            st.booleans(), st.sets(st.integers(0, 3), max_size=2)), min_size=1, max_size=6)
_request = st.builds(FleetRequest, hosts=st.integers(2, 4), gpu_count=st.integers(1, 3),
                     vram_mb=st.sampled_from([GIB, 8 * GIB]), exclusive=st.booleans(),
                     same=st.sampled_from(["", "rack"]), prefer=st.sampled_from(["", "rack"]))


def _build(spec: list[tuple[list[int], str | None, bool, set[int]]]) -> list[FleetHost]:
    return [_host(f"h{n}", len(free), tuple(free), {"rack": rack} if rack else {}, cordoned=cordoned,
                  blocked=frozenset(blocked))
            for n, (free, rack, cordoned, blocked) in enumerate(spec)]


def _exact(req: FleetRequest) -> FleetRequest:
    return FleetRequest(req.hosts, req.gpu_count, 0 if req.exclusive else req.vram_mb, req.exclusive, req.topology,
                        req.same, req.prefer)


@settings(max_examples=500, deadline=None)
@given(_fleet, _request)
def test_a_grant_is_whole_fits_now_and_keeps_same_and_g2(spec: list[tuple[list[int], str | None, bool, set[int]]],
                                                         req: FleetRequest) -> None:
    req, hosts = _exact(req), _build(spec)
    by = {h.host: h for h in hosts}
    got = plan_gang(req, hosts)
    ever = [h for h in hosts if not isinstance(could_use(h.slots, req.on(h)), Refused)]
    if isinstance(got, Refused):
        # No group of hosts could ever hold it: by rack when ``same``, else the whole fleet.
        if req.same:
            racks = [h.labels.get("rack") for h in ever if h.labels.get("rack")]
            assert all(racks.count(r) < req.hosts for r in set(racks))
        else:
            assert len(ever) < req.hosts
        return
    if isinstance(got, FleetGrant):
        names = [h for h, _ in got.parts]
        assert len(names) == req.hosts == len(set(names)) and names == sorted(names)
        if req.same:
            assert len({by[x].labels.get("rack") for x in names}) == 1 and by[names[0]].labels.get("rack")
        for host, indexes in got.parts:
            h = by[host]
            assert not h.cordoned and len(indexes) == req.gpu_count and not set(indexes) & h.blocked
            for i in indexes:
                slot = h.slots[i]
                assert slot.idle if req.exclusive else slot.free_mb >= req.vram_mb
    else:
        assert isinstance(got, FleetWait)
        for host, _ in got.reserve:
            assert not by[host].cordoned
        assert not got.reserve or len(got.reserve) == req.hosts


@settings(max_examples=500, deadline=None)
@given(_fleet, st.lists(_request, min_size=2, max_size=3))
def test_no_two_gangs_deadlock_the_first_ranked_is_granted_once_other_leases_go(
        spec: list[tuple[list[int], str | None, bool, set[int]]], reqs: list[FleetRequest]) -> None:
    """Gangs ranked in list order, each blocked only by what the ones before it reserve or hold. Once every
    lease goes and no host is cordoned, the first one that can ever be granted is granted, whatever the others
    reserved: no cycle of reservations can hold it."""
    hosts = [FleetHost(h.host, h.labels, tuple(s.__class__(s.index, s.uuid, s.usable_mb, s.usable_mb)
                                                for s in h.slots), h.caps)
             for h in _build(spec)]
    blocked: dict[str, set[int]] = {h.host: set() for h in hosts}
    first = None
    for req in map(_exact, reqs):
        view = [FleetHost(h.host, h.labels, h.slots, h.caps, frozenset(blocked[h.host])) for h in hosts]
        got = plan_gang(req, view)
        if isinstance(got, Refused):
            continue
        if first is None:
            first = got
            assert isinstance(got, FleetGrant), got
        for host, indexes in (got.parts if isinstance(got, FleetGrant) else got.reserve):
            blocked[host] |= set(indexes)


# -- eviction over host sets (G3) ----------------------------------------------------------------------------
def _held(name: str, holders: list[tuple[str, int, tuple[int, ...]]]) -> tuple[FleetHost, list[Holder]]:
    """A 4-GPU host whose GPUs the holders (id, priority, GPU indexes) hold whole."""
    taken = {i for _, _, idx in holders for i in idx}
    h = _host(name, free=tuple(0 if n in taken else 16 * GIB for n in range(4)))
    return h, [Holder(id=i, agent="other", priority=p, preemptible=True, created_at=1.0, token=1,
                      vram=tuple((n, 16 * GIB) for n in idx)) for i, p, idx in holders]


def test_a_gang_evicts_on_the_hosts_whose_victims_are_lowest_under_g3() -> None:
    a, va = _held("a", [("a1", 1, (0, 1, 2, 3))])
    b, vb = _held("b", [("b1", 5, (0, 1, 2, 3))])
    c, vc = _held("c", [("c1", 1, (0, 1)), ("c2", 1, (2, 3))])
    req = FleetRequest(hosts=2, gpu_count=4, vram_mb=0, exclusive=True)
    got = plan_gang_eviction(req, [a, b, c], {"a": va, "b": vb, "c": vc}, priority=9, agent="me")
    assert got is not None and [h for h, _ in got.reserve] == ["a", "c"]
    assert sorted(v.id for _, v in got.victims) == ["a1", "c1", "c2"]
    # Nothing of priority 5 or more is evicted for a priority-5 gang: only a and c can be freed.
    assert plan_gang_eviction(req, [a, b, c], {"a": va, "b": vb, "c": vc}, priority=1, agent="me") is None


@settings(max_examples=500, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 9), st.booleans()), min_size=0, max_size=4), min_size=2, max_size=5),
       st.integers(2, 3), st.integers(1, 4), st.integers(0, 10))
def test_gang_victims_are_preemptible_lower_priority_and_on_the_hosts_reserved(
        fleet: list[list[tuple[int, bool]]], hosts_n: int, gpus: int, priority: int) -> None:
    hosts, holders = [], {}
    for n, leases in enumerate(fleet):
        name = f"h{n}"
        slots = tuple(GpuSlot(index=i, uuid=f"{name}-g{i}", usable_mb=16 * GIB, free_mb=0 if i < len(leases) else 16 * GIB,
                              leased=i < len(leases)) for i in range(4))
        hosts.append(FleetHost(name, {}, slots, {s.uuid: 16 * GIB for s in slots}))
        holders[name] = [Holder(id=f"{name}-l{i}", agent="x", priority=p, preemptible=pre, created_at=float(i), token=i,
                                vram=((i, 16 * GIB),)) for i, (p, pre) in enumerate(leases)]
    req = FleetRequest(hosts=hosts_n, gpu_count=gpus, vram_mb=0, exclusive=True)
    got = plan_gang_eviction(req, hosts, holders, priority, "me")
    if got is None:
        return
    reserved = {h for h, _ in got.reserve}
    assert len(reserved) == hosts_n
    for host, v in got.victims:
        assert host in reserved and v.preemptible and v.priority < priority
    # Once the victims are gone, the gang fits on the reserved hosts now.
    gone = {v.id for _, v in got.victims}
    freed = []
    for h in hosts:
        held = {i for x in holders[h.host] if x.id not in gone for i, _ in x.vram}
        freed.append(FleetHost(h.host, {}, tuple(GpuSlot(s.index, s.uuid, s.usable_mb, 0 if s.index in held else s.usable_mb,
                                                         s.index in held) for s in h.slots), h.caps))
    granted = plan_gang(req, freed, reserved=sorted(reserved))
    assert isinstance(granted, FleetGrant) and {h for h, _ in granted.parts} == reserved


def test_a_reservation_moves_off_a_host_that_is_cordoned() -> None:
    """Issue 31: a waiter that could be placed elsewhere moves there: a gang's reservation leaves a cordoned host."""
    hosts = [_host("a", free=(0, 0, 0, 0)), _host("b", free=(0, 0, 0, 0), cordoned=True), _host("c", free=(0,) * 4)]
    got = plan_gang(FleetRequest(hosts=2, gpu_count=4, vram_mb=0, exclusive=True), hosts, reserved=("a", "b"))
    assert isinstance(got, FleetWait) and [h for h, _ in got.reserve] == ["a", "c"]
