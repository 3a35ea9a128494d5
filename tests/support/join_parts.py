"""The parts of a multi-host lease run under ``gpucoord run --join LEASE --rank R`` (real child processes, one
per rank, each with a session of the holder's agent on its rank's host): ``join_part`` starts one,
``ENV_SCRIPT`` prints what its command sees, ``PID_SCRIPT`` prints its pid and waits to be stopped."""
from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tests.support.processes import gpucoord_run

# The command's view: its pid, GPUs, and the GPUCOORD_* and torchrun PET_* variables, as one JSON line.
ENV_SCRIPT = ("import os, json; print(json.dumps({k: v for k, v in os.environ.items() "
              "if k.startswith(('PET_', 'GPUCOORD_')) or k == 'CUDA_VISIBLE_DEVICES'}), flush=True)")
# A part that runs until it is stopped: its pid first (``tests.support.processes.command_pid``).
PID_SCRIPT = "import os, time; print(os.getpid(), flush=True); time.sleep(600)"


def join_part(addr: str, agent: str, lease: Any, rank: int, script: str) -> subprocess.Popen[str]:
    """``gpucoord run --join`` of ``lease``'s rank ``rank`` by ``agent`` on that rank's host, running ``script``."""
    host = lease.part(rank).host
    return gpucoord_run(addr, "--host", host, "--agent", agent, "--join", lease.id, "--rank", str(rank), "--",
                        sys.executable, "-c", script)


def printed_env(run: subprocess.Popen[str], timeout: float) -> dict[str, str]:
    """The environment ``ENV_SCRIPT`` printed (its last line), once ``run`` exited 0."""
    out, err = run.communicate(timeout=timeout)
    assert run.returncode == 0, err
    env: dict[str, str] = json.loads(out.strip().splitlines()[-1])
    return env
