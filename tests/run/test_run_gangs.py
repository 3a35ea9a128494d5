"""``gpucoord run --gpus N`` (issue 21): the command runs under one gang lease; ``CUDA_VISIBLE_DEVICES`` and
``GPUCOORD_GPU_UUIDS`` list the gang's GPU uuids in index order, with one MPS memory limit per device; the
processes are recorded on every GPU's record; the whole gang goes when the command exits."""
from __future__ import annotations

import json
import sys

import pytest

from tests.support.cluster import Cluster
from tests.support.processes import gpucoord_run

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]

SCRIPT = ("import os, json; print(json.dumps({k: os.environ[k] for k in ('CUDA_VISIBLE_DEVICES', "
          "'GPUCOORD_GPU_UUIDS', 'CUDA_MPS_PINNED_DEVICE_MEM_LIMIT', 'GPUCOORD_LEASE_ID')}))")


def test_run_with_a_gang_of_two_nvlink_gpus_sees_both_uuids_in_order(cluster: Cluster) -> None:
    cluster.start_node("h1", "4x16GiB:nvlink=0-1,2-3")
    addr = cluster.start_coordinator()
    run = gpucoord_run(addr, "--host", "h1", "--agent", "a", "--vram", "2GiB", "--gpus", "2", "--topology", "nvlink",
                       "--", sys.executable, "-c", SCRIPT)
    out, err = run.communicate(timeout=60)
    assert run.returncode == 0, err
    env = json.loads(out.splitlines()[-1])
    assert env["CUDA_VISIBLE_DEVICES"] == env["GPUCOORD_GPU_UUIDS"] == "GPU-sim-h1-0,GPU-sim-h1-1"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M,1=2048M"
    assert "GPUs 0,1" in err
    assert cluster.get_prefix(cluster.keys.leases()) == []


def test_run_exclusive_takes_whole_gpus_and_records_its_processes_on_each(cluster: Cluster) -> None:
    cluster.start_node("h1", "2x16GiB")
    addr = cluster.start_coordinator()
    script = ("import sys, time; print('up', flush=True); sys.stdin.readline()")
    run = gpucoord_run(addr, "--host", "h1", "--agent", "a", "--exclusive", "--gpus", "2", "--",
                       sys.executable, "-c", script, stdin=-1)
    assert run.stdout is not None and run.stdout.readline().strip() == "up"
    records = [json.loads(kv.value) for kv in cluster.get_prefix(cluster.keys.leases())]
    assert len(records) == 2 and all(r["exclusive"] and r["vram_mb"] == 16384 for r in records)
    assert records[0]["pids"] == records[1]["pids"] and records[0]["pids"]
    assert run.stdin is not None
    _, err = run.communicate("\n", timeout=60)
    assert run.returncode == 0, err
    assert cluster.get_prefix(cluster.keys.leases()) == []
