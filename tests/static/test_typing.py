"""The code base type-checks with mypy --strict (generated modules excluded; see pyproject.toml)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import REPO


def test_mypy_strict() -> None:
    pytest.importorskip("mypy")
    proc = subprocess.run([sys.executable, "-m", "mypy", "coordinator", "agent_client"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
