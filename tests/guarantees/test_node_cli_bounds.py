"""`gpucoord node` refuses values it would store unbounded, quoting at most a short prefix of them."""
from __future__ import annotations

import subprocess
import sys

from tests.support import REPO
from tests.support.processes import child_env


def node(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coordinator.cli", "node", "--etcd", "127.0.0.1:1",
                           "--fake-gpus", "1x1GiB", *args],
                          capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=60)


def test_an_oversized_host_or_disk_path_is_refused_before_anything_starts() -> None:
    bad_host = node("--host", "h" * 100_000)
    assert bad_host.returncode == 2 and "--host" in bad_host.stderr and len(bad_host.stderr) < 300
    bad_disk = node("--host", "h1", "--disk-path", "/" + "d" * 300)
    assert bad_disk.returncode == 2 and "--disk-path" in bad_disk.stderr and len(bad_disk.stderr) < 300
