"""coordinator.policy.partition, Hypothesis properties: random specs fit or are rejected cleanly, valid specs fit,
auto-split shares differ by at most one, garbage never crashes the parser."""
from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.policy.partition import (
    KINDS,
    MODES,
    Partition,
    PartitionError,
    PartitionSpec,
    compute_partition,
    parse_size,
    parse_spec,
)
from coordinator.records import GpuInfo, HostInventory
from tests.support.partition_specs import (
    HOST,
    GiB,
    MiB,
    inventory,
    json_roundtrip,
    spec,
    uuid_of,
)

# -- properties ------------------------------------------------------------------------------------

AGENT_NAMES = ["agent-a", "agent-b", "agent-c", "agent-d", "agent-e", "agent-f"]
PROPS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def inventories(draw: st.DrawFn) -> HostInventory:
    n = draw(st.integers(1, 64))
    if draw(st.booleans()):
        core_ids = tuple(range(n))
    else:
        core_ids = tuple(sorted(draw(st.sets(st.integers(0, 255), min_size=n, max_size=n))))
    ngpu = draw(st.integers(0, 8))
    sizes = draw(st.lists(st.sampled_from([1, 512, 16384, 24576, 40960, 81920, 143771]) | st.integers(1, 200_000),
                          min_size=ngpu, max_size=ngpu))
    return HostInventory(
        host=HOST, address="127.0.0.1:7071", cpu_count=n, core_ids=core_ids,
        mem_bytes=draw(st.integers(0, 2 << 40)), disk_path="/", disk_bytes=draw(st.integers(0, 64 << 40)),
        gpus=tuple(GpuInfo(index=i, uuid=uuid_of(i), name="sim", vram_total_mb=t) for i, t in enumerate(sizes)),
    )


def _size(draw: st.DrawFn, hi: int) -> Any:
    """A size up to about ``hi`` bytes, as an int or a string."""
    n = draw(st.integers(0, max(0, hi)))
    form = draw(st.sampled_from(["int", "str", "mib"]))
    if form == "int":
        return n
    if form == "str":
        return str(n)
    return f"{n // MiB}MiB"


@st.composite
def raw_specs(draw: st.DrawFn, inv: HostInventory) -> Any:
    """Random specs: some valid, many not (wrong host, oversized, overlapping, malformed)."""
    garbage: st.SearchStrategy[Any] = st.sampled_from([-1, "-3GiB", "lots", None, [], 1.5, True])
    maybe_bad = draw(st.sampled_from([False] * 9 + [True]))
    ncores = len(inv.core_ids)
    mode = draw(st.sampled_from(MODES) | st.just("bogus")) if maybe_bad else draw(st.sampled_from(MODES))
    agents = draw(st.lists(st.sampled_from(AGENT_NAMES), min_size=0 if maybe_bad else 1, max_size=6,
                           unique=not maybe_bad))
    host = draw(st.sampled_from([HOST] * 19 + ["other-host"]))
    data: dict[str, Any] = {"host": host, "mode": mode, "agents": agents}
    reserved: dict[str, Any] = {}
    if draw(st.booleans()):
        reserved["cpu"] = draw(st.integers(0, ncores + 1))
    if draw(st.booleans()):
        reserved["mem"] = _size(draw, inv.mem_bytes + GiB)
    if draw(st.booleans()):
        reserved["disk"] = _size(draw, inv.disk_bytes + GiB)
    if draw(st.booleans()):
        top = min([g.vram_total_mb for g in inv.gpus], default=1024)
        reserved["vram_headroom"] = f"{draw(st.integers(0, top + 10))}MiB"
    if maybe_bad and draw(st.booleans()):
        reserved[draw(st.sampled_from(["cpu", "mem", "disk", "vram_headroom", "gpu"]))] = draw(garbage)
    data["reserved"] = reserved
    if mode == "manual" or (maybe_bad and agents):
        kinds = draw(st.sets(st.sampled_from(KINDS)))
        n = max(1, len(agents))
        allocs: dict[str, Any] = {}
        for agent in agents:
            k = kinds if not maybe_bad else draw(st.sets(st.sampled_from(KINDS)))
            a: dict[str, Any] = {}
            if "cpu" in k:
                if draw(st.booleans()):
                    a["cpu"] = draw(st.integers(1, max(1, 2 * ncores // n)))
                else:
                    pool = list(inv.core_ids) + [max(inv.core_ids) + 1]
                    a["cores"] = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=max(1, 2 * ncores // n),
                                               unique=True))
            if "mem" in k:
                a["mem"] = _size(draw, 2 * inv.mem_bytes // n)
            if "disk" in k:
                a["disk"] = _size(draw, 2 * inv.disk_bytes // n)
            refs = st.integers(0, len(inv.gpus)) | st.sampled_from([g.uuid for g in inv.gpus] + ["GPU-unknown"])
            if "gpus" in k:
                a["gpus"] = draw(st.lists(refs, max_size=3, unique=True))
            if "vram" in k:
                caps = draw(st.dictionaries(refs.map(str), st.integers(1, 200_000).map(lambda m: f"{m}MiB"),
                                            max_size=3))
                a["vram"] = caps
            if maybe_bad and draw(st.booleans()):
                a[draw(st.sampled_from(["cpu", "cores", "mem", "gpus", "vram", "bogus"]))] = draw(garbage)
            allocs[agent] = a
        if maybe_bad and draw(st.booleans()):
            allocs["agent-zz"] = {}
        data["allocations"] = allocs
    return data


@st.composite
def valid_specs(draw: st.DrawFn, inv: HostInventory) -> PartitionSpec:
    """Specs built to fit ``inv``: compute_partition must accept every one."""
    cores = sorted(set(inv.core_ids))
    mode = draw(st.sampled_from(MODES))
    rcpu = draw(st.integers(0, len(cores) - 1))
    avail = cores[rcpu:]
    if mode == "auto-split":
        nagents = draw(st.integers(1, min(len(avail), len(AGENT_NAMES))))
    elif mode == "manual":
        nagents = draw(st.integers(1, len(AGENT_NAMES)))
    else:
        nagents = draw(st.integers(0, len(AGENT_NAMES)))
    agents = draw(st.permutations(AGENT_NAMES))[:nagents]
    rmem = draw(st.integers(0, inv.mem_bytes))
    rdisk = draw(st.integers(0, inv.disk_bytes))
    headroom = draw(st.integers(0, min([g.vram_total_mb for g in inv.gpus], default=4096)))
    data: dict[str, Any] = {"host": inv.host, "mode": mode, "agents": agents,
                            "reserved": {"cpu": rcpu, "mem": rmem, "disk": rdisk, "vram_headroom": f"{headroom}MiB"}}
    if mode == "manual":
        kinds = draw(st.sets(st.sampled_from(KINDS)))
        if len(avail) < nagents:
            kinds.discard("cpu")
        allocs: dict[str, dict[str, Any]] = {a: {} for a in agents}
        if "cpu" in kinds:
            # split a random number of the available cores into nonempty chunks, one per agent
            take = draw(st.integers(nagents, len(avail)))
            shuffled = draw(st.permutations(avail))[:take]
            cuts = sorted(draw(st.sets(st.integers(1, take - 1), min_size=nagents - 1, max_size=nagents - 1))) \
                if nagents > 1 else []
            chunks = [shuffled[i:j] for i, j in zip([0, *cuts], [*cuts, take])]
            for a, chunk in zip(agents, chunks):
                if draw(st.booleans()):
                    allocs[a]["cores"] = chunk
                else:
                    allocs[a]["cpu"] = len(chunk)
        for kind, total in (("mem", inv.mem_bytes - rmem), ("disk", inv.disk_bytes - rdisk)):
            if kind in kinds:
                left = total
                for a in agents:
                    share = draw(st.integers(0, left))
                    allocs[a][kind] = share
                    left -= share
        owned: set[int] = set()
        if "gpus" in kinds:
            for a in agents:
                allocs[a]["gpus"] = []
            for g in inv.gpus:
                who = draw(st.sampled_from([None, *agents]))
                if who is not None:
                    allocs[who]["gpus"].append(g.index if draw(st.booleans()) else g.uuid)
                    owned.add(g.index)
        if "vram" in kinds:
            for a in agents:
                caps: dict[str, str] = {}
                for g in inv.gpus:
                    usable = g.vram_total_mb - headroom
                    if g.index not in owned and usable >= 1 and draw(st.booleans()):
                        key = str(g.index) if draw(st.booleans()) else g.uuid
                        caps[key] = f"{draw(st.integers(1, usable))}MiB"
                allocs[a]["vram"] = caps
        data["allocations"] = allocs
    return parse_spec(data)


def check_fits(inv: HostInventory, p: Partition) -> None:
    """Every invariant of an accepted partition."""
    assert p.spec is not None
    s = p.spec
    r = s.reserved
    cores = sorted(set(inv.core_ids))
    reserved_cores, avail = set(cores[: r.cpu]), cores[r.cpu:]
    avail_mem, avail_disk = inv.mem_bytes - r.mem, inv.disk_bytes - r.disk
    assert avail and avail_mem >= 0 and avail_disk >= 0
    usable = {g.uuid: max(0, g.vram_total_mb - r.vram_headroom_mb) for g in inv.gpus}
    assert (p.host, p.mode, p.agents, p.headroom_mb) == (inv.host, s.mode, s.agents, r.vram_headroom_mb)
    assert [a.agent for a in p.allocations] == list(s.agents)

    for a in p.allocations:
        assert len(set(a.cores)) == len(a.cores)
        assert set(a.cores) <= set(avail) and not set(a.cores) & reserved_cores
        assert 0 <= a.mem_bytes <= avail_mem and 0 <= a.disk_bytes <= avail_disk
        caps = dict(a.vram_caps_mb)
        assert len(caps) == len(a.vram_caps_mb)
        for uuid, cap in caps.items():
            assert 0 <= cap <= usable[uuid]
        for uuid in a.whole_gpus:
            assert caps[uuid] == usable[uuid]
        assert p.allows(a.agent)
        assert p.gpu_caps(a.agent, inv) == (usable if s.mode == "shared" else caps)

    # no GPU given whole twice, and a whole GPU is nobody else's
    whole = [u for a in p.allocations for u in a.whole_gpus]
    assert len(whole) == len(set(whole))
    for a in p.allocations:
        for b in p.allocations:
            if a.agent != b.agent:
                assert not set(a.whole_gpus) & set(dict(b.vram_caps_mb))

    named = p.allocations and s.allocations and s.allocations[0][1].kinds() or frozenset()
    split_cpu = s.mode == "auto-split" or "cpu" in named
    split_mem = s.mode == "auto-split" or "mem" in named
    split_disk = s.mode == "auto-split" or "disk" in named
    all_cores = [c for a in p.allocations for c in a.cores]
    if split_cpu:
        assert len(all_cores) == len(set(all_cores)) <= len(cores) - r.cpu
        assert all(a.cores for a in p.allocations)
    else:
        assert all(list(a.cores) == avail for a in p.allocations)
    if split_mem:
        assert sum(a.mem_bytes for a in p.allocations) <= avail_mem
    else:
        assert all(a.mem_bytes == avail_mem for a in p.allocations)
    if split_disk:
        assert sum(a.disk_bytes for a in p.allocations) <= avail_disk
    else:
        assert all(a.disk_bytes == avail_disk for a in p.allocations)
    if s.mode == "shared":
        assert p.allows("stranger") and p.gpu_caps("stranger", inv) == usable
        assert all(a.whole_gpus == () and dict(a.vram_caps_mb) == usable for a in p.allocations)
    else:
        assert not p.allows("stranger") and p.gpu_caps("stranger", inv) == {}

    assert Partition.from_json(json_roundtrip(p.to_json())) == p
    assert parse_spec(json_roundtrip(s.to_json())) == s


@PROPS
@given(data=st.data())
def test_property_random_specs_fit_or_are_rejected_cleanly(data: st.DataObject) -> None:
    inv = data.draw(inventories())
    raw = data.draw(raw_specs(inv))
    try:
        p = compute_partition(inv, parse_spec(raw))
    except PartitionError as e:
        assert isinstance(e.field, str) and e.field
        assert isinstance(e.message, str) and e.message
        assert str(e) == f"{e.field}: {e.message}"
        return
    check_fits(inv, p)


@PROPS
@given(data=st.data())
def test_property_valid_specs_are_accepted_and_fit(data: st.DataObject) -> None:
    inv = data.draw(inventories())
    s = data.draw(valid_specs(inv))
    p = compute_partition(inv, s)
    assert p.spec == s
    check_fits(inv, p)
    if s.mode == "manual":
        for (_agent, want), got in zip(s.allocations, p.allocations):
            if want.cpu_count() is not None:
                assert len(got.cores) == want.cpu_count()
            if want.cores is not None:
                assert set(got.cores) == set(want.cores)
            if want.mem is not None:
                assert got.mem_bytes == want.mem
            if want.disk is not None:
                assert got.disk_bytes == want.disk
            if want.gpus is not None:
                assert len(got.whole_gpus) == len(want.gpus)


@PROPS
@given(inv=inventories(), nagents=st.integers(1, 6), rcpu=st.integers(0, 8), headroom=st.integers(0, 600))
def test_property_auto_split_shares_differ_by_at_most_one(inv: HostInventory, nagents: int, rcpu: int,
                                                          headroom: int) -> None:
    s = spec(agents=tuple(AGENT_NAMES[:nagents]), reserved={"cpu": rcpu, "vram_headroom": f"{headroom}MiB"})
    try:
        p = compute_partition(inv, s)
    except PartitionError as e:
        assert e.field in ("agents", "reserved.cpu", "reserved.vram_headroom")
        return
    check_fits(inv, p)
    for measure in (lambda a: len(a.cores), lambda a: a.mem_bytes, lambda a: a.disk_bytes,
                    lambda a: len(a.whole_gpus)):
        values = [measure(a) for a in p.allocations]
        assert max(values) - min(values) <= 1
        assert values == sorted(values, reverse=True)  # remainders go to the first agents
    assert sum(len(a.cores) for a in p.allocations) == len(inv.core_ids) - rcpu
    assert sum(a.mem_bytes for a in p.allocations) == inv.mem_bytes
    if len(inv.gpus) >= nagents:
        assert sorted(u for a in p.allocations for u in a.whole_gpus) == sorted(g.uuid for g in inv.gpus)
    else:
        for a in p.allocations:
            assert a.whole_gpus == ()
            assert dict(a.vram_caps_mb) == {g.uuid: p.usable_mb(g) // nagents for g in inv.gpus}


@PROPS
@given(value=st.one_of(st.integers(), st.text(max_size=20), st.floats(), st.none(), st.booleans(),
                       st.lists(st.integers(), max_size=2)))
def test_property_parse_size_never_crashes(value: Any) -> None:
    try:
        n = parse_size(value, "f")
    except PartitionError as e:
        assert e.field == "f" and e.message
    else:
        assert isinstance(n, int) and 0 <= n < 2**63


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 300) | st.text(max_size=8) | st.sampled_from(
        ["host", "mode", "agents", "reserved", "allocations", "cpu", "cores", "mem", "gpus", "vram", "manual",
         "16GiB", "agent-a", HOST]),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(
        st.sampled_from(["host", "mode", "agents", "reserved", "allocations", "agent-a", "cpu", "cores", "mem",
                         "disk", "gpus", "vram", "vram_headroom", "0", "x"]), children, max_size=5),
    max_leaves=20,
)


@PROPS
@given(raw=json_values)
def test_property_garbage_never_crashes(raw: Any) -> None:
    inv = inventory(gpus=[81920, 40960])
    try:
        p = compute_partition(inv, parse_spec(raw))
    except PartitionError as e:
        assert e.field and e.message
    else:
        check_fits(inv, p)
    try:
        Partition.from_json(raw)
    except PartitionError as e:
        assert e.field and e.message
