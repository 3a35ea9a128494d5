"""One typed vocabulary at the etcd boundary: only ``coordinator/etcd/`` talks to etcd's client.

Everything else states its reads and writes with ``coordinator.txn`` and reads typed results
(``coordinator.etcd.types``); etcd's protobuf messages, and the private compiler that builds them
(``coordinator.etcd._compile``), stay inside ``coordinator/etcd/``. The scan reads the source (every
``import``, at any depth, including function-local ones), so a lazy import cannot slip past it.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

from tests.static.import_graph import REPO

pytestmark = pytest.mark.unit

BOUNDARY = "coordinator/etcd/"
# Test files that check etcd's raw messages themselves, each with its reason.
ALLOWED_TESTS = {
    "tests/etcd/test_compile.py": "the golden test: typed values must compile to exactly these protobufs",
}
FORBIDDEN = ("aetcd", "coordinator.etcd._compile")


def _forbidden_imports(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found += [n for n in names if any(n == f or n.startswith(f + ".") for f in FORBIDDEN)]
    return found


def _scanned() -> list[pathlib.Path]:
    root = pathlib.Path(REPO)
    return sorted(p for d in ("coordinator", "agent_client", "tests") for p in (root / d).rglob("*.py"))


def test_the_scan_sees_every_form_of_import() -> None:
    assert _forbidden_imports("import aetcd") == ["aetcd"]
    assert _forbidden_imports("def f():\n    from aetcd import rpc\n") == ["aetcd", "aetcd.rpc"]
    assert _forbidden_imports("from coordinator.etcd import _compile") == ["coordinator.etcd._compile"]
    assert _forbidden_imports("import coordinator.etcd._compile as c") == ["coordinator.etcd._compile"]
    assert _forbidden_imports("from coordinator.etcd.types import KV\nimport aetcdx") == []


def test_only_the_etcd_package_imports_aetcd_or_the_compiler() -> None:
    root = pathlib.Path(REPO)
    offenders = {}
    for path in _scanned():
        rel = path.relative_to(root).as_posix()
        if rel.startswith(BOUNDARY) or rel in ALLOWED_TESTS:
            continue
        bad = _forbidden_imports(path.read_text())
        if bad:
            offenders[rel] = sorted(set(bad))
    assert not offenders, ("outside coordinator/etcd/, use coordinator.txn and the typed results of "
                           f"coordinator.etcd.types: {offenders}")


def test_every_allowance_is_still_needed() -> None:
    root = pathlib.Path(REPO)
    for rel in ALLOWED_TESTS:
        assert _forbidden_imports((root / rel).read_text()), f"{rel} no longer needs its allowance"
