"""``gpucoord bench all --quick`` runs end to end and produces every line of the performance table.

A smoke test: it asserts that each target P1-P8 is measured and reported, never a timing (this machine's
numbers say nothing; see docs/performance.md for a full run)."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator.bench import eventloop
from coordinator.bench.rig import etcd_metric, proposals, renice
from coordinator.bench.stats import percentile
from coordinator.etcd.store import Store
from tests.support.cluster import EtcdEndpoint
from tests.support.noise import assert_no_asyncio_noise
from tests.support.processes import child_env
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

EXPECTED = {"P1": 1, "P2": 3, "P3": 3, "P4": 4, "P5": 3, "P6": 2, "P7": 2, "P8": 6, "GANG": 2, "MULTIHOST": 5,
            "TEAMS": 3}


# A bound against a hung bench, not a speed: a quick run takes about 90 s on a quiet 2-core machine, and a
# busy neighbour (a CPU hog, another gpucoord stack) can make it several times slower.
@pytest.mark.timeout(1200)
def test_quick_bench_reports_every_target() -> None:
    proc = subprocess.run([sys.executable, "-m", "coordinator.cli", "bench", "all", "--quick", "--json"],
                          capture_output=True, text=True, timeout=1100, env=child_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    # Every phase's event loop ends with nothing left running and nothing used after it closed.
    assert_no_asyncio_noise(proc.stderr, "bench all --quick")
    doc = json.loads(proc.stdout)
    counts: dict[str, int] = {}
    for line in doc["lines"]:
        counts[line["id"]] = counts.get(line["id"], 0) + 1
        assert line["what"] and line["unit"] is not None and line["target"]
        assert isinstance(line["figure"], float)
        if line["target"] != "report":
            assert line["ok"] in (True, False), line     # a verdict, whichever it is
    assert counts == EXPECTED
    assert set(doc["side_by_side"]) == {"1", "16"}
    for level in doc["side_by_side"].values():
        assert level["gpucoord_pairs_s"] > 0 and level["lock_pairs_s"] > 0
    # The gang line's two sides both ran: 2-GPU gangs and the same agents' two single leases.
    assert doc["gang"]["agents"] == 8
    assert doc["gang"]["gang"]["pairs_s"] > 0 and doc["gang"]["singles"]["pairs_s"] > 0
    # The multi-host line's two sides both ran: 2-host x 4-GPU gangs over 8 hosts and the same agents' gang
    # per host, host A then B.
    assert (doc["multihost"]["agents"], doc["multihost"]["hosts"], doc["multihost"]["gpus_per_host"]) == (4, 8, 4)
    for side in ("multihost", "per_host"):
        assert doc["multihost"][side]["pairs_s"] > 0 and doc["multihost"][side]["acquire_p50_ms"] > 0
    # And P1/P4 with multi-host gangs held and waiting, and without.
    for side in ("none", "gangs"):
        assert doc["multihost"]["p1_p4"][side]["pairs_s"] > 0 and doc["multihost"]["p1_p4"][side]["acquire_p50_ms"] > 0
    # The teams line's two sides both ran, and with teams stored the grants took the limited team's path:
    # each round's transaction bumped the team's ledger.
    for side in ("none", "teams"):
        assert doc["teams"][side]["pairs_s"] > 0 and doc["teams"][side]["acquire_p50_ms"] > 0
    assert doc["teams"]["ledger_bumps"] > 0


def test_the_multihost_line_is_printed_with_its_fields() -> None:
    """``bench multihost --quick``: two MULTIHOST lines, pairs/s and acquire p50, each with its baseline (a
    gang per host in a fixed host order) and a verdict, then three of P1 and P4 with multi-host gangs held and
    waiting against none; the figures themselves are not judged here."""
    proc = subprocess.run([sys.executable, "-m", "coordinator.cli", "bench", "multihost", "--quick"],
                          capture_output=True, text=True, timeout=600, env=child_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert_no_asyncio_noise(proc.stderr, "bench multihost --quick")
    lines = [x for x in proc.stdout.splitlines() if x.startswith("MULTIHOST")]
    assert [("pairs/s" in x, "acquire p50" in x) for x in lines[:2]] == [(True, False), (False, True)], proc.stdout
    for x in lines[:2]:
        assert ("PASS" in x or "FAIL" in x) and "ratio" in x and "baseline" in x and "host A then B" in x, x
        assert "2-host x 4-GPU" in x and "4 agents" in x, x
    assert ["(P1)" in lines[2], "(P4)" in lines[3], "(P4)" in lines[4]] == [True, True, True], proc.stdout
    for x in lines[2:]:
        assert ("PASS" in x or "FAIL" in x) and "without them, same run" in x, x


def test_text_output_has_one_line_per_figure() -> None:
    proc = subprocess.run([sys.executable, "-m", "coordinator.cli", "bench", "p7", "--quick"],
                          capture_output=True, text=True, timeout=600, env=child_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("P7")]
    assert len(lines) == 2 and all("target <= 50 ms" in x and ("PASS" in x or "FAIL" in x) for x in lines)


def test_proposals_read_from_etcd_metrics_count_each_write(etcd: EtcdEndpoint) -> None:
    """P2 and P8 divide a difference of etcd's committed raft proposals: each put is one proposal."""
    async def puts(n: int) -> None:
        async with Store(etcd.endpoints) as s:
            for i in range(n):
                await s.put(f"/bench-test/proposals/{i}".encode(), b"x")
    before = proposals(etcd.metrics_url)
    asyncio.run(puts(5))
    # etcd sets the gauge in its raft loop, not before it answers a put: the last one may show a moment later.
    wait_for(lambda: proposals(etcd.metrics_url) - before >= 5, 10, "etcd's metric to count the 5 puts")
    # A sample with labels is found by its name alone; a name etcd does not export is an error, not 0.
    assert etcd_metric(etcd.metrics_url, "etcd_server_go_version") == 1.0
    with pytest.raises(RuntimeError, match="etcd_no_such_metric"):
        etcd_metric(etcd.metrics_url, "etcd_no_such_metric")


def test_percentile_takes_the_upper_nearest_rank() -> None:
    """The figures are observed values: p50 of an even count is the upper middle one, p99 of 20 the largest."""
    twenty = [float(x) for x in range(20, 0, -1)]
    assert (percentile(twenty, .5), percentile(twenty, .99), percentile(twenty, 0)) == (11.0, 20.0, 1.0)
    assert percentile([3.0, 1.0, 2.0], .5) == 2.0
    assert percentile([5.0], .99) == 5.0
    assert percentile([], .5) != percentile([], .5)     # NaN


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1, max_size=300),
       st.sampled_from([0.0, 0.25, 0.5, 0.9, 0.99, 1.0]))
def test_percentile_is_the_smallest_value_with_more_than_q_of_them_at_or_below(values: list[float], q: float) -> None:
    p = percentile(values, q)
    assert p in values
    at_or_below = sum(v <= p for v in values)
    below = sum(v < p for v in values)
    assert at_or_below > q * len(values) or at_or_below == len(values)
    assert below <= q * len(values)


def test_the_phases_share_one_event_loop_and_each_run_cancels_what_it_left() -> None:
    """A gRPC call cancelled at the end of one phase's run completes on a loop that is still open (no
    "Event loop is closed" from the next run), and nothing a run started keeps running into the next."""
    left: list[asyncio.Task[None]] = []

    async def phase() -> asyncio.AbstractEventLoop:
        left.append(asyncio.create_task(asyncio.sleep(3600)))
        return asyncio.get_running_loop()

    with eventloop.one_loop():
        first, second = eventloop.run(phase()), eventloop.run(phase())
        assert first is second and not first.is_closed()
        assert left[0].cancelled() and left[1].cancelled()
    assert first.is_closed()


def test_renice_lowers_every_thread_of_a_process_not_only_its_first() -> None:
    """P5's restart puts its agents' process at nice 19: Linux's niceness is per thread, and a gRPC client's
    work runs on threads of its own."""
    child = subprocess.Popen([sys.executable, "-c", "import sys, threading; t = threading.Thread(target=sys.stdin.read);"
                              "t.start(); print('up', flush=True); t.join()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"up\n"
        renice(child.pid, 7)
        tids = os.listdir(f"/proc/{child.pid}/task")
        assert len(tids) >= 2
        # /proc/PID/task/TID/stat: the 19th field is the thread's niceness (after the name in parentheses).
        nice = [int(open(f"/proc/{child.pid}/task/{t}/stat").read().rpartition(")")[2].split()[16]) for t in tids]
        assert nice == [7] * len(tids)
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(10)
