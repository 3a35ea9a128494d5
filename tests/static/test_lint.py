"""The code base passes ruff with the rules in pyproject.toml ([tool.ruff.lint]: import order, pyflakes,
bugbear, asyncio, blind except, and noqa comments that silence nothing), and every noqa comment names its rule
and says why."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

ROOT = Path(REPO)

NOQA = re.compile(r"#\s*noqa\b(?P<rest>.*)")
EXPLAINED = re.compile(r":\s*[A-Z]+[0-9]+(,\s*[A-Z]+[0-9]+)*\s+-\s+\S")


def test_ruff_check_is_clean() -> None:
    pytest.importorskip("ruff")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_every_noqa_names_a_rule_and_a_reason() -> None:
    bare = []
    for path in sorted(ROOT.glob("**/*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in {".venv", "build"} or rel.parts[:2] == ("agent_client", "api"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            m = NOQA.search(line)
            if m and not EXPLAINED.match(m.group("rest")):
                bare.append(f"{rel}:{n}: {line.strip()}")
    assert not bare, "a noqa without 'RULE - reason':\n" + "\n".join(bare)
