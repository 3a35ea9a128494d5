"""Review of multi-host gangs as pure policy (``coordinator/policy/fleet.py``, G3 over host sets): defects found in
review, each kept as a test that fails without its fix."""
from __future__ import annotations

import pytest

from coordinator.policy.fleet import FleetHost, FleetRequest, plan_gang_eviction
from coordinator.policy.placement import GpuSlot
from coordinator.policy.victims import Holder

GIB = 1024


def _one_gpu_host(name: str) -> FleetHost:
    """A host with one 16 GiB GPU, held whole."""
    slot = GpuSlot(index=0, uuid=f"{name}-g0", usable_mb=16 * GIB, free_mb=0, leased=True)
    return FleetHost(name, {}, (slot,), {slot.uuid: 16 * GIB})


def _holder(lease_id: str, priority: int = 1, created_at: float = 1.0, token: int = 1, idle: bool = False) -> Holder:
    return Holder(id=lease_id, agent="other", priority=priority, preemptible=True, created_at=created_at,
                  token=token, vram=((0, 16 * GIB),), idle=idle)


REQ = FleetRequest(hosts=2, gpu_count=1, vram_mb=0, exclusive=True)


def test_victims_over_host_sets_are_taken_newest_first() -> None:
    hosts = [_one_gpu_host(n) for n in ("a", "b", "c")]
    holders = {"a": [_holder("old", created_at=1.0, token=1)],
               "b": [_holder("mid", created_at=5.0, token=5)],
               "c": [_holder("new", created_at=9.0, token=9)]}
    got = plan_gang_eviction(REQ, hosts, holders, priority=9, agent="me")
    assert got is not None
    # Same priority, one victim per host: G3 takes the newest first, so the oldest lease ("old", on a) is spared.
    assert sorted(v.id for _, v in got.victims) == ["mid", "new"]


def test_victims_over_host_sets_take_idle_leases_first() -> None:
    hosts = [_one_gpu_host(n) for n in ("a", "b", "c")]
    holders = {"a": [_holder("busy")], "b": [_holder("idle1", idle=True)], "c": [_holder("idle2", idle=True)]}
    got = plan_gang_eviction(REQ, hosts, holders, priority=9, agent="me")
    assert got is not None
    assert sorted(v.id for _, v in got.victims) == ["idle1", "idle2"]


def test_one_multi_host_victim_is_counted_once() -> None:
    hosts = [_one_gpu_host(n) for n in ("c", "d", "x", "y")]
    holders = {"c": [_holder("c1")], "d": [_holder("d1")],
               "x": [_holder("gang")], "y": [_holder("gang")]}   # one 2-host lease, its parts on x and y
    got = plan_gang_eviction(REQ, hosts, holders, priority=9, agent="me")
    assert got is not None
    assert [v.id for _, v in got.victims] == ["gang"]
    assert [h for h, _ in got.reserve] == ["x", "y"]


def test_a_stored_inventory_with_one_gpu_index_twice_is_refused_so_its_host_fails_closed() -> None:
    """A plan names GPUs by index and ``replica/fleet.py`` maps them back to uuids over the host's slots: a stored
    inventory with two GPUs of one index would turn one placed GPU into two records, the second never placed (G1,
    G10). Fixed where it starts: such a ``hosts/<host>`` value does not parse, so the host is INVALID (no
    admission there, a gang's included) until it is rewritten."""
    from coordinator.host_records import GpuInfo, HostInventory
    from coordinator.record_fields import InvalidRecord
    good = HostInventory("h", "", 1, (0,), 1 << 30, "/", 1 << 30, (GpuInfo(0, "GPU-a", "sim", 16384),)).to_json()
    gpu = good["gpus"][0]   # type: ignore[index]
    doc = {**good, "gpus": [gpu, {**gpu, "uuid": "GPU-b"}]}
    with pytest.raises(InvalidRecord, match="gpus"):
        HostInventory.from_json(doc)
    with pytest.raises(InvalidRecord, match="gpus"):
        HostInventory.from_json({**doc, "gpus": [gpu, {**gpu, "index": 1}]})
    assert len(HostInventory.from_json({**doc, "gpus": [gpu, {**gpu, "index": 1, "uuid": "GPU-b"}]}).gpus) == 2
