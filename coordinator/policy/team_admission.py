"""Teams in an admission round (G11): the teams' state a round is decided against (``TeamState``), the limit
check of a grant, and what the round's transaction compares and writes for the teams it charges. Pure: plain
functions over the round's copies (``writes.Round``), no I/O.

A team is charged VRAM x GPUs: a grant is charged the ``vram_mb`` of every GPU record it writes (a gang: each
of its GPUs; an exclusive lease: each GPU's whole usable VRAM, as its records say).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

from coordinator import errors
from coordinator.keys import Keys
from coordinator.limits import quote
from coordinator.policy.fair_share import borrow_shares
from coordinator.policy.teams import Charge, Membership, Team
from coordinator.records import VramLease, dumps
from coordinator.txn import Compare, ModRevisionIs, NothingWrittenSince, Op, Put

if TYPE_CHECKING:
    from coordinator.policy.admission import GpuView
    from coordinator.policy.host import HostView


@dataclasses.dataclass(frozen=True)
class TeamState:
    """What admission needs of the teams, from one consistent copy of etcd at ``revision`` (the replica's
    mirror, or a snapshot): membership, every team's use over the fleet (``used``, counting the leases
    ``counted``: every GPU record of each) and the ledgers (mod_revision, seq) of ``teamledgers/`` by team.

    A grant charged to a team with a limit or a quota compares that team's ledger and bumps it, and every grant
    compares that no team changed since ``revision``: grants for one such team are thus serialized across hosts
    and replicas, and each counted every lease of the team that a grant created before it. Leases that end only
    lower the use, so no grant takes a team above its limit, and each grant's quota mark is exact."""

    membership: Membership
    used: Mapping[str, int]
    counted: frozenset[str]
    ledgers: Mapping[str, tuple[int, int]]
    revision: int
    # Every lease record of the fleet in that copy, built when asked (reclaim classifies them, oldest first,
    # into in and over quota: a round that does not reclaim never pays for it), and the GPU models by uuid (for
    # quotas per model; {} when no team has one).
    records: Callable[[], Sequence[VramLease]] = tuple
    models: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # Each team's fair-share factor over time (``teams.fair_factors``), as this replica last computed it from the
    # decayed usage; {} (every factor 1: weight alone) until it has.
    fair: Mapping[str, float] = dataclasses.field(default_factory=dict)
    # The fleet's VRAM beyond the teams' quotas (its GPUs' VRAM less every quota, at least 0), shared by fair
    # share while teams contend for it (``share_refusal``); None: not known (no share is held to).
    borrowable_mb: int | None = None

    def limited(self, team: str) -> bool:
        return self.membership.team(team).limit_mb is not None

    def serialized(self, team: str) -> bool:
        """Whether the team's grants are serialized through its ledger: it has a limit (no grant may pass it)
        or a quota (each grant's quota mark, and reclaim's classification, count every earlier grant)."""
        t = self.membership.team(team)
        return t.limit_mb is not None or t.quota_mb > 0

    def ledger(self, team: str) -> tuple[int, int]:
        return self.ledgers.get(team, (0, 0))


def limit_refusal(team: Team, used_mb: int, charge_mb: int) -> str | None:
    """Why a request charging ``charge_mb`` to ``team`` (now using ``used_mb``) is refused, None when its
    limit allows it. The message names ``team`` and the limit (RESOURCE_EXHAUSTED, or the request waits)."""
    if team.limit_mb is None or used_mb + charge_mb <= team.limit_mb:
        return None
    return (f"team: team {quote(team.name)} uses {used_mb} MiB; {charge_mb} MiB more would pass its limit of "
            f"{team.limit_mb} MiB")


def grant_charge_mb(gpus: Sequence[GpuView], vram_mb: int, exclusive: bool) -> int:
    """What a new grant on ``gpus`` (one, or a gang's) is charged: ``vram_mb`` on each, or each GPU's usable
    VRAM if exclusive (what its records will say)."""
    return sum(g.usable_mb if exclusive else vram_mb for g in gpus)


def team_use(state: TeamState, view: HostView, team: str) -> int:
    """The team's use over the fleet: the teams' copy, and every GPU record of this host's leases that copy
    has not counted because it is newer (written after the copy's revision, or this round's grant). A record
    of the host's snapshot that the copy, read later, no longer has ended in between: it is not counted (it
    made a grant's quota mark ``true`` though the team was within its quota, in the 24-client race)."""
    return state.used.get(team, 0) + sum(
        x.vram_mb for g in view.gpus.values() for x in g.leases
        if x.id not in state.counted and (x.mod_revision == 0 or x.mod_revision > state.revision)
        and state.membership.team_of(x.agent) == team)


def least_charge_mb(candidates: Sequence[GpuView], vram_mb: int, gpu_count: int, exclusive: bool) -> int:
    """The least a request that does not fit yet could be charged once granted on some of ``candidates``:
    ``vram_mb`` on each of its GPUs, or, exclusive, the smallest usable VRAM of that many candidates."""
    if not exclusive:
        return vram_mb * gpu_count
    return sum(sorted(g.usable_mb for g in candidates)[:gpu_count])


def beyond_limit(state: TeamState | None, view: HostView, agent: str, vram_mb: int, gpu_count: int,
                 exclusive: bool) -> errors.FailedPrecondition | None:
    """Why a request could never be granted under its team's limit, even with nothing of its team in use:
    the least it could be charged on any GPUs of the host passes the limit. Refused at once (it leaves the
    queue) rather than waiting out its wait; None when the limit could ever allow it."""
    if state is None:
        return None
    team = state.membership.team(state.membership.team_of(agent))
    least = least_charge_mb(list(view.gpus.values()), vram_mb, gpu_count, exclusive)
    if team.limit_mb is None or least <= team.limit_mb:
        return None
    return errors.FailedPrecondition(
        f"team: the request is charged at least {least} MiB, more than the limit of team {quote(team.name)} "
        f"({team.limit_mb} MiB) even with nothing of it in use", "team")


def team_wait_over(reason: str, wait_s: float) -> errors.WaitTimeout:
    """The answer to a request whose wait ended while it waited for its team's limit or fair share (``reason``,
    from ``limit_refusal`` or ``share_refusal``): RESOURCE_EXHAUSTED naming ``team`` and the limit."""
    what = "fair share" if FAIR_SHARE_MARK in reason else "limit"
    return errors.WaitTimeout(f"{reason} (waited {round(wait_s, 1):g} s for its team's {what})", "team")


FAIR_SHARE_MARK = "its fair share of the idle capacity"


def share_refusal(state: TeamState, team: str, used: Callable[[str], int], charge_mb: int,
                  waiting: Mapping[str, int]) -> str | None:
    """Why a grant charging ``charge_mb`` to ``team`` waits for its fair share of the idle capacity (docs/teams.md
    "Fair share"), or None. While other teams wait to borrow on this host (``waiting``: team -> the least its
    waiting request there would be charged), each team that borrows or waits to borrow may borrow (use above its
    quota) at most its share ``w·F / Σ w·F`` of the fleet's VRAM beyond the quotas. Work-conserving: only a
    waiting team that would borrow and whose waiting request fits within its own share holds another back (two
    teams each a GPU short of their shares never both wait while a GPU idles)."""
    if state.borrowable_mb is None:
        return None
    members = state.membership

    def borrowed(name: str, extra: int = 0) -> int:
        return max(0, used(name) + extra - members.team(name).quota_mb)
    after = borrowed(team, charge_mb)
    if after == 0:
        return None         # within its quota: what a quota guarantees is never held back
    contenders = {n for n in state.used if borrowed(n) > 0} | {team}
    claims = {n: least for n, least in waiting.items() if n != team and borrowed(n, least) > 0}
    shares = borrow_shares(members, state.fair, contenders | set(claims))

    def within(name: str, mb: int) -> bool:      # (a relative slack: the share is a float)
        return mb <= shares[name] * state.borrowable_mb * (1 + 1e-9) if state.borrowable_mb is not None else True
    holders = sorted(n for n in claims if within(n, borrowed(n, claims[n])))
    cap = round(shares[team] * state.borrowable_mb)
    if not holders or within(team, after):
        return None
    return (f"team: team {quote(team)} would borrow {after} MiB, past {FAIR_SHARE_MARK} ({cap} of "
            f"{state.borrowable_mb} MiB) while team {quote(holders[0])} waits")


def team_limit(state: TeamState, view: HostView, agent: str, charge_mb: int,
               used: Callable[[str], int] | None = None) -> str | None:
    """Why granting ``charge_mb`` to ``agent`` would take its team above its limit, or None. ``used``: the
    team's use (``team_use``), when the caller keeps it."""
    team = state.membership.team_of(agent)
    if not state.limited(team):
        return None
    return limit_refusal(state.membership.team(team), used(team) if used else team_use(state, view, team), charge_mb)


def over_quota_mark(state: TeamState | None, view: HostView, agent: str, charge_mb: int,
                    used: Callable[[str], int] | None = None, by_model: Mapping[str, int] | None = None) -> bool | None:
    """The quota mark of a new grant charging ``charge_mb`` to ``agent``: whether its team's use over the
    fleet, counting it, passes the team's quota (``quota_mb``), or, on a GPU model the team has a quota for,
    its use of that model counting what the grant charges that model (``by_model``: each GPU's charge to its
    own model), passes that quota: what ``teams.in_quota`` would say of it as the newest lease. None
    (unmarked) without teams."""
    if state is None:
        return None
    name = state.membership.team_of(agent)
    team = state.membership.team(name)
    if (used(name) if used else team_use(state, view, name)) + charge_mb > team.quota_mb:
        return True
    quotas = {m: mb for m, mb in (by_model or {}).items() if team.model_quota(m) is not None}
    if not quotas:
        return False
    models = dict(state.models)
    if view.inventory is not None:
        models.update((g.uuid, g.name) for g in view.inventory.gpus)
    # The copy's records, and this host's that the copy has not counted because they are newer (as team_use).
    records = [*state.records(), *(x for g in view.gpus.values() for x in g.leases if x.id not in state.counted
                                   and (x.mod_revision == 0 or x.mod_revision > state.revision))]
    held: dict[str, int] = {}
    for parts in by_lease(records):
        c = charge_of(parts, state.membership, models)
        if c.team == name:
            for m, mb in c.by_model().items():
                held[m] = held.get(m, 0) + mb
    return any(held.get(m, 0) + mb > (team.model_quota(m) or 0) for m, mb in quotas.items())


def charge_of(parts: Sequence[VramLease], membership: Membership, models: Mapping[str, str] | str = "") -> Charge:
    """A lease as the teams see it, from every GPU record of it (one, or a gang's): VRAM x GPUs, each GPU
    charged its own record's ``vram_mb`` (an exclusive gang's: each GPU's whole usable VRAM), to its own model
    (``models``: by GPU uuid; a string: the model of every GPU)."""
    lease = parts[0]

    def model_of(uuid: str) -> str:
        return models if isinstance(models, str) else models.get(uuid, "")
    return Charge(id=lease.id, team=membership.team_of(lease.agent), vram_mb=lease.vram_mb,
                  gpus=tuple(x.gpu_uuid for x in parts), created_at=lease.created_at, token=lease.token,
                  model=model_of(lease.gpu_uuid), preemptible=lease.preemptible, min_runtime_s=lease.min_runtime_s,
                  total_mb=sum(x.vram_mb for x in parts),
                  per_gpu=tuple((x.gpu_uuid, x.vram_mb, model_of(x.gpu_uuid)) for x in parts))


def by_lease(records: Iterable[VramLease]) -> list[list[VramLease]]:
    """Lease records grouped by lease id (a gang: one record per GPU), in first-seen order."""
    out: dict[str, list[VramLease]] = {}
    for x in records:
        out.setdefault(x.id, []).append(x)
    return list(out.values())


def fleet_charges(state: TeamState, view: HostView) -> list[Charge]:
    """Every live lease of the fleet as a charge: the teams' copy for the other hosts, and this host as the
    round sees it (its snapshot, with this round's grants)."""
    here = {g.uuid for g in view.gpus.values()}
    models = dict(state.models)
    if view.inventory is not None:
        models.update((g.uuid, g.name) for g in view.inventory.gpus)
    records = [x for x in state.records() if x.gpu_uuid not in here]
    records += [x for g in sorted(view.gpus.values(), key=lambda g: g.index) for x in g.leases]
    return [charge_of(parts, state.membership, models) for parts in by_lease(records)]


def charged_teams(state: TeamState, new_leases: Iterable[VramLease]) -> dict[str, int]:
    """The teams this round's new lease records charge, with what each is charged (every GPU record)."""
    out: dict[str, int] = {}
    for lease in new_leases:
        team = state.membership.team_of(lease.agent)
        out[team] = out.get(team, 0) + lease.vram_mb
    return out


def team_writes(state: TeamState, keys: Keys, new_leases: list[VramLease]) -> tuple[list[Compare], list[Op]]:
    """What a round that writes ``new_leases`` adds to its transaction: the teams it counted are still the
    teams, and every limited team it charges takes its ledger's next number (so grants for one limited team
    are serialized across hosts and replicas)."""
    if not new_leases:
        return [], []
    compares: list[Compare] = [NothingWrittenSince(keys.teams(), state.revision)]
    ops: list[Op] = []
    for team in sorted(t for t in charged_teams(state, new_leases) if state.serialized(t)):
        revision, seq = state.ledger(team)
        compares.append(ModRevisionIs(keys.team_ledger(team), revision))
        ops.append(Put(keys.team_ledger(team), dumps({"seq": seq + 1})))
    return compares, ops
