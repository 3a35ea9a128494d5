"""G3 for leases bound to processes: the evicted (or revoked) process is gone before anyone else gets its VRAM.

The requester of an eviction is granted only when the victim's holder released the lease after its
processes exited (``gpucoord run`` releases once its whole process group is gone), or the node reports none
of them on the GPU, or the kill margin past the deadline has passed. Every test runs the real
``gpucoord run`` (or a real process attached to a lease) against a real etcd, an in-process coordinator and
node daemons, and measures on the process itself: a thread waits on its pidfd, which becomes readable the
moment it exits. The grant is timed by the lease's ``created_at`` (the coordinator's clock when it decided
the grant, before the commit), so "created after the process was gone" is a strict order, not a race.

Host h1's simulated GPU has no process list (as a GPU whose processes NVML cannot list): the order there comes
from the holder's release and the margin. Host h2's lists the command's PID (``--fake-processes``, as NVML
lists a CUDA process): the order there also goes through the node's report.

``GPUCOORD_EVICTION_RUNS`` sets how many evictions the slow-child test runs (default 4, two per host; the
issue's acceptance run is 20).
"""
from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from agent_client import Client
from agent_client.api import coordinator_pb2 as pb
from coordinator import metrics
from coordinator.cli.common import fetch_status
from tests.history import read_history
from tests.support import REPO
from tests.support.cluster import Cluster
from tests.support.processes import (
    ProcessGone,
    child_env,
    gpucoord_run,
    write_fake_processes,
)
from tests.support.rpcs import coordinator_stub
from tests.support.waiting import Background, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]

# The command put under the lease. It prints its pid once ready, then waits for signals. "slow" and "ignore"
# ignore SIGTERM; "slow" also takes a while to exit after SIGKILL, like a process with a large CUDA context
# whose driver unmaps its memory as it exits: 2 GiB of small pages and many epoll registrations, which the
# kernel tears down before the process is gone. "term" exits at SIGTERM; every mode dies of SIGINT silently.
CHILD = r"""
import mmap, os, resource, select, signal, sys
mode = sys.argv[1]
signal.signal(signal.SIGINT, signal.SIG_DFL)
if mode in ("slow", "ignore"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
keep = []
if mode == "slow":
    m = mmap.mmap(-1, 2 << 30, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_NOHUGEPAGE)
    try:
        m.madvise(23)    # MADV_POPULATE_WRITE
    except OSError:
        for i in range(0, len(m), 4096):
            m[i] = 1
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    eps = [select.epoll() for _ in range(80)]
    for _ in range(min(hard, 20000) - 200):
        fd = os.eventfd(0)
        for ep in eps:
            ep.register(fd)
    keep = [m, eps]
print(os.getpid(), flush=True)
while True:
    signal.pause()
"""

GRACE_S = 1.0
RUNS = int(os.environ.get("GPUCOORD_EVICTION_RUNS", "4"))


@pytest.fixture
def child_py(tmp_path: Path) -> str:
    path = tmp_path / "child.py"
    path.write_text(CHILD)
    return str(path)


@pytest.fixture
def started() -> Iterator[list[int]]:
    """PIDs a test started; whatever still runs at the end is SIGKILLed by PID."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if not ProcessGone.now_gone(pid):
            os.kill(pid, signal.SIGKILL)


def start_victim(addr: str, host: str, child_py: str, mode: str, started: list[int],
                 *extra: str) -> tuple[subprocess.Popen[str], int]:
    """``gpucoord run`` of the child, holding the whole 16 GiB GPU at priority 0; returns it and the child's pid."""
    run = gpucoord_run(addr, "--host", host, "--agent", "low", "--vram", "16GiB", *extra, "--",
                       sys.executable, child_py, mode)
    started.append(run.pid)
    assert run.stdout is not None
    line = run.stdout.readline()
    if not line.strip():
        run.kill()
        raise AssertionError(f"the command did not start: {run.communicate(timeout=10)[1]}")
    pid = int(line)
    started.append(pid)
    return run, pid


def reported(addr: str, host: str, pid: int, state: str) -> bool:
    gpu = fetch_status(addr, host)["hosts"][0]["gpus"][0]
    return any(p["pid"] == pid and p["state"] == state for p in gpu["processes"])


def lease_created_at(cluster: Cluster, lease_id: str) -> float:
    (lease,) = [x for x in cluster.leases() if x.id == lease_id]
    return float(lease.created_at)


def notice_deadline(cluster: Cluster) -> float:
    kvs = wait_for(lambda: cluster.get_prefix(cluster.keys.evictions()), 20, "the eviction notice")
    return float(json.loads(kvs[0].value)["deadline_unix"])


def evict_once(cluster: Cluster, addr: str, host: str, child_py: str, mode: str, started: list[int],
               procs_file: Path | None = None, grace: float = GRACE_S) -> dict[str, Any]:
    """One eviction of a ``gpucoord run`` child by a priority-9 request for the whole GPU: when the child was
    gone, when the grant was decided, and what ``run`` said."""
    run, pid = start_victim(addr, host, child_py, mode, started)
    if procs_file is not None:
        # 0 MiB, as NVML lists a process whose memory it cannot tell: the listing alone, not the untracked
        # VRAM it would add up to, is what orders the grant.
        write_fake_processes(procs_file, {0: {pid: 0}})
        wait_for(lambda: reported(addr, host, pid, "leased"), 10, "the node to list the child on its GPU")
    gone = ProcessGone(pid)
    with Client(addr, agent="high", host=host) as c:
        asked = time.time()
        request = Background(c.acquire, 16384, priority=9, wait=30)
        # A child that exits at SIGTERM may be gone, its notice with it, before we could read the notice.
        deadline = notice_deadline(cluster) if mode != "term" else asked + grace
        lease = request.result(timeout=40)
        gone_when_answered = ProcessGone.now_gone(pid)
        created = lease_created_at(cluster, lease.id)
        lease.release()
    gone_at = gone.wait(10)
    _, err = run.communicate(timeout=30)
    return {"pid": pid, "gone": gone_at, "granted": created, "deadline": deadline, "gone_when_answered":
            gone_when_answered, "returncode": run.returncode, "stderr": err}


def test_an_evicted_child_slow_to_exit_is_gone_before_the_requester_is_granted(
        cluster: Cluster, child_py: str, tmp_path: Path, started: list[int]) -> None:
    procs_file = tmp_path / "procs.json"
    cluster.start_node("h1", "1x16GiB")
    cluster.start_node("h2", "1x16GiB", fake_processes=str(procs_file))
    addr = cluster.start_coordinator(eviction_grace_s=GRACE_S)
    runs = []
    for i in range(RUNS):
        host = ("h1", "h2")[i % 2]
        runs.append(evict_once(cluster, addr, host, child_py, "slow", started,
                               procs_file if host == "h2" else None) | {"host": host})
    lines = [f"{r['host']}: exit after its deadline {r['gone'] - r['deadline']:.3f} s, grant "
             f"{(r['granted'] - r['gone']) * 1000:.1f} ms after it was gone" for r in runs]
    print(f"\n{RUNS} evictions of a child slow to exit:\n  " + "\n  ".join(lines))
    for r in runs:
        assert r["granted"] > r["gone"], f"granted before the evicted child was gone: {r}"
        assert r["gone_when_answered"]
        assert r["returncode"] == 137 and "SIGKILL at the eviction deadline" in r["stderr"], r["stderr"]
    exits = [r["gone"] - r["deadline"] for r in runs]
    print(f"exit after the deadline: median {statistics.median(exits):.3f} s, max {max(exits):.3f} s")


def test_an_evicted_child_that_exits_at_sigterm_is_gone_before_the_requester_is_granted(
        cluster: Cluster, child_py: str, tmp_path: Path, started: list[int]) -> None:
    procs_file = tmp_path / "procs.json"
    cluster.start_node("h1", "1x16GiB")
    cluster.start_node("h2", "1x16GiB", fake_processes=str(procs_file))
    addr = cluster.start_coordinator(eviction_grace_s=10)
    for host in ("h1", "h2"):
        r = evict_once(cluster, addr, host, child_py, "term", started, procs_file if host == "h2" else None,
                       grace=10)
        assert r["granted"] > r["gone"], f"granted before the evicted child was gone: {r}"
        assert r["granted"] < r["deadline"], "it exited at once: its release, not the deadline, let the grant in"
        assert r["returncode"] == 143 and "it ended after SIGTERM" in r["stderr"], r["stderr"]


def _usage_history(cluster: Cluster) -> list[tuple[int, Any]]:
    """(revision, usage report) of every usage/h1 write in etcd's history."""
    events = cluster.lt.run(read_history(cluster.store, cluster.keys.root()))
    return [(ev.kv.mod_revision, json.loads(ev.kv.value)) for ev in events
            if ev.kind == "PUT" and ev.kv.key == cluster.keys.usage("h1")]


def _lists(report: Any, pid: int) -> bool:
    return any(p["pid"] == pid for g in report["gpus"] for p in g["processes"])


def test_the_grant_waits_until_the_nodes_report_no_longer_lists_the_evicted_child(
        cluster: Cluster, child_py: str, tmp_path: Path, started: list[int]) -> None:
    """The child exits at its SIGTERM and ``run`` releases at once, but the node (as a driver still freeing the
    child's memory) lists its pid until a given time: the VRAM stays held until the report no longer lists
    it (``departing/``), well before the kill margin."""
    procs_file = tmp_path / "procs.json"
    cluster.start_node("h1", "1x16GiB", fake_processes=str(procs_file))
    addr = cluster.start_coordinator(eviction_grace_s=GRACE_S, eviction_kill_margin_s=10)
    run, pid = start_victim(addr, "h1", child_py, "term", started)
    until = time.time() + 2.0
    # 0 MiB: as NVML lists a process whose memory it cannot tell (containers), so that only the listing
    # itself, not the untracked VRAM it would add up to, holds the GPU.
    write_fake_processes(procs_file, {0: {pid: {"mib": 0, "until": until}}})
    wait_for(lambda: reported(addr, "h1", pid, "leased"), 10, "the node to list the child on its GPU")
    waits_before = metrics.REGISTRY.get_sample_value("gpucoord_victim_process_wait_seconds_count") or 0.0
    gone = ProcessGone(pid)
    with Client(addr, agent="high", host="h1") as c:
        request = Background(c.acquire, 16384, priority=9, wait=30)
        gone_at = gone.wait(10)
        victim_id = json.loads(wait_for(lambda: cluster.get_prefix(cluster.keys.departings()), 10,
                                        "the departing record")[0].value)["lease_id"]
        table = subprocess.run([sys.executable, "-m", "coordinator.cli", "status", "--coordinator", addr],
                               capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=30).stdout
        lease = request.result(timeout=30)
        created = lease_created_at(cluster, lease.id)
        lease_rev = next(kv.create_revision for kv in cluster.get_prefix(cluster.keys.leases()))
        lease.release()
    assert gone_at < until - 0.5, "the child should be gone well before the node stops listing it"
    assert created >= until, f"granted {until - created:.2f} s before the node's report stopped listing the child"
    assert f"DEPARTING on GPU 0: lease {victim_id} (low, 16.0G) ended, evicted by high/" in table, table
    assert f"its processes on the GPU: {pid}; VRAM held until they are gone" in table, table
    # In etcd's history: the report current when the grant was committed no longer lists the child, and one
    # before it (after the child was gone) still did.
    usage = _usage_history(cluster)
    before = [rep for rev, rep in usage if rev < lease_rev]
    assert not _lists(before[-1], pid) and any(_lists(rep, pid) for rep in before), before[-3:]
    wait_for(lambda: not cluster.get_prefix(cluster.keys.departings()), 10, "the leader to end the departing record")
    waits = metrics.REGISTRY.get_sample_value("gpucoord_victim_process_wait_seconds_count")
    assert waits == waits_before + 1
    assert run.wait(30) == 143


def test_at_the_kill_margin_the_vram_counts_as_free_though_the_node_still_lists_the_child(
        cluster: Cluster, child_py: str, tmp_path: Path, started: list[int]) -> None:
    """The bound: a process the node reports past the deadline plus the kill margin no longer holds the
    GPU (its departing record is forced); once the node stops listing it the record goes."""
    margin = 1.5
    procs_file = tmp_path / "procs.json"
    cluster.start_node("h1", "1x16GiB", fake_processes=str(procs_file))
    addr = cluster.start_coordinator(eviction_grace_s=GRACE_S, eviction_kill_margin_s=margin)
    run, pid = start_victim(addr, "h1", child_py, "term", started)
    # 0 MiB: listed, but adding no untracked VRAM (which admission would count whatever the bound).
    write_fake_processes(procs_file, {0: {pid: {"mib": 0, "until": time.time() + 600}}})
    wait_for(lambda: reported(addr, "h1", pid, "leased"), 10, "the node to list the child on its GPU")
    with Client(addr, agent="high", host="h1") as c:
        asked = time.time()
        request = Background(c.acquire, 16384, priority=9, wait=30)
        lease = request.result(timeout=30)
        created = lease_created_at(cluster, lease.id)
        assert created >= asked + GRACE_S + margin - 0.1, "granted before the kill margin passed"
        (kv,) = cluster.get_prefix(cluster.keys.departings())
        assert json.loads(kv.value)["forced"] is True
        table = subprocess.run([sys.executable, "-m", "coordinator.cli", "status", "--coordinator", addr],
                               capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=30).stdout
        assert "the kill margin passed: no longer held for it" in table, table
        write_fake_processes(procs_file, {})
        wait_for(lambda: not cluster.get_prefix(cluster.keys.departings()), 10, "the forced record to go")
        lease.release()
    assert run.wait(30) == 143


def _holder_with_a_listed_process(cluster: Cluster, addr: str, procs_file: Path,
                                  started: list[int]) -> tuple[Client, Any, subprocess.Popen[bytes]]:
    """A library holder (not ``gpucoord run``) of the whole GPU with a real process attached, which the node
    lists on the GPU; it ignores its eviction notice."""
    holder = Client(addr, agent="low", host="h1")
    lease = holder.acquire(16384)
    proc = subprocess.Popen(["sleep", "600"])
    started.append(proc.pid)
    lease.attach([proc.pid])
    write_fake_processes(procs_file, {0: {proc.pid: 15000}})
    wait_for(lambda: reported(addr, "h1", proc.pid, "leased"), 10, "the node to list the process")
    return holder, lease, proc


def test_a_lease_whose_processes_the_node_no_longer_reports_is_revoked_after_its_deadline_without_the_margin(
        cluster: Cluster, tmp_path: Path, started: list[int]) -> None:
    procs_file = tmp_path / "procs.json"
    cluster.start_node("h1", "1x16GiB", fake_processes=str(procs_file))
    addr = cluster.start_coordinator(eviction_grace_s=GRACE_S, eviction_kill_margin_s=60)
    holder, victim, proc = _holder_with_a_listed_process(cluster, addr, procs_file, started)
    try:
        with Client(addr, agent="high", host="h1") as c:
            request = Background(c.acquire, 16384, priority=9, wait=30)
            deadline = notice_deadline(cluster)
            wait_for(lambda: time.time() > deadline + 1.0, 10, "the deadline to pass")
            # Past the deadline, its process still listed: the lease stands (the margin is 60 s).
            assert [x.id for x in cluster.leases()] == [victim.id]
            (row,) = fetch_status(addr, "h1")["hosts"][0]["leases"]
            assert row["eviction"]["processes"] == "stopping"
            table = subprocess.run([sys.executable, "-m", "coordinator.cli", "status", "--coordinator", addr],
                                   capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=30).stdout
            (line,) = [x for x in table.splitlines() if victim.id in x]
            assert "EVICTING: deadline passed, asked by high/" in line, line
            assert line.endswith("; processes stopping (still on the GPU)"), line
            gone = ProcessGone(proc.pid)
            proc.kill()
            proc.wait()
            lease = request.result(timeout=20)
            created = lease_created_at(cluster, lease.id)
            assert created > gone.wait(5)
            assert created < deadline + 10, "revoked at the margin, not when the node reported the process gone"
            lease.release()
    finally:
        holder.close()


def test_a_report_published_before_the_deadline_does_not_end_the_lease_early(
        cluster: Cluster, tmp_path: Path, started: list[int]) -> None:
    """The node's word counts only from a report published after the deadline: one from before it (here the
    process has not touched the GPU yet, and no report follows within the margin) leaves the revoke to the
    kill margin, since the process may still take the GPU until it is killed."""
    margin = 2.0
    procs_file = tmp_path / "procs.json"
    write_fake_processes(procs_file, {})
    cluster.start_node("h1", "1x16GiB", fake_processes=str(procs_file), heartbeat_s=30)
    addr = cluster.start_coordinator(eviction_grace_s=GRACE_S, eviction_kill_margin_s=margin)
    with Client(addr, agent="low", host="h1") as holder, Client(addr, agent="high", host="h1") as c:
        victim = holder.acquire(16384)
        proc = subprocess.Popen(["sleep", "600"])
        started.append(proc.pid)
        victim.attach([proc.pid])
        wait_for(lambda: [x.pids for x in cluster.leases()] == [(proc.pid,)], 10, "the lease to record it")
        request = Background(c.acquire, 16384, priority=9, wait=30)
        deadline = notice_deadline(cluster)
        # Its process is not on the GPU, which the node can see: status says so.
        (row,) = fetch_status(addr, "h1")["hosts"][0]["leases"]
        assert row["eviction"]["processes"] == "gone"
        lease = request.result(timeout=30)
        created = lease_created_at(cluster, lease.id)
        assert created >= deadline + margin - 0.2, "revoked on a report from before the deadline"
        lease.release()
    proc.kill()
    proc.wait()


def test_at_the_kill_margin_a_node_with_enforce_kill_kills_what_is_left(
        cluster: Cluster, tmp_path: Path, started: list[int]) -> None:
    margin = 1.0
    procs_file = tmp_path / "procs.json"
    cluster.start_node("h1", "1x16GiB", fake_processes=str(procs_file), enforce="kill")
    addr = cluster.start_coordinator(eviction_grace_s=GRACE_S, eviction_kill_margin_s=margin)
    holder, victim, proc = _holder_with_a_listed_process(cluster, addr, procs_file, started)
    try:
        with Client(addr, agent="high", host="h1") as c:
            request = Background(c.acquire, 16384, priority=9, wait=30)
            deadline = notice_deadline(cluster)
            gone = ProcessGone(proc.pid)
            lease = request.result(timeout=30)
            assert lease_created_at(cluster, lease.id) >= deadline + margin - 0.2
            gone.wait(10)   # the node SIGKILLs the orphaned process at its next scan
            assert proc.wait(10) == -signal.SIGKILL
            wait_for(lambda: not cluster.get_prefix(cluster.keys.departings()), 10, "the forced record to go")
            lease.release()
    finally:
        holder.close()


def test_an_operators_revoke_kills_the_child_at_once_and_frees_its_vram_only_once_it_is_gone(
        cluster: Cluster, child_py: str, tmp_path: Path, started: list[int]) -> None:
    procs_file = tmp_path / "procs.json"
    cluster.start_node("h2", "1x16GiB", fake_processes=str(procs_file))
    addr = cluster.start_coordinator()
    # A long TTL: the run's own check of its lease (every TTL/4 = 15 s) is not what kills the child.
    run, pid = start_victim(addr, "h2", child_py, "slow", started, "--ttl", "60")
    # Listed with 0 MiB (NVML cannot always tell a process's memory): only the listing holds the GPU.
    write_fake_processes(procs_file, {0: {pid: 0}})
    wait_for(lambda: reported(addr, "h2", pid, "leased"), 10, "the node to list the child on its GPU")
    (victim,) = cluster.leases()
    gone = ProcessGone(pid)
    with Client(addr, agent="waiter", host="h2") as c:
        request = Background(c.acquire, 16384, wait=30)   # priority 0: it waits, it does not evict
        wait_for(lambda: cluster.get_prefix(cluster.keys.queue("h2")), 10, "the request to wait")
        t0 = time.time()
        resp = coordinator_stub(addr).RevokeLease(pb.RevokeLeaseRequest(lease_id=victim.id), timeout=10)
        assert resp.revoked and resp.processes
        lease = request.result(timeout=30)
        created = lease_created_at(cluster, lease.id)
        gone_at = gone.wait(5)
        lease.release()
    assert created > gone_at, "the VRAM was granted before the revoked child was gone"
    assert gone_at - t0 < 2.5, f"SIGKILL came {gone_at - t0:.1f} s after the revoke, not at once"
    _, err = run.communicate(timeout=30)
    assert run.returncode == 137 and "revoked by operator: SIGKILL at once" in err, err


# -- gpucoord run's stderr: one line saying what happened, by whom, and the status it passes on ---------------

LEASE_LINE = re.compile(r"gpucoord run: lease [0-9a-f]{20}: GPU 0 \(GPU-sim-h1-0\), 16384 MiB, token \d+; "
                        r"started \S+ as pid (\d+)$")


def _stderr_lines(err: str) -> list[str]:
    assert "Traceback" not in err and "Task was destroyed" not in err and "Exception ignored" not in err, err
    return err.splitlines()


@pytest.mark.parametrize("event", ["eviction", "revoke", "ctrl-c", "session loss"])
def test_run_says_in_one_line_what_ended_the_command_by_whom_and_its_status(
        cluster: Cluster, child_py: str, started: list[int], event: str) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator(eviction_grace_s=GRACE_S)
    run, pid = start_victim(addr, "h1", child_py, "ignore", started)
    (victim,) = wait_for(lambda: cluster.leases(), 10, "the lease")
    wait_for(lambda: victim.pgid or [x for x in cluster.leases() if x.pgid], 10, "the lease to record the group")
    python = re.escape(sys.executable)
    if event == "eviction":
        with Client(addr, agent="high", host="h1") as c:
            lease = c.acquire(16384, priority=9, wait=30)
            rid = lease.request_id
            lease.release()
        final = (rf"gpucoord run: evicted by high/{rid} \(priority 9 request for 16384 MiB needs the room\): "
                 rf"SIGTERM at the notice, SIGKILL at the eviction deadline; {python} \(pid {pid}\) was killed by "
                 rf"SIGKILL \(status 137\)$")
        status = 137
    elif event == "revoke":
        coordinator_stub(addr).RevokeLease(pb.RevokeLeaseRequest(lease_id=victim.id), timeout=10)
        final = (rf"gpucoord run: revoked by operator: SIGKILL at once; {python} \(pid {pid}\) was killed by "
                 rf"SIGKILL \(status 137\)$")
        status = 137
    elif event == "ctrl-c":
        run.send_signal(signal.SIGINT)
        final = (rf"gpucoord run: interrupted: SIGINT forwarded to the command; {python} \(pid {pid}\) was killed "
                 rf"by SIGINT \(status 130\)$")
        status = 130
    else:
        cluster.lt.run(cluster.store.revoke(victim.etcd_lease))   # the session is gone from etcd
        final = (rf"gpucoord run: lease lost \(the session expired or was revoked: the coordinator no longer keeps "
                 rf"it alive\): "
                 rf"SIGKILL at once; {python} \(pid {pid}\) was killed by SIGKILL \(status 137\)$")
        status = 137
    _, err = run.communicate(timeout=60)
    lines = _stderr_lines(err)
    assert len(lines) == 2, err
    started_line = LEASE_LINE.match(lines[0])
    assert started_line is not None and started_line.group(1) == str(pid), lines[0]
    assert re.match(final, lines[1]), f"{lines[1]!r} does not match {final!r}"
    assert run.returncode == status
