"""No module is over 400 lines outside generated code (``agent_client/api/``): a module of one concern fits on a
few screens. The tests themselves are held to it as well."""
from __future__ import annotations

from pathlib import Path

from tests.support import REPO

ROOT = Path(REPO)
MAX_LINES = 400

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
    over = _over(_modules("coordinator", "agent_client"))
    assert not over, "split these along their concerns:\n" + "\n".join(over)
