"""``gpucoord run`` and the node's check of GPU processes against leases: the acceptance of issue 9.

Every test runs the real ``gpucoord run`` wrapper as a child process around a real command, against a real
etcd, an in-process coordinator and an in-process node daemon whose simulated GPUs list real PIDs
(``--fake-processes``). Processes are stopped by PID.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import grpc
import psutil
import pytest

from agent_client import Client
from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from coordinator import metrics
from coordinator.cli.common import fetch_status
from tests.support import REPO
from tests.support.cluster import Cluster
from tests.support.processes import (
    child_env,
    command_pid,
    gpucoord_run,
    write_fake_processes,
)
from tests.support.waiting import LIVENESS_S, Background, wait_for

pytestmark = pytest.mark.integration

# The command put under the lease. It prints its pid, then: "trap" ignores SIGTERM (writing when it came)
# and waits for signals; "pause" waits for signals; "stdin" runs until its stdin closes.
CHILD = r"""
import os, signal, sys, time
mode = sys.argv[1]
print(os.getpid(), flush=True)
if mode == "trap":
    def on_term(*_):
        with open(sys.argv[2], "w") as f:
            f.write(repr(time.time()))
    signal.signal(signal.SIGTERM, on_term)
if mode == "stdin":
    sys.stdin.read()
else:
    while True:
        signal.pause()
"""


@pytest.fixture
def child_py(tmp_path: Path) -> str:
    path = tmp_path / "child.py"
    path.write_text(CHILD)
    return str(path)


def alive(pid: int) -> bool:
    """Running, not a zombie (a killed process whose wrapper died may wait for a reaper as a zombie)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def gpu_status(addr: str, host: str = "h1", index: int = 0) -> dict[str, Any]:
    gpus: list[dict[str, Any]] = fetch_status(addr, host)["hosts"][0]["gpus"]
    return next(g for g in gpus if int(g["index"]) == index)


def test_run_prints_the_leased_gpu_uuid_exits_0_and_leaves_nothing(cluster: Cluster) -> None:
    cluster.start_node("h1", "2x16GiB")
    addr = cluster.start_coordinator()
    script = ("import os; print(os.environ['CUDA_VISIBLE_DEVICES']); "
              "print(' '.join(os.environ[k] for k in ('GPUCOORD_LEASE_ID', 'GPUCOORD_TOKEN', 'GPUCOORD_GPU_UUID', "
              "'GPUCOORD_VRAM_MB', 'CUDA_MPS_PINNED_DEVICE_MEM_LIMIT')))")
    run = gpucoord_run(addr, "--host", "h1", "--agent", "a", "--vram", "1GiB", "--gpu", "1", "--",
                       sys.executable, "-c", script)
    out, err = run.communicate(timeout=60)
    assert run.returncode == 0, err
    uuid, extra = out.splitlines()
    assert uuid == "GPU-sim-h1-1"
    lease_id, token, gpu_uuid, vram, mps = extra.split()
    assert (gpu_uuid, vram, mps) == (uuid, "1024", "0=1024M") and int(token) >= 1 and lease_id
    assert "exited with status 0" in err
    assert cluster.get_prefix(cluster.keys.leases()) == []
    assert cluster.get_prefix(cluster.keys.sessions()) == []


def test_a_child_that_ignores_sigterm_is_killed_at_its_eviction_deadline_before_the_requester_gets_in(
        cluster: Cluster, child_py: str, tmp_path: Path, started: list[int]) -> None:
    grace = 3.0
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator(eviction_grace_s=grace)
    term_file = tmp_path / "term"
    run = gpucoord_run(addr, "--host", "h1", "--agent", "low", "--vram", "16GiB", "--",
                       sys.executable, child_py, "trap", str(term_file))
    started.append(run.pid)
    pid = command_pid(run, started)
    died: list[float] = []

    def watch() -> None:
        wait_for(lambda: not alive(pid), 60, "the child to die", interval=0.005)
        died.append(time.time())
    watcher = Background(watch)
    with Client(addr, agent="high", host="h1") as c:
        request = Background(c.acquire, 16384, priority=10, wait=30)
        lease = request.result(timeout=40)
        # Granted: the child must already be gone (run kills it, then releases).
        assert not alive(pid), "the evicting request was granted while the evicted child still ran"
        granted = time.time()
        lease.release()
    watcher.result(timeout=10)
    assert term_file.exists(), "the child never got SIGTERM"
    term_at = float(term_file.read_text())
    # It trapped SIGTERM: only the SIGKILL at the deadline ended it.
    assert died[0] - term_at >= grace - 1.0, (term_at, died[0])
    assert died[0] <= granted
    _, err = run.communicate(timeout=30)
    assert run.returncode == 137, err
    assert "evicted by high/" in err and "SIGKILL at the eviction deadline" in err, err


@pytest.mark.parametrize("enforce", ["kill", "report"])
def test_a_child_whose_wrapper_is_killed_is_killed_by_the_node_or_reported_orphaned(
        cluster: Cluster, child_py: str, tmp_path: Path, started: list[int], enforce: str) -> None:
    ttl, scan_s = 3, 0.2   # the Cluster's node scans every 0.2 s
    procs_file = tmp_path / "procs.json"
    cluster.start_node("h1", "1x16GiB", fake_processes=str(procs_file), enforce=enforce)
    addr = cluster.start_coordinator()
    kills_before = metrics.NODE_REGISTRY.get_sample_value("gpucoord_node_enforce_kills_total",
                                                     {"reason": "orphaned"}) or 0.0
    run = gpucoord_run(addr, "--host", "h1", "--agent", "a", "--vram", "2GiB", "--ttl", str(ttl), "--",
                       sys.executable, child_py, "pause")
    started.append(run.pid)
    pid = command_pid(run, started)
    write_fake_processes(procs_file, {0: {pid: 1500}})
    wait_for(lambda: [p["state"] for p in gpu_status(addr)["processes"]] == ["leased"], 10,
             "the node to attribute the child to its lease")
    os.kill(run.pid, signal.SIGKILL)
    run.wait(10)
    killed_at = time.monotonic()
    if enforce == "kill":
        # G4: the lease goes (within TTL + 1 s on a quiet machine: bench P6); the node kills at its next scan.
        wait_for(lambda: not alive(pid), LIVENESS_S, "the node to kill the orphaned child")
        print(f"the orphaned child killed {time.monotonic() - killed_at:.1f}s after its run "
              f"(TTL {ttl}s + 1 s + a scan, {scan_s}s, on a quiet machine)")
        after = metrics.NODE_REGISTRY.get_sample_value("gpucoord_node_enforce_kills_total", {"reason": "orphaned"})
        assert after == kills_before + 1
    else:
        wait_for(lambda: [p["state"] for p in gpu_status(addr)["processes"]] == ["orphaned"], LIVENESS_S,
                 "the node to report the child as orphaned")
        assert alive(pid), "--enforce report killed a process"
        assert (metrics.NODE_REGISTRY.get_sample_value("gpucoord_node_enforce_kills_total", {"reason": "orphaned"})
                or 0.0) == kills_before
        out = subprocess.run([sys.executable, "-m", "coordinator.cli", "status", "--coordinator", addr, "--host",
                              "h1"], capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=30)
        assert f"ORPHANED on GPU 0: pid {pid}" in out.stdout, out.stdout
        os.kill(pid, signal.SIGKILL)


def _cores_allowed(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError("no Cpus_allowed_list")


def _ranges(ids: list[int]) -> str:
    out: list[list[int]] = []
    for i in sorted(ids):
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)


@pytest.fixture
def split_host(cluster: Cluster) -> Iterator[tuple[str, dict[str, Any]]]:
    """h1 with this machine's real cores, auto-split between agent-a and agent-b; yields agent-b's share."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs at least 2 usable cores to split them")
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(addr))
    spec = {"host": "h1", "mode": "auto-split", "agents": ["agent-a", "agent-b"]}
    resp = stub.ApplyPartition(pb.ApplyPartitionRequest(spec_json=json.dumps(spec)), timeout=10)
    mine = next(a for a in json.loads(resp.partition_json)["allocations"] if a["agent"] == "agent-b")
    yield addr, mine


def _fake_cgroup_root(tmp_path: Path) -> Path:
    """A directory shaped like a delegated cgroup v2 directory (NOT a real cgroup: see docs/agents.md)."""
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text("cpu memory\n")
    return root


def test_the_child_runs_on_its_partition_cores_with_its_memory_share(
        split_host: tuple[str, dict[str, Any]], child_py: str, tmp_path: Path, started: list[int]) -> None:
    addr, mine = split_host
    root = _fake_cgroup_root(tmp_path)
    run = gpucoord_run(addr, "--host", "h1", "--agent", "agent-b", "--vram", "1GiB", "--cgroup-root", str(root),
                       "--", sys.executable, child_py, "stdin", stdin=subprocess.PIPE)
    started.append(run.pid)
    pid = command_pid(run, started)
    assert _cores_allowed(pid) == _ranges(mine["cores"])
    assert _cores_allowed(pid) != _cores_allowed(os.getpid())
    (cg,) = [d for d in root.iterdir() if d.is_dir()]
    assert cg.name.startswith("gpucoord-agent-b-")
    assert (cg / "memory.max").read_text() == str(mine["mem_bytes"])
    assert (cg / "cpu.max").read_text() == f"{len(mine['cores']) * 100000} 100000"
    assert (cg / "cgroup.procs").read_text() == str(pid)
    _, err = run.communicate(input="", timeout=30)
    assert run.returncode == 0, err
    assert "not enforced" not in err, err


def test_a_limit_that_cannot_be_enforced_is_said_once_with_the_reason(
        split_host: tuple[str, dict[str, Any]]) -> None:
    addr, mine = split_host
    run = gpucoord_run(addr, "--host", "h1", "--agent", "agent-b", "--vram", "1GiB", "--",
                       sys.executable, "-c", "pass")
    _, err = run.communicate(timeout=30)
    assert run.returncode == 0, err
    line = f"the memory limit (memory.max = {mine['mem_bytes']} B) is not enforced: no --cgroup-root"
    assert err.count(line) == 1, err


def _real_cgroup_root() -> str | None:
    """A real, writable cgroup v2 directory with the memory controller (GPUCOORD_TEST_CGROUP_ROOT, or
    /sys/fs/cgroup when it is one), or None."""
    for root in (os.environ.get("GPUCOORD_TEST_CGROUP_ROOT"), "/sys/fs/cgroup"):
        if root and os.access(root, os.W_OK):
            try:
                if "memory" in Path(root, "cgroup.controllers").read_text().split():
                    return root
            except OSError:
                continue
    return None


@pytest.mark.skipif(_real_cgroup_root() is None, reason="no writable cgroup v2 directory with the memory "
                                                        "controller here (set GPUCOORD_TEST_CGROUP_ROOT)")
def test_memory_max_in_a_real_cgroup(split_host: tuple[str, dict[str, Any]], child_py: str,
                                     started: list[int]) -> None:
    addr, mine = split_host
    root = _real_cgroup_root()
    assert root is not None
    run = gpucoord_run(addr, "--host", "h1", "--agent", "agent-b", "--vram", "1GiB", "--cgroup-root", root,
                       "--", sys.executable, child_py, "stdin", stdin=subprocess.PIPE)
    started.append(run.pid)
    pid = command_pid(run, started)
    cg = Path(root, Path(f"/proc/{pid}/cgroup").read_text().strip().split("::", 1)[1].lstrip("/"))
    assert cg.name.startswith("gpucoord-agent-b-")
    assert (cg / "memory.max").read_text().strip() == str(mine["mem_bytes"] // 4096 * 4096)
    _, err = run.communicate(input="", timeout=30)
    assert run.returncode == 0, err
    assert not cg.exists(), "the cgroup was left behind"


def test_over_use_shows_in_status_json_and_a_metric(cluster: Cluster, child_py: str, tmp_path: Path,
                                                    started: list[int]) -> None:
    procs_file = tmp_path / "procs.json"
    cluster.start_node("h1", "1x16GiB", fake_processes=str(procs_file), over_use_tolerance_mb=256)
    addr = cluster.start_coordinator()
    run = gpucoord_run(addr, "--host", "h1", "--agent", "a", "--vram", "1000MiB", "--",
                       sys.executable, child_py, "stdin", stdin=subprocess.PIPE)
    started.append(run.pid)
    pid = command_pid(run, started)

    def lease_use() -> list[dict[str, Any]]:
        return list(gpu_status(addr)["lease_use"])
    write_fake_processes(procs_file, {0: {pid: 1200}})   # within 1000 + 256
    wait_for(lambda: [(u["used_mb"], u["over_use"]) for u in lease_use()] == [(1200, False)], 10,
             "the node to report 1200 MiB used, within tolerance")
    (use,) = lease_use()
    sample = {"gpu": "GPU-sim-h1-0", "lease": use["lease_id"]}
    assert metrics.NODE_REGISTRY.get_sample_value("gpucoord_node_lease_over_use_bytes", sample) == 0
    write_fake_processes(procs_file, {0: {pid: 1500}})
    wait_for(lambda: [u["over_use"] for u in lease_use()] == [True], 10, "the node to report over-use")
    out = subprocess.run([sys.executable, "-m", "coordinator.cli", "status", "--json", "--coordinator", addr],
                         capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=30)
    (gpu,) = json.loads(out.stdout)["hosts"][0]["gpus"]
    (use,) = gpu["lease_use"]
    # Numbers are JSON numbers in status --json (not protobuf's strings for 64-bit integers).
    assert (use["over_use"], use["used_mb"], use["vram_mb"], use["pids"]) == (True, 1500, 1000, [pid])
    assert gpu["processes"] == [{"pid": pid, "used_mb": 1500, "state": "leased",
                                 "lease_id": use["lease_id"]}]
    assert metrics.NODE_REGISTRY.get_sample_value("gpucoord_node_lease_over_use_bytes", sample) == 500 * metrics.MIB
    assert metrics.NODE_REGISTRY.get_sample_value("gpucoord_node_lease_vram_used_bytes", sample) == 1500 * metrics.MIB
    _, err = run.communicate(input="", timeout=30)
    assert run.returncode == 0, err


@pytest.mark.skipif(shutil.which("script") is None, reason="needs script(1) to give the command a terminal")
def test_an_interactive_command_gets_the_terminal(cluster: Cluster, started: list[int]) -> None:
    """On a terminal, the command's process group becomes the foreground: it can read the terminal
    (a background group would be stopped by SIGTTIN) and Ctrl-C reaches it."""
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    inner = " ".join(shlex.quote(a) for a in (
        sys.executable, "-m", "coordinator.cli", "run", "--coordinator", addr, "--host", "h1", "--agent", "a",
        "--vram", "1GiB", "--", sys.executable, "-c", "import sys; print('got', sys.stdin.readline().strip())"))
    try:
        out = subprocess.run(["script", "-qec", inner, "/dev/null"], input="hello\n", capture_output=True, text=True,
                             env=child_env(), cwd=REPO, timeout=30)
    except subprocess.TimeoutExpired as e:
        text = e.stdout.decode() if isinstance(e.stdout, bytes) else str(e.stdout)
        for pid in re.findall(r"as pid (\d+)", text):
            started.append(int(pid))   # stopped in the background: the fixture kills it
        raise AssertionError(f"the command hung (stopped reading the terminal?): {text}") from None
    assert out.returncode == 0, out.stdout
    assert "got hello" in out.stdout
