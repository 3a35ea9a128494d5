"""A waiting multi-host gang's reservation beats a stream of 1-GPU requests (issue 30 acceptance, G2 across hosts),
against a real etcd, a coordinator and four node daemons of 2 simulated GPUs: with every host partly held, a
2-host gang of whole hosts waits and reserves two hosts; from then on no 1-GPU request sent after the
reservation was written is granted on a reserved host while the reservation stands (judged on etcd's history,
revision by revision, so at any speed), the stream goes on on the other hosts, and the gang is granted, before
its wait ends, once the holders of its two hosts are gone. The history checker ends the test."""
from __future__ import annotations

import threading
import time

import pytest

from agent_client import Client, errors
from tests.support.cluster import Cluster, events_since, queue, revision
from tests.support.waiting import LIVENESS_S, Background, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]
HOSTS = ("a", "b", "c", "d")
STREAM_HOLD_S = 0.4     # each stream lease is held this long, one asked every 50 ms on each host
STREAM_EVERY_S = 0.05
STREAM_MB = 1000


def reservations(cluster: Cluster) -> dict[str, tuple[str, ...]]:
    """host -> the GPUs a waiting multi-host gang reserves there."""
    return {h: e.reserve for h in HOSTS for e in queue(cluster, h) if e.hosts > 1}


def test_a_waiting_two_host_gang_reserves_its_hosts_against_a_stream_and_is_granted_once_they_drain(
        cluster: Cluster) -> None:
    addr = cluster.start_coordinator()
    for host in HOSTS:
        cluster.start_node(host, "2x16GiB")
    wait_for(lambda: all(cluster.get_prefix(cluster.keys.host(h)) for h in HOSTS), LIVENESS_S, "the hosts")
    stop = threading.Event()
    grants: list[tuple[float, str, str]] = []      # (sent at, lease id, host) of the stream's grants
    refused: list[tuple[float, str]] = []          # (sent at, host) of the stream's requests held back

    def stream(host: str) -> None:
        """1-GPU requests of 1 GB from an agent of the host, each held 0.4 s: one every 50 ms at most holds 8 at a
        time at any speed, and the host has room for 31, so that only a reservation holds one back."""
        timers = []
        with Client(addr, agent=f"agent-s{host}", host=host) as s:
            while not stop.is_set():
                sent = time.monotonic()
                try:
                    lease = s.acquire(vram_mb=STREAM_MB)
                    grants.append((sent, lease.id, lease.host))
                    timers.append(threading.Timer(STREAM_HOLD_S, lease.release))
                    timers[-1].start()
                except errors.ResourceExhausted:
                    refused.append((sent, host))
                stop.wait(STREAM_EVERY_S)
            for timer in timers:
                timer.join()

    holders = [Client(addr, agent="agent-h", host=h) for h in HOSTS]
    streams = [threading.Thread(target=stream, args=(h,), daemon=True) for h in HOSTS]
    try:
        # The existing holders: 1 GB on GPU 0 of every host, so that no host is whole when the gang arrives.
        held = [c.acquire(vram_mb=1024, gpu="0") for c in holders]
        for t in streams:
            t.start()
        wait_for(lambda: len({h for _, _, h in grants}) == len(HOSTS), LIVENESS_S, "the stream on every host")
        before = revision(cluster)
        with Client(addr, agent="agent-t", host="a") as trainer:
            gang = Background(trainer.acquire, exclusive=True, gpu_count=2, hosts=2, wait=4 * LIVENESS_S)
            reserved = wait_for(lambda: (lambda r: r if len(r) == 2 else None)(reservations(cluster)), LIVENESS_S,
                                "the gang's reservation on two hosts")
            assert len(cluster.get_prefix(cluster.keys.gang_queue())) == 1
            written = time.monotonic()      # every stream request sent from now on arrived after the reservation
            # The stream asks on the reserved hosts after the reservation, while their holders still hold a
            # little of each: room enough for it, but reserved (its answers are judged on the history below:
            # any request of the stream has room, so only the reservation refuses one).
            wait_for(lambda: set(reserved) <= {h for s, h in refused + [(s, h) for s, _, h in grants] if s > written},
                     LIVENESS_S, "the stream to ask on the reserved hosts after the reservation")
            bad = reserved_grants(cluster, before, grants, written)
            assert not bad, bad
            for lease in held:
                lease.release()
            released = time.monotonic()     # its two hosts' GPUs drain of their holders now (printed, not asserted)
            lease = gang.result(4 * LIVENESS_S)     # granted before its wait ended (ResourceExhausted otherwise)
            granted = time.monotonic()
            print(f"2-host gang granted {granted - released:.3f} s after the holders released "
                  f"({granted - written:.3f} s after its reservation), on {lease.hosts}; "
                  f"reserved {sorted(reserved)}; stream grants {len(grants)}, held back {len(refused)}")
            assert len(lease.hosts) == 2 and all(len(p.gpus) == 2 for p in lease.parts), lease.parts
            stop.set()
            for t in streams:
                t.join(LIVENESS_S)
            bad = reserved_grants(cluster, before, grants, written)
            assert not bad, bad
            lease.release()
    finally:
        stop.set()
        for c in holders:
            c.close()


def reserved_grants(cluster: Cluster, before: int, grants: list[tuple[float, str, str]],
                    written: float) -> list[str]:
    """The stream's grants sent after ``written`` whose lease record was written on a host at a revision where a
    reservation (a multi-host ``queue/<host>/`` entry: the gang's, from its ``gangqueue/`` rank) stood there."""
    root = cluster.keys.root()
    events = [e for e in events_since(cluster, before) if e[1].startswith(root)]   # (the etcd may be shared)
    ranks = {cluster.keys.parse(key)[1][0] for kind, key, _ in events
             if kind == "PUT" and cluster.keys.parse(key)[0] == "gangqueue"}
    spans: dict[str, list[list[int]]] = {}          # host -> [[from revision, to revision (exclusive)], ...]
    for kind, key, rev in events:
        what, parts = cluster.keys.parse(key)
        if what == "queue" and parts[1] in ranks:
            if kind == "PUT":
                spans.setdefault(parts[0], []).append([rev, 1 << 62])
            elif spans.get(parts[0]):
                spans[parts[0]][-1][1] = rev
    made: dict[str, int] = {}                        # lease id -> the revision that created its record
    for kind, key, rev in events:
        what, parts = cluster.keys.parse(key)
        if kind == "PUT" and what == "leases":
            made.setdefault(parts[2], rev)
    bad = []
    for sent, lease_id, host in grants:
        at = made.get(lease_id, 0)
        if sent > written and any(lo <= at < hi for lo, hi in spans.get(host, [])):
            bad.append(f"stream lease {lease_id} granted on reserved host {host} at revision {at}")
    return bad
