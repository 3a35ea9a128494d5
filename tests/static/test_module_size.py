"""No module is over 400 lines outside generated code (``agent_client/api/``): a module of one concern fits on a
few screens. The tests themselves are held to it as well."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import REPO

ROOT = Path(REPO)
MAX_LINES = 400

# Modules over the limit that issue 20 (item 3) is splitting on other branches: each is reported, and expected
# to fail until its split lands. Remove a name once its module is under the limit (an XPASS says so).
BEING_SPLIT = (
    "coordinator/policy/placement.py",
    "coordinator/policy/planner.py",
    "coordinator/records.py",
)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def _modules(*dirs: str) -> list[Path]:
    found = [p for d in dirs for p in (ROOT / d).rglob("*.py")
             if not p.relative_to(ROOT).as_posix().startswith("agent_client/api/")]
    assert found, f"no module found under {dirs}"
    return sorted(found)


def _over(paths: list[Path]) -> list[str]:
    return [f"{p.relative_to(ROOT).as_posix()}: {n} lines" for p in paths if (n := _lines(p)) > MAX_LINES]


def test_no_test_module_is_over_400_lines() -> None:
    over = _over(_modules("tests"))
    assert not over, "split these along their sections:\n" + "\n".join(over)


def test_no_package_module_is_over_400_lines_outside_generated_code() -> None:
    paths = [p for p in _modules("coordinator", "agent_client") if p.relative_to(ROOT).as_posix() not in BEING_SPLIT]
    over = _over(paths)
    assert not over, "split these along their concerns:\n" + "\n".join(over)


@pytest.mark.parametrize("module", [
    pytest.param(m, marks=pytest.mark.xfail(strict=False, reason="issue 20 item 3: split on another branch"))
    for m in BEING_SPLIT])
def test_a_module_being_split_is_under_400_lines(module: str) -> None:
    path = ROOT / module
    if not path.exists():
        return    # split into modules of other names: the test above checks those
    n = _lines(path)
    assert n <= MAX_LINES, f"{module}: {n} lines"
