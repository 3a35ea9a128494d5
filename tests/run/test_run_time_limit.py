"""``gpucoord run --time 4 --signal-before 2 -- CMD`` (issue 31, docs/policies.md "Time limits"): the lease's time-limit
notice makes ``run`` SIGTERM its command (not before the end minus the warning), the command (which traps SIGTERM)
is SIGKILLed at the notice's deadline, the lease's end, and the lease is gone; a request waiting for the GPU is
granted after it. Only the order is asserted, with liveness deadlines, never an upper time bound. Bad durations are
refused before anything is sent (exit 2, the flag named)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent_client import Client
from tests.support import REPO
from tests.support.cluster import Cluster
from tests.support.processes import ProcessGone, child_env, command_pid, gpucoord_run
from tests.support.waiting import LIVENESS_S, Background, wait_for

pytestmark = pytest.mark.integration

# Prints its pid, records the wall time of its SIGTERM in a file (and keeps running), waits for signals.
CHILD = r"""
import os, signal, sys, time
print(os.getpid(), flush=True)
def on_term(*_):
    with open(sys.argv[1], "w") as f:
        f.write(repr(time.time()))
signal.signal(signal.SIGTERM, on_term)
while True:
    signal.pause()
"""


@pytest.mark.usefixtures("history_checked")
def test_run_time_gets_sigterm_at_end_minus_signal_before_and_is_gone_after_the_end(
        cluster: Cluster, tmp_path: Path, started: list[int]) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    child_py, term_file = tmp_path / "child.py", tmp_path / "term"
    child_py.write_text(CHILD)
    before = time.time()
    run = gpucoord_run(addr, "--host", "h1", "--agent", "timed", "--vram", "16GiB", "--time", "4",
                       "--signal-before", "2", "--", sys.executable, str(child_py), str(term_file))
    started.append(run.pid)
    pid = command_pid(run, started)
    gone = ProcessGone(pid)
    (lease,) = cluster.leases()
    assert (lease.time_limit_s, lease.time_limit_warning_s) == (4.0, 2.0)
    with Client(addr, agent="waiter", host="h1") as c:
        request = Background(c.acquire, 8192, wait=LIVENESS_S)   # equal priority: it waits for the lease's end
        died = gone.wait(LIVENESS_S)
        granted = request.result(timeout=LIVENESS_S)
        assert granted.host == "h1" and not [x for x in cluster.leases() if x.id == lease.id]
        granted.release()
    wait_for(term_file.exists, LIVENESS_S, "the command's SIGTERM")
    term_at = float(term_file.read_text())
    # The SIGTERM came at the notice, not before the end minus the warning; the SIGKILL not before the end.
    assert term_at - before >= 4.0 - 2.0, term_at - before
    assert died - before >= 4.0 and died >= term_at, (before, term_at, died)
    _, err = run.communicate(timeout=LIVENESS_S)
    assert run.returncode == 137, err
    assert "evicted by operator (time-limit): SIGTERM at the notice, SIGKILL at the eviction deadline" in err, err


@pytest.mark.parametrize("flags", [("--time", "2x"), ("--time", "-5"), ("--signal-before", "soon"),
                                   ("--time", "999d")])
def test_a_bad_duration_is_refused_naming_the_flag_before_anything_is_sent(flags: tuple[str, str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "coordinator.cli", "run", "--coordinator", "127.0.0.1:1",
                           "--agent", "a", "--vram", "1GiB", *flags, "--", "true"],
                          capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert flags[0] in proc.stderr, proc.stderr
