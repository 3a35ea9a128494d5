"""The calls and sessions of one admission round as the planner's Hypothesis tests build them (a ``Caller``
with the gang fields, its session, the host's keys and clocks), shared by tests/unit/test_planner.py and
tests/support/gang_scenarios.py."""
from __future__ import annotations

import dataclasses

from coordinator.keys import Keys, lease_id_for, session_id_from_etcd_lease
from coordinator.node.fake import parse_fake_gpus
from coordinator.policy.admission import GpuView
from coordinator.policy.host import HostView
from coordinator.records import (
    GpuLedger,
    HostInventory,
    QueueEntry,
    SessionInfo,
    VramLease,
)

KEYS = Keys("/t/")
HOST = "h"
AGENTS = ("a", "b", "c")
NOW = 1000.0        # monotonic
WALL = 1.7e9


@dataclasses.dataclass(frozen=True)
class _KV:
    key: bytes
    value: bytes
    mod_revision: int
    etcd_lease: int = 0


@dataclasses.dataclass(eq=False)
class Call:
    """A call as a replica serves it (``Caller``), with the gang fields."""

    session: SessionInfo
    vram_mb: int
    gpu_ref: str | None
    priority: int
    preemptible: bool
    request_id: str
    lease_id: str
    wait_s: float
    arrival_ns: int
    deadline: float
    rank: str | None = None
    gone: bool = False
    gpu_count: int = 1
    exclusive: bool = False
    topology: str = "any"
    gpus: tuple[str, ...] = ()
    min_runtime_s: float = 0.0
    time_limit_s: float = 0.0
    time_limit_warning_s: float = 0.0


def session(agent: str) -> SessionInfo:
    etcd_lease = 0x100 + AGENTS.index(agent)
    return SessionInfo(agent, session_id_from_etcd_lease(etcd_lease), HOST, etcd_lease)


def host_view(spec: str, leases: list[VramLease]) -> HostView:
    """A host of ``spec``'s simulated GPUs (``parse_fake_gpus``) holding ``leases``, as a round reads it."""
    inventory = HostInventory(HOST, "", 8, tuple(range(8)), 1 << 34, "/", 1 << 40, parse_fake_gpus(spec, HOST))
    gpus = {g.uuid: GpuView(uuid=g.uuid, index=g.index, total_mb=g.vram_total_mb, usable_mb=g.vram_total_mb,
                            ledger=GpuLedger(g.vram_total_mb, 2, 300 + g.index),
                            leases=[x for x in leases if x.gpu_uuid == g.uuid]) for g in inventory.gpus}
    return HostView(HOST, 500, inventory, _KV(KEYS.host(HOST), b"{}", 40, 0x99), None, None, gpus,
                    {x.id: x for x in leases}, None, (), ())


# One 16 GiB GPU, its leases, and waiting calls with their queue entries (the team-wait and share tests).
def one_gpu_host(leases: list[VramLease], entries: tuple[QueueEntry, ...] = ()) -> HostView:
    """One 16 GiB GPU."""
    inventory = HostInventory(HOST, "", 8, tuple(range(8)), 1 << 34, "/", 1 << 40, parse_fake_gpus("1x16GiB", HOST))
    gpus = {g.uuid: GpuView(uuid=g.uuid, index=g.index, total_mb=g.vram_total_mb, usable_mb=g.vram_total_mb,
                            ledger=GpuLedger(g.vram_total_mb, 2, 300), leases=list(leases)) for g in inventory.gpus}
    return HostView(HOST, 500, inventory, _KV(KEYS.host(HOST), b"{}", 40, 0x99), None, None, gpus,
                    {x.id: x for x in leases}, None, (), entries)


def one_gpu_lease(lease_id: str, agent: str, vram_mb: int, priority: int = 0) -> VramLease:
    s = session(agent)
    return VramLease(id=lease_id, host=HOST, gpu_uuid=f"GPU-sim-{HOST}-0", gpu_index=0, agent=agent,
                     session_id=s.session_id, vram_mb=vram_mb, priority=priority, preemptible=True,
                     request_id=lease_id, token=1, created_at=1.0, etcd_lease=s.etcd_lease)


def waiting_call(agent: str, rid: str, vram_mb: int, wait_s: float, arrival: int, priority: int = 0) -> Call:
    return Call(session(agent), vram_mb, None, priority, True, rid, lease_id_for(agent, rid, HOST), wait_s, arrival,
                NOW + wait_s)


def entry_of(call: Call) -> QueueEntry:
    """``call`` as its queue entry (written by an earlier round)."""
    s = call.session
    return QueueEntry(rank=Keys.queue_rank(call.priority, call.arrival_ns, call.lease_id), agent=s.agent,
                      session_id=s.session_id, etcd_lease=s.etcd_lease, vram_mb=call.vram_mb, gpu="",
                      priority=call.priority, preemptible=True, request_id=call.request_id, lease_id=call.lease_id,
                      deadline_unix=WALL + call.wait_s, replica="r1", mod_revision=450, wait_s=call.wait_s)
