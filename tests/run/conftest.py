"""Fixtures of the ``gpucoord run`` tests: ``victim_py`` (the command the eviction tests put under a lease);
``started`` (PIDs to kill at the end) is tests/conftest.py's."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.run_victim import CHILD


@pytest.fixture
def victim_py(tmp_path: Path) -> str:
    """``run_victim.CHILD`` as a file: ``python victim.py MODE``."""
    path = tmp_path / "victim.py"
    path.write_text(CHILD)
    return str(path)
