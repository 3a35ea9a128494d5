"""``gpucoord run --join`` on two simulated hosts end to end (issue 30 acceptance), against a real etcd, a
coordinator and two node daemons: a 2-host gang granted to one session of an agent; each rank's
``gpucoord run --join LEASE --rank R`` on its own host (a session of the same agent there) runs a command that
sees torchrun's variables for its rank (``PET_NNODES``, ``PET_NODE_RANK``, ``PET_NPROC_PER_NODE``, one
``PET_MASTER_ADDR:PET_MASTER_PORT`` for every rank) and only its own host's GPUs (``CUDA_VISIBLE_DEVICES``:
their uuids); when the commands end, the gang stays its holder's."""
from __future__ import annotations

import pytest

from agent_client import Client
from tests.support.cluster import Cluster
from tests.support.join_parts import ENV_SCRIPT, join_part, printed_env
from tests.support.waiting import LIVENESS_S

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]


def test_each_rank_of_a_two_host_gang_sees_its_torchrun_variables_and_only_its_own_hosts_gpus(
        cluster: Cluster) -> None:
    addr = cluster.start_coordinator()
    for host in ("a", "b"):
        cluster.start_node(host, "3x16GiB")
    with Client(addr, agent="agent-g", host="a") as holder:
        lease = holder.acquire(vram_mb=2000, gpu_count=2, hosts=2)
        assert sorted(lease.hosts) == ["a", "b"]
        runs = [join_part(addr, "agent-g", lease, rank, ENV_SCRIPT) for rank in (0, 1)]
        envs = [printed_env(run, LIVENESS_S) for run in runs]
        for rank, env in enumerate(envs):
            part = lease.part(rank)
            print(f"rank {rank} on {part.host}: {env}")
            assert (env["PET_NNODES"], env["PET_NODE_RANK"], env["PET_NPROC_PER_NODE"]) == ("2", str(rank), "2")
            assert env["GPUCOORD_RANK"] == str(rank) and env["GPUCOORD_LEASE_ID"] == lease.id
            assert env["CUDA_VISIBLE_DEVICES"] == ",".join(g.uuid for g in part.gpus)
            assert all(f"-{part.host}-" in u for u in env["CUDA_VISIBLE_DEVICES"].split(",")), env   # GPU-sim-HOST-i
        # One rendezvous for every rank: the same master address and port (rank 0's host).
        assert envs[0]["PET_MASTER_ADDR"] and envs[0]["PET_MASTER_PORT"].isdigit()
        assert {(e["PET_MASTER_ADDR"], e["PET_MASTER_PORT"]) for e in envs} == {
            (envs[0]["PET_MASTER_ADDR"], envs[0]["PET_MASTER_PORT"])}
        # The parts ended; the gang is still its holder's, whole.
        assert len(cluster.get_prefix(cluster.keys.leases())) == 4
        assert lease.release()
    assert cluster.get_prefix(cluster.keys.leases()) == []
