"""The command the eviction tests of ``gpucoord run`` put under a lease (``CHILD``, written to a file by the
``victim_py`` fixture of tests/conftest.py), the eviction grace they run with, and ``start_victim``."""
from __future__ import annotations

import subprocess
import sys

from tests.support.processes import command_pid, gpucoord_run

# The command put under the lease. It prints its pid once ready, then waits for signals. "slow" and "ignore"
# ignore SIGTERM; "slow" also takes a while to exit after SIGKILL, like a process with a large CUDA context
# whose driver unmaps its memory as it exits: 2 GiB of small pages and many epoll registrations, which the
# kernel tears down before the process is gone. "term" exits at SIGTERM; every mode dies of SIGINT silently.
CHILD = r"""
import mmap, os, resource, select, signal, sys
mode = sys.argv[1]
signal.signal(signal.SIGINT, signal.SIG_DFL)
if mode in ("slow", "ignore"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
keep = []
if mode == "slow":
    m = mmap.mmap(-1, 2 << 30, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_NOHUGEPAGE)
    try:
        m.madvise(23)    # MADV_POPULATE_WRITE
    except OSError:
        for i in range(0, len(m), 4096):
            m[i] = 1
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    eps = [select.epoll() for _ in range(80)]
    for _ in range(min(hard, 20000) - 200):
        fd = os.eventfd(0)
        for ep in eps:
            ep.register(fd)
    keep = [m, eps]
print(os.getpid(), flush=True)
while True:
    signal.pause()
"""

GRACE_S = 1.0


def start_victim(addr: str, host: str, child_py: str, mode: str, started: list[int],
                 *extra: str) -> tuple[subprocess.Popen[str], int]:
    """``gpucoord run`` of the child, holding the whole 16 GiB GPU at priority 0; returns it and the child's pid."""
    run = gpucoord_run(addr, "--host", host, "--agent", "low", "--vram", "16GiB", *extra, "--",
                       sys.executable, child_py, mode)
    started.append(run.pid)
    return run, command_pid(run, started)
