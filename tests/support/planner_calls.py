"""The calls and sessions of one admission round as the planner's Hypothesis tests build them (a ``Caller``
with the gang fields, its session, the host's keys and clocks), shared by tests/unit/test_planner.py and
tests/support/gang_scenarios.py."""
from __future__ import annotations

import dataclasses

from coordinator.keys import Keys, session_id_from_etcd_lease
from coordinator.records import SessionInfo

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


def session(agent: str) -> SessionInfo:
    etcd_lease = 0x100 + AGENTS.index(agent)
    return SessionInfo(agent, session_id_from_etcd_lease(etcd_lease), HOST, etcd_lease)
