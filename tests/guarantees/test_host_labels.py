"""Host labels (issue 30): ``gpucoord node --label KEY=VALUE`` in both modes (etcd-direct and registry) ends up
in the host's inventory (``hosts/<host>``) and in ``gpucoord status`` (table and ``--json``); a bad label exits
2 naming ``--label`` with nothing published; a malformed stored ``labels`` field makes the host INVALID,
naming it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from coordinator.records import dumps
from tests.support import REPO
from tests.support.cluster import Cluster
from tests.support.processes import child_env, spawn_node, stop_process
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *args], capture_output=True, text=True,
                          env=child_env(), cwd=REPO, timeout=60)


def stored_inventory(cluster: Cluster, host: str) -> dict[str, Any]:
    (kv,) = cluster.get_prefix(cluster.keys.host(host))
    inventory: dict[str, Any] = json.loads(kv.value)["inventory"]
    return inventory


def test_labels_of_nodes_in_both_modes_are_stored_and_shown_by_status(cluster: Cluster, tmp_path: Path) -> None:
    addr = cluster.start_coordinator()
    direct = spawn_node(cluster.endpoints, cluster.prefix, "h1", "1x16GiB", str(tmp_path / "h1.log"),
                        extra=["--label", "rack=r1", "--label", "example.com/block=b2"])
    remote = spawn_node(cluster.endpoints, cluster.prefix, "h2", "1x16GiB", str(tmp_path / "h2.log"),
                        extra=["--label=rack=r2"], coordinators=[addr])
    plain = spawn_node(cluster.endpoints, cluster.prefix, "h3", "1x16GiB", str(tmp_path / "h3.log"))
    try:
        def three() -> dict[str, Any] | None:
            doc = json.loads(cli("status", "--json", "--coordinator", addr).stdout)
            hosts = {h["host"]: h for h in doc["hosts"] if h["alive"]}
            return hosts if len(hosts) == 3 else None
        hosts = wait_for(three, 30, "the three hosts in status")
        assert hosts["h1"]["labels"] == {"rack": "r1", "example.com/block": "b2"}
        assert hosts["h2"]["labels"] == {"rack": "r2"}
        assert hosts["h3"]["labels"] == {}
        assert stored_inventory(cluster, "h1")["labels"] == {"example.com/block": "b2", "rack": "r1"}
        assert stored_inventory(cluster, "h2")["labels"] == {"rack": "r2"}
        table = cli("status", "--coordinator", addr).stdout.splitlines()
        assert "  labels: example.com/block=b2 rack=r1" in table and "  labels: rack=r2" in table, table
        assert sum(line.startswith("  labels:") for line in table) == 2
    finally:
        for proc in (direct, remote, plain):
            stop_process(proc)


def test_a_bad_label_exits_2_naming_it_and_publishes_nothing(cluster: Cluster) -> None:
    addr = cluster.start_coordinator()
    base = ["node", "--prefix", cluster.prefix, "--listen", "127.0.0.1:0", "--fake-gpus", "1x16GiB"]
    for mode, host, label in ((["--etcd", ",".join(cluster.endpoints)], "h1", "Rack=r1"),
                              (["--coordinator", addr], "h2", "rack=r 1"),
                              (["--etcd", ",".join(cluster.endpoints)], "h3", "rack")):
        got = cli(*base, *mode, "--host", host, "--label", "block=b2", "--label", label)
        err = got.stderr.strip().splitlines()
        assert got.returncode == 2, (got.returncode, got.stderr)
        assert len(err) == 1 and err[0].startswith("gpucoord: error: --label") and "nothing was changed" not in err[0], err
        twice = cli(*base, *mode, "--host", host, "--label", "rack=r1", "--label", "rack=r2")
        assert twice.returncode == 2 and "--label: the key 'rack' is given twice" in twice.stderr, twice.stderr
    assert cluster.get_prefix(cluster.keys.hosts()) == []


def test_a_malformed_stored_labels_field_makes_the_host_invalid_naming_it(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    kv = cluster.get_prefix(cluster.keys.host("h1"))[0]
    doc = json.loads(kv.value)
    doc["inventory"]["labels"] = {"rack": "not a value"}
    cluster.lt.run(cluster.store.put(cluster.keys.host("h1"), dumps(doc), kv.etcd_lease))

    def invalid() -> str:
        (host,) = json.loads(cli("status", "--json", "--coordinator", addr).stdout)["hosts"]
        return str(host["invalid"])
    why = wait_for(invalid, 30, "the host to be INVALID")
    assert "labels:" in why and "'not a value'" in why, why
