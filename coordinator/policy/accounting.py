"""Usage accounting (issue 33): what a lease that ended used, from the etcd events of the revision that ended it.

Pure: no I/O. The leader's accountant (``coordinator.replica.accountant``) feeds it the deletions of each
revision, in revision order, and writes what it returns; ``gpucoord usage`` sums the rollups.

How a lease ended is read from what else went in the revision that deleted it (one transaction, or one
etcd_lease expiry, is one revision):

* its session key ``sessions/<agent>/<session_id>`` went too: ``session`` (the session expired, or its holder
  closed it: both are the revoke of one etcd_lease, and etcd's history cannot tell them apart);
* else its eviction notice ``evictions/<lease_id>`` went too: ``revoke`` (an operator's revoke notice),
  ``reclaim`` (a team reclaim's notice) or ``eviction`` (one by priority, or an operator's evict), whether
  its holder released it under the notice or the leader revoked it at the deadline: either way the notice
  ended it;
* else ``release``. An operator's revoke of a lease bound to no processes deletes it at once, without a
  notice, and so counts as ``release`` too.

A gang (one record per GPU under one id, granted and ended in one transaction) is one usage record.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from typing import Any, Callable, Iterable, Mapping, Sequence

from coordinator.keys import Keys
from coordinator.notice_records import requester_agent
from coordinator.policy.teams import Membership
from coordinator.records import InvalidRecord, StoredKV, VramLease, load_record

END_REASONS = ("release", "session", "eviction", "reclaim", "revoke")
EVICTED = frozenset({"eviction", "reclaim", "revoke"})   # the reasons counted as evictions suffered
RECORD_FORMAT = 1
HOUR_S = 3600


@dataclasses.dataclass(frozen=True)
class Deleted:
    """One deletion of a revision: its key, the value it had, and the revision that created it."""

    key: bytes
    prev_value: bytes
    create_revision: int
    revision: int


@dataclasses.dataclass(frozen=True)
class UsageRecord:
    """``accounting/records/<lease_id>@<start_revision>``: one ended lease (docs/teams.md, "Usage accounting")."""

    lease_id: str
    agent: str
    team: str
    host: str
    gpus: tuple[str, ...]         # uuids, in index order
    gpu_indexes: tuple[int, ...]
    vram_mb: int                  # per GPU
    exclusive: bool
    start_revision: int           # the lease's create_revision
    end_revision: int             # the revision that deleted it
    start_unix: float             # its created_at (the granting replica's wall clock)
    end_unix: float               # when the leader's accountant saw it end (its wall clock)
    reason: str
    gpu_seconds: float
    vram_mib_seconds: float
    format: int = RECORD_FORMAT
    # Who caused its end, when a notice ended it: the requesting agent (``operator`` for an operator's, a drain's
    # or a lost host's) and that agent's team ("" for the operator). Absent from the records of earlier releases.
    caused_by: str = ""
    caused_team: str = ""
    # GPU-seconds of its GPUs' time below the idle threshold, as the leader's sampled utilization saw it (a lower
    # bound: unknown utilization, or time before the leader started watching, counts as busy). Absent from the
    # records of earlier releases (0).
    idle_gpu_seconds: float = 0.0

    @property
    def key_name(self) -> str:
        return record_name(self.lease_id, self.start_revision)

    def to_json(self) -> dict[str, object]:
        d: dict[str, object] = {name: getattr(self, name) for name in _RECORD_FIELDS}   # (asdict deep-copies)
        d["gpus"], d["gpu_indexes"] = list(self.gpus), list(self.gpu_indexes)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> UsageRecord:
        return cls(**{**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d},
                      "gpus": tuple(d["gpus"]), "gpu_indexes": tuple(d["gpu_indexes"])})


_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(UsageRecord))


def record_name(lease_id: str, start_revision: int) -> str:
    """A record's last key segment: the lease id and the revision that created it (an id can come back)."""
    return f"{lease_id}@{start_revision}"


def seconds(start_unix: float, end_unix: float) -> float:
    """The lease's duration, never negative (two machines' clocks), to the millisecond."""
    return round(max(0.0, end_unix - start_unix), 3)


def how_it_ended(lease: Mapping[str, Any], deleted: Mapping[bytes, bytes], keys: Keys) -> tuple[str, str]:
    """How a lease ended, from the keys deleted in the same revision (module docstring), and who caused it: the
    agent of the ending notice's ``requested_by``, or ``operator`` (a notice that does not say); "" when no
    notice ended it (a release, or its session's end)."""
    if keys.session(str(lease.get("agent", "")), str(lease.get("session_id", ""))) in deleted:
        return "session", ""
    notice = deleted.get(keys.eviction(str(lease.get("id", ""))))
    if notice is None:
        return "release", ""
    try:
        doc = json.loads(notice)
    except ValueError:
        return "eviction", "operator"
    if not isinstance(doc, dict):
        return "eviction", "operator"
    reason = "revoke" if doc.get("revoke") else "reclaim" if doc.get("reclaim") else "eviction"
    return reason, requester_agent(str(doc.get("requested_by") or "operator"))


def ended_in(revision: Sequence[Deleted], keys: Keys, team_of: Callable[[str], str],
             end_unix: float) -> list[UsageRecord]:
    """The usage records of the leases that one revision's deletions ended, sorted by record name. A lease
    record whose value is not readable is skipped (its host was INVALID; nothing was granted on it)."""
    deleted = {d.key: d.prev_value for d in revision}
    parts: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for d in revision:
        try:
            kind, segs = keys.parse(d.key)
        except ValueError:
            continue
        if kind != "leases" or len(segs) != 3:
            continue
        try:
            doc = json.loads(d.prev_value)
        except ValueError:
            continue
        if isinstance(doc, dict) and isinstance(doc.get("id"), str):
            parts[(doc["id"], d.create_revision)].append(doc)
    out = []
    for (lease_id, start_rev), docs in parts.items():
        try:
            out.append(_record(lease_id, start_rev, revision[0].revision, docs, deleted, keys, team_of, end_unix))
        except (KeyError, TypeError, ValueError):
            continue
    return sorted(out, key=lambda r: r.key_name)


def _record(lease_id: str, start_rev: int, end_rev: int, docs: list[dict[str, Any]], deleted: Mapping[bytes, bytes],
            keys: Keys, team_of: Callable[[str], str], end_unix: float) -> UsageRecord:
    # A multi-host gang (its records carry ``hosts``): rank order, then GPU index; the record names rank 0's host.
    ranks = {str(h[0]): n for n, h in enumerate(docs[0].get("hosts") or ()) if isinstance(h, list) and h}
    docs = sorted(docs, key=lambda d: (ranks.get(str(d.get("host")), 0), int(d["gpu_index"])))
    first = docs[0]
    start = float(first["created_at"])
    if not math.isfinite(start):
        raise ValueError("created_at")
    dur = seconds(start, end_unix)
    n = len(docs)
    vram = int(first["vram_mb"])
    reason, causer = how_it_ended(first, deleted, keys)
    return UsageRecord(
        lease_id=lease_id, agent=str(first["agent"]), team=team_of(str(first["agent"])), host=str(first["host"]),
        gpus=tuple(str(d["gpu_uuid"]) for d in docs), gpu_indexes=tuple(int(d["gpu_index"]) for d in docs),
        vram_mb=vram, exclusive=bool(first.get("exclusive", False)), start_revision=start_rev, end_revision=end_rev,
        start_unix=start, end_unix=end_unix, reason=reason,
        gpu_seconds=round(n * dur, 3), vram_mib_seconds=round(n * vram * dur, 3), caused_by=causer,
        caused_team=team_of(causer) if causer and causer != "operator" else "")


# -- rollups ------------------------------------------------------------------------------------------------

def hour_of(unix: float) -> str:
    """The UTC hour a wall time falls in, as its rollup key names it: ``2026-12-04T19``."""
    import time
    return time.strftime("%Y-%m-%dT%H", time.gmtime(unix))


def hour_start(hour: str) -> float:
    import calendar
    import time
    return float(calendar.timegm(time.strptime(hour, "%Y-%m-%dT%H")))


def split_by_hour(start_unix: float, end_unix: float) -> list[tuple[str, float]]:
    """``[start, end)`` cut at UTC hour boundaries: (hour, seconds in it), the seconds summing to ``seconds()``."""
    total = seconds(start_unix, end_unix)
    if total == 0:
        return [(hour_of(end_unix), 0.0)]
    out: list[tuple[str, float]] = []
    t = start_unix
    end = start_unix + total
    while t < end:
        boundary = (math.floor(t / HOUR_S) + 1) * HOUR_S
        piece = min(end, boundary) - t
        out.append((hour_of(t), piece))
        t = min(end, boundary)
    # The pieces sum to the total to the millisecond: the last one takes the rounding.
    head = [(h, round(s, 3)) for h, s in out[:-1]]
    return [*head, (out[-1][0], round(total - sum(s for _, s in head), 3))]


# A rollup: ``accounting/hours/<hour>/<team>`` = {"gpu_s", "vram_mib_s", "evictions", "leases",
# "agents": {agent: [gpu_s, vram_mib_s, evictions, leases]}, "caused", "caused_agents": {agent: count},
# "idle_gpu_s", "idle_agents": {agent: idle_gpu_s}}: the last four, the evictions the team's (and each agent's)
# requests caused in that hour and its idle GPU-seconds, are absent from earlier releases' rollups (read as 0).
def empty_rollup() -> dict[str, Any]:
    return {"gpu_s": 0.0, "vram_mib_s": 0.0, "evictions": 0, "leases": 0, "agents": {}}


def pieces_of(record: UsageRecord) -> list[tuple[str, float]]:
    """The hours a record's time falls in, in order, with its seconds in each."""
    return split_by_hour(record.start_unix, record.end_unix)


def charge(rollups: dict[tuple[str, str], dict[str, Any]], record: UsageRecord,
           pieces: Sequence[tuple[str, float]], final: bool) -> set[tuple[str, str]]:
    """Charge some of ``record``'s hours (``pieces``) to its team's rollups (each present in ``rollups``): GPU-
    and VRAM-seconds by the hour they were used; with ``final`` (these pieces end the record) its eviction and
    its count, in the hour it ended. The (hour, team) keys it touched."""
    touched = set()
    n = len(record.gpus)
    for i, (hour, secs) in enumerate(pieces):
        key = (hour, record.team)
        r = rollups.setdefault(key, empty_rollup())
        a = r["agents"].setdefault(record.agent, [0.0, 0.0, 0, 0])
        gpu_s, vram_s = round(n * secs, 3), round(n * record.vram_mb * secs, 3)
        r["gpu_s"] = round(r["gpu_s"] + gpu_s, 3)
        r["vram_mib_s"] = round(r["vram_mib_s"] + vram_s, 3)
        a[0], a[1] = round(a[0] + gpu_s, 3), round(a[1] + vram_s, 3)
        if record.idle_gpu_seconds > 0:     # by the hours it was held in (absent from earlier releases' rollups)
            idle = round(record.idle_gpu_seconds * secs / max(seconds(record.start_unix, record.end_unix), 1e-9), 3)
            r["idle_gpu_s"] = round(float(r.get("idle_gpu_s", 0.0)) + idle, 3)
            by_agent = r.setdefault("idle_agents", {})
            by_agent[record.agent] = round(float(by_agent.get(record.agent, 0.0)) + idle, 3)
        if final and i == len(pieces) - 1:
            ev = 1 if record.reason in EVICTED else 0
            r["evictions"] += ev
            r["leases"] += 1
            a[2] += ev
            a[3] += 1
        touched.add(key)
    if final and record.caused_team:   # the requester's team caused it, in the hour it ended
        key = (pieces[-1][0], record.caused_team)
        r = rollups.setdefault(key, empty_rollup())
        r["caused"] = int(r.get("caused", 0)) + 1
        by_agent = r.setdefault("caused_agents", {})
        by_agent[record.caused_by] = int(by_agent.get(record.caused_by, 0)) + 1
        touched.add(key)
    return touched


def rollup_keys(record: UsageRecord, pieces: Sequence[tuple[str, float]], final: bool) -> set[tuple[str, str]]:
    """The (hour, team) rollups ``charge`` touches for these pieces of ``record``."""
    keys = {(h, record.team) for h, _ in pieces}
    if final and record.caused_team and pieces:
        keys.add((pieces[-1][0], record.caused_team))
    return keys


@dataclasses.dataclass(frozen=True)
class Unit:
    """Part of one commit: some hours of a record; ``final``: the last of them, and the record itself."""

    record: UsageRecord
    pieces: tuple[tuple[str, float], ...]
    final: bool


def plan_commit(records: Sequence[UsageRecord], i: int, part: int, budget: int) -> tuple[list[Unit], int, int]:
    """What one transaction of at most ``budget`` writes (rollup keys plus records) takes, from record ``i``'s
    piece ``part`` on: the units, and the (record, piece) to go on from. A record of more hours than one
    transaction takes is written over several, its hours first and the record with its last ones."""
    units: list[Unit] = []
    keys: set[tuple[str, str]] = set()
    finals = 0
    while i < len(records):
        r = records[i]
        rest = pieces_of(r)[part:]
        new = rollup_keys(r, rest, True) - keys
        if len(keys) + len(new) + finals + 1 <= budget:
            units.append(Unit(r, tuple(rest), True))
            keys |= new
            finals += 1
            i, part = i + 1, 0
            continue
        room = budget - len(keys) - finals - 1    # every piece a new key, and room kept for nothing else
        if room > 0 and (not units or room >= 8):
            units.append(Unit(r, tuple(rest[:room]), False))
            part += room
        break
    return units, i, part


@dataclasses.dataclass
class Totals:
    gpu_s: float = 0.0
    vram_mib_s: float = 0.0
    evictions: int = 0
    leases: int = 0
    caused: int = 0
    idle_s: float = 0.0

    def add(self, gpu_s: float, vram_mib_s: float, evictions: int, leases: int, caused: int = 0,
            idle_s: float = 0.0) -> None:
        self.gpu_s += gpu_s
        self.vram_mib_s += vram_mib_s
        self.evictions += evictions
        self.leases += leases
        self.caused += caused
        self.idle_s += idle_s

    def row(self) -> dict[str, float | int]:
        """GPU-hours, VRAM-GiB-hours (to 1/1000), evictions suffered, leases ended, evictions caused, idle GPU-hours;
        and the exact seconds."""
        return {"gpu_hours": round(self.gpu_s / HOUR_S, 3),
                "vram_gib_hours": round(self.vram_mib_s / 1024 / HOUR_S, 3),
                "evictions": self.evictions, "leases": self.leases, "evictions_caused": self.caused,
                "idle_gpu_hours": round(self.idle_s / HOUR_S, 3),
                "gpu_seconds": round(self.gpu_s, 3), "vram_mib_seconds": round(self.vram_mib_s, 3),
                "idle_gpu_seconds": round(self.idle_s, 3)}


def totals_from_rollups(rollups: Iterable[tuple[str, str, Mapping[str, Any]]], by: str) -> dict[str, Totals]:
    """Sum (hour, team, rollup) by ``team`` or ``agent``."""
    out: dict[str, Totals] = defaultdict(Totals)
    for _hour, team, r in rollups:
        if by == "team":
            out[team].add(float(r["gpu_s"]), float(r["vram_mib_s"]), int(r["evictions"]), int(r["leases"]),
                          int(r.get("caused", 0)), float(r.get("idle_gpu_s", 0.0)))
        else:
            for agent, (g, v, e, n) in r["agents"].items():
                out[agent].add(float(g), float(v), int(e), int(n))
            for agent, c in (r.get("caused_agents") or {}).items():
                out[agent].add(0.0, 0.0, 0, 0, int(c))
            for agent, idle in (r.get("idle_agents") or {}).items():
                out[agent].add(0.0, 0.0, 0, 0, 0, float(idle))
    return dict(out)


def totals_from_records(records: Iterable[UsageRecord], by: str, since: float, until: float) -> dict[str, Totals]:
    """Sum raw records by ``host`` (or ``team``, ``agent``): the share of each lease's time within [since, until)."""
    out: dict[str, Totals] = defaultdict(Totals)
    for r in records:
        end = r.start_unix + seconds(r.start_unix, r.end_unix)
        lo, hi = max(since, r.start_unix), min(until, end)
        secs = max(0.0, hi - lo)
        ended_inside = since <= end < until
        if secs == 0 and not ended_inside:
            continue
        n = len(r.gpus)
        name = r.host if by == "host" else r.team if by == "team" else r.agent
        share = secs / max(end - r.start_unix, 1e-9) if end > r.start_unix else float(ended_inside)
        out[name].add(n * secs, n * r.vram_mb * secs, int(ended_inside and r.reason in EVICTED), int(ended_inside),
                      idle_s=r.idle_gpu_seconds * share)
    return dict(out)


def decayed_gpu_seconds(rollups: Iterable[tuple[str, float]], live_starts: Iterable[float], now: float,
                        half_life_s: float) -> float:
    """A team's decayed usage (fair share over time, docs/teams.md "Decayed usage"): every GPU-second it used,
    weighted by 2^(-age / half_life). ``rollups``: (hour, GPU-seconds) of its ended leases, each hour's charged at
    the hour's end; ``live_starts``: when each GPU of its live leases was granted (unix s), its running time
    integrated with the decay. A half-life of 0 is no memory: 0 (today's weight-only order)."""
    if half_life_s <= 0:
        return 0.0
    total = 0.0
    for hour, gpu_s in rollups:
        age = max(0.0, now - (hour_start(hour) + 3600.0))
        total += gpu_s * 0.5 ** (age / half_life_s)
    k = math.log(2) / half_life_s
    for start in live_starts:
        total += -math.expm1(-k * max(0.0, now - start)) / k
    return total


def decayed_by_team(keys: Keys, membership: Membership, rollup_kvs: Iterable[StoredKV],
                    records: Iterable[VramLease], half_life_s: float, now: float) -> dict[str, float]:
    """Each team's decayed usage in GPU-seconds (``policy.accounting.decayed_gpu_seconds``): its hourly rollups
    (``accounting/hours/<hour>/<team>``, malformed ones left out) and its live lease records (one per GPU)."""
    rollups: dict[str, list[tuple[str, float]]] = {}
    for kv in rollup_kvs:
        parts = keys.parse(kv.key)[1]
        try:
            value = load_record(kv.value).get("gpu_s")
        except InvalidRecord:
            continue
        gpu_s = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
        if len(parts) == 3 and math.isfinite(gpu_s):
            rollups.setdefault(parts[2], []).append((parts[1], gpu_s))
    live: dict[str, list[float]] = {}
    for lease in records:
        live.setdefault(membership.team_of(lease.agent), []).append(lease.created_at)
    return {team: decayed_gpu_seconds(rollups.get(team, ()), live.get(team, ()), now, half_life_s)
            for team in set(rollups) | set(live)}

