"""The import graph of the package, from the source (``ast``), for the layering checks and the docs.

``python -m tests.static.import_graph`` prints one line per module: ``module -> imported modules``.
Every import counts, also those inside functions and under ``TYPE_CHECKING``: a dependency is a
dependency wherever it is written.
"""
from __future__ import annotations

import ast
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("coordinator", "agent_client")


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            out[module_name(path)] = path
    return out


def _resolve(name: str, known: dict[str, pathlib.Path]) -> str | None:
    """The longest known module that ``name`` is or lies in (``a.b.C`` -> ``a.b``)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (packages' ``__init__`` included as themselves)."""
    known = modules()
    edges: dict[str, set[str]] = {m: set() for m in known}
    for mod, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base]) if base else ".".join(anchor)
                # "from pkg import mod" imports the module pkg.mod when there is one, else names of pkg
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            for t in targets:
                r = _resolve(t, known)
                # A module's own parent packages are imported before it anyway: not an edge.
                if r is not None and r != mod and not mod.startswith(r + "."):
                    edges[mod].add(r)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def main() -> None:
    edges = graph()
    for mod in sorted(edges):
        deps = sorted(edges[mod])
        print(f"{mod} -> {', '.join(deps) if deps else '-'}")
    found = cycles(edges)
    print(f"# {len(edges)} modules, {sum(len(v) for v in edges.values())} edges, {len(found)} cycles")
    for c in found:
        print("# cycle:", " <-> ".join(c))


if __name__ == "__main__":
    main()
