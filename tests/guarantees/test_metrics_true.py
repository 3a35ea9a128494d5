"""Metrics that are true (issue 29): every way a lease ends counts in ``gpucoord_releases_total{reason}``; the
fleet gauges follow the replica's watch with no ``status`` call; the node exports only its own families; a
read of an unknown host is NOT_FOUND and makes no series; and the Grafana dashboard's lease and VRAM panels,
evaluated on the scraped text, give the right numbers."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid
from typing import Any

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent_client import Client
from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from coordinator import metrics
from coordinator.deploy import DASHBOARD
from tests.support import REPO
from tests.support.cluster import Cluster
from tests.support.processes import child_env
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

USABLE_MB = 16384   # the node's 1x16GiB GPU; the coordinator's default headroom is 0
MIB = metrics.MIB   # the VRAM gauges are in bytes


def scrape(registry: Any = metrics.REGISTRY) -> list[tuple[str, dict[str, str], float]]:
    """The text a scrape reads, parsed back into samples."""
    return [(s.name, dict(s.labels), s.value) for fam in text_string_to_metric_families(generate_latest(registry).decode())
            for s in fam.samples]


def sample(name: str, **labels: str) -> float | None:
    return metrics.REGISTRY.get_sample_value(name, labels)


def releases() -> dict[str, float]:
    return {r: sample("gpucoord_releases_total", reason=r) or 0.0 for r in metrics.RELEASE_REASONS}


_EXPR = re.compile(r'^(max|sum) by \(([^)]*)\) \((\w+)(?:\{([^}]*)\})?\)$')


def evaluate(expr: str, samples: list[tuple[str, dict[str, str], float]]) -> dict[tuple[str, ...], float]:
    """The few PromQL forms the lease, VRAM and team panels use: ``max|sum by (L, ...) (name{k="v", ...})``."""
    m = _EXPR.match(expr)
    assert m, f"the evaluator does not know {expr!r}"
    agg, by, name, matchers = m.groups()
    keys = [x.strip() for x in by.split(",")]
    want = dict(re.findall(r'(\w+)="([^"]*)"', matchers or ""))
    out: dict[tuple[str, ...], list[float]] = {}
    for n, labels, value in samples:
        if n == name and all(labels.get(k) == v for k, v in want.items()):
            out.setdefault(tuple(labels.get(k, "") for k in keys), []).append(value)
    return {k: (max(v) if agg == "max" else sum(v)) for k, v in out.items()}


def panel(title_word: str) -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    (p,) = [p for p in doc["panels"] if title_word in p["title"]]
    return [t["expr"] for t in p["targets"]]


def test_every_end_counts_and_the_gauges_follow_the_watch(cluster: Cluster) -> None:
    daemon = cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    gpu = daemon.inventory.gpus[0].uuid if daemon.inventory is not None else ""
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(addr))
    stub.SetTeam(pb.SetTeamRequest(name="ta", quota_mb=4096, members=pb.TeamMembers(patterns=["agent-a"])),
                 timeout=10)
    before = releases()

    def gauges_are(leases: int, leased_mb: int, team_used: int) -> None:
        def ok() -> bool:
            return (sample("gpucoord_leases", host="h1") == leases
                    and sample("gpucoord_vram_bytes", host="h1", gpu=gpu, kind="leased") == leased_mb * MIB
                    and sample("gpucoord_vram_bytes", host="h1", gpu=gpu, kind="free") == (USABLE_MB - leased_mb) * MIB
                    and sample("gpucoord_team_vram_bytes", team="ta", kind="used") == team_used * MIB)
        wait_for(ok, timeout=30, what=f"gauges at {leases} leases, {leased_mb} MiB leased, team {team_used}")
        # The dashboard's panels, evaluated on what a scrape reads, say the same.
        samples = scrape()
        (lease_expr,) = panel("Live VRAM leases")
        assert evaluate(lease_expr, samples)[("h1",)] == leases
        leased_expr, free_expr = panel("VRAM leased and free")
        assert evaluate(leased_expr, samples)[("h1", gpu)] == leased_mb * MIB
        assert evaluate(free_expr, samples)[("h1", gpu)] == (USABLE_MB - leased_mb) * MIB
        used_expr = panel("Teams")[0]
        assert evaluate(used_expr, samples)[("ta",)] == team_used * MIB

    def delta() -> dict[str, float]:
        now = releases()
        return {r: now[r] - before[r] for r in now if now[r] != before[r]}

    a = Client(addr, agent="agent-a", host="h1")
    b = Client(addr, agent="agent-b", host="h1")
    l1, l2 = a.acquire(1000), a.acquire(2000)
    l3 = b.acquire(3000)
    gauges_are(3, 6000, 3000)
    assert delta() == {}

    assert stub.RevokeLease(pb.RevokeLeaseRequest(lease_id=l2.id), timeout=10).revoked
    gauges_are(2, 4000, 1000)
    l1.release()
    gauges_are(1, 3000, 0)
    a.acquire(500)
    a.close()                      # a close ends its lease
    b.close()                      # and this one ends l3
    gauges_are(0, 0, 0)
    assert delta() == {"revoke": 1, "release": 1, "close": 2}, delta()
    del l3

    # An expiry: a session that stops keeping alive, with a lease.
    sid = stub.OpenSession(pb.OpenSessionRequest(agent="agent-a", host="h1", ttl_seconds=2), timeout=10).session_id
    stub.Acquire(pb.AcquireRequest(session=pb.SessionRef(agent="agent-a", session_id=sid), vram_mb=700,
                                   request_id=uuid.uuid4().hex), timeout=10)
    gauges_are(1, 700, 700)
    wait_for(lambda: delta().get("expiry") == 1, timeout=30, what="the expiry counted")
    gauges_are(0, 0, 0)
    assert delta() == {"revoke": 1, "release": 1, "close": 2, "expiry": 1}, delta()


def test_an_eviction_and_a_reclaim_count_by_their_reason(cluster: Cluster) -> None:
    """The leader's two ends at a notice's deadline: a priority eviction counts as ``eviction``, a team's
    reclaim of another team's over-quota lease as ``reclaim`` (the holders ignore their notices)."""
    cluster.start_node("h1", "2x16GiB", heartbeat_s=3600)
    addr = cluster.start_coordinator(eviction_grace_s=1.0, eviction_kill_margin_s=0.5)
    before = releases()

    def delta() -> dict[str, float]:
        now = releases()
        return {r: now[r] - before[r] for r in now if now[r] != before[r]}

    with Client(addr, agent="low", host="h1") as low, Client(addr, agent="high", host="h1") as high:
        victims = [low.acquire(16000, gpu=i, priority=0) for i in (0, 1)]
        granted = high.acquire(10000, priority=5, wait=30)
        assert sum(v.evicting.is_set() for v in victims) == 1
        wait_for(lambda: delta() == {"eviction": 1}, timeout=30, what=f"the eviction counted, not {delta()}")
        granted.release()
    wait_for(lambda: delta() == {"eviction": 1, "release": 1, "close": 1}, timeout=30,
             what=f"the release and the close counted, not {delta()}")

    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(addr))
    for team in ("a", "b"):
        stub.SetTeam(pb.SetTeamRequest(name=team, quota_mb=USABLE_MB, limit_mb=2 * USABLE_MB,
                                       members=pb.TeamMembers(patterns=[f"{team}-*"])), timeout=10)
    with Client(addr, agent="a-1", host="h1") as a, Client(addr, agent="b-1", host="h1") as b:
        held = [a.acquire(0, gpu=i, exclusive=True, priority=9) for i in (0, 1)]
        assert [x.over_quota for x in held] == [False, True]
        b.acquire(0, exclusive=True, wait=30)
        assert held[1].evicting.is_set() and held[1].notice.reclaim_team == "b", held[1].notice
        wait_for(lambda: delta().get("reclaim") == 1, timeout=30, what=f"the reclaim counted, not {delta()}")
    wait_for(lambda: delta() == {"eviction": 1, "release": 1, "close": 3, "reclaim": 1}, timeout=30,
             what=f"the closes counted, not {delta()}")


def test_an_unknown_host_is_not_found_and_makes_no_series(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(addr))
    with pytest.raises(grpc.RpcError) as info:
        stub.GetStatus(pb.GetStatusRequest(host="nosuch"), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and info.value.details().startswith("host: "), \
        info.value.details()
    assert stub.GetStatus(pb.GetStatusRequest(host="h1"), timeout=10).hosts[0].host == "h1"
    # The command: exit 1 with one line naming the field, nothing on stdout.
    done = subprocess.run([sys.executable, "-m", "coordinator.cli", "status", "--host", "nosuch", "--coordinator",
                           addr], capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=60,
                          stdin=subprocess.DEVNULL)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and done.stdout == "", (done.returncode, done.stdout, done.stderr)
    assert len(lines) == 1 and lines[0].startswith("gpucoord: error: NOT_FOUND: host: "), lines
    assert not [s for s in scrape() if s[1].get("host") == "nosuch"]


def test_the_node_exports_only_its_own_families() -> None:
    node = {name for name, _, _ in scrape(metrics.NODE_REGISTRY) if not name.endswith("_created")}
    coordinator_only = {"gpucoord_leases", "gpucoord_vram_bytes", "gpucoord_team_vram_bytes", "gpucoord_releases_total",
                        "gpucoord_admissions_total", "gpucoord_acquire_seconds_count", "gpucoord_keepalive_streams"}
    assert not node & coordinator_only, node & coordinator_only
    assert {n for n in node if n.startswith("gpucoord_")} <= (
        {n for n in node if n.startswith("gpucoord_node_")}
        | {"gpucoord_refusals_total", "gpucoord_etcd_errors_total", "gpucoord_etcd_nospace_total",
           "gpucoord_metrics_refusals_total", "gpucoord_tls_handshake_failures_total"})


def test_the_gauges_of_a_fleet_larger_than_one_slice_cover_every_host_and_leave_and_come_back_with_them(
        cluster: Cluster) -> None:
    """The gauges compute ``HOSTS_AT_ONCE`` host views at most between two yields to the event loop: every host of a
    fleet several slices large gets its series, loses them when it goes, and gets them again when it comes back
    with the very same values (a replica sets only the series whose value moved since it last set them)."""
    from coordinator.node.fake_hosts import fake_host_names, register_fake_hosts
    from coordinator.replica.gauges import HOSTS_AT_ONCE
    count = 2 * HOSTS_AT_ONCE + 7
    prefix = f"g{uuid.uuid4().hex[:6]}"
    names = fake_host_names(prefix, count)
    cluster.start_coordinator()
    registration = cluster.lt.run(register_fake_hosts(cluster.store, cluster.keys, prefix, count, "1x16GiB"))
    try:
        wait_for(lambda: all(sample("gpucoord_leases", host=h) == 0.0 for h in names), 60,
                 f"the lease gauge of all {count} hosts")
        free = [s for s in scrape() if s[0] == "gpucoord_vram_bytes" and s[1].get("kind") == "free"
                and s[1].get("host", "").startswith(prefix)]
        assert sorted(s[1]["host"] for s in free) == sorted(names)
        assert all(s[2] == USABLE_MB * MIB for s in free)
    finally:
        cluster.lt.run(registration.close())
    wait_for(lambda: all(sample("gpucoord_leases", host=h) is None for h in names), 60,
             f"the series of all {count} hosts gone with them")
    registration = cluster.lt.run(register_fake_hosts(cluster.store, cluster.keys, prefix, count, "1x16GiB"))
    try:
        def back() -> bool:
            free = {s[1]["host"]: s[2] for s in scrape() if s[0] == "gpucoord_vram_bytes"
                    and s[1].get("kind") == "free" and s[1].get("host", "").startswith(prefix)}
            return (all(sample("gpucoord_leases", host=h) == 0.0 for h in names)
                    and free == {h: USABLE_MB * MIB for h in names})
        wait_for(back, 60, f"the series of all {count} hosts back with them")
    finally:
        cluster.lt.run(registration.close())


def test_a_hosts_usage_report_reaches_its_gauges_within_the_usage_interval_even_in_a_quiet_fleet(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host whose usage report alone changed has its series computed again at most every ``USAGE_EVERY_S``
    (daemons rewrite their reports every few seconds): two reports in a row, the second within that interval
    of the first, and then nothing more in the whole fleet. The second still reaches the gauge, on time."""
    from coordinator.node.fake_hosts import fake_host_names, register_fake_hosts
    from coordinator.replica import gauges
    from coordinator.txn import Put
    monkeypatch.setattr(gauges, "USAGE_EVERY_S", 2.0)
    prefix = f"u{uuid.uuid4().hex[:6]}"
    (host,) = fake_host_names(prefix, 1)
    cluster.start_coordinator()
    registration = cluster.lt.run(register_fake_hosts(cluster.store, cluster.keys, prefix, 1, "1x16GiB"))
    try:
        (kv,) = cluster.get_prefix(cluster.keys.usage(host))
        doc = json.loads(kv.value)
        gpu = doc["gpus"][0]["uuid"]
        wait_for(lambda: sample("gpucoord_gpu_utilization_percent", host=host, gpu=gpu) is not None, 30,
                 "the host's utilization series")

        def report(pct: int) -> None:
            doc["gpus"][0]["utilization_pct"] = pct
            cluster.lt.run(cluster.store.commit([], [Put(kv.key, json.dumps(doc).encode(), kv.etcd_lease)]))
        report(40)
        wait_for(lambda: sample("gpucoord_gpu_utilization_percent", host=host, gpu=gpu) == 40.0, 30,
                 "the first report in the gauge")
        report(70)      # within USAGE_EVERY_S of the first: its turn comes later, with nothing else to wake it
        wait_for(lambda: sample("gpucoord_gpu_utilization_percent", host=host, gpu=gpu) == 70.0, 30,
                 "the second report in the gauge")
    finally:
        cluster.lt.run(registration.close())


def test_a_daemons_rewrite_of_the_same_figures_computes_nothing_and_a_stale_hosts_figures_come_back(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon rewrites its report every heartbeat, most often with a new ``ts`` alone: its host's series are not
    computed again for that (a fleet of 10,000 hosts sends about 2,000 such rewrites a second). A new figure still
    reaches them; and a host whose series were computed while its report was stale (its daemon stuck) gets its
    figures back when the daemon rewrites the very same ones."""
    from coordinator.node.fake_hosts import fake_host_names, register_fake_hosts
    from coordinator.record_fields import dumps
    from coordinator.replica import gauges
    from coordinator.txn import Put
    monkeypatch.setattr(gauges, "USAGE_EVERY_S", 0.0)     # a usage report's change is followed at once
    computed: list[str] = []
    stuck: set[str] = set()     # hosts whose report the replica sees as stale (as of a daemon stuck long ago)
    real_view = gauges.host_view

    def counted(keys: Any, host: str, snap: Any, untracked: bool, usage_age: Any) -> Any:
        computed.append(host)
        return real_view(keys, host, snap, untracked, (lambda kv: 1e9) if host in stuck else usage_age)
    monkeypatch.setattr(gauges, "host_view", counted)
    prefix = f"s{uuid.uuid4().hex[:6]}"
    host, other = fake_host_names(prefix, 2)
    addr = cluster.start_coordinator()
    registration = cluster.lt.run(register_fake_hosts(cluster.store, cluster.keys, prefix, 2, "1x16GiB"))
    try:
        reports = {h: cluster.get_prefix(cluster.keys.usage(h))[0] for h in (host, other)}
        docs = {h: json.loads(kv.value) for h, kv in reports.items()}
        gpu = {h: docs[h]["gpus"][0]["uuid"] for h in (host, other)}

        def utilization(h: str) -> float | None:
            return sample("gpucoord_gpu_utilization_percent", host=h, gpu=gpu[h])

        def report(h: str, pct: int) -> None:
            """As a daemon writes it: its bytes (sorted keys, ``ts`` last), a new ``ts``."""
            docs[h]["gpus"][0]["utilization_pct"] = pct
            value = dumps(docs[h] | {"interval_s": 5.0, "ts": time.time()})
            cluster.lt.run(cluster.store.commit([], [Put(reports[h].key, value, reports[h].etcd_lease)]))

        marks = iter(range(1, 100))

        def every_host_looked_at() -> None:
            """Two passes of the gauges since now, each seen through a new figure of the other host."""
            for _ in range(2):
                mark = next(marks)
                report(other, mark)
                wait_for(lambda m=mark: utilization(other) == m, 30, f"the other host's figure {mark}")

        # A stale report (its daemon stuck): a lease on the host (its shape moves) has its series computed again,
        # with the utilization unknown (-1).
        report(host, 40)
        wait_for(lambda: utilization(host) == 40.0, 30, "the host's first figure")
        stuck.add(host)
        with Client(addr, agent=f"a{prefix}", host=host) as c:
            c.acquire(1024).release()
        wait_for(lambda: utilization(host) == -1.0, 30, "the host's stale report in its gauge")
        # The daemon is back with the very same figures: they count again.
        stuck.discard(host)
        report(host, 40)
        wait_for(lambda: utilization(host) == 40.0, 30, "the host's figures back once its report is fresh")

        # A daemon's rewrites with a new ts alone: nothing computed again (while fresh); a new figure: at once.
        report(host, 55)
        wait_for(lambda: utilization(host) == 55.0, 30, "a new figure")
        every_host_looked_at()
        before = computed.count(host)
        for _ in range(3):
            report(host, 55)
            every_host_looked_at()
        assert computed.count(host) == before, "a rewrite of the same figures computed the host's series again"
        assert utilization(host) == 55.0
        report(host, 70)
        wait_for(lambda: utilization(host) == 70.0, 30, "a new figure after rewrites of the same")
    finally:
        cluster.lt.run(registration.close())
