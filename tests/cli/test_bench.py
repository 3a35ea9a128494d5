"""``gpucoord bench all --quick`` runs end to end and produces every line of the performance table.

A smoke test: it asserts that each target P1-P8 is measured and reported, never a timing (this machine's
numbers say nothing; see the README's performance section for a full run)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.harness import child_env

pytestmark = pytest.mark.integration

EXPECTED = {"P1": 1, "P2": 2, "P3": 3, "P4": 4, "P5": 2, "P6": 2, "P7": 2, "P8": 4}


def test_quick_bench_reports_every_target() -> None:
    proc = subprocess.run([sys.executable, "-m", "coordinator.cli", "bench", "all", "--quick", "--json"],
                          capture_output=True, text=True, timeout=240, env=child_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    counts: dict[str, int] = {}
    for line in doc["lines"]:
        counts[line["id"]] = counts.get(line["id"], 0) + 1
        assert line["what"] and line["unit"] is not None and line["target"]
        assert isinstance(line["figure"], float)
        if line["target"] != "report":
            assert line["ok"] in (True, False), line     # a verdict, whichever it is
    assert counts == EXPECTED
    assert set(doc["side_by_side"]) == {"1", "16"}
    for level in doc["side_by_side"].values():
        assert level["gpucoord_pairs_s"] > 0 and level["lock_pairs_s"] > 0


def test_text_output_has_one_line_per_figure() -> None:
    proc = subprocess.run([sys.executable, "-m", "coordinator.cli", "bench", "p7", "--quick"],
                          capture_output=True, text=True, timeout=120, env=child_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("P7")]
    assert len(lines) == 2 and all("target <= 50 ms" in x and ("PASS" in x or "FAIL" in x) for x in lines)
