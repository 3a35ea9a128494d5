"""Partial failure of a multi-host gang has one rule, the whole gang (issue 30 acceptance, G12), against a real
etcd, a coordinator and two node daemons: a granted 2-host gang whose parts run under ``gpucoord run --join`` on
each host; one host's node daemon is killed (it stops without deregistering, as SIGKILL leaves it). Its holder
gets one ``host-lost`` notice naming the host; the part on the surviving host is stopped before the gang's
records go (G3's order, judged by observation: never a moment when the records are gone and it still runs); the
whole gang goes in one transaction (one revision deletes every part's record), as soon as the surviving node
reports its part's processes gone after the deadline: not at the kill margin (set to 10 minutes here, so that a
revoke that waited for it fails the test's liveness deadline). How soon (the node's TTL + the grace) is printed,
not asserted. The history checker ends it."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from agent_client import Client, errors
from agent_client.api import coordinator_pb2 as pb
from agent_client.lease import EvictionNotice
from coordinator.limits import MAX_KILL_MARGIN_S
from tests.support.cluster import Cluster, events_since, revision
from tests.support.join_parts import join_part
from tests.support.processes import ProcessGone, command_pid, write_fake_processes
from tests.support.rpcs import coordinator_stub
from tests.support.waiting import LIVENESS_S, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]
NODE_TTL = 3
# A part that ignores SIGTERM (the notice's signal): only the SIGKILL at the deadline stops it, so that the
# order (its processes gone before its GPUs are freed) is the revoke's to keep, not the notice's.
STUBBORN = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(os.getpid(), flush=True); "
            "time.sleep(600)")
GRACE_S = 2.0
# A part that stops at its notice's SIGTERM, as most do: the gang can go at the grace's end.
OBEDIENT = "import os, time; print(os.getpid(), flush=True); time.sleep(600)"


@pytest.mark.parametrize("part", [STUBBORN, OBEDIENT], ids=["part-ignores-sigterm", "part-stops-at-sigterm"])
def test_a_lost_host_of_a_granted_gang_notifies_once_stops_the_other_part_first_and_takes_the_whole_gang_at_once(
        cluster: Cluster, started: list[int], part: str, tmp_path: Path) -> None:
    addr = cluster.start_coordinator(eviction_grace_s=GRACE_S, eviction_kill_margin_s=MAX_KILL_MARGIN_S)
    files = {h: tmp_path / f"procs-{h}.json" for h in ("a", "b")}
    for host, path in files.items():      # the nodes list the parts' processes on their GPUs (as NVML does)
        write_fake_processes(path, {})
        cluster.start_node(host, "2x16GiB", ttl=NODE_TTL, heartbeat_s=1.0, fake_processes=str(path))
    with Client(addr, agent="agent-g", host="a") as holder:
        lease = holder.acquire(exclusive=True, gpu_count=2, hosts=2)
        notices: list[EvictionNotice] = []
        lease.on_evict(notices.append)
        runs = {lease.part(r).host: join_part(addr, "agent-g", lease, r, part) for r in (0, 1)}
        pids = {host: command_pid(run, started) for host, run in runs.items()}
        for host, pid in pids.items():
            write_fake_processes(files[host], {0: {pid: 1000}, 1: {pid: 1000}})
        lease_keys = {kv.key for kv in cluster.get_prefix(cluster.keys.leases())}
        assert len(lease_keys) == 4
        wait_for(lambda: all(b'"pids":[' in kv.value and b'"pids":[]' not in kv.value
                             for kv in cluster.get_prefix(cluster.keys.leases())), LIVENESS_S,
                 "both parts' processes attached")
        before = revision(cluster)
        eviction_records: list[dict[str, object]] = []    # every version of the gang's notice record, as seen
        killed = time.monotonic()
        cluster.stop_node("b", revoke=False)      # killed: hosts/b stays until its TTL runs out
        # Until the records are gone, watch the order: a record read gone while the surviving part still runs
        # (read after it) means the GPUs were freed under a running process.
        order: list[str] = []

        def gone() -> bool:
            eviction_records.extend(json.loads(kv.value) for kv in cluster.get_prefix(cluster.keys.eviction(lease.id)))
            left = cluster.get_prefix(cluster.keys.leases())
            if not left and not ProcessGone.now_gone(pids["a"]):
                order.append("the gang's records were gone while its part on a still ran")
            return not left
        wait_for(gone, NODE_TTL + GRACE_S + LIVENESS_S, "the whole gang to go (before the kill margin)")
        print(f"the gang went {time.monotonic() - killed:.2f} s after host b's node daemon was killed "
              f"(TTL {NODE_TTL} s + grace {GRACE_S:g} s); notices {notices}")
        assert not order, order
        wait_for(lambda: notices, LIVENESS_S, "the holder's notice")
        assert len(notices) == 1, notices
        assert notices[0].reason == "host-lost", notices[0]
        # The notice's record names the lost host (``asked_by``, which status shows); the notice a session gets
        # does not carry it (test_the_host_lost_notice_the_holder_gets_names_the_host, below).
        assert any(rec.get("asked_by") == "host b lost" and rec.get("reason") == "host-lost" for rec in eviction_records)
        # One transaction deleted every part's record (and nothing later wrote one back).
        deletes = {rev for kind, key, rev in events_since(cluster, before) if kind == "DELETE" and key in lease_keys}
        puts = [key for kind, key, _ in events_since(cluster, before) if kind == "PUT" and key in lease_keys]
        assert len(deletes) == 1, deletes
        assert not cluster.get_prefix(cluster.keys.leases())
        print(f"records deleted at revision {deletes}; lease record updates meanwhile {len(puts)}")
        for host, run in runs.items():     # both parts end: the survivor by its notice, b's by the lease gone
            run.communicate(timeout=LIVENESS_S)
            assert ProcessGone.now_gone(pids[host])
        try:
            assert not lease.release()
        except errors.NotFound:
            pass       # the lease is gone: nothing to release


def test_the_host_lost_notice_the_holder_gets_names_the_host(cluster: Cluster) -> None:
    addr = cluster.start_coordinator(eviction_grace_s=GRACE_S)
    for host in ("a", "b"):
        cluster.start_node(host, "1x16GiB", ttl=NODE_TTL, heartbeat_s=1.0)
    with Client(addr, agent="agent-g", host="a") as holder:
        lease = holder.acquire(exclusive=True, hosts=2)
        notices: list[EvictionNotice] = []
        lease.on_evict(notices.append)
        cluster.stop_node("b", revoke=False)
        wait_for(lambda: notices, NODE_TTL + LIVENESS_S, "the holder's notice")
        assert notices[0].reason == "host-lost"
        assert notices[0].asked_by == "host b lost", notices[0]


def test_an_evicted_gang_whose_part_on_another_host_still_runs_is_not_freed_as_if_it_had_stopped(
        cluster: Cluster, started: list[int], tmp_path: Path) -> None:
    """G3's order across hosts: an operator's notice to a 2-host gang bound to a process on each host (the node
    lists each on its GPU); at the notice the part on the notice record's host stops, the other's keeps running.
    The gang may go only as a lease whose processes still run goes: at the kill margin, with a ``departing/``
    record for the GPU they hold (its VRAM counted as used by them), never as if every part had stopped."""
    # Reports every 0.5 s, well inside the margin: a revoke that took a report after the deadline as proof
    # enough, without reading it, would free the gang before the margin (and write no departing record).
    addr = cluster.start_coordinator(eviction_kill_margin_s=10.0)
    files = {h: tmp_path / f"procs-{h}.json" for h in ("a", "b")}
    for host, path in files.items():
        write_fake_processes(path, {})
        cluster.start_node(host, "1x16GiB", fake_processes=str(path), heartbeat_s=0.5)
    stub = coordinator_stub(addr)
    with Client(addr, agent="agent-g", host="a") as holder, Client(addr, agent="agent-g", host="b") as joined:
        lease = holder.acquire(exclusive=True, hosts=2)
        procs = {h: subprocess.Popen(["sleep", "600"]) for h in ("a", "b")}
        started.extend(p.pid for p in procs.values())
        for host, session in (("a", holder), ("b", joined)):
            stub.AttachProcesses(pb.AttachProcessesRequest(session=pb.SessionRef(agent="agent-g",
                                                                                 session_id=session.session_id),
                                                           lease_id=lease.id, pids=[procs[host].pid]), timeout=30)
            write_fake_processes(files[host], {0: {procs[host].pid: 1000}})
        wait_for(lambda: all(str(procs[h].pid).encode() in b"".join(kv.value for kv in cluster.get_prefix(
            cluster.keys.usage(h))) for h in ("a", "b")), LIVENESS_S, "both nodes to list their part's process")
        before = revision(cluster)
        stub.EvictLease(pb.EvictLeaseRequest(lease_id=lease.id, grace_seconds=1.0, reason="test"), timeout=30)
        record = json.loads(wait_for(lambda: cluster.get_prefix(cluster.keys.eviction(lease.id)), LIVENESS_S,
                                     "the notice record")[0].value)
        stopped = record["host"]
        running = "b" if stopped == "a" else "a"
        procs[stopped].kill()          # the notice's host's part stops; the other's runs on
        procs[stopped].wait()
        wait_for(lambda: not cluster.get_prefix(cluster.keys.leases()), LIVENESS_S, "the gang to go")
        assert procs[running].poll() is None
        writes = [(kind, key, rev) for kind, key, rev in events_since(cluster, before)]
        gone_at = {rev for kind, key, rev in writes if kind == "DELETE" and b"/leases/" in key}
        departing = [key for kind, key, rev in writes if kind == "PUT" and b"/departing/" + running.encode() in key]
        print(f"the gang went at revision {gone_at}; departing records of {running}'s part: {departing}")
        assert departing, f"the gang was freed while its part on {running} still ran, with no departing record"
        procs[running].kill()
        procs[running].wait()
