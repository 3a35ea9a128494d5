"""Idle GPUs (issue 31, docs/policies.md "Idle GPUs"): every replica tracks its GPUs' utilization; the leader acts on it.

Every replica samples, each ``SAMPLE_S``, the nodes' usage reports in its mirror into ``ctx.utilization``
(``policy.idle.UtilizationHistory``): each GPU's ``utilization_pct`` as seen at the moment this replica first saw
the report (``ReplicaContext.observed``: its own monotonic clock, never a node's wall clock), -1 (unknown) when
the report is stale, gone, malformed or has no figure. ``judged`` then says, for every lease in the mirror, whether
it is idle under its policy: the fleet's (``idle_after_s``, ``idle_below_pct``, ``idle_action``), overridden by its
agent's team where the team sets them. Status and the ``gpucoord_idle_leases`` gauge show that judgment.

The leader's duty (``IdleReclaim.run``) sends each idle lease under ``evict`` an operator's eviction notice with the
reason ``idle`` and the fleet's grace (``Leases.evict``); the leader's deadline enforcement then revokes it at the
deadline, with the kill margin and G3's order for process-bound leases, as for any notice. Under ``warn`` nothing
is written: the lease shows ``idle`` in status and in the gauge, and the leader logs it once per idle stretch.
A lease that already has a notice (a drain's, a time limit's, a revoke's, a priority eviction's) keeps it.

The judgment (whatever the action) also orders G3 where a replica decides: among the candidates of one priority,
priority eviction takes the idle leases first, and reclaim takes a team's idle leases first (``Holder.idle``,
``teams.reclaim_order``), as judged when the round first asks (``IdleNow``: the same judgment status shows).

A replica that starts late or a new leader has no history: its judgment can come late, never early.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import heapq
import logging
import math
from typing import Any, Collection, Iterator

from coordinator import clock, errors, metrics
from coordinator.etcd.types import KV
from coordinator.policy.idle import (
    ACTIONS,
    REASON,
    IdlePolicy,
    LeaseIdle,
    team_policy,
    to_evict,
)
from coordinator.policy.teams import Membership
from coordinator.record_fields import without_ts
from coordinator.replica.context import ReplicaContext
from coordinator.replica.idle_judged import Judged
from coordinator.replica.leases import Leases, usage_doc
from coordinator.replica.teams import read_teams
from coordinator.replica.view import HOSTS_CACHED, STALE_INTERVALS

log = logging.getLogger(__name__)

SAMPLE_S = 1.0          # how often every replica samples the usage reports (and the leader looks for idle leases)
ASKED_BY = "idle reclaim"   # the notices' asked_by


def fleet_policy(ctx: ReplicaContext) -> IdlePolicy:
    c = ctx.config
    return IdlePolicy(c.idle_after_s, c.idle_below_pct, c.idle_action)


Parsed = tuple[float, tuple[tuple[str, int], ...]] | None
"""A usage report as sampling reads it: its node's interval and (GPU uuid, percent or -1) per GPU; None when it is
malformed."""


def _parse(kv: KV) -> Parsed:
    """A report as sampling reads it: parsed (and cached) less its ``ts`` (``record_fields.without_ts``), so each
    content is parsed once, not each version (sampling reads no ``ts``)."""
    return _parse_value(without_ts(kv.value))


@functools.lru_cache(maxsize=HOSTS_CACHED)
def _parse_value(value: bytes) -> Parsed:
    doc = usage_doc(value)
    if doc is None:
        return None
    rows = []
    for g in doc.get("gpus", ()):
        pct = g.get("utilization_pct", -1)
        rows.append((str(g.get("uuid", "")), pct if isinstance(pct, int) and not isinstance(pct, bool) else -1))
    return float(doc.get("interval_s", 5.0)), tuple(rows)


Sampled = dict[bytes, tuple[tuple[int, bool, frozenset[float]], tuple[tuple[str, int], ...], float]]
"""Per usage report: its version, staleness and the thresholds as last sampled, its GPUs and their figures, and when
it goes stale if it was fresh (``inf`` once stale)."""


@dataclasses.dataclass
class SampleMemory:
    """``sample``'s memory between passes, kept by its caller: what each report was sampled as, the mirror's
    generations of the usage reports at the last pass, and when each report sampled fresh goes stale."""
    sampled: Sampled = dataclasses.field(default_factory=dict)
    generation: int = -1
    keys_generation: int = -1
    thresholds: frozenset[float] = frozenset()
    stale_at: list[tuple[float, bytes, int]] = dataclasses.field(default_factory=list)   # a heap: (when, key, version)


def sample(ctx: ReplicaContext, last: SampleMemory | None = None) -> None:
    """Feed ``ctx.utilization`` with what the mirror's usage reports say now (see the module's docstring). Each
    version of a report is parsed once. Sampled whether idle reclaim is on or not: usage accounting measures each
    lease's idle GPU-seconds from the same history (``replica/accountant.py``).

    ``last`` (kept by the caller between passes): while no report came or went and the thresholds held, a pass
    samples only the reports put since the last one (``Mirror.puts_since``) and those whose fresh version went stale
    since (``SampleMemory.stale_at``): the others would be sampled as before, which changes nothing. Otherwise it
    samples every report, and skips those sampled so before (the same values, in the same bands); the GPUs without
    a report are looked for only when a report came, went or changed its GPUs. A fleet of 10,000 hosts is 10,000
    reports and 80,000 GPUs a second otherwise."""
    history = ctx.utilization
    fleet, _, by_team = policies(ctx)
    thresholds = frozenset({fleet.below_pct, *(p.below_pct for p in by_team.values())})
    now = clock.monotonic()
    mirror = ctx.mirror
    generation, keys_generation = mirror.generation("usage"), mirror.keys_generation("usage")
    changed = None
    if last is not None and last.thresholds == thresholds and last.keys_generation == keys_generation:
        changed = mirror.puts_since("usage", last.generation)
    if last is not None and changed is not None:
        todo = {kv.key: kv for kv in changed}
        while last.stale_at and last.stale_at[0][0] < now:
            _, key, version = heapq.heappop(last.stale_at)
            kv = mirror.flat(key)
            if kv is not None and kv.mod_revision == version:
                todo.setdefault(key, kv)
        gpus_moved = False
        for kv in todo.values():
            gpus_moved = _sample_one(ctx, kv, now, thresholds, last.sampled, last.sampled, last.stale_at) or gpus_moved
        if len(last.stale_at) > 4 * len(last.sampled) + 1024:   # versions rewritten long before they went stale
            last.stale_at = [(at, key, state[0]) for key, (state, _, at) in last.sampled.items() if at != math.inf]
            heapq.heapify(last.stale_at)
        sampled = last.sampled
    else:
        sampled, stale_at = {}, list[tuple[float, bytes, int]]()
        gpus_moved = last is None
        before = last.sampled if last is not None else {}
        for kv in mirror.items("usage"):
            gpus_moved = _sample_one(ctx, kv, now, thresholds, before, sampled, stale_at) or gpus_moved
        gpus_moved = gpus_moved or len(before) != len(sampled)
        heapq.heapify(stale_at)
        if last is not None:
            last.sampled, last.stale_at = sampled, stale_at
    if gpus_moved:
        history.keep_only(uuid for _, rows, _ in sampled.values() for uuid, _ in rows)   # a GPU without a report: unknown
    if last is not None:
        last.generation, last.keys_generation, last.thresholds = generation, keys_generation, thresholds


def _sample_one(ctx: ReplicaContext, kv: KV, now: float, thresholds: frozenset[float], before: Sampled,
                sampled: Sampled, stale_at: list[tuple[float, bytes, int]]) -> bool:
    """Sample one report into ``sampled`` (skipped when ``before`` has it sampled so); whether its GPUs moved (it
    is malformed, new, or names other GPUs than before)."""
    parsed = _parse(kv)
    if parsed is None:
        sampled.pop(kv.key, None)
        return True   # malformed: its GPUs are unknown (they get no points)
    stale = ctx.usage_age(kv) > STALE_INTERVALS * parsed[0]
    state = (kv.mod_revision, stale, thresholds)
    was = before.get(kv.key)
    if was is not None and was[0] == state:
        sampled[kv.key] = was
        if not stale:
            heapq.heappush(stale_at, (was[2], kv.key, kv.mod_revision))
        return False
    at = ctx.observed.saw(kv.key, kv.mod_revision)
    rows = parsed[1]
    goes_stale = math.inf if stale else at + STALE_INTERVALS * parsed[0]
    sampled[kv.key] = (state, rows, goes_stale)
    if not stale:
        heapq.heappush(stale_at, (goes_stale, kv.key, kv.mod_revision))
    if was is not None and was[0][1:] == state[1:] and was[1] == rows:
        return False    # a daemon's rewrite of the same figures (its ts alone new): observed again, they change nothing
    for uuid, pct in rows:
        ctx.utilization.observe(uuid, now if stale else at, -1 if stale else pct, thresholds)
    return was is None or [u for u, _ in was[1]] != [u for u, _ in rows]


def policies(ctx: ReplicaContext) -> tuple[IdlePolicy, Membership, dict[str, IdlePolicy]]:
    """The fleet's policy, the teams' membership and each team's policy (only those that set something)."""
    fleet = fleet_policy(ctx)
    teams, _ = read_teams(ctx.mirror.items("teams"))
    by_team = {name: team_policy(fleet, t.idle_after_s, t.idle_below_pct, t.idle_action)
               for name, t in teams.items() if t.idle_after_s or t.idle_below_pct or t.idle_action}
    return fleet, Membership(teams.values()), by_team


def judged(ctx: ReplicaContext, now: float | None = None, idle_only: bool = False) -> Judged:
    """lease id -> (its idle judgment, its team), for every lease in the mirror (``idle_only``: the idle ones);
    kept between passes where nothing it depends on moved (``replica/idle_judged.py``)."""
    now = clock.monotonic() if now is None else now
    fleet, membership, by_team = policies(ctx)
    if not fleet.on and not any(p.on for p in by_team.values()):
        ctx.idle_judgments.clear()   # (nothing kept while it is off)
        return {}   # idle reclaim is off: nothing to judge
    teams = tuple((kv.key, kv.mod_revision) for kv in ctx.mirror.items("teams"))
    return ctx.idle_judgments.judge(ctx.mirror, ctx.observed, ctx.utilization, fleet, membership, by_team,
                                    (fleet, teams), now, idle_only)


def status_fields(ctx: ReplicaContext) -> dict[str, dict[str, Any]]:
    """lease id -> the idle fields status shows: ``idle``, ``idle_since`` (unix seconds, 0: not below the
    threshold now) and ``idle_action`` ("" when no policy applies)."""
    mono, wall = clock.monotonic(), clock.wall()
    out = {}
    for lease_id, (j, _) in judged(ctx, mono).items():
        out[lease_id] = {"idle": j.idle, "idle_since": wall - (mono - j.idle_since) if j.idle_since is not None else 0.0,
                         "idle_action": j.action}
    return out


def update_gauge(found: dict[str, tuple[LeaseIdle, str]]) -> None:
    counts: dict[tuple[str, str], int] = {}
    for j, team in found.values():
        if j.idle:
            counts[(team, j.action)] = counts.get((team, j.action), 0) + 1
    metrics.IDLE_LEASES.clear()
    for team in {t for t, _ in counts} | {"default"}:
        for action in ACTIONS:
            metrics.IDLE_LEASES.labels(team, action).set(counts.get((team, action), 0))


class IdleNow(Collection[str]):
    """The ids of the leases judged idle now, judged once, when a round first asks (only a round choosing victims
    does): ``Context.idle`` of every round."""

    def __init__(self, ctx: ReplicaContext) -> None:
        self._ctx: ReplicaContext = ctx
        self._ids: frozenset[str] | None = None

    def _judged(self) -> frozenset[str]:
        if self._ids is None:
            self._ids = frozenset(judged(self._ctx, idle_only=True))
        return self._ids

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._judged()

    def __iter__(self) -> Iterator[str]:
        return iter(self._judged())

    def __len__(self) -> int:
        return len(self._judged())


class IdleReclaim:
    def __init__(self, ctx: ReplicaContext, leases: Leases) -> None:
        self.ctx, self.leases = ctx, leases
        self._warned: set[str] = set()
        self._sampled = SampleMemory()   # sample's memory between passes

    async def sample_forever(self) -> None:
        """Every replica: keep the history and the gauge current (cheap: one pass over the usage reports)."""
        while True:
            # The first pass a period after the start: it parses every usage report (10,000 in a large fleet),
            # which a starting replica's first calls would wait behind.
            await asyncio.sleep(SAMPLE_S)
            if self.ctx.mirror.ready:
                try:
                    sample(self.ctx, self._sampled)
                    update_gauge(judged(self.ctx, idle_only=True))
                except Exception:
                    log.exception("sampling the GPUs' utilization failed; retrying")

    async def sweep(self) -> list[str]:
        """The leader: send the notices due now; the lease ids noticed."""
        found = judged(self.ctx, idle_only=True)
        idle_now = set(found)
        for lease_id in sorted(idle_now - self._warned):
            j, team = found[lease_id]
            if j.action == "warn":
                log.warning("lease %s (team %s) is idle: its GPUs stayed below the threshold for the window; "
                            "warned only (idle_action warn)", lease_id, team)
        self._warned = idle_now
        sent = []
        noticed = [x for x in found if self.ctx.mirror.get(self.ctx.keys.eviction(x)) is not None]
        for lease_id in to_evict((j for j, _ in found.values()), noticed):
            try:
                await self.leases.evict(lease_id, 0.0, REASON, ASKED_BY)
                log.info("lease %s is idle: eviction notice sent (reason idle)", lease_id)
                sent.append(lease_id)
            except errors.NotFound:
                continue   # released meanwhile
            except errors.GpucoordError as e:
                log.warning("could not send the idle notice of lease %s: %s", lease_id, e)
        return sent

    async def run(self) -> None:
        """The leader's duty, for as long as the term lasts."""
        while True:
            if self.ctx.mirror.ready:
                await self.sweep()
            await asyncio.sleep(SAMPLE_S)
