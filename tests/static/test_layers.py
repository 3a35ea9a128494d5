"""The package's layers, as the source shows them: dependencies point down, never back up, never in a cycle.

Layers, bottom up (a module may import its own layer's modules and those of the layers below):
    limits   protocol limits and ``quote()``: imports nothing of the package
    core     keys, errors, clock, records, aio, txn, heap, changelog     (limits)
    security certificates, TLS, identity, authorization, the interceptor  (limits, core)
    config   config, metrics (and its HTTP server)                       (limits, core, security)
    etcd     the store and its request builders, etcd processes        (base)
    policy   admission, planner, partition: pure, no I/O                (base)
    node     the node daemon and its inventory                          (base, etcd, policy)
    replica  service, admitter, leader, mirror, view                    (base, etcd, policy)
    web      the read-only fleet console: HTML pages and SSE over HTTP  (base)
    rpc      the gRPC servers and message conversion                    (all of the above, agent_client.api)
    bench    the performance bench: rig, baselines, phases, report      (base, etcd, node, agent_client)
where base is the four layers below etcd (limits, core, security, config).
    cli      commands, rendering, up, demo, the bench command           (everything)
``agent_client`` imports nothing of ``coordinator``.

The tests have a rule of their own: a test module (and a conftest) imports, of ``tests``, only the shared
helpers (the ``tests.support`` package, ``tests.history``, ``tests.faultlink``, ``tests.static.import_graph``), never
another test module.
"""
from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

from tests.static.import_graph import REPO, cycles, graph

# The bottom of the package, in order: each may import its own layer and those before it.
BASE_LAYERS = {
    "limits": {"coordinator.limits"},
    "core": {"coordinator", "coordinator.keys", "coordinator.errors", "coordinator.clock", "coordinator.records",
             "coordinator.record_fields", "coordinator.host_records", "coordinator.notice_records",
             "coordinator.aio", "coordinator.txn", "coordinator.heap", "coordinator.changelog"},
    "security": set(),      # coordinator.security and its modules
    "config": {"coordinator.config", "coordinator.metrics", "coordinator.metrics_http"},
}
BASE = set(BASE_LAYERS)
ALLOWED = {
    **{name: set(list(BASE_LAYERS)[:n + 1]) for n, name in enumerate(BASE_LAYERS)},
    "etcd": {*BASE, "etcd"},
    "policy": {*BASE, "policy"},
    "node": {*BASE, "etcd", "policy", "node", "api"},
    "replica": {*BASE, "etcd", "policy", "replica"},
    # The console renders the status document it is handed (the rpc layer's, as 'status --json' prints it).
    "web": {*BASE, "web"},
    "rpc": {*BASE, "etcd", "policy", "node", "replica", "web", "rpc", "api"},
    # The bench drives gpucoord from outside, as agents and operators do: through processes, agent_client
    # and etcd itself, never through the replica's or the servers' code.
    "bench": {*BASE, "etcd", "node", "bench", "api", "client"},
    "cli": {*BASE, "etcd", "policy", "node", "replica", "web", "rpc", "bench", "cli", "api", "client"},
}


def layer(module: str) -> str:
    if module == "coordinator.security" or module.startswith("coordinator.security."):
        return "security"
    for name, members in BASE_LAYERS.items():
        if module in members:
            return name
    if module.startswith("agent_client.api"):
        return "api"
    if module.startswith("agent_client"):
        return "client"
    parts = module.split(".")
    assert parts[0] == "coordinator" and len(parts) > 1, module
    assert parts[1] in ALLOWED, f"{module}: which layer is it? (tests/static/test_layers.py)"
    return parts[1]


def test_there_is_no_import_cycle() -> None:
    assert cycles(graph()) == []


def test_agent_client_imports_nothing_of_coordinator() -> None:
    bad = {(m, d) for m, deps in graph().items() if m.startswith("agent_client") for d in deps
           if d.startswith("coordinator")}
    assert not bad


def test_the_base_layers_are_ordered() -> None:
    """limits < core < security < config and metrics: the order is the layer test's own, so check it says
    what the docstring says (security below config and metrics, limits at the bottom)."""
    assert list(BASE_LAYERS) == ["limits", "core", "security", "config"]
    assert ALLOWED["limits"] == {"limits"}
    assert "config" not in ALLOWED["security"] and "security" in ALLOWED["config"]
    assert layer("coordinator.limits") == "limits" and layer("coordinator.metrics") == "config"
    assert layer("coordinator.security.interceptor") == "security"


def test_dependencies_only_point_down() -> None:
    bad = []
    for mod, deps in graph().items():
        if not mod.startswith("coordinator"):
            continue
        for d in deps:
            if layer(d) not in ALLOWED[layer(mod)]:
                bad.append(f"{mod} ({layer(mod)}) imports {d} ({layer(d)})")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", ["coordinator.policy.planner", "coordinator.policy.decide",
                                    "coordinator.policy.admission", "coordinator.policy.placement",
                                    "coordinator.policy.victims", "coordinator.policy.gang",
                                    "coordinator.policy.partition"])
def test_the_pure_policy_loads_neither_aetcd_nor_grpc(module: str) -> None:
    code = (f"import sys, {module}; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('aetcd', 'grpc')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"


# Joining or splitting on "/" is how a key schema leaks out of its module.
_KEY_BUILDING = re.compile(r'"/"\.join|\+ b"/"|b"/" \+|\.r?split\("/"|\.encode\(\) \+ |\+ [a-z_.]*\.encode\(\)')


def test_no_key_is_built_or_parsed_outside_keys_py() -> None:
    offenders = []
    for pkg in ("coordinator", "agent_client"):
        for path in (REPO / pkg).rglob("*.py"):
            if path.name == "keys.py" or path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if _KEY_BUILDING.search(line):
                    offenders.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


# What a test may import of ``tests``: the shared helpers, never another test module or a conftest.
TEST_HELPERS = {"tests.support", "tests.history", "tests.faultlink", "tests.static.import_graph"}


def _is_helper(module: str) -> bool:
    """``module`` is a shared helper: one of TEST_HELPERS or a module of the ``tests.support`` package."""
    return module in TEST_HELPERS or module.startswith("tests.support.")


def _imports_of_tests(path: pathlib.Path) -> set[str]:
    """The modules of ``tests`` that ``path`` imports (relative imports resolved), wherever written."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            # "from tests import history" names a module; "from tests.history import X" names X in one
            found |= {f"{base}.{a.name}" if base in ("tests", "tests.static") else base for a in node.names}
    return {m for m in found if m == "tests" or m.startswith("tests.")}


def test_no_test_module_imports_another() -> None:
    files = sorted([*(REPO / "tests").rglob("test_*.py"), *(REPO / "tests").rglob("conftest.py")])
    assert len(files) > 50, "the test files were not found"
    bad = [f"{path.relative_to(REPO)} imports {mod}" for path in files
           for mod in sorted(_imports_of_tests(path)) if not _is_helper(mod)]
    assert not bad, "\n".join(bad)
