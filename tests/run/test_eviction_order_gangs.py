"""Evict before grant for a gang bound to processes (issues 18 and 21): the requester of an evicted gang's GPUs
is granted only once the gang's processes are gone from every GPU of the gang, as the node reports them. A
gang's processes are often one per GPU (a tensor-parallel rank on each), so a process the node lists on the
gang's second GPU only must hold that GPU as well."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from agent_client import Client
from tests.support.cluster import Cluster
from tests.support.processes import ProcessGone, write_fake_processes
from tests.support.run_victim import GRACE_S, start_victim
from tests.support.waiting import Background, wait_for

# A kill margin far longer than any step of these tests takes on a loaded machine: it never decides a grant.
MARGIN_S = 60.0

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]


def listed(cluster: Cluster, pid: int, gpus: tuple[int, ...]) -> bool:
    """The node's usage report lists ``pid`` on each of ``gpus``."""
    (kv,) = cluster.get_prefix(cluster.keys.usage("h1")) or [None]
    if kv is None:
        return False
    report = {g["index"]: g for g in json.loads(kv.value)["gpus"]}
    return all(any(p["pid"] == pid for p in report[g]["processes"]) for g in gpus)


def granted_at(cluster: Cluster, lease_id: str) -> float:
    """When the grant of ``lease_id`` was decided (its records' ``created_at``, one for every GPU)."""
    (created,) = {float(x.created_at) for x in cluster.leases() if x.id == lease_id}
    return created


@pytest.mark.parametrize("listed_on", [(0,), (1,), (0, 1)], ids=["first-gpu-only", "second-gpu-only", "both-gpus"])
def test_an_evicted_gangs_gpus_are_granted_only_once_the_node_no_longer_lists_its_processes(
        cluster: Cluster, victim_py: str, tmp_path: Path, started: list[int], listed_on: tuple[int, ...]) -> None:
    procs_file = tmp_path / "procs.json"
    cluster.start_node("h1", "2x16GiB", fake_processes=str(procs_file))
    # The node lists the child until the test stops it, once the child is gone and the departing records are
    # there; a kill margin that never decides: each step waits on the one before, at any speed.
    addr = cluster.start_coordinator(eviction_grace_s=GRACE_S, eviction_kill_margin_s=MARGIN_S)
    run, pid = start_victim(addr, "h1", victim_py, "term", started, "--gpus", "2")
    # 0 MiB: the listing alone (as NVML lists a process whose memory it cannot tell) holds the GPU. Listed
    # after it exits too, until the test rewrites the file (an hour is forever here).
    write_fake_processes(procs_file, {g: {pid: {"mib": 0, "until": time.time() + 3600}} for g in listed_on})
    wait_for(lambda: listed(cluster, pid, listed_on), 10, "the node to list the child on its GPUs")
    gone = ProcessGone(pid)
    with Client(addr, agent="high", host="h1") as c:
        request = Background(c.acquire, 16384, priority=9, wait=MARGIN_S + 30, gpu_count=2)
        gone_at = gone.wait(10)
        departing = wait_for(lambda: cluster.get_prefix(cluster.keys.departings()), 10, "the departing records")
        assert not request.done.is_set(), "granted while the node still listed the evicted child"
        until = time.time()
        write_fake_processes(procs_file, {})    # the driver has freed it: the node's next report says so
        lease = request.result(timeout=MARGIN_S + 40)
        created = granted_at(cluster, lease.id)
        assert created < until + MARGIN_S, "the kill margin, not the node's report, let the grant in"
        lease.release()
    held = sorted(json.loads(kv.value)["gpu_uuid"] for kv in departing)
    assert gone_at < until, "the child should be gone before the node stops listing it"
    assert created >= until, f"granted {until - created:.2f} s before the node's report stopped listing the child"
    assert [f"GPU-sim-h1-{g}" for g in listed_on] == held[-len(listed_on):], held
    assert run.wait(30) == 143


def test_the_node_attributes_a_gangs_processes_to_its_lease_on_every_gpu(
        cluster: Cluster, victim_py: str, tmp_path: Path, started: list[int]) -> None:
    """The node keeps each GPU's record of a gang: a rank on the gang's second GPU is ``leased`` there (not
    ``leased_elsewhere``), and that GPU's VRAM in use counts against the gang's lease, not as untracked."""
    procs_file = tmp_path / "procs.json"
    cluster.start_node("h1", "2x16GiB", fake_processes=str(procs_file))
    addr = cluster.start_coordinator()
    run, pid = start_victim(addr, "h1", victim_py, "term", started, "--gpus", "2")
    write_fake_processes(procs_file, {0: {pid: 1000}, 1: {pid: 1000}})
    wait_for(lambda: listed(cluster, pid, (0, 1)), 10, "the node to list the child on its GPUs")

    def report() -> dict[int, dict[str, object]]:
        (kv,) = cluster.get_prefix(cluster.keys.usage("h1"))
        return {g["index"]: g for g in json.loads(kv.value)["gpus"]}

    gpus = wait_for(lambda: (r := report()) and all(r[g]["processes"][0]["state"] == "leased" for g in (0, 1))
                    and r, 10, "the child leased on both GPUs")
    (lease_id,) = {x.id for x in cluster.leases()}
    for g in (0, 1):
        assert [x["lease_id"] for x in gpus[g]["leases"]] == [lease_id], gpus[g]
        assert gpus[g]["untracked_mb"] == 0, gpus[g]
    run.send_signal(15)
    assert run.wait(30) == 143
