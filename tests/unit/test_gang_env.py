"""A multi-host lease's parts as launchers need them (agent_client.gang_env, issue 30): the hostfile, each rank's
environment with torchrun's PET_* variables, the parts read from the hosts' status; how ``run --join`` picks
its rank (agent_client.join, against a fake client) and what ``lease show`` prints (coordinator.cli.lease_show)."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agent_client import errors
from agent_client.api import coordinator_pb2 as pb
from agent_client.gang_env import (
    GangPart,
    hostfile,
    lease_parts,
    master_host,
    master_port,
    rank_env,
)
from agent_client.join import AsyncJoinedProcess, JoinedLease, own_part
from coordinator.cli.lease_show import lease_text
from tests.support.join_fakes import H1, H2, LID, FakeJoiningClient, lease_msg

PARTS = (GangPart(0, "h1", ("GPU-a", "GPU-b")), GangPart(1, "h2", ("GPU-c", "GPU-d", "GPU-e")))


def test_the_master_port_is_a_function_of_the_lease_id_within_29500_to_30499() -> None:
    assert master_port(LID) == master_port(LID)
    ports = {master_port(f"lease-{n}") for n in range(200)}
    assert all(29500 <= p < 30500 for p in ports) and len(ports) > 100


@pytest.mark.parametrize(("address", "host"), [("10.0.0.5:7001", "10.0.0.5"), ("[fd00::1]:7001", "fd00::1"),
                                               ("fd00::1", "fd00::1"), ("node-1", "node-1"), ("", "h1"),
                                               ("  ", "h1")])
def test_the_master_address_is_the_registered_address_host_part_else_the_host_name(address: str, host: str) -> None:
    assert master_host(address, "h1") == host


def test_the_hostfile_has_one_line_per_rank_in_rank_order() -> None:
    assert hostfile(PARTS[::-1]) == "h1 slots=2\nh2 slots=3\n"


def test_each_rank_gets_its_gpus_and_torchruns_variables() -> None:
    env = rank_env(LID, PARTS, 1, "10.0.0.5")
    assert env == {
        "CUDA_VISIBLE_DEVICES": "GPU-c,GPU-d,GPU-e", "GPUCOORD_LEASE_ID": LID, "GPUCOORD_GPU_UUIDS": "GPU-c,GPU-d,GPU-e",
        "GPUCOORD_RANK": "1", "GPUCOORD_HOSTS": "h1,h2", "PET_NNODES": "2", "PET_NODE_RANK": "1",
        "PET_NPROC_PER_NODE": "3", "PET_MASTER_ADDR": "10.0.0.5", "PET_MASTER_PORT": str(master_port(LID))}
    assert rank_env(LID, PARTS, 0, "10.0.0.5")["PET_NPROC_PER_NODE"] == "2"
    # Every rank agrees on the rendezvous.
    assert {(e["PET_MASTER_ADDR"], e["PET_MASTER_PORT"], e["PET_NNODES"])
            for e in (rank_env(LID, PARTS, r, "10.0.0.5") for r in (0, 1))} == {
        ("10.0.0.5", str(master_port(LID)), "2")}


def test_a_rank_the_lease_does_not_have_is_refused_naming_rank() -> None:
    with pytest.raises(ValueError, match="rank: 2 is not a rank"):
        rank_env(LID, PARTS, 2, "h1")


def test_the_parts_come_from_each_hosts_status_in_rank_order_gpus_in_index_order() -> None:
    assert lease_parts([("h2", H2), ("h1", H1)]) == PARTS
    # One host's status alone: the other rank is known, its GPUs are not.
    assert lease_parts([("h2", H2)]) == (GangPart(0, "h1", ()), PARTS[1])


def test_a_lease_of_one_host_is_one_part() -> None:
    single = lease_msg("h1", [(2, "GPU-x")], hosts=())
    assert lease_parts([("h1", single)]) == (GangPart(0, "h1", ("GPU-x",)),)


def test_own_part_keeps_the_hosts_gpus_only() -> None:
    both = pb.Lease()
    both.CopyFrom(H1)
    both.gpus.extend(H2.gpus)
    part = own_part(both, "h2")
    assert [g.uuid for g in part.gpus] == ["GPU-e", "GPU-c", "GPU-d"] and part.host == "h2"
    assert list(part.hosts) == ["h1", "h2"]


def join(host: str, rank: int | None, **kw: Any) -> tuple[AsyncJoinedProcess, JoinedLease]:
    proc = AsyncJoinedProcess(FakeJoiningClient(host, **kw), ["true"], LID, rank, env={"PATH": "/bin"})  # type: ignore[arg-type]
    lease = asyncio.run(proc._lease())
    assert isinstance(lease, JoinedLease)
    return proc, lease


def test_join_binds_the_ranks_gpus_and_routes_the_leases_notices_to_it() -> None:
    proc, lease = join("h2", 1)
    env = proc._child_env(lease)
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-c,GPU-d,GPU-e" and env["GPUCOORD_RANK"] == "1"
    assert env["PET_MASTER_ADDR"] == "10.0.0.5" and env["PET_NODE_RANK"] == "1" and env["PET_NNODES"] == "2"
    assert env["GPUCOORD_LEASE_ID"] == LID and env["PATH"] == "/bin" and "GPUCOORD_TOKEN" in env
    assert proc.client._leases[LID] is lease and lease.rank == 1
    assert asyncio.run(lease.release()) is False


def test_join_without_rank_takes_the_sessions_hosts_rank_and_falls_back_to_the_host_name() -> None:
    proc, lease = join("h1", None, address="")
    assert lease.rank == 0 and proc.gang_env["PET_MASTER_ADDR"] == "h1"


@pytest.mark.parametrize(("host", "rank", "error", "words"), [
    ("h1", 1, errors.FailedPrecondition, "rank 1 of lease 0123456789abcdef0123 is on host h2, not on this session's host h1"),
    ("h2", 5, errors.FailedPrecondition, "rank 5 is not one of its ranks (0 to 1)"),
    ("h3", None, errors.FailedPrecondition, "this session's host h3 holds no part of it"),
])
def test_join_refuses_a_rank_not_on_the_sessions_host(host: str, rank: int | None, error: type, words: str) -> None:
    with pytest.raises(error, match="rank: ") as e:
        join(host, rank)
    assert words in e.value.message


def test_join_of_an_unknown_lease_is_not_found() -> None:
    client = FakeJoiningClient("h1")
    proc = AsyncJoinedProcess(client, ["true"], "no-such-lease", 0)  # type: ignore[arg-type]
    with pytest.raises(errors.NotFound, match="lease_id: no live lease no-such-lease"):
        asyncio.run(proc._lease())


def test_lease_show_prints_a_hostfile_and_each_ranks_environment() -> None:
    text = lease_text([("h1", H1), ("h2", H2)], {"h1": "10.0.0.5:7001"})
    assert "hostfile:\nh1 slots=2\nh2 slots=3\n" in text
    assert f"rank 1 (h2): gpucoord run --join {LID} --rank 1 --host h2 --agent a -- CMD" in text
    assert "  PET_MASTER_ADDR=10.0.0.5" in text and "  CUDA_VISIBLE_DEVICES=GPU-c,GPU-d,GPU-e" in text
    assert text.count("PET_NODE_RANK=") == 2


def test_lease_show_of_a_lease_of_one_host_prints_its_fields_only() -> None:
    single = lease_msg("h1", [(2, "GPU-x")], hosts=())
    text = lease_text([("h1", single)], {})
    assert text.startswith(f"lease {LID}\n") and "h1 GPU 2 GPU-x 1000 MiB token 7" in text
    assert "hostfile" not in text and "PET_" not in text
