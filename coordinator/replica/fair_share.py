"""Each team's fair-share factor over time (docs/teams.md "Fair share"), kept by every replica for admission: every
``fair_share_every_s``, while teams are stored, the teams' decayed usage from the hourly rollups and the live
leases (``accounting.decayed_by_team``, as ``status`` shows it) turned into factors (``teams.fair_factors``).
Reclaim takes first from the team furthest over its fair share (``teams.over_share``). Each replica reads etcd
for it on its own: the factors of two replicas may differ for a moment, which only orders reclaim's victims
differently (which leases may be taken, and the compares that guard a reclaim, do not depend on it)."""
from __future__ import annotations

import asyncio
import logging

from coordinator import clock, errors
from coordinator.policy.accounting import decayed_by_team
from coordinator.policy.fair_share import fair_factors
from coordinator.records import InvalidRecord, VramLease
from coordinator.replica.context import ReplicaContext
from coordinator.replica.teams import mirror_membership, usable_by_host
from coordinator.replica.view import lease_of

log = logging.getLogger(__name__)


async def refresh(ctx: ReplicaContext) -> dict[str, float]:
    """The factors now ({} without teams), also kept in ``ctx.fair_share``."""
    membership = mirror_membership(ctx.mirror) if ctx.mirror.ready else None
    if membership is None:
        ctx.fair_share, ctx.borrowable_mb = {}, None
        return ctx.fair_share
    rollups = (await ctx.store.get_prefix(ctx.keys.usage_rollups())).kvs
    leases: list[VramLease] = []
    for kv in ctx.mirror.all_host_items("leases"):
        try:
            leases.append(lease_of(kv))
        except InvalidRecord:
            continue
    decayed = decayed_by_team(ctx.keys, membership, rollups, leases, ctx.config.usage_half_life_s, clock.wall())
    ctx.fair_share = fair_factors(decayed, membership)
    ctx.borrowable_mb = max(0, fleet_vram_mb(ctx) - sum(t.quota_mb for t in membership.teams.values()))
    return ctx.fair_share


def fleet_vram_mb(ctx: ReplicaContext) -> int:
    """The usable VRAM of every GPU of the registered hosts (its total less its partition's headroom, what a
    grant is charged), parsed strictly (a malformed registration counts 0, as its host admits nothing)."""
    usable = usable_by_host(ctx.keys, ctx.mirror.items("hosts"), ctx.mirror.items("partitions"))
    return sum(sum(gpus) for gpus in usable.values())


async def run(ctx: ReplicaContext) -> None:
    while True:
        try:
            await refresh(ctx)
        except errors.GpucoordError as e:
            log.warning("fair share: could not read the teams' usage (%s); the last factors stand", e)
        except Exception:   # a bad stored value must not end the duty: the last factors stand
            log.exception("fair share: computing the factors failed; the last factors stand")
        await asyncio.sleep(ctx.config.fair_share_every_s)
