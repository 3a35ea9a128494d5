"""Fixtures of the ``gpucoord run`` tests: ``started`` (PIDs to kill at the end) and ``victim_py`` (the command
the eviction tests put under a lease)."""
from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.processes import ProcessGone
from tests.support.run_victim import CHILD


@pytest.fixture
def started() -> Iterator[list[int]]:
    """PIDs a test started (wrappers and commands); whatever still runs at the end is SIGKILLed by PID."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if not ProcessGone.now_gone(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass    # it went meanwhile


@pytest.fixture
def victim_py(tmp_path: Path) -> str:
    """``run_victim.CHILD`` as a file: ``python victim.py MODE``."""
    path = tmp_path / "victim.py"
    path.write_text(CHILD)
    return str(path)
