"""The README's partition examples are applied by the real CLI and must print what the README shows."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import REPO, Cluster, child_env

pytestmark = pytest.mark.integration

EXAMPLE = re.compile(r"<!-- example: (?P<name>[\w.-]+) -->\n```toml\n(?P<toml>.*?)```\n\n```text\n"
                     r"\$ (?P<cmd>[^\n]+)\n(?P<out>.*?)```", re.S)


def examples() -> list[tuple[str, str, str, str]]:
    text = (Path(REPO) / "README.md").read_text()
    found = [(m["name"], m["toml"], m["cmd"], m["out"]) for m in EXAMPLE.finditer(text)]
    assert len(found) >= 4, "the README lost its partition examples"
    return found


@pytest.fixture
def sim_hosts(cluster: Cluster) -> str:
    host = dict(cpu_count=16, core_ids=tuple(range(16)), mem_bytes=64 << 30, disk_bytes=1 << 40)
    cluster.start_node("gpu-node-1", "4x80GiB", **host)
    cluster.start_node("gpu-node-2", "1x80GiB", **host)
    return cluster.start_coordinator()


@pytest.mark.parametrize("name,toml,cmd,out", examples(), ids=[e[0] for e in examples()])
def test_readme_partition_example(sim_hosts: str, tmp_path: Path, name: str, toml: str, cmd: str, out: str) -> None:
    (tmp_path / name).write_text(toml)
    argv = cmd.split()
    assert argv[:3] == ["gpucoord", "partition", "apply"], cmd
    proc = subprocess.run([sys.executable, "-m", "coordinator.cli", "partition", "--coordinator", sim_hosts,
                           *argv[2:]], capture_output=True, text=True, env=child_env(), cwd=tmp_path, timeout=60)
    printed = proc.stdout if proc.returncode == 0 else proc.stderr
    assert printed.strip() == out.strip(), f"README example {name} is stale:\n{printed}"
