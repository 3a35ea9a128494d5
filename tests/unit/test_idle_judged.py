"""Idle judgments kept between passes (``replica/idle_judged.py``) are the judgments made afresh: every lease of
the mirror judged by ``policy.idle.judge`` from its records, the history and the policies, at every pass."""
from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from coordinator.config import CoordinatorConfig
from coordinator.etcd.types import KV, WatchBatch, WatchEvent
from coordinator.keys import Keys
from coordinator.policy import idle as policy_idle
from coordinator.policy.idle import LeaseIdle, UtilizationHistory, judge
from coordinator.records import VramLease
from coordinator.replica import idle
from coordinator.replica.idle_judged import IdleJudgments
from coordinator.replica.mirror import Mirror
from coordinator.replica.view import lease_of
from tests.support.observed import FakeObserved

pytestmark = pytest.mark.unit
K = Keys("/t/")
HOSTS = ("h1", "h2")
IDS = ("L0", "L1", "L2", "L3")
GPUS = tuple(f"{h}-GPU-{i}" for h in HOSTS for i in (0, 1))


class World:
    def __init__(self) -> None:
        self.rev = 1
        self.mirror = Mirror(K)
        self.mirror.reset([], 1)
        self.mirror.ready = True
        self.ctx = SimpleNamespace(config=CoordinatorConfig(idle_after_s=10.0), mirror=self.mirror,
                                   observed=FakeObserved(), keys=K, utilization=UtilizationHistory(),
                                   idle_judgments=IdleJudgments())
        self.held: dict[str, list[bytes]] = {}

    def _event(self, kind: str, key: bytes, value: bytes = b"") -> None:
        self.rev += 1
        self.mirror.apply(WatchBatch(self.rev, (WatchEvent(kind, KV(key, value, self.rev, self.rev, 1, 0), None),)))

    def grant(self, lease_id: str, shape: str, host: str, agent: str) -> None:
        self.release(lease_id)
        if shape == "multi":
            parts = tuple((h, (f"{h}-GPU-0",)) for h in HOSTS)
        else:
            parts = ((host, (f"{host}-GPU-0", f"{host}-GPU-1") if shape == "gang" else (f"{host}-GPU-1",)),)
        keys = []
        for h, uuids in parts:
            for uuid in uuids:
                rec = VramLease(id=lease_id, host=h, gpu_uuid=uuid, gpu_index=int(uuid[-1]), agent=agent,
                                session_id="1f", vram_mb=100, priority=0, preemptible=True, request_id=lease_id,
                                token=self.rev, created_at=0.0, gang=uuids if len(uuids) > 1 else (),
                                hosts=parts if len(parts) > 1 else ())
                key = K.lease(h, uuid, lease_id)
                self._event("PUT", key, json.dumps(rec.to_json()).encode())
                self.ctx.observed.saw(key, self.rev)   # (the replica's watch sees it now)
                keys.append(key)
                self.ctx.observed.now += 0.5            # a gang's parts are seen one after the other
        self.held[lease_id] = keys

    def release(self, lease_id: str) -> None:
        for key in self.held.pop(lease_id, []):
            self._event("DELETE", key)

    def team(self, below: float, after: float, action: str) -> None:
        key = K.team("calm")
        if not (below or after or action):
            self._event("DELETE", key)
            return
        doc = {"name": "calm", "members": ["b"], "idle_below_pct": below, "idle_after_s": after, "idle_action": action}
        self._event("PUT", key, json.dumps(doc).encode())


def afresh(ctx: Any, now: float) -> dict[str, tuple[LeaseIdle, str]]:
    """The judgment of every lease made from nothing (what ``judged`` did at every pass before it kept any)."""
    fleet, membership, by_team = idle.policies(ctx)
    if not fleet.on and not any(p.on for p in by_team.values()):
        return {}
    leases: dict[str, tuple[VramLease, float, list[str]]] = {}
    for kv in ctx.mirror.all_host_items("leases"):
        lease = lease_of(kv)
        seen = ctx.observed.saw(kv.key, kv.create_revision)
        held = leases.get(lease.id)
        leases[lease.id] = (lease, seen, [lease.gpu_uuid]) if held is None else \
            (held[0], max(held[1], seen), [*held[2], lease.gpu_uuid])
    out = {}
    for lease_id, (lease, seen, uuids) in leases.items():
        team = membership.team_of(lease.agent)
        out[lease_id] = (judge(lease_id, seen, uuids, ctx.utilization, by_team.get(team, fleet), now), team)
    return out


steps = st.lists(st.one_of(
    st.tuples(st.just("grant"), st.tuples(st.sampled_from(IDS), st.sampled_from(["one", "gang", "multi"]),
                                          st.sampled_from(HOSTS), st.sampled_from(["a", "b"]))),
    st.tuples(st.just("release"), st.sampled_from(IDS)),
    st.tuples(st.just("report"), st.tuples(st.sampled_from(GPUS), st.sampled_from([0, 3, 8, 50, -1]))),
    st.tuples(st.just("forget"), st.sampled_from(GPUS)),          # a GPU left without a report
    st.tuples(st.just("team"), st.tuples(st.sampled_from([0.0, 5.0]), st.sampled_from([0.0, 4.0, 30.0]),
                                         st.sampled_from(["", "warn", "evict"]))),
    st.tuples(st.just("fleet"), st.sampled_from([0.0, 10.0, 20.0])),
    st.tuples(st.just("time"), st.sampled_from([1.0, 5.0, 11.0])),
), max_size=40)


@settings(max_examples=400, deadline=None)
@given(steps, st.booleans())
@example([("grant", ("L0", "multi", "h1", "a")), ("report", ("h1-GPU-0", 0)), ("report", ("h2-GPU-0", 0)),
          ("time", 11.0), ("report", ("h2-GPU-0", 50)), ("time", 1.0)], False)   # one host's part goes busy
@example([("grant", ("L0", "one", "h1", "b")), ("report", ("h1-GPU-1", 0)), ("time", 11.0),
          ("team", (5.0, 30.0, "warn")), ("time", 1.0)], False)                # a team's window, set later
@example([("report", ("h1-GPU-1", 0)), ("time", 5.0), ("grant", ("L0", "one", "h1", "a")), ("time", 5.0)],
         False)                                                 # a lease granted on a GPU already below
def test_judgments_kept_between_passes_are_the_judgments_made_afresh(plan: list[tuple[str, Any]],
                                                                      short_log: bool) -> None:
    """After each step, ``judged`` (every lease, and the idle ones alone) equals every lease judged afresh; with
    ``short_log`` the history's log of moved GPUs forgets often, so passes also start from nothing."""
    w = World()
    with pytest.MonkeyPatch.context() as mp:
        if short_log:
            mp.setattr(policy_idle, "MOVES_KEPT", 2)
        for op, arg in plan:
            c = w.ctx
            if op == "grant":
                w.grant(*arg)
            elif op == "release":
                w.release(arg)
            elif op == "report":
                c.utilization.observe(arg[0], c.observed.now, arg[1], (5.0, 10.0))
            elif op == "forget":
                c.utilization.keep_only(g for g in GPUS if g != arg)
            elif op == "team":
                w.team(*arg)
            elif op == "fleet":
                c.config = CoordinatorConfig(idle_after_s=arg, idle_below_pct=10.0, idle_action="evict")
            elif op == "time":
                c.observed.now += arg
            expected = afresh(c, c.observed.now)
            assert idle.judged(c, c.observed.now) == expected, op
            assert idle.judged(c, c.observed.now, idle_only=True) == \
                {x: j for x, j in expected.items() if j[0].idle}, op


def test_the_log_of_moved_gpus_says_when_it_no_longer_reaches_back(monkeypatch: Any) -> None:
    monkeypatch.setattr(policy_idle, "MOVES_KEPT", 4)
    h = UtilizationHistory()
    mark, moved = h.moved_since(0)
    assert moved == set()
    h.observe("g1", 1.0, 0)
    h.observe("g1", 2.0, 0)     # the same value: no point, no move
    mark, moved = h.moved_since(mark)
    assert moved == {"g1"}
    for t in range(5):
        h.observe("g2", 3.0 + t, t)
    _, moved = h.moved_since(mark)
    assert moved is None        # five moves since: more than the log keeps
