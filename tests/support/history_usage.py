"""The usage records against etcd's history (issue 33): every lease that ended after accounting began, and up
to where the accountant's cursor has reached, has exactly one record (none missing, none twice, none for a
lease that never ended), and the record says what the history says:

* its GPUs, host, agent, VRAM per GPU: those of the lease records deleted;
* its start: the revision that created the lease and the lease's ``created_at``; its end revision: the
  revision that deleted it, and its end time lies between the wall times the history already held then (the
  latest ``created_at`` of a lease created before it, the latest cursor time before it) and the cursor time of
  the transaction that wrote the record;
* its GPU-seconds and VRAM-MiB-seconds: GPUs x (end - start) (x VRAM), to the millisecond;
* how it ended, by the rule of docs/teams.md (session key deleted in that revision: ``session``; else its
  notice deleted: ``revoke``/``reclaim``/``eviction`` by the notice's flags; else ``release``), written
  here again from the history rather than taken from the accountant's code;
* each record's idle GPU-seconds lie within [0, its GPU-seconds] (the accountant measures them on its own clock
  from the sampled utilization: the history bounds them, it cannot give them exactly);
* the rollups, as they stand at the end, sum to the records per team (GPU-seconds, evictions, leases, idle
  GPU-seconds), when no record or rollup was swept by retention.

The checker reads the same events as ``tests.history.read_history``."""
from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from typing import Any

from coordinator.etcd.store import WatchEvent
from coordinator.keys import Keys


@dataclasses.dataclass
class UsageReport:
    ended: int = 0          # leases that ended while accounting ran, up to the cursor
    pending: int = 0        # leases that ended after the cursor's last position (not checked)
    partial_commits: int = 0   # cursor writes inside a revision (one written in parts)
    records: int = 0
    gpu_seconds: dict[str, float] = dataclasses.field(default_factory=dict)    # per team, from the history
    violations: list[str] = dataclasses.field(default_factory=list)

    def assert_ok(self) -> None:
        assert not self.violations, "\n".join(self.violations[:20])


def check_usage(events: list[WatchEvent], keys: Keys) -> UsageReport:
    rep = UsageReport()
    by_rev: dict[int, list[WatchEvent]] = defaultdict(list)
    for ev in events:
        by_rev[ev.kv.mod_revision].append(ev)
    began: int | None = None     # the revision the first cursor put says accounting starts after
    cursor = 0
    wall = 0.0                   # the latest wall time the history held so far
    cursor_at: dict[int, float] = {}
    ended: dict[str, dict[str, Any]] = {}       # "<id>@<create rev>" -> what the history says
    written: dict[str, list[tuple[int, dict[str, Any]]]] = defaultdict(list)
    rollups: dict[bytes, dict[str, Any]] = {}
    by_end: dict[int, int] = defaultdict(int)    # records written so far, by the revision their lease ended
    swept = False
    for rev in sorted(by_rev):
        evs = by_rev[rev]
        partial: dict[str, Any] | None = None
        gone = {ev.kv.key: ev.prev_kv for ev in evs if ev.kind == "DELETE"}
        for ev in evs:
            kind, parts = keys.parse(ev.kv.key)
            if kind == "accounting" and parts[:1] == ["cursor"] and ev.kind == "PUT":
                doc = json.loads(ev.kv.value)
                began = doc["revision"] if began is None else began
                cursor = doc["revision"]
                cursor_at[rev] = doc["at"]
                rep.partial_commits += bool(doc.get("skip") or doc.get("part"))
                partial = doc if doc.get("skip") or doc.get("part") else None
            elif kind == "accounting" and parts[:1] == ["records"]:
                if ev.kind == "PUT":
                    written[parts[1]].append((rev, json.loads(ev.kv.value)))
                    by_end[written[parts[1]][-1][1]["end_revision"]] += 1
                else:
                    swept = True
            elif kind == "accounting" and parts[:1] == ["hours"]:
                if ev.kind == "PUT":
                    rollups[ev.kv.key] = json.loads(ev.kv.value)
                else:
                    rollups.pop(ev.kv.key, None)
                    swept = True
            elif kind == "leases" and ev.kind == "DELETE" and ev.prev_kv is not None and began is not None \
                    and rev > began:
                doc = json.loads(ev.prev_kv.value)
                name = f"{doc['id']}@{ev.prev_kv.create_revision}"
                reason, causer = _ended(doc, gone, keys)
                e = ended.setdefault(name, {"doc": doc, "gpus": [], "rev": rev, "wall": wall,
                                            "reason": reason, "caused_by": causer})
                e["gpus"].append((doc["gpu_index"], doc["gpu_uuid"]))
                if e["rev"] != rev:
                    rep.violations.append(f"lease {name}: its GPUs went at revisions {e['rev']} and {rev}")
        if partial is not None and by_end[partial["revision"] + 1] != partial["skip"]:
            # A new leader resumes from this cursor: it must count exactly the records of that revision written.
            rep.violations.append(f"cursor at revision {rev} says {partial['skip']} records of revision "
                                  f"{partial['revision'] + 1} are written; {by_end[partial['revision'] + 1]} are")
        for ev in evs:
            if ev.kind == "PUT" and keys.parse(ev.kv.key)[0] == "leases":
                wall = max(wall, float(json.loads(ev.kv.value).get("created_at", 0)))
        wall = max(wall, cursor_at.get(rev, 0.0))
    due = {n: e for n, e in ended.items() if e["rev"] <= cursor}
    rep.ended = len(due)
    rep.pending = len(ended) - len(due)
    rep.records = len(written)
    for name, e in due.items():
        puts = written.get(name, [])
        if not puts:
            rep.violations.append(f"lease {name} ended at revision {e['rev']} and has no usage record")
            continue
        if len(puts) > 1:
            rep.violations.append(f"lease {name} has {len(puts)} usage records (revisions {[r for r, _ in puts]})")
        _compare(rep, name, e, *puts[0], cursor_at)
    for name in set(written) - set(ended):
        rep.violations.append(f"usage record {name} is of no lease that ended while accounting ran")
    if not swept:
        _compare_rollups(rep, [doc for puts in written.values() for _, doc in puts[:1]], rollups)
    return rep


def _ended(doc: dict[str, Any], gone: dict[bytes, Any], keys: Keys) -> tuple[str, str]:
    """How the lease ended, and who asked for the notice that ended it (its requested_by's agent, or operator;
    "" for none)."""
    if keys.session(doc["agent"], doc["session_id"]) in gone:
        return "session", ""
    notice = gone.get(keys.eviction(doc["id"]))
    if notice is None:
        return "release", ""
    n = json.loads(notice.value)
    reason = "revoke" if n.get("revoke") else "reclaim" if n.get("reclaim") else "eviction"
    return reason, str(n.get("requested_by") or "operator").split("/", 1)[0] or "operator"


def _compare(rep: UsageReport, name: str, e: dict[str, Any], at_rev: int, rec: dict[str, Any],
             cursor_at: dict[int, float]) -> None:
    doc = e["doc"]
    gpus = [u for _, u in sorted(e["gpus"])]
    n = len(gpus)
    want = {"agent": doc["agent"], "host": doc["host"], "gpus": gpus, "vram_mb": doc["vram_mb"],
            "end_revision": e["rev"], "start_unix": doc["created_at"], "reason": e["reason"],
            "caused_by": e.get("caused_by", "")}
    hosts = [str(h) for h, _ in doc.get("hosts") or ()]
    if len(hosts) > 1:
        # A multi-host gang (issue 30): the record names one host and lists its GPUs by index, the order between
        # hosts' equal indexes left to the accountant (which host it names is not yet a rule): one of the gang's
        # hosts, and the gang's GPUs in any order.
        if rec.get("host") in hosts:
            want["host"] = rec["host"]
        if sorted(rec.get("gpus") or ()) == sorted(gpus):
            want["gpus"] = rec["gpus"]
    if "caused_by" not in rec:      # a record of an earlier release (format 1 without it)
        del want["caused_by"]
    for k, v in want.items():
        if rec.get(k) != v:
            rep.violations.append(f"usage record {name}: {k} is {rec.get(k)!r}, the history says {v!r}")
    if int(name.rsplit("@", 1)[1]) != rec.get("start_revision"):
        rep.violations.append(f"usage record {name}: start_revision {rec.get('start_revision')}")
    end = float(rec["end_unix"])
    written_at = cursor_at.get(at_rev)
    if written_at is None:
        rep.violations.append(f"usage record {name} was written without the cursor (revision {at_rev})")
    elif not e["wall"] - 0.5 <= end <= written_at:
        rep.violations.append(f"usage record {name}: its end {end} is not between the history's time at its "
                              f"end ({e['wall']}) and when it was written ({written_at})")
    secs = max(0.0, round(end - float(doc["created_at"]), 3))
    if abs(rec["gpu_seconds"] - n * secs) > 0.002 or abs(rec["vram_mib_seconds"] - n * doc["vram_mb"] * secs) > 0.5:
        rep.violations.append(f"usage record {name}: {rec['gpu_seconds']} GPU-s, {rec['vram_mib_seconds']} "
                              f"MiB-s; the history says {n * secs} and {n * doc['vram_mb'] * secs}")
    idle = float(rec.get("idle_gpu_seconds", 0.0))   # (absent from earlier releases' records: 0)
    if not 0.0 <= idle <= rec["gpu_seconds"] + 0.002:
        rep.violations.append(f"usage record {name}: {idle} idle GPU-s, outside [0, its {rec['gpu_seconds']} GPU-s]")
    rep.gpu_seconds[rec["team"]] = rep.gpu_seconds.get(rec["team"], 0.0) + n * secs


def _compare_rollups(rep: UsageReport, records: list[dict[str, Any]], rollups: dict[bytes, dict[str, Any]]) -> None:
    from_records: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0, 0])
    idle: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])     # team -> records', rollups' idle GPU-s
    for r in records:
        t = from_records[r["team"]]
        idle[r["team"]][0] += float(r.get("idle_gpu_seconds", 0.0))
        t[0] += r["gpu_seconds"]
        t[1] += r["reason"] in ("eviction", "reclaim", "revoke")
        t[2] += 1
        if r.get("caused_team"):
            from_records[r["caused_team"]][3] += 1
    from_rollups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0, 0])
    for key, r in rollups.items():
        t = from_rollups[key.decode().rsplit("/", 1)[1]]
        idle[key.decode().rsplit("/", 1)[1]][1] += float(r.get("idle_gpu_s", 0.0))
        t[0] += r["gpu_s"]
        t[1] += r["evictions"]
        t[2] += r["leases"]
        t[3] += r.get("caused", 0)
    for team in set(from_records) | set(from_rollups):
        a, b = from_records[team], from_rollups[team]
        if abs(a[0] - b[0]) > 0.01 * max(1, a[2]) or a[1:] != b[1:]:
            rep.violations.append(f"team {team}: records sum to {a}, rollups to {b} (GPU-s, evictions, leases, "
                                  "evictions caused)")
        if abs(idle[team][0] - idle[team][1]) > 0.01 * max(1, a[2]):
            rep.violations.append(f"team {team}: records sum to {idle[team][0]} idle GPU-s, rollups to {idle[team][1]}")
