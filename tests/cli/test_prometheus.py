"""The shipped Grafana dashboard against a real Prometheus (issue 34): Debian's ``prometheus`` scrapes a real
coordinator and a real node daemon (child processes) every second while the test makes what the panels
show happen (acquires, a refusal, a team, an over-use, an eviction held back by its victim's processes, a
revoke, a malformed stored value); then every panel expression, its variables substituted, runs as the range
query Grafana would make over the test's time, and each must return data. ``promtool check metrics`` passes
on both ``/metrics``. Without prometheus and promtool (``.ci/prometheus`` provides Debian's) it skips in one
line. About 30 s."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest

from agent_client import Client
from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from coordinator.deploy import DASHBOARD
from coordinator.etcd.process import free_port
from tests.support.cluster import Cluster
from tests.support.processes import (
    ProcessGone,
    command_pid,
    gpucoord_run,
    spawn_coordinator,
    spawn_node,
    stop_process,
    write_fake_processes,
)
from tests.support.prometheus import SCRAPE_S, Prometheus, http_get, seen, tools
from tests.support.run_victim import CHILD
from tests.support.waiting import Background, wait_for

pytestmark = pytest.mark.integration

# What Grafana puts for its variables: the dashboard's time range (the test's), its interval (the step), and
# $__rate_interval = max($__interval + scrape interval, 4 * scrape interval).
RATE_INTERVAL = f"{max(2 * SCRAPE_S, 4 * SCRAPE_S)}s"


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expression) of every target of the dashboard."""
    doc = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in doc["panels"] for t in p.get("targets", [])]


def substitute(expr: str, range_s: int) -> str:
    """The expression as Grafana sends it: ``$__rate_interval``, ``$__interval``, ``$__range`` and the
    dashboard's template variables (a datasource only, which no expression uses) replaced."""
    for var, value in (("__rate_interval", RATE_INTERVAL), ("__interval", f"{SCRAPE_S}s"), ("__range", f"{range_s}s")):
        expr = expr.replace(f"${{{var}}}", value).replace(f"${var}", value)
    assert "$" not in expr, f"a variable the test does not know in {expr!r}"
    return expr


@pytest.fixture
def prometheus_tools() -> tuple[str, str]:
    found = tools()
    if found is None:
        pytest.skip("prometheus: not available (no prometheus and promtool on PATH or in $GPUCOORD_PROMETHEUS_DIR;"
                    " .ci/prometheus fetches Debian's): the dashboard was not run against a real Prometheus")
    return found


@pytest.fixture
def scraped(cluster: Cluster, prometheus_tools: tuple[str, str], tmp_path: Path
            ) -> Iterator[tuple[Prometheus, str, dict[str, str], Path]]:
    """A coordinator and node h1 (1x16GiB, simulated processes from a file) as child processes, each serving
    /metrics, and a Prometheus scraping both: (prometheus, the coordinator's address, job -> metrics URL,
    the processes file)."""
    procs_file = tmp_path / "procs.json"
    cport, nport = free_port(), free_port()
    coordinator, port = spawn_coordinator(
        cluster.endpoints, cluster.prefix, "127.0.0.1:0", str(tmp_path / "coordinator.log"),
        extra=["--metrics-listen", f"127.0.0.1:{cport}", "--grace", "1", "--eviction-kill-margin", "60"])
    node = spawn_node(cluster.endpoints, cluster.prefix, "h1", "1x16GiB", str(tmp_path / "node.log"),
                      extra=["--metrics-listen", f"127.0.0.1:{nport}", "--fake-processes", str(procs_file),
                             "--over-use-tolerance", "0", "--heartbeat", "1"])
    prom = None
    try:
        prom = Prometheus(prometheus_tools[0], tmp_path, {"gpucoord-coordinator": f"127.0.0.1:{cport}",
                                                          "gpucoord-node": f"127.0.0.1:{nport}"})
        wait_for(prom.targets_up, 60, "prometheus to scrape both targets", interval=0.25)
        yield prom, f"127.0.0.1:{port}", {"coordinator": f"http://127.0.0.1:{cport}/metrics",
                                          "node": f"http://127.0.0.1:{nport}/metrics"}, procs_file
    finally:
        if prom is not None:
            prom.close()
        stop_process(node)
        stop_process(coordinator)


def listed(addr: str, pid: int) -> bool:
    out = subprocess.run([sys.executable, "-m", "coordinator.cli", "status", "--json", "--coordinator", addr],
                         capture_output=True, text=True, timeout=30)
    hosts = json.loads(out.stdout or "{}").get("hosts", [])
    return any(p["pid"] == pid for h in hosts if h["host"] == "h1" for g in h["gpus"] for p in g["processes"])


def make_load(cluster: Cluster, prom: Prometheus, addr: str, procs_file: Path, child: str, started: list[int]) -> None:
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(addr))
    stub.SetTeam(pb.SetTeamRequest(name="ta", quota_mb=4096, limit_mb=8192, members=pb.TeamMembers(patterns=["a"])),
                 timeout=10)
    # Refusals (no session) and malformed stored values (another host's record, each value counted once):
    # twice each, with a scrape between, since a rate sees a series' increase only after its first sample.
    for value in (b"{not json", b"[not json"):
        with pytest.raises(grpc.RpcError):
            stub.Acquire(pb.AcquireRequest(vram_mb=100), timeout=10)
        cluster.lt.run(cluster.store.put(cluster.keys.host("bad-host"), value))
        seen(prom, "gpucoord_refusals_total and on() gpucoord_invalid_records_total", "the refusal and bad value")

    # An over-use: a lease of 1000 MiB whose process the node lists at 1500 MiB (tolerance 0).
    run = gpucoord_run(addr, "--host", "h1", "--agent", "a", "--vram", "1000MiB", "--", sys.executable, child, "term")
    started.append(run.pid)
    pid = command_pid(run, started)
    write_fake_processes(procs_file, {0: {pid: 1500}})
    seen(prom, "gpucoord_node_lease_over_use_bytes > 0", "the over-use")
    run.terminate()                          # gpucoord run passes SIGTERM on; the child exits at it
    run.wait(30)
    write_fake_processes(procs_file, {})

    # An eviction whose grant waits on the victim's processes: the node still lists the victim's child after
    # it exited, until the test rewrites the file (once Prometheus has scraped the waiting request).
    run = gpucoord_run(addr, "--host", "h1", "--agent", "low", "--vram", "16GiB", "--", sys.executable, child, "term")
    started.append(run.pid)
    pid = command_pid(run, started)
    write_fake_processes(procs_file, {0: {pid: {"mib": 0, "until": time.time() + 3600}}})
    wait_for(lambda: listed(addr, pid), 30, "the node to list the victim's child")
    with Client(addr, agent="high", host="h1") as high:
        request = Background(high.acquire, 16384, priority=9, wait=120)
        wait_for(lambda: ProcessGone.now_gone(pid), 30, "the evicted child to exit at its SIGTERM")
        seen(prom, "gpucoord_queue_depth > 0", "the waiting request")
        write_fake_processes(procs_file, {})
        request.result(timeout=60).release()
    run.wait(30)
    seen(prom, "gpucoord_victim_process_wait_seconds_count > 0", "the wait on the victim's processes")

    # Idle GPU-seconds: leases held on GPU 0 while the node reports it at 0 % (each record with idle time),
    # twice with a scrape between (a new counter's increase shows from its second sample).
    procs_file.write_text(json.dumps({"utilization": {"0": 0}}))
    for n in (1, 2):
        idle_records(cluster, addr, n)
        seen(prom, f"gpucoord_team_idle_gpu_seconds_total{{team=\"ta\"}} and on() (count(up) >= {n})",
             f"idle record {n}")

    # A revoke, a release and a close.
    with Client(addr, agent="a", host="h1") as a:
        lease = a.acquire(1000)
        assert stub.RevokeLease(pb.RevokeLeaseRequest(lease_id=lease.id), timeout=10).revoked
        a.acquire(2000).release()
        a.acquire(500)
    seen(prom, 'gpucoord_releases_total{reason="close"} > 0', "the close")


def idle_records(cluster: Cluster, addr: str, n: int) -> None:
    """Until ``n`` usage records of agent ``a`` have idle time: hold a lease on GPU 0 (at 0 %) over a few of the
    leader's one-second utilization samples, release it, read its record (deadlines, never a bare sleep)."""
    def records() -> list[dict[str, Any]]:
        return [json.loads(kv.value) for kv in cluster.get_prefix(cluster.keys.usage_records())]

    def one_more() -> bool:
        with Client(addr, agent="a", host="h1") as a:
            lease = a.acquire(100, gpu=0)
            held = time.monotonic()
            wait_for(lambda: time.monotonic() - held >= 2.5, 30, "a lease held over a few samples")  # a duration
            lease.release()
        wait_for(lambda: any(d["lease_id"] == lease.id for d in records()), 30, "its usage record")
        return sum(1 for d in records() if d["agent"] == "a" and d.get("idle_gpu_seconds", 0) > 0) >= n
    wait_for(one_more, 120, f"{n} records of agent a with idle time")


def test_every_dashboard_expression_returns_data_from_a_real_prometheus(
        cluster: Cluster, prometheus_tools: tuple[str, str], scraped: tuple[Prometheus, str, dict[str, str], Path],
        tmp_path: Path, started: list[int]) -> None:
    prom, addr, urls, procs_file = scraped
    promtool = prometheus_tools[1]
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    start = time.time()
    make_load(cluster, prom, addr, procs_file, str(child), started)
    end = time.time()

    empty, zero = [], []
    for title, expr in dashboard_exprs():
        series = prom.query_range(substitute(expr, int(end - start) + 1), start, end)
        values = [float(v) for s in series for _, v in s["values"] if not re.fullmatch(r"[+-]?(NaN|Inf)", v)]
        if not values:
            empty.append(f"{title}: {expr}")
        elif not any(values):
            zero.append(expr)
    assert not empty, "panel expressions with no data:\n  " + "\n  ".join(empty)
    print(f"\n{len(dashboard_exprs())} dashboard expressions returned data; only zeros (nothing of the kind "
          f"happened): {zero}")

    for job, url in urls.items():
        text = http_get(url)
        assert "gpucoord_" in text
        check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                               timeout=60)
        assert check.returncode == 0, f"promtool check metrics on the {job}'s /metrics:\n{check.stdout}{check.stderr}"
