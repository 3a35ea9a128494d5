"""Teams (G11): the team record, membership, usage accounting, quota classification, the limit check and
the choice of reclaim victims. Pure: plain functions over plain data, no I/O.

A team is stored under ``teams/<team>`` (``coordinator.keys``) and managed by operators (``gpucoord team
set|show|list|delete``). Its fields:

- ``quota_mb``: VRAM guaranteed to the team over the whole fleet, in MiB (0: none). ``quota_by_model``
  optionally narrows the guarantee per GPU model (``GpuInfo.name``): a lease on a GPU of a listed model is
  in quota only while the team's use of that model also stays within it.
- ``limit_mb``: the hard cap on the team's use over the fleet; ``None``: no cap. Never below the quota.
- ``weight``: the team's share of what is idle beyond the quotas (0.001 to 1,000,000; default 1).
- ``members``: agent names (``alice``) or patterns (``research-*``, ``job-?-*``: fnmatch's ``*``, ``?``,
  ``[...]``, as the priority caps of a partition spec take them).
- ``max_min_runtime_s``: the longest minimum runtime a lease of the team may declare before it can be
  reclaimed (default 0: a borrowed lease can be reclaimed at once).

**Membership.** An agent belongs to exactly one team: the team that names it exactly; else the team with the
most specific pattern that matches its name (the longest pattern; ties: the smallest team name); else
``default``. For prefix patterns that is the longest prefix. No two teams may claim the same pattern
(``team set`` refuses it, in a transaction that compares every team), so the rule is a function; a store
written by hand that breaks this resolves a tie to the smallest team name. ``default`` has no members of its
own; its record (quota, limit, weight) applies to every agent no other team names, and without a record it has
no quota, no limit and weight 1.

**Usage** is VRAM x GPUs: every lease is charged, on each GPU it holds, that GPU's own record's ``vram_mb``,
to that GPU's model (``charges.Charge``).
"""
from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Collection, Iterable, Mapping

from coordinator.keys import last_segment, valid_name
from coordinator.limits import MAX_TIME_LIMIT_S, quote
from coordinator.policy.charges import Charge as Charge
from coordinator.policy.partition.caps import PATTERN_CHARS
from coordinator.policy.team_fields import (
    _FIELDS,
    IDLE_FIELDS,
    MAX_MIN_RUNTIME_S,
    MAX_MODEL_NAME_LEN,
    MAX_TEAM_MB,
    MAX_TEAM_MEMBERS,
    MAX_TEAM_MODELS,
    MAX_WEIGHT,
    MIN_WEIGHT,
    TIME_LIMIT_FIELDS,
    TeamError,
    _amount,
    _members,
    _models,
    _number,
    check_changes,
    check_idle,
    check_pattern,
)
from coordinator.records import InvalidRecord, StoredKV, load_record

__all__ = ["MAX_MIN_RUNTIME_S", "MAX_MODEL_NAME_LEN", "MAX_TEAM_MB", "MAX_TEAM_MEMBERS", "MAX_TEAM_MODELS",
           "MAX_WEIGHT", "MIN_WEIGHT", "TeamError", "check_changes", "check_pattern"]

DEFAULT_TEAM = "default"


@dataclasses.dataclass(frozen=True)
class Team:
    """A team as stored under ``teams/<name>``, with its etcd metadata (0: not stored)."""

    name: str
    quota_mb: int = 0
    limit_mb: int | None = None
    weight: float = 1.0
    members: tuple[str, ...] = ()
    quota_by_model: tuple[tuple[str, int], ...] = ()   # (GPU model, MiB), sorted by model
    max_min_runtime_s: float = 0.0
    # Time limits (issue 31): the longest limit its agents may ask, and the limit of a request that asks none
    # (0: the fleet's); stored only when set, so that a replica of the previous release reads the others.
    max_time_limit_s: float = 0.0
    default_time_limit_s: float = 0.0
    # Idle GPUs (issue 31): the team's idle window, threshold and action (0 or "": the fleet's); stored only
    # when set.
    idle_after_s: float = 0.0
    idle_below_pct: float = 0.0
    idle_action: str = ""
    mod_revision: int = 0

    def model_quota(self, model: str) -> int | None:
        return dict(self.quota_by_model).get(model)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "quota_mb": self.quota_mb, "limit_mb": self.limit_mb, "weight": self.weight,
                "members": list(self.members), "quota_by_model": dict(self.quota_by_model),
                "max_min_runtime_s": self.max_min_runtime_s,
                **{f: getattr(self, f) for f in (*TIME_LIMIT_FIELDS, *IDLE_FIELDS) if getattr(self, f)}}

    @classmethod
    def from_json(cls, doc: Any, name: str, mod_revision: int = 0) -> Team:
        """A team from its JSON document; ``TeamError`` naming the first bad field, checked in a fixed order
        (name, quota_mb, quota_by_model, limit_mb, weight, members, max_min_runtime_s). Fields missing take
        their defaults; a field this release does not know is refused (it might mean something)."""
        if not isinstance(name, str) or not valid_name(name):
            raise TeamError("name", f"{quote(name)} is not a valid team name (letters, digits, '.', '_', ':', "
                                    "'@', '-'; at most 128)")
        if not isinstance(doc, dict):
            raise TeamError("team", f"expected an object, got {type(doc).__name__}")
        unknown = sorted(set(doc) - set(_FIELDS) - {"name"})
        if unknown:
            raise TeamError(unknown[0][:32], "unknown field")
        if "name" in doc and doc["name"] != name:
            raise TeamError("name", f"the record names {quote(doc['name'])}, its key {quote(name)}")
        quota = _amount(doc.get("quota_mb", 0), "quota_mb")
        by_model = _models(doc.get("quota_by_model", {}))
        for model, mb in by_model:
            if mb > quota:
                raise TeamError(f"quota_by_model[{quote(model)}]", f"{mb} MiB is above the team's quota_mb "
                                f"({quota}): a model's guarantee is part of the team's")
        limit = doc.get("limit_mb")
        if limit is not None:
            limit = _amount(limit, "limit_mb")
            if limit < quota:
                raise TeamError("limit_mb", f"{limit} MiB is below the team's quota_mb ({quota})")
        weight = _number(doc.get("weight", 1.0), "weight", MIN_WEIGHT, MAX_WEIGHT)
        patterns = _members(doc.get("members", []))
        if name == DEFAULT_TEAM and patterns:
            raise TeamError("members", f"the {DEFAULT_TEAM!r} team holds every agent no other team names: it "
                                       "takes no members")
        min_runtime = _number(doc.get("max_min_runtime_s", 0.0), "max_min_runtime_s", 0.0, MAX_MIN_RUNTIME_S)
        most, default = (_number(doc.get(f, 0.0), f, 0.0, MAX_TIME_LIMIT_S) for f in TIME_LIMIT_FIELDS)
        if most and default > most:
            raise TeamError("default_time_limit_s", f"{default:g} s is above the team's max_time_limit_s ({most:g} s)")
        idle_after, idle_below, idle_action = check_idle(doc)
        return cls(name=name, quota_mb=quota, limit_mb=limit, weight=weight, members=tuple(sorted(patterns)),
                   quota_by_model=tuple(by_model), max_min_runtime_s=min_runtime, max_time_limit_s=most,
                   default_time_limit_s=default, idle_after_s=idle_after, idle_below_pct=idle_below,
                   idle_action=idle_action, mod_revision=mod_revision)

    @classmethod
    def from_kv(cls, kv: StoredKV) -> Team:
        """A stored team; InvalidRecord (naming the field) when it is malformed."""
        try:
            return cls.from_json(load_record(kv.value), last_segment(kv.key), kv.mod_revision)
        except TeamError as e:
            raise InvalidRecord(str(e)) from None

    def changed(self, changes: Mapping[str, Any]) -> Team:
        """This team with ``changes`` (fields of the JSON document) applied, validated as a whole: TeamError
        naming the field. Fields not in ``changes`` keep their values."""
        unknown = sorted(set(changes) - set(_FIELDS))
        if unknown:
            raise TeamError(unknown[0][:32], "unknown field")
        return Team.from_json(self.to_json() | dict(changes), self.name, self.mod_revision)


def default_team(name: str = DEFAULT_TEAM) -> Team:
    """A team with no record: no quota, no limit, weight 1."""
    return Team(name=name)


def member_conflicts(team: Team, others: Iterable[Team]) -> list[str]:
    """Why ``team`` cannot be stored beside ``others``: each pattern another team already claims."""
    mine = set(team.members)
    return [f"{quote(p)} already belongs to team {quote(o.name)}" for o in sorted(others, key=lambda t: t.name)
            if o.name != team.name for p in sorted(mine & set(o.members))]


class Membership:
    """Which team an agent is in (the module's rule): exact name, else the most specific pattern that matches
    (the longest; ties: the smallest team name), else ``default``. A prefix pattern (``research-*``) is looked
    up by prefix; other globs are matched in turn, and their answers kept."""

    def __init__(self, teams: Iterable[Team]) -> None:
        self.teams: dict[str, Team] = {t.name: t for t in teams}
        self._exact: dict[str, str] = {}
        self._prefixes: dict[str, str] = {}
        self._globs: list[tuple[int, str, str]] = []     # (-length, team, pattern): the most specific first
        for t in sorted(self.teams.values(), key=lambda t: t.name, reverse=True):   # the smallest name wins a tie
            for p in t.members:
                if not PATTERN_CHARS & set(p):
                    self._exact[p] = t.name
                elif p.endswith("*") and not PATTERN_CHARS & set(p[:-1]):
                    self._prefixes[p[:-1]] = t.name
                else:
                    self._globs.append((-len(p), t.name, p))
        self._globs.sort()
        self._lengths = sorted({len(p) for p in self._prefixes}, reverse=True)
        self._matched: dict[str, str] = {}

    def team_of(self, agent: str) -> str:
        exact = self._exact.get(agent)
        if exact is not None:
            return exact
        if self._globs:
            known = self._matched.get(agent)
            if known is not None:
                return known
        best = (1, DEFAULT_TEAM)
        for n in self._lengths:
            if n <= len(agent):
                hit = self._prefixes.get(agent[:n])
                if hit is not None:
                    best = (-(n + 1), hit)
                    break
        if not self._globs:
            return best[1]
        for length, name, pattern in self._globs:
            if (length, name) >= best:
                break
            if fnmatch.fnmatchcase(agent, pattern):
                best = (length, name)
                break
        if len(self._matched) >= 65536:
            self._matched.clear()
        self._matched[agent] = best[1]
        return best[1]

    def team(self, name: str) -> Team:
        """The record of a team, or the defaults of one without a record."""
        return self.teams.get(name) or default_team(name)


# -- usage and quota -----------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Usage:
    """A team's usage: what ``status`` shows."""

    used_mb: int = 0
    borrowed_mb: int = 0          # used above the quota
    leases: int = 0
    over_quota_leases: int = 0
    waiting_mb: int = 0
    waiting: int = 0
    decayed_gpu_s: float = 0.0    # its decayed usage (docs/teams.md "Decayed usage")


def used_by_team(charges: Iterable[Charge]) -> dict[str, int]:
    used: dict[str, int] = {}
    for c in charges:
        used[c.team] = used.get(c.team, 0) + c.charge_mb
    return used


def in_quota(charges: Iterable[Charge], membership: Membership) -> dict[str, bool]:
    """Lease id -> whether it is in quota. A team's leases fill its quota oldest first: a lease is in quota
    while the team's usage, counting it and every older lease of the team, stays within ``quota_mb``, and,
    on a GPU model the team has a quota for, its usage of that model too. Every other lease is over quota
    (borrowed). The classification follows the live leases: when older ones end, newer ones move into quota."""
    by_team: dict[str, list[Charge]] = {}
    for c in charges:
        by_team.setdefault(c.team, []).append(c)
    out: dict[str, bool] = {}
    for name, held in by_team.items():
        team = membership.team(name)
        fleet = 0
        per_model: dict[str, int] = {}
        for c in sorted(held, key=Charge.age_order):
            fleet += c.charge_mb
            ok = fleet <= team.quota_mb
            for model, mb in c.by_model().items():   # each GPU's record to that GPU's own model
                per_model[model] = per_model.get(model, 0) + mb
                model_quota = team.model_quota(model)
                ok = ok and (model_quota is None or per_model[model] <= model_quota)
            out[c.id] = ok
    return out


def usage_by_team(charges: Iterable[Charge], membership: Membership,
                  waiting: Iterable[tuple[str, int]] = ()) -> dict[str, Usage]:
    """Every team's usage (``waiting``: (team, VRAM x GPUs) of each queue entry); every stored team and
    ``default`` appear, used or not."""
    charges = list(charges)
    marks = in_quota(charges, membership)
    acc: dict[str, dict[str, int]] = {n: {} for n in [*membership.teams, DEFAULT_TEAM]}
    for c in charges:
        a = acc.setdefault(c.team, {})
        a["used_mb"] = a.get("used_mb", 0) + c.charge_mb
        a["leases"] = a.get("leases", 0) + 1
        if not marks[c.id]:
            a["over_quota_leases"] = a.get("over_quota_leases", 0) + 1
    for team, mb in waiting:
        a = acc.setdefault(team, {})
        a["waiting_mb"] = a.get("waiting_mb", 0) + mb
        a["waiting"] = a.get("waiting", 0) + 1
    return {n: Usage(borrowed_mb=max(0, a.get("used_mb", 0) - membership.team(n).quota_mb), **a)
            for n, a in acc.items()}


# -- quota and reclaim (the limit: team_admission.py) ---------------------------------------------------------

def stays_in_quota(team: Team, charges: Iterable[Charge], charge_mb: int, model: str = "",
                   by_model: Mapping[str, int] | None = None) -> bool:
    """Whether a request of ``team`` charging ``charge_mb`` (on GPUs of ``model``, or ``by_model``: what it
    charges each GPU model) would be in quota: the team's usage, counting it, within its quota (and its quota
    of each of those models, when it has one)."""
    held = [c for c in charges if c.team == team.name]
    if sum(c.charge_mb for c in held) + charge_mb > team.quota_mb:
        return False
    for m, mb in (by_model if by_model is not None else {model: charge_mb}).items():
        model_quota = team.model_quota(m)
        if model_quota is not None and sum(c.by_model().get(m, 0) for c in held) + mb > model_quota:
            return False
    return True


def over_share(team: Team, used_mb: int, factor: float = 1.0) -> float:
    """How far a team is over its fair share: the VRAM it borrows (used above its quota) per unit of its
    effective weight, its weight times its fair-share factor (``fair_factors``; 1 without usage history).
    Reclaim takes from the team with the largest first."""
    return max(0, used_mb - team.quota_mb) / (team.weight * factor)


def protected(charge: Charge, team: Team, now: float) -> bool:
    """A lease younger than its minimum runtime (as declared, capped by its team's ``max_min_runtime_s``) is
    not reclaimed yet, so that a borrowed GPU is not thrashed."""
    return now - charge.created_at < min(charge.min_runtime_s, team.max_min_runtime_s)


def reclaimable(requester: str, charges: Iterable[Charge], membership: Membership, now: float) -> list[Charge]:
    """The leases a request of team ``requester`` may reclaim: other teams' over-quota, preemptible leases
    past their minimum runtime. In-quota leases never are."""
    charges = list(charges)
    marks = in_quota(charges, membership)
    return [c for c in charges if c.team != requester and not marks[c.id] and c.preemptible
            and not protected(c, membership.team(c.team), now)]


def reclaim_order(requester: str, candidates: Iterable[Charge], charges: Iterable[Charge],
                  membership: Membership, idle: Collection[str] = (),
                  fair: Mapping[str, float] | None = None) -> list[Charge]:
    """``candidates`` (from ``reclaimable``) in the order reclaim takes them: each time from the team
    furthest over its fair share (``over_share``, with ``fair``: each team's fair-share factor, 1 when absent)
    as it stands once the leases before are gone (ties: the team's name), and of that team its newest lease
    judged ``idle`` if it has one, else its newest lease."""
    fair = fair or {}
    used = used_by_team(charges)
    left: dict[str, list[Charge]] = {}
    for c in candidates:
        if c.team != requester:
            left.setdefault(c.team, []).append(c)
    for held in left.values():
        held.sort(key=lambda c: (c.id in idle, Charge.age_order(c)))   # the idle, the newest last: popped first
    order: list[Charge] = []
    while left:
        name = min(left, key=lambda n: (-over_share(membership.team(n), used.get(n, 0), fair.get(n, 1.0)), n))
        c = left[name].pop()
        if not left[name]:
            del left[name]
        used[name] = used.get(name, 0) - c.charge_mb
        order.append(c)
    return order


def _short(shortfall: Mapping[str, int], victims: Iterable[Charge]) -> bool:
    freed: dict[str, int] = {}
    for v in victims:
        for g in v.gpus:
            freed[g] = freed.get(g, 0) + v.on(g)   # each GPU's own record (an exclusive gang's GPUs differ)
    return any(freed.get(g, 0) < need for g, need in shortfall.items())


def choose_reclaim(requester: str, charge_mb: int, shortfall: Mapping[str, int], charges: Iterable[Charge],
                   membership: Membership, now: float, model: str = "",
                   exclude: Collection[str] = (), by_model: Mapping[str, int] | None = None,
                   idle: Collection[str] = (), fair: Mapping[str, float] | None = None) -> list[Charge] | None:
    """The leases to reclaim for a request of team ``requester`` charging ``charge_mb`` that lacks
    ``shortfall[gpu]`` MiB on each GPU it is placed on (``by_model``: what it charges each GPU model): [] when
    nothing is short; None when the team would not
    stay within its quota with the request (it may not reclaim), or when even every reclaimable lease would not
    make it fit.

    Victims are taken in ``reclaim_order`` (weighted share, then idle, then newest first), skipping leases on no GPU
    still short, until the request fits; then every victim that can be spared is dropped, in that same order:
    the set is minimal (no victim can be spared), the order rule winning over the smallest count."""
    if not _short(shortfall, ()):
        return []
    charges = list(charges)
    if not stays_in_quota(membership.team(requester), charges, charge_mb, model, by_model):
        return None
    useful = [c for c in reclaimable(requester, charges, membership, now)   # ``exclude``: already going
              if set(c.gpus) & set(shortfall) and c.id not in exclude]
    victims: list[Charge] = []
    for c in reclaim_order(requester, useful, charges, membership, idle, fair):
        if not _short(shortfall, victims):
            break
        if _short({g: n for g, n in shortfall.items() if g in c.gpus}, victims):
            victims.append(c)
    if _short(shortfall, victims):
        return None
    for v in list(victims):
        rest = [x for x in victims if x is not v]
        if not _short(shortfall, rest):
            victims = rest
    return victims
