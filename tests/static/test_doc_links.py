"""Every relative link of README.md and docs/*.md points to a file that exists and, with an ``#anchor``, to a
heading of that file (GitHub's anchors: the heading's text lowercased, punctuation dropped, spaces to
hyphens, ``-1``, ``-2`` ... for repeats). Links and headings inside fenced code blocks do not count."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.docs import DOCS, ROOT, on_disk

LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)\)")


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    kept, fenced = [], False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            kept.append(line)
    return "\n".join(kept)


def anchors(path: Path) -> set[str]:
    out: set[str] = set()
    for line in prose(path.read_text()).splitlines():
        m = re.match(r"^#{1,6} (.*?)\s*#*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m[1].lower()).replace(" ", "-")
        n, candidate = 0, slug
        while candidate in out:
            n += 1
            candidate = f"{slug}-{n}"
        out.add(candidate)
    return out


def links(path: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", prose(path.read_text()))     # not inside code spans
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z][a-z+.-]*:", t)]


def test_the_slug_rule() -> None:
    assert "production-etcd" in anchors(ROOT / "docs" / "etcd.md")
    assert "binding-a-process-to-its-lease-gpucoord-run" in anchors(ROOT / "docs" / "agents.md")
    assert "an-agents-first-lease" in anchors(ROOT / "README.md")


@pytest.mark.parametrize("name", [*DOCS, *sorted(on_disk() - set(DOCS))])
def test_every_relative_link_resolves(name: str) -> None:
    page = ROOT / name
    bad = []
    for target in links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            bad.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    assert not bad, f"{name}: broken links:\n" + "\n".join(bad)


def test_the_readme_links_every_page() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md") if t.partition("#")[0]}
    missing = [name for name in DOCS[1:] if (ROOT / name).resolve() not in linked]
    assert not missing, f"README.md does not link {missing}"
