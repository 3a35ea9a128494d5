"""GPU topology end to end (issue 21, item 5): a node daemon publishes each GPU's NUMA node and NVLink peers in
``hosts/<host>`` (real etcd), and ``gpucoord status`` (its table, ``--json`` and the API) shows them; a host
without topology shows it unknown; ``gpucoord node`` refuses a bad topology spec naming the part."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agent_client import Client
from tests.support import REPO
from tests.support.cluster import Cluster
from tests.support.processes import child_env

pytestmark = pytest.mark.integration


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *args], capture_output=True, text=True,
                          env=child_env(), cwd=REPO, timeout=60)


def test_the_node_publishes_topology_and_status_shows_it(cluster: Cluster) -> None:
    cluster.start_node("h1", "4x16GiB:numa=0-1,2-3:nvlink=0-1,2-3")
    cluster.start_node("h2", "2x16GiB")                       # no topology stated: unknown
    (kv,) = cluster.get_prefix(cluster.keys.host("h1"))
    gpus = json.loads(kv.value)["inventory"]["gpus"]
    assert [(g["numa_node"], g["nvlink_peers"]) for g in gpus] == [(0, [1]), (0, [0]), (1, [3]), (1, [2])]
    (kv,) = cluster.get_prefix(cluster.keys.host("h2"))
    assert [(g["numa_node"], g["nvlink_peers"]) for g in json.loads(kv.value)["inventory"]["gpus"]] == [
        (None, []), (None, [])]

    coord = cluster.start_coordinator()
    with Client(coord, agent="agent-a", host="h1") as c:
        status = c.status("h1")
    assert [(g.numa_node, list(g.nvlink_peers)) for g in status.hosts[0].gpus] == [
        (0, [1]), (0, [0]), (1, [3]), (1, [2])]

    doc = json.loads(cli("status", "--json", "--coordinator", coord).stdout)
    shown = {h["host"]: [(g["numa_node"], g["nvlink_peers"]) for g in h["gpus"]] for h in doc["hosts"]}
    assert shown == {"h1": [(0, [1]), (0, [0]), (1, [3]), (1, [2])], "h2": [(None, []), (None, [])]}   # unknown NUMA node: null in JSON

    table = cli("status", "--coordinator", coord).stdout
    header = next(line for line in table.splitlines() if line.strip().startswith("GPU"))
    assert header.split()[-2:] == ["numa", "nvlink"], table
    rows = {(h, line.split()[0]): line.split()[-2:] for h, block in _host_blocks(table).items()
            for line in block if line.split() and line.split()[0].isdigit()}
    assert rows[("h1", "0")] == ["0", "1"] and rows[("h1", "3")] == ["1", "2"], table
    assert rows[("h2", "0")] == ["?", "-"], table


def _host_blocks(table: str) -> dict[str, list[str]]:
    blocks: dict[str, list[str]] = {}
    current = ""
    for line in table.splitlines():
        if line.startswith("host "):
            current = line.split()[1]
            blocks[current] = []
        elif current:
            blocks[current].append(line)
    return blocks


def test_gpucoord_node_refuses_a_bad_topology_spec_naming_the_part() -> None:
    proc = cli("node", "--etcd", "127.0.0.1:1", "--host", "h1", "--fake-gpus", "8x80GiB:numa=0-3:nvlink=0-8")
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("gpucoord: error: --fake-gpus: invalid --fake-gpus spec")
    assert "nvlink set '0-8' names GPU 8, but the spec has 8 GPUs (0..7)" in line
