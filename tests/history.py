"""The history checker: replays etcd's whole revision history under a prefix and checks the guarantees.

It reads every event with a watch from revision 1 (with prev_kv), groups them by revision, and after each
revision checks:

* G1 capacity: on every GPU, the sum of live leases <= usable (ledger capacity - partition headroom), and
  every agent's leases on a GPU <= its partition's cap there (when the host has an explicit partition);
* G5 fencing: every new lease's token is greater than every token issued before it on that GPU, and the
  ledger's sequence number is the highest token;
* G6 idempotency: never two live leases with the same (host, agent, request_id) (a request is of one
  host: agent a's request_id on h2 is another request than on h1);
* gangs (issue 21): a gang lease (one record per GPU, each listing the gang) is wholly present or wholly
  absent at every revision; a GPU held exclusively holds no other lease;
* G3 eviction: every eviction notice made for a request of priority P names a preemptible lease of
  priority < P, and a request that had victims is admitted only once all of them are gone (or on room it
  found free, their notices withdrawn in that same revision); notices serve their requester
  (tests/support/history_notices.py): a request's notice stands, and its lease ends under it, only while the
  requester's queue entry (where it still waits) lists that lease;
* G11 teams (tests/support/history_teams.py): no grant takes a team above its limit; a lease's quota mark
  (``over_quota``) agrees with its team's usage; a reclaim notice names another team's over-quota lease (G3's
  priority rule does not apply to it); with teams stored, eviction by priority stays within the requester's team;
* cordons (issue 31, tests/support/history_cordons.py): no lease is created on a host in a revision after
  which its ``cordons/<host>`` key exists;
* time limits (issue 31, tests/support/history_time_limits.py): no lease with a ``time_limit_s`` is live after a
  revision whose records' wall times are past its end + the kill margin + a slack;
* idle GPUs (issue 31, tests/support/history_idle.py): an eviction notice with the reason ``idle`` is put only
  for a lease granted a window before, while the host's usage reports over that window show each of its GPUs at
  a known utilization below the threshold;
* multi-host gangs (G12, issue 30, tests/support/history_multihost.py): a lease whose records carry ``hosts``
  has every (host, uuid) record its ``hosts`` lists, or none, at every revision, all with the same ``hosts``;
* one registration per host (G9, issue 29): ``hosts/<host>`` is put only while it is absent or on the same
  etcd lease (a second daemon, or a coordinator registering for one, never takes over a live
  registration), and ``usage/<host>`` is put only on the etcd lease ``hosts/<host>`` is on;
* G3 order for leases bound to processes, against the node's ``usage/`` reports in the history: a lease
  that ended under an eviction notice (released, or revoked) counts as gone only once the host's report
  lists none of its processes on its GPU, or its ``departing/`` record was forced (the kill margin passed).
  Until then no lease is created for the request that evicted it, and a lease created on that GPU by
  anyone else must fit with the ended lease's VRAM still counted. Leases that went with their session
  (expiry, or the holder closing it) are not held to this: the node's untracked VRAM covers them.
"""
from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from typing import Any

from coordinator.etcd.store import Store, WatchEvent
from coordinator.keys import Keys
from coordinator.policy.departing import reported_pids, still_reported
from coordinator.txn import Range
from tests.support.history_cordons import CordonRules
from tests.support.history_idle import IdleRules
from tests.support.history_multihost import MultiHostRules
from tests.support.history_notices import NoticeRules
from tests.support.history_teams import TeamRules
from tests.support.history_time_limits import SLACK_S as TIME_LIMIT_SLACK_S
from tests.support.history_time_limits import TimeLimitRules

SENTINEL = b"zz-history-sentinel"    # the key a history read writes under its prefix to mark "now"


@dataclasses.dataclass
class HistoryReport:
    revisions: int = 0
    events: int = 0
    leases_created: int = 0
    evictions: int = 0
    # Revisions that wrote lease records of several hosts, none of a multi-host gang: transactions of different
    # hosts that shared one etcd transaction (coordinator/etcd/shared_commits.py), and the leader's batched
    # removals. Counted, not a rule: every rule above holds at each such revision as at any other.
    shared_revisions: int = 0
    # Sessions taken over by another replica (a put of a session record that exists: replica/liveness.py).
    session_takeovers: int = 0
    # Revisions that deleted several session records: sessions that expired together, their keys deleted in shared
    # transactions (replica/ended_together.py). Counted, not a rule: each session's keys still go in one revision.
    sessions_ended_together: int = 0
    max_used: dict[str, int] = dataclasses.field(default_factory=dict)
    violations: list[str] = dataclasses.field(default_factory=list)
    over_capacity: list[tuple[int, str, str]] = dataclasses.field(default_factory=list)   # G1: (rev, host, gpu)
    live_leases: set[bytes] = dataclasses.field(default_factory=set)   # at the end of the replay, by key

    def assert_ok(self) -> None:
        assert not self.violations, "\n".join(self.violations[:20])
        assert self.revisions > 0


# Roots (a test's key prefix) that held no key at a known revision: their history before it is of no use to a
# replay, which may start there from an empty state. A test's etcd is shared by the whole run: a read from
# revision 1 scanned every earlier test's history, and under load the checker ran past its deadline.
_EMPTY_AT: dict[bytes, int] = {}


def empty_at(root: bytes, revision: int) -> None:
    """Record that nothing existed under ``root`` at ``revision`` (read in one snapshot with the revision)."""
    _EMPTY_AT[root] = revision


def history_start(prefix: bytes) -> int:
    """The first revision a read of ``prefix``'s history needs: after the revision where its root was known
    empty, else 1."""
    known = [rev for root, rev in _EMPTY_AT.items() if prefix.startswith(root)]
    return max(known) + 1 if known else 1


async def read_history(store: Store, prefix: bytes, ended: list[int] | None = None) -> list[WatchEvent]:
    """Every event under ``prefix`` from its ``history_start`` (revision 1 unless its root was known empty at a
    later one) until now.

    A sentinel key written under the prefix marks "now": the watch has delivered everything before it
    once the event of this read's own put of the sentinel arrives (an earlier read's put of it is passed).
    """
    sentinel = prefix + SENTINEL
    now = await store.put(sentinel, b"{}")
    events: list[WatchEvent] = []
    async for batch in store.watch(prefix, start_revision=history_start(prefix), prev_kv=True):
        assert not batch.resync, "history was compacted: the checker needs it whole"
        for ev in batch.events:
            # This read's own sentinel: an earlier read's (a history read twice) is history like any event.
            if ev.kv.key == sentinel and ev.kv.mod_revision >= now:
                if ended is not None:
                    ended.append(ev.kv.mod_revision)    # where the read ended: every event before it is in
                return events
            events.append(ev)
    return events


def check_history(events: list[WatchEvent], keys: Keys, time_limit_slack_s: float = TIME_LIMIT_SLACK_S) -> HistoryReport:
    rep = HistoryReport(events=len(events))
    leases: dict[tuple[str, str], dict[str, dict[str, Any]]] = defaultdict(dict)  # (host, gpu) -> id -> lease
    capacity: dict[tuple[str, str], int] = {}
    seq: dict[tuple[str, str], int] = {}
    max_token: dict[tuple[str, str], int] = defaultdict(int)
    partitions: dict[str, dict[str, Any]] = {}
    notices: dict[str, dict[str, Any]] = {}        # lease id -> live eviction notice
    usage: dict[str, dict[str, Any]] = {}          # host -> its node's latest report
    ended: dict[str, dict[str, Any]] = {}          # lease id -> a lease bound to processes that ended under a notice
    forced: set[str] = set()                       # lease ids whose departing record was forced (the kill margin)
    teams = TeamRules()
    registrations: dict[str, int] = {}            # host -> the etcd lease hosts/<host> is on
    notice_rules = NoticeRules()
    cordon_rules = CordonRules()
    time_limit_rules = TimeLimitRules(time_limit_slack_s)
    idle_rules = IdleRules()
    multihost_rules = MultiHostRules()
    by_rev: dict[int, list[WatchEvent]] = defaultdict(list)
    for ev in events:
        if not ev.kv.key.endswith(SENTINEL):      # an earlier history read's mark (under leases/, teams/...)
            by_rev[ev.kv.mod_revision].append(ev)
    for rev in sorted(by_rev):
        rep.revisions += 1
        touched: set[tuple[str, str]] = set()
        touched_ids: set[tuple[str, str]] = set()     # (host, lease id) of the lease records this revision changes
        single_host: set[str] = set()                 # hosts of the lease records it changes, multi-host gangs aside
        granted_from_queue: list[tuple[str, list[str]]] = []
        created: list[tuple[str, str, dict[str, Any]]] = []
        # Sessions that end in this revision (expiry, or closed): their leases go with them.
        sessions_gone = {keys.parse(ev.kv.key)[1][-1] for ev in by_rev[rev]
                         if ev.kind == "DELETE" and keys.parse(ev.kv.key)[0] == "sessions"}
        rep.sessions_ended_together += len(sessions_gone) > 1
        for ev in by_rev[rev]:
            kind, parts = keys.parse(ev.kv.key)
            teams.event(kind, parts, ev)
            notice_rules.event(kind, parts, ev)
            cordon_rules.event(kind, parts, ev)
            time_limit_rules.event(kind, parts, ev)
            idle_rules.event(kind, parts, ev)
            multihost_rules.event(kind, parts, ev)
            if kind == "evictions" and parts:
                if ev.kind == "PUT":
                    notices[parts[0]] = json.loads(ev.kv.value)
                else:
                    notices.pop(parts[0], None)
            elif kind == "usage" and parts:
                if ev.kind == "PUT":
                    usage[parts[0]] = json.loads(ev.kv.value)
                    # (no registration: only a usage report on no etcd lease at all passes, as unit histories build)
                    if ev.kv.etcd_lease != registrations.get(parts[0], 0):
                        rep.violations.append(f"rev {rev}: registration: usage/{parts[0]} put on etcd lease "
                                              f"{ev.kv.etcd_lease:x}, hosts/{parts[0]} is on "
                                              f"{registrations.get(parts[0], 0):x}")
                else:
                    usage.pop(parts[0], None)
            elif kind == "hosts" and parts:
                held = registrations.get(parts[0])
                if ev.kind == "PUT" and held is not None and held != ev.kv.etcd_lease:
                    rep.violations.append(f"rev {rev}: registration: hosts/{parts[0]} moved from etcd lease "
                                          f"{held:x} to {ev.kv.etcd_lease:x} while it lived")
                if ev.kind == "PUT":
                    registrations[parts[0]] = ev.kv.etcd_lease
                else:
                    registrations.pop(parts[0], None)
            elif kind == "sessions" and ev.kind == "PUT" and ev.kv.version > 1:
                rep.session_takeovers += 1
            elif kind == "departing" and ev.kind == "PUT" and json.loads(ev.kv.value).get("forced"):
                forced.add(parts[-1])
            if kind == "evictions" and ev.kind == "PUT":
                rec = json.loads(ev.kv.value)
                rep.evictions += 1
                teams.notice(rec)
                victim = leases.get((rec["host"], rec["gpu_uuid"]), {}).get(rec["lease_id"])
                if victim is None:
                    rep.violations.append(f"rev {rev}: G3 eviction notice for lease {rec['lease_id']} that is not live")
                elif rec.get("requester_priority") is not None and not rec.get("reclaim"):
                    if not victim["preemptible"]:
                        rep.violations.append(f"rev {rev}: G3 non-preemptible lease {victim['id']} was evicted")
                    if int(victim["priority"]) >= int(rec["requester_priority"]):
                        rep.violations.append(
                            f"rev {rev}: G3 lease {victim['id']} of priority {victim['priority']} evicted for a "
                            f"request of priority {rec['requester_priority']}")
            if kind == "queue" and ev.kind == "DELETE" and ev.prev_kv is not None:
                entry = json.loads(ev.prev_kv.value)
                if entry.get("victims"):
                    granted_from_queue.append((entry["lease_id"], list(entry["victims"])))
            if kind == "leases":
                host, gpu, lease_id = parts
                touched.add((host, gpu))
                touched_ids.add((host, lease_id))
                if ev.kind == "PUT":
                    lease = json.loads(ev.kv.value)
                    if ev.kv.version == 1:
                        rep.leases_created += 1
                        teams.created(lease)
                        created.append((host, gpu, lease))
                        if lease["token"] <= max_token[(host, gpu)]:
                            rep.violations.append(
                                f"rev {rev}: G5 token {lease['token']} on {host}/{gpu} is not above "
                                f"{max_token[(host, gpu)]}")
                        max_token[(host, gpu)] = max(max_token[(host, gpu)], lease["token"])
                    leases[(host, gpu)][lease_id] = lease
                    if not lease.get("hosts"):
                        single_host.add(host)
                else:
                    gone = leases[(host, gpu)].pop(lease_id, None)
                    if gone is None:    # etcd only reports the delete of a key that exists
                        rep.violations.append(f"rev {rev}: history read missed events: lease {lease_id} on "
                                              f"{host}/{gpu} deleted, never put")
                    else:
                        teams.deleted(gone)
                    if gone is not None and not gone.get("hosts"):
                        single_host.add(host)
                    bound = gone is not None and (gone.get("pids") or gone.get("pgid"))
                    if bound and lease_id in notices and gone["session_id"] not in sessions_gone:
                        ended[lease_id] = gone | {"requested_by": notices[lease_id].get("requested_by", "")}
            elif kind == "gpus" and ev.kind == "PUT":
                host, gpu = parts
                d = json.loads(ev.kv.value)
                capacity[(host, gpu)] = int(d["capacity_mb"])
                seq[(host, gpu)] = int(d["seq"])
                touched.add((host, gpu))
            elif kind == "partitions":
                host = parts[0]
                if ev.kind == "PUT":
                    partitions[host] = json.loads(ev.kv.value)["partition"]
                else:
                    partitions.pop(host, None)
                touched |= {k for k in leases if k[0] == host}
        rep.shared_revisions += len(single_host) > 1
        for hg in touched:
            host, gpu = hg
            live = leases[hg]
            used = sum(int(x["vram_mb"]) for x in live.values())
            rep.max_used[f"{host}/{gpu}"] = max(rep.max_used.get(f"{host}/{gpu}", 0), used)
            part = partitions.get(host)
            headroom = int(part.get("headroom_mb", 0)) if part else 0
            if hg in capacity and used > capacity[hg] - headroom:
                rep.violations.append(f"rev {rev}: G1 {host}/{gpu} has {used} MiB leased > usable "
                                      f"{capacity[hg] - headroom} MiB")
                rep.over_capacity.append((rev, host, gpu))
            if live and hg in seq and max(int(x["token"]) for x in live.values()) > seq[hg]:
                rep.violations.append(f"rev {rev}: G5 a live token on {host}/{gpu} is above the ledger's seq")
            if part is not None and part.get("mode") != "shared":
                caps = {a["agent"]: dict((u, c) for u, c in a.get("vram_caps_mb", []))
                        for a in part.get("allocations", [])}
                per_agent: dict[str, int] = defaultdict(int)
                for x in live.values():
                    per_agent[x["agent"]] += int(x["vram_mb"])
                for agent, mb in per_agent.items():
                    cap = caps.get(agent, {}).get(gpu, 0)
                    if mb > cap:
                        rep.violations.append(f"rev {rev}: G1 agent {agent} holds {mb} MiB on {host}/{gpu}, "
                                              f"above its cap {cap} MiB")
        # Gangs: wholly present or absent; exclusive GPUs not shared.
        for host, lease_id in touched_ids:
            on = {gpu: live[lease_id] for (h, gpu), live in leases.items() if h == host and lease_id in live}
            gangs = {tuple(x.get("gang") or ()) for x in on.values()}
            gang = next(iter(gangs)) if len(gangs) == 1 else None
            if on and (gang is None or (gang and set(on) != set(gang)) or (not gang and len(on) > 1)):
                rep.violations.append(f"rev {rev}: gang lease {lease_id} partly held: on {sorted(on)}, gang "
                                      f"{sorted(gangs)}")
        for hg in touched:
            live = leases[hg]
            if any(x.get("exclusive") for x in live.values()) and len(live) > 1:
                rep.violations.append(f"rev {rev}: exclusive GPU {hg[0]}/{hg[1]} shared by {sorted(live)}")
        # G3 for leases bound to processes: an ended victim is gone once the node lists none of its processes.
        for host, gpu, lease in created:
            held = []
            for v in ended.values():
                if (v["host"], v["gpu_uuid"]) != (host, gpu) or v["id"] in forced:
                    continue
                if not still_reported(usage.get(host), gpu, v["id"], v.get("pids", ())):
                    continue
                held.append(v)
                pids = list(reported_pids(usage.get(host), gpu, v["id"], v.get("pids", ())))
                if v["requested_by"] == f"{lease['agent']}/{lease['request_id']}":
                    rep.violations.append(f"rev {rev}: G3 lease {lease['id']} admitted while its victim {v['id']}'s "
                                          f"processes {pids} are still reported on {host}/{gpu}")
            if held:
                part = partitions.get(host)
                usable = capacity.get((host, gpu), 0) - (int(part.get("headroom_mb", 0)) if part else 0)
                used = sum(int(x["vram_mb"]) for x in leases[(host, gpu)].values()) + sum(
                    int(v["vram_mb"]) for v in held)
                if (host, gpu) in capacity and used > usable:
                    rep.violations.append(
                        f"rev {rev}: G3 lease {lease['id']} admitted on {host}/{gpu} with {used} MiB held > usable "
                        f"{usable} MiB, counting ended leases {[v['id'] for v in held]} whose processes are "
                        "still reported")
        rep.violations += teams.check(rev, leases)
        # G3: a request with victims is admitted only after they are all gone, or on room it found free with
        # their notices withdrawn in that same revision.
        live_ids = {lease_id for live in leases.values() for lease_id in live}
        withdrawn = notice_rules.withdrawn_now()
        for lease_id, victims in granted_from_queue:
            if lease_id in live_ids:
                still = [v for v in victims if v in live_ids and v not in withdrawn]
                if still:
                    rep.violations.append(f"rev {rev}: G3 lease {lease_id} admitted while its victims {still} live")
        rep.violations += notice_rules.check(rev)
        rep.violations += cordon_rules.check(rev)
        rep.violations += time_limit_rules.check(rev)
        rep.violations += idle_rules.check(rev)
        rep.violations += multihost_rules.check(rev)
        # G6 across every GPU of a host: the lease id is a function of (host, agent, request_id); it repeats
        # only on the GPUs of one gang, each record listing them all.
        seen: dict[tuple[str, str, str], tuple[str, ...]] = {}
        for (host, gpu), live in leases.items():
            for x in live.values():
                k = (host, x["agent"], x["request_id"])
                gang = tuple(x.get("gang") or ())
                if k in seen and (not gang or seen[k] != gang or gpu not in gang):
                    rep.violations.append(f"rev {rev}: G6 two live leases for request {k}")
                seen[k] = gang
    rep.live_leases = {keys.lease(host, gpu, lease_id) for (host, gpu), live in leases.items() for lease_id in live}
    return rep


async def check_store(store: Store, keys: Keys, time_limit_slack_s: float = TIME_LIMIT_SLACK_S) -> HistoryReport:
    """``time_limit_slack_s``: see ``TimeLimitRules`` (a fault test widens it by its leader failover)."""
    ended: list[int] = []
    report = check_history(await read_history(store, keys.root(), ended), keys, time_limit_slack_s)
    await _confirm_capacity_violations(store, keys, report)
    await _confirm_replay(store, keys, report, ended[0])
    return report


def replay_differs(report: HistoryReport, etcd_leases: set[bytes], revision: int) -> list[str]:
    """What the replay's live leases at its end lack or have beyond etcd's own (read at ``revision``, where the
    history read ended): a history read that missed events (a lost DELETE leaves a phantom lease, which can
    show as a G1 over-commit that etcd never had)."""
    phantom, missing = sorted(report.live_leases - etcd_leases), sorted(etcd_leases - report.live_leases)
    if not phantom and not missing:
        return []
    return [f"rev {revision}: history read missed events: the replay holds {len(phantom)} leases etcd does not "
            f"({[k.decode() for k in phantom[:3]]}), etcd {len(missing)} the replay does not "
            f"({[k.decode() for k in missing[:3]]})"]


async def _confirm_replay(store: Store, keys: Keys, report: HistoryReport, ended: int) -> None:
    """etcd's leases at the revision where the history read ended (its sentinel's) against the replay's."""
    kvs = await store.read_at(Range(keys.kind("leases"), prefix=True), ended)
    report.violations += replay_differs(report, {kv.key for kv in kvs if not kv.key.endswith(SENTINEL)}, ended)


async def _confirm_capacity_violations(store: Store, keys: Keys, report: HistoryReport) -> None:
    """Read the GPU's leases again at the revision of each G1 violation (etcd keeps the whole history in
    the tests), so that a report says which leases overlapped, or that the history read missed events."""
    checked: list[str] = []
    for rev, host, gpu in report.over_capacity[:3]:
        kvs = await store.read_at(Range(keys.leases(host, gpu), prefix=True), rev)
        live = [json.loads(kv.value) | {"create_revision": kv.create_revision} for kv in kvs]
        total = sum(int(x["vram_mb"]) for x in live)
        checked.append(f"  etcd at rev {rev}: {len(live)} leases, {total} MiB on {host}/{gpu}: " + ", ".join(
            f"{x['id']} {x['vram_mb']} MiB agent {x['agent']} req {x.get('request_id')} created {x['create_revision']}"
            for x in live))
    report.violations += checked
