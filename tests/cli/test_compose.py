"""docker-compose.yml is a small cluster that cannot drift from the CLI: parsed here (PyYAML, the ``test``
extra), its structure checked, and every flag it passes to gpucoord or etcd found in that program's --help."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from coordinator.etcd.process import etcd_binary
from tests.support import REPO
from tests.support.compose import compose_command
from tests.support.processes import child_env

COMPOSE = Path(REPO) / "docker-compose.yml"


def compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return doc


def _help(argv: list[str]) -> str:
    proc = subprocess.run(argv + ["--help"], capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout + proc.stderr


def _flags(argv: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in argv if isinstance(a, str) and a.startswith("--")}


def test_the_compose_file_is_a_small_cluster() -> None:
    services = compose()["services"]
    etcds = [n for n, s in services.items() if s.get("entrypoint") == ["etcd-server"]]
    coordinators = [n for n, s in services.items() if (s.get("command") or [None])[0] == "coordinator"]
    nodes = [n for n, s in services.items() if (s.get("command") or [None])[0] == "node"]
    assert len(etcds) == 3 and len(coordinators) == 2 and len(nodes) == 1, list(services)
    # One image, built once.
    assert {s["image"] for s in services.values()} == {"gpucoord:local"}
    assert [n for n, s in services.items() if "build" in s] == [etcds[0]]
    assert all(s.get("pull_policy") == "never" for n, s in services.items() if "build" not in s)
    # Healthchecks everywhere.
    for name, s in services.items():
        assert s.get("healthcheck", {}).get("test", [None])[0] == "CMD", f"{name} has no healthcheck"
    # The etcd members form one cluster, and every gpucoord part is given all of it.
    endpoints = ",".join(f"{n}:2379" for n in etcds)
    for n in etcds:
        args = dict(a.split("=", 1) for a in services[n]["command"])
        assert args["--name"] == n
        assert args["--initial-cluster"] == ",".join(f"{m}=http://{m}:2380" for m in etcds)
    for n in coordinators:
        cmd = services[n]["command"]
        assert cmd[cmd.index("--etcd") + 1] == endpoints
    # The node daemon talks to every coordinator replica, and never to etcd.
    for n in nodes:
        cmd = services[n]["command"]
        assert "--etcd" not in cmd and not any(c.startswith("--etcd-") for c in cmd), cmd
        assert cmd[cmd.index("--coordinator") + 1] == ",".join(f"{c}:7070" for c in coordinators)
    # The node advertises an address agents can reach (not the container's 0.0.0.0) and reports a real disk.
    node = services[nodes[0]]["command"]
    advertise = node[node.index("--advertise") + 1]
    assert not advertise.startswith("0.0.0.0") and any(p.startswith(advertise + ":") for p in
                                                       services[nodes[0]]["ports"])
    disk = node[node.index("--disk-path") + 1]
    assert any(v.split(":")[1] == disk for v in services[nodes[0]]["volumes"])
    # etcd's client port, the coordinators and every metrics port are reachable from the host.
    published = {p.rsplit(":", 1)[0] for s in services.values() for p in s.get("ports", [])}
    assert {"127.0.0.1:2379", "127.0.0.1:7070", "127.0.0.1:7071", "127.0.0.1:7072", "127.0.0.1:7073",
            "127.0.0.1:7170", "127.0.0.1:7171"} <= published


def test_every_flag_in_the_compose_file_exists() -> None:
    gpucoord = [sys.executable, "-m", "coordinator.cli"]
    etcd_help = _help([etcd_binary()])
    checked = 0
    for name, s in compose()["services"].items():
        commands = [s["command"]] if s.get("entrypoint") != ["etcd-server"] else []
        test = s["healthcheck"]["test"][1:]
        if test[0] == "gpucoord":
            commands.append(test[1:])
        for cmd in commands:
            text = _help(gpucoord + [cmd[0]])
            for flag in _flags(cmd[1:]):
                assert re.search(rf"(^|[\s,\[]){re.escape(flag)}\b", text), f"{name}: gpucoord {cmd[0]} has no {flag}"
                checked += 1
        if s.get("entrypoint") == ["etcd-server"]:
            for flag in _flags(s["command"]):
                assert re.search(rf"(^|\s){re.escape(flag)}\b", etcd_help, re.M), f"{name}: etcd has no {flag}"
                checked += 1
    assert checked > 40


def test_docker_compose_accepts_the_file() -> None:
    command = compose_command()
    if command is None:
        pytest.skip("no 'docker compose' or docker-compose here: the file is checked by the parse and flag tests above")
    proc = subprocess.run([*command, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
