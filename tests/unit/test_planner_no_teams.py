"""G11: a round decided with no team stored (as of revision R: the mirror showed none, perhaps before it had
caught up) compares that no team was written after R, so that a grant never escapes a team an operator stored
before it: the transaction fails and the grant is decided again, counting the team."""
from __future__ import annotations

import dataclasses

from coordinator.config import CoordinatorConfig
from coordinator.keys import lease_id_for
from coordinator.policy.admission import GpuView
from coordinator.policy.host import HostView
from coordinator.policy.plan import Context
from coordinator.policy.planner import plan_round
from coordinator.records import GpuInfo, GpuLedger, HostInventory
from coordinator.txn import NothingWrittenSince
from tests.support.planner_calls import _KV, HOST, KEYS, NOW, WALL, Call, session


def _empty_host() -> HostView:
    inventory = HostInventory(HOST, "", 8, tuple(range(8)), 1 << 34, "/", 1 << 40, (GpuInfo(0, "GPU-0", "sim", 8192),))
    gpu = GpuView(uuid="GPU-0", index=0, total_mb=8192, usable_mb=8192, ledger=GpuLedger(8192, 1, 300), leases=[])
    return HostView(HOST, 500, inventory, _KV(KEYS.host(HOST), b"{}", 40, 0x99), None, None, {"GPU-0": gpu}, {},
                    None, (), ())


def _call(rid: str, vram_mb: int = 1024) -> Call:
    a = session("a")
    return Call(a, vram_mb, None, 0, True, rid, lease_id_for("a", rid, HOST), 0.0, 2000, NOW)


def test_a_grant_decided_without_teams_compares_that_none_was_stored_since() -> None:
    ctx = dataclasses.replace(Context(KEYS, CoordinatorConfig().validate(), "r1", frozenset(), NOW, WALL),
                              no_teams_since=480)
    call = _call("r")
    plan = plan_round(_empty_host(), [call], {}, {call.session.session_id}, ctx)
    assert len(plan.new_leases) == 1
    assert NothingWrittenSince(KEYS.teams(), 480) in plan.compares
    # A round that grants nothing compares nothing about teams.
    refused = _call("big", 9000)
    plan = plan_round(_empty_host(), [refused], {}, {refused.session.session_id}, ctx)
    assert not plan.new_leases and not any(isinstance(c, NothingWrittenSince) for c in plan.compares)
