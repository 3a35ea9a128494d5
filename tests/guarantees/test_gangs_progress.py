"""Gangs make progress where single leases deadlock or starve (issue 21, acceptance): two agents that each need
both GPUs of a host loop on gangs with no deadlock, both progressing; the same agents taking two single
leases in opposite orders deadlock until a wait times out (kept as documentation of the problem); a 4-GPU
exclusive request waiting behind a stream of 1-GPU requests is granted soon after enough GPUs drain (G2 with
gangs: the stream may not take the GPUs it could use). Every test ends with the history checker."""
from __future__ import annotations

import os
import threading
import time

import pytest

from agent_client import Client, errors
from tests.support.cluster import Cluster
from tests.support.waiting import LIVENESS_S, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]
LOOP_S = float(os.environ.get("GPUCOORD_GANG_LOOP_S", "30"))   # the 30 s; lower it for a quick run
HOLD_S = 0.05


def loop(addr: str, agent: str, until: float, take: str, counts: dict[str, int], failures: list[str]) -> None:
    with Client(addr, agent=agent, host="h1") as c:
        while time.monotonic() < until:
            try:
                if take == "gang":
                    lease = c.acquire(vram_mb=12_000, gpu_count=2, wait=10)
                    time.sleep(HOLD_S)   # the work: holding the lease is what the test is about
                    lease.release()
                else:                    # two single leases, in this agent's own order
                    order = (0, 1) if take == "forward" else (1, 0)
                    first = c.acquire(vram_mb=12_000, gpu=order[0], wait=2)
                    try:
                        time.sleep(HOLD_S)   # loading the first half before asking for the second
                        second = c.acquire(vram_mb=12_000, gpu=order[1], wait=2)
                    finally:
                        first.release()
                    second.release()
                counts[agent] = counts.get(agent, 0) + 1
            except errors.GpucoordError as e:
                failures.append(f"{agent}: {type(e).__name__}: {e}")
                if take == "gang":
                    return


def run_pair(cluster: Cluster, takes: tuple[str, str], seconds: float) -> tuple[dict[str, int], list[str]]:
    cluster.start_node("h1", "2x16GiB")
    addr = cluster.start_coordinator()
    until = time.monotonic() + seconds
    counts: dict[str, int] = {}
    failures: list[str] = []
    threads = [threading.Thread(target=loop, args=(addr, agent, until, take, counts, failures), daemon=True)
               for agent, take in zip(("agent-a", "agent-b"), takes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 30)
    return counts, failures


def test_two_agents_needing_both_gpus_loop_on_gangs_without_deadlock_and_both_progress(cluster: Cluster) -> None:
    counts, failures = run_pair(cluster, ("gang", "gang"), LOOP_S)
    print(f"two agents on 2-GPU gangs for {LOOP_S:g} s: {counts} pairs, {len(failures)} failed")
    assert not failures, failures[:3]
    # Each pair is a 50 ms hold plus two round trips: both agents get many turns, neither is starved.
    assert min(counts.get("agent-a", 0), counts.get("agent-b", 0)) >= LOOP_S, counts


@pytest.mark.xfail(reason="documentation: two single acquires in opposite orders deadlock until a wait times out "
                          "(the problem gangs solve); it passes when they happen not to collide", strict=False)
def test_two_single_acquires_in_opposite_orders_deadlock_until_a_wait_times_out(cluster: Cluster) -> None:
    counts, failures = run_pair(cluster, ("forward", "backward"), min(LOOP_S, 10.0))
    print(f"two single acquires in opposite orders: {counts} pairs, {len(failures)} failed: {failures[:2]}")
    assert not failures, (counts, failures[:3])


def test_an_exclusive_four_gpu_request_is_not_starved_by_a_stream_of_one_gpu_requests(cluster: Cluster) -> None:
    cluster.start_node("h1", "8x80GiB")
    addr = cluster.start_coordinator()
    stop = threading.Event()
    held: list[float] = []
    hold_s = 0.4

    def stream() -> None:
        """A 1-GPU shared request (60 GiB of 80) every 50 ms, each held 400 ms."""
        timers = []
        with Client(addr, agent="agent-s", host="h1") as s:
            while not stop.is_set():
                try:
                    lease = s.acquire(vram_mb=60_000)   # one per GPU: the stream spreads over the host
                    held.append(time.monotonic())
                    timers.append(threading.Timer(hold_s, lease.release))
                    timers[-1].start()
                except errors.ResourceExhausted:
                    pass                 # held back behind the waiting gang (G2): the stream goes on
                stop.wait(0.05)
            for timer in timers:
                timer.join()
    t = threading.Thread(target=stream, daemon=True)
    t.start()
    try:
        with Client(addr, agent="agent-t", host="h1") as trainer:
            while len(held) < 12:        # the stream has spread over the host's GPUs
                time.sleep(0.05)
            asked = time.monotonic()
            lease = trainer.acquire(exclusive=True, gpu_count=4, wait=30)
            granted = time.monotonic()
            waited = granted - asked
            print(f"exclusive gang of 4 granted {waited:.3f} s after asking, behind {len(held)} stream grants")
            # Granted once the stream's leases on 4 GPUs drained (each is held 0.4 s), within 2 s of that.
            assert waited <= hold_s + 2.0, f"the exclusive gang waited {waited:.2f} s"
            assert len(lease.gpus) == 4 and lease.exclusive
            # Once the gang holds its 4 GPUs, the stream runs on the other 4 beside it.
            wait_for(lambda: any(x > granted for x in held), LIVENESS_S, "the stream to run beside the gang")
            lease.release()
    finally:
        stop.set()
        t.join(LIVENESS_S)
