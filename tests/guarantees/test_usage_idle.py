"""Idle GPU-seconds in the usage records (issue 33 point 1, docs/teams.md "Usage accounting"), against a real
etcd, a coordinator and a node whose ``--fake-processes`` file sets GPU 0 at 0 % and GPU 1 at 50 %: a lease on
each, held while the leader's sampled utilization has seen both; the record of the lease on GPU 0 has idle time
(never more than its GPU-seconds), the one on GPU 1 none; ``gpucoord usage`` shows it per agent and in the CSV's
last column. The usage checker (records against etcd's history, idle within bounds, rollups summing to the
records) ends it."""
from __future__ import annotations

import json
import pathlib
import time
from typing import Any

import pytest

from agent_client import Client
from coordinator.cli.main import main as cli_main
from tests.history import read_history
from tests.support.cluster import Cluster
from tests.support.history_usage import check_usage
from tests.support.waiting import LIVENESS_S, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]
HELD_S = 2.0     # how long the leases are held once both GPUs' utilization has been seen


def records(cluster: Cluster) -> dict[str, dict[str, Any]]:
    return {kv.key.decode().rsplit("/", 1)[1]: json.loads(kv.value)
            for kv in cluster.get_prefix(cluster.keys.usage_records())}


def test_a_lease_on_an_idle_gpu_records_idle_time_and_one_on_a_busy_gpu_none(
        cluster: Cluster, tmp_path: pathlib.Path, capsys: Any) -> None:
    procs = tmp_path / "procs.json"
    procs.write_text(json.dumps({"utilization": {"0": 0, "1": 50}}))
    addr = cluster.start_coordinator(idle_below_pct=5.0)
    cluster.start_node("h1", "2x16GiB", fake_processes=str(procs), heartbeat_s=1.0)
    wait_for(lambda: cluster.get_prefix(cluster.keys.accounting_cursor()), LIVENESS_S, "the accountant's cursor")
    ctx = cluster.service(addr).ctx
    with Client(addr, agent="idle-a", host="h1") as a, Client(addr, agent="busy-a", host="h1") as b:
        idle, busy = a.acquire(1000, gpu=0), b.acquire(1000, gpu=1)
        uuids = (idle.gpus[0].uuid, busy.gpus[0].uuid)
        wait_for(lambda: [ctx.utilization.current(u) for u in uuids] == [0, 50], LIVENESS_S,
                 "the replica's sampled utilization of both GPUs")
        seen = time.monotonic()
        wait_for(lambda: time.monotonic() - seen >= HELD_S, LIVENESS_S, "the leases held a while")   # a duration
        idle.release()
        busy.release()
    wait_for(lambda: len(records(cluster)) >= 2, LIVENESS_S, "both records")
    by_agent = {r["agent"]: r for r in records(cluster).values()}
    print({a: (r["gpu_seconds"], r["idle_gpu_seconds"]) for a, r in by_agent.items()})
    # Some idle time, never more than held (how much depends on when the samples fell: a lower bound).
    assert 0 < by_agent["idle-a"]["idle_gpu_seconds"] <= by_agent["idle-a"]["gpu_seconds"]
    assert by_agent["busy-a"]["idle_gpu_seconds"] == 0
    check_usage(cluster.lt.run(read_history(cluster.store, cluster.keys.root()), timeout=120), cluster.keys).assert_ok()
    etcd = ["--etcd", ",".join(cluster.endpoints), "--prefix", cluster.prefix]
    capsys.readouterr()      # (what was printed above)
    assert cli_main(["usage", "--by", "agent", "--since", "1h", "--json", *etcd]) == 0
    rows = {r["agent"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["idle-a"]["idle_gpu_seconds"] == pytest.approx(by_agent["idle-a"]["idle_gpu_seconds"], abs=0.01)
    assert rows["busy-a"]["idle_gpu_seconds"] == 0
    assert cli_main(["usage", "--by", "team", "--csv", *etcd]) == 0
    head, *lines = capsys.readouterr().out.splitlines()
    assert head.endswith(",idle GPU-hours [GPU*h]") and float(lines[0].rsplit(",", 1)[1]) > 0
