"""Multi-host gangs make progress where per-host gangs deadlock (issue 30 acceptance, G12), against a real etcd,
two coordinator replicas and three node daemons of 4 simulated GPUs: two agents that each need two whole hosts
loop on 2-host gangs, each through its own replica, and both progress (judged by how many grants each gets,
never by how fast); the same agents taking one per-host gang after the other, in opposite host orders, hold one
host each and wait for the other's (kept as documentation of the problem multi-host gangs solve). Every test
ends with the history checker (whole or absent at every revision)."""
from __future__ import annotations

import threading
import time

import pytest

from agent_client import Client, errors
from tests.support.cluster import Cluster
from tests.support.waiting import LIVENESS_S, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]
HOSTS = ("a", "b", "c")
HOLD_S = 0.05          # the hold: the work is holding the lease
WAIT_S = 5.0           # the wait: a wait that ends unanswered is retried, not a failure
DEADLOCK_WAIT_S = 10.0 # each second per-host gang's wait: it can only end unanswered
GRANTS = 8             # each agent's goal: progress is this many grants each, however long they take


def fleet(cluster: Cluster) -> tuple[str, str]:
    """Two replicas that see each other, then the three hosts (registered through both)."""
    addrs = (cluster.start_coordinator(), cluster.start_coordinator())
    wait_for(lambda: len(cluster.replicas()) == 2, LIVENESS_S, "both replicas to register")
    for host in HOSTS:
        cluster.start_node(host, "4x16GiB")
    wait_for(lambda: all(cluster.get_prefix(cluster.keys.host(h)) for h in HOSTS), LIVENESS_S, "the hosts")
    return addrs


def loop_gangs(addr: str, agent: str, counts: dict[str, int], timeouts: dict[str, int], failures: list[str],
               until: float) -> None:
    with Client(addr, agent=agent, host="a") as c:
        while counts.get(agent, 0) < GRANTS and time.monotonic() < until:
            try:
                lease = c.acquire(exclusive=True, gpu_count=4, hosts=2, wait=WAIT_S)
            except errors.ResourceExhausted:
                timeouts[agent] = timeouts.get(agent, 0) + 1   # the other agent held on: ask again
                continue
            except errors.GpucoordError as e:
                failures.append(f"{agent}: {type(e).__name__}: {e}")
                return
            try:
                assert len(lease.hosts) == 2 and all(len(p.gpus) == 4 for p in lease.parts), lease.parts
                time.sleep(HOLD_S)   # the work: holding the lease is what the test is about
            finally:
                lease.release()
            counts[agent] = counts.get(agent, 0) + 1


def test_two_agents_looping_two_host_gangs_through_two_replicas_both_progress(cluster: Cluster) -> None:
    addrs = fleet(cluster)
    counts: dict[str, int] = {}
    timeouts: dict[str, int] = {}
    failures: list[str] = []
    until = time.monotonic() + 4 * LIVENESS_S      # a liveness deadline: only a stuck agent misses it
    threads = [threading.Thread(target=loop_gangs, args=(addr, agent, counts, timeouts, failures, until), daemon=True)
               for agent, addr in zip(("agent-x", "agent-y"), addrs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5 * LIVENESS_S)
    print(f"two agents on 2-host x 4-GPU gangs: grants {counts}, waits that ended unanswered {timeouts}")
    assert not failures, failures[:3]
    # Three hosts, two gangs of two: they cannot both hold at once, so each grant of one waited for the other's
    # release; neither is starved and neither deadlocks.
    assert counts.get("agent-x", 0) == GRANTS and counts.get("agent-y", 0) == GRANTS, counts
    assert cluster.get_prefix(cluster.keys.leases()) == []
    assert cluster.get_prefix(cluster.keys.gang_queue()) == []


def test_per_host_gangs_in_opposite_host_orders_deadlock_documentation(cluster: Cluster) -> None:
    """Documentation of the problem multi-host gangs solve (it asserts the deadlock, which the barrier makes
    certain): agent x takes host a's 4 GPUs, then asks for b's; agent y takes b's, then asks for a's. Both hold
    one host and wait for the other's, which can never be granted: both waits end unanswered."""
    addrs = fleet(cluster)
    both_hold = threading.Barrier(2, timeout=LIVENESS_S)
    outcomes: dict[str, str] = {}

    def per_host(addr: str, agent: str, first: str, second: str) -> None:
        with Client(addr, agent=agent, host=first) as one, Client(addr, agent=agent, host=second) as other:
            held = one.acquire(exclusive=True, gpu_count=4, wait=LIVENESS_S)
            try:
                both_hold.wait()     # each holds its first host before asking for its second
                try:
                    other.acquire(exclusive=True, gpu_count=4, wait=DEADLOCK_WAIT_S).release()
                    outcomes[agent] = "granted"
                except errors.ResourceExhausted:
                    outcomes[agent] = f"timed out holding {first}"
            finally:
                held.release()

    threads = [threading.Thread(target=per_host, args=(addrs[0], "agent-x", "a", "b"), daemon=True),
               threading.Thread(target=per_host, args=(addrs[1], "agent-y", "b", "a"), daemon=True)]
    for t in threads:
        t.start()
    # Both at once: each host's 4 GPUs held by one agent, and the other agent waiting there.
    wait_for(lambda: all(len(cluster.get_prefix(cluster.keys.leases(h))) == 4 and cluster.get_prefix(cluster.keys.queue(h))
                         for h in ("a", "b")), LIVENESS_S, "each agent to hold one host and wait for the other's")
    for t in threads:
        t.join(LIVENESS_S)
    print(f"per-host gangs in opposite orders: {outcomes}")
    assert outcomes == {"agent-x": "timed out holding a", "agent-y": "timed out holding b"}, outcomes
