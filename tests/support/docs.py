"""The project's documentation: README.md and the pages under docs/, in the one order their blocks run.

``tests/cli/test_readme.py`` runs every fenced block of these files against one ``gpucoord up``, README.md's
first and then each page's, in this order, which is the order their text had when it was all one README:
a block may use what an earlier one made (a file it wrote, the second node, a team), so a page moves in this
list only with its blocks checked against the pages around it. Two blocks run later than they did there, both
read-only: cli.md's (a refused ``lease revoke``, once before "Metrics") and the key schema's ``gpucoord keys``
and ``etcdctl`` reads (once before "Running securely", now after "Production: etcd" in etcd.md). README.md's
own blocks of an operator's first hour only read (``status``) or check flags (``synopsis``). Every ``docs/*.md`` must be listed here (the
README test fails on one that is not), and docs/README.md lists the pages in the same order.
"""
from __future__ import annotations

from pathlib import Path

from tests.support import REPO

ROOT = Path(REPO)
DOCS = ("README.md", "docs/README.md", "docs/agents.md", "docs/guarantees.md", "docs/security.md",
        "docs/operations.md", "docs/cli.md", "docs/etcd.md", "docs/partitions.md", "docs/teams.md",
        "docs/policies.md", "docs/performance.md", "docs/design.md")


def doc_paths() -> list[Path]:
    """Every documentation file, in the order of ``DOCS``."""
    return [ROOT / name for name in DOCS]


def on_disk() -> set[str]:
    """README.md and every Markdown file under docs/, as repository-relative names."""
    return {"README.md"} | {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")}


def all_text() -> str:
    """README.md and the docs/ pages, one after another."""
    return "\n".join(p.read_text() for p in doc_paths())


def doc_with(marker: str) -> tuple[str, str]:
    """The one documentation file that holds ``marker``: (its name, its text)."""
    found = [(name, (ROOT / name).read_text()) for name in DOCS if marker in (ROOT / name).read_text()]
    assert len(found) == 1, f"{marker!r} is in {[n for n, _ in found] or 'no documentation file'}"
    return found[0]
