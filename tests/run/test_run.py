"""``gpucoord run``: a real wrapper process around a real child, against a real etcd (the acceptance of
issue 9). Children are stopped by PID."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness import REPO, Cluster, child_env, wait_for

pytestmark = pytest.mark.integration


def gpucoord_run(addr: str, *args: str, stdin: Any = subprocess.DEVNULL) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "coordinator.cli", "run", "--coordinator", addr, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=stdin, text=True,
                            env=child_env(), cwd=REPO)


def test_run_prints_the_leased_gpu_uuid_exits_0_and_leaves_nothing(cluster: Cluster) -> None:
    cluster.start_node("h1", "2x16GiB")
    addr = cluster.start_coordinator()
    script = ("import os; print(os.environ['CUDA_VISIBLE_DEVICES']); "
              "print(' '.join(os.environ[k] for k in ('GPUCOORD_LEASE_ID', 'GPUCOORD_TOKEN', 'GPUCOORD_GPU_UUID', "
              "'GPUCOORD_VRAM_MB', 'CUDA_MPS_PINNED_DEVICE_MEM_LIMIT')))")
    proc = gpucoord_run(addr, "--host", "h1", "--agent", "a", "--vram", "1GiB", "--gpu", "1", "--",
                        sys.executable, "-c", script)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    uuid, extra = out.splitlines()
    assert uuid == "GPU-sim-h1-1"
    lease_id, token, gpu_uuid, vram, mps = extra.split()
    assert (gpu_uuid, vram, mps) == (uuid, "1024", "0=1024M") and int(token) >= 1 and lease_id
    assert "exited with status 0" in err
    assert cluster.get_prefix(cluster.keys.leases()) == []
    assert cluster.get_prefix(cluster.keys.sessions()) == []
