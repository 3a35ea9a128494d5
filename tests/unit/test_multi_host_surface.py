"""Multi-host gangs (issue 30) at the surface, the pure parts: a lease's message over its hosts (rank order,
each GPU with its host and rank), the client's view of it (its parts, the part of a host), and a lease of
one host answered as before."""
from __future__ import annotations

from typing import Any

import pytest

from agent_client.api import coordinator_pb2 as pb
from agent_client.lease import AsyncLease, LeaseGpu, LeasePart
from coordinator.records import VramLease
from coordinator.rpc.status_message import lease_pb

pytestmark = pytest.mark.unit

PARTS = (("b", ("GPU-b0", "GPU-b1")), ("a", ("GPU-a0", "GPU-a1")))   # rank 0 on host b, rank 1 on host a


def record(host: str, index: int, uuid: str, token: int, hosts: Any = PARTS, gang: tuple[str, ...] = ()) -> VramLease:
    return VramLease(id="L1", host=host, gpu_uuid=uuid, gpu_index=index, agent="ag", session_id="s", vram_mb=1024,
                     priority=0, preemptible=True, request_id="r", token=token, created_at=1.0,
                     gang=gang or dict(hosts).get(host, ()) if hosts else gang, hosts=hosts)


def gang_records() -> list[VramLease]:
    return [record("a", 1, "GPU-a1", 7), record("b", 1, "GPU-b1", 5), record("a", 0, "GPU-a0", 6),
            record("b", 0, "GPU-b0", 4)]


def test_a_multi_host_lease_lists_its_hosts_and_gpus_in_rank_then_index_order() -> None:
    records = gang_records()
    msg = lease_pb(records[0], parts=records)
    assert list(msg.hosts) == ["b", "a"]
    assert [(g.host, g.rank, g.index, g.token) for g in msg.gpus] == [
        ("b", 0, 0, 4), ("b", 0, 1, 5), ("a", 1, 0, 6), ("a", 1, 1, 7)]
    assert (msg.host, msg.gpu_index, msg.gpu_uuid, msg.token) == ("b", 0, "GPU-b0", 4)   # rank 0's first GPU


def test_a_lease_of_one_host_is_answered_as_before_with_its_host_on_each_gpu() -> None:
    one = [record("h", 3, "GPU-3", 9, hosts=(), gang=("GPU-2", "GPU-3")),
           record("h", 2, "GPU-2", 8, hosts=(), gang=("GPU-2", "GPU-3"))]
    msg = lease_pb(one[0], parts=one)
    assert not msg.hosts and (msg.host, msg.gpu_index, msg.token) == ("h", 2, 8)
    assert [(g.index, g.host, g.rank) for g in msg.gpus] == [(2, "h", 0), (3, "h", 0)]


class Holder:
    async def release(self, lease_id: str) -> bool:
        return True

    async def attach_processes(self, lease_id: str, pids: Any, pgid: int = 0) -> bool:
        return True


def test_the_client_sees_each_rank_s_part_and_names_rank_0_in_its_single_gpu_fields() -> None:
    records = gang_records()
    lease = AsyncLease(Holder(), lease_pb(records[0], parts=records))
    assert lease.hosts == ("b", "a")
    assert lease.part(1) == LeasePart(1, "a", (LeaseGpu(0, "GPU-a0", 6, 1024), LeaseGpu(1, "GPU-a1", 7, 1024)))
    assert (lease.host, lease.gpu_uuid, lease.gpu_index) == ("b", "GPU-b0", 0)
    assert [g.uuid for g in lease.gpus] == ["GPU-b0", "GPU-b1"]    # its host's GPUs only, never another host's
    assert lease.rank_of("a") == 1 and lease.rank_of("c") is None
    with pytest.raises(IndexError):
        lease.part(2)
    with pytest.raises(IndexError):
        lease.part(-1)


def test_a_part_view_names_that_host_s_gpus_and_gets_the_lease_s_notices() -> None:
    from agent_client.lease import EvictionNotice

    records = gang_records()
    lease = AsyncLease(Holder(), lease_pb(records[0], parts=records))
    view = lease.on_part(1)
    assert (view.id, view.host, view.gpu_uuid, view.token) == ("L1", "a", "GPU-a0", 6)
    assert [g.uuid for g in view.gpus] == ["GPU-a0", "GPU-a1"] and view.hosts == ("b", "a")
    lease._notify(EvictionNotice("L1", "GPU-b0", "host-lost", "x", 0.0, deadline=1.0))
    assert view.evicting.is_set()


def test_a_lease_of_one_host_has_one_part_its_own() -> None:
    msg = pb.Lease(id="L", host="h", gpu_uuid="GPU-0", gpu_index=0, token=3, vram_mb=5)   # an older replica's
    lease = AsyncLease(Holder(), msg)
    assert lease.hosts == () and lease.parts == (LeasePart(0, "h", (LeaseGpu(0, "GPU-0", 3, 5),)),)
    assert lease.rank_of("h") == 0


def test_run_of_a_multi_host_lease_says_each_rank_s_join_command() -> None:
    from agent_client.command import announce

    records = gang_records()
    lease = AsyncLease(Holder(), lease_pb(records[0], parts=records))
    said: list[str] = []
    announce(lease, ["python", "train.py", "--lr", "1e-3 x"], said.append)
    assert said == ["lease L1: hosts b,a (2x2 GPUs)",
                    "rank 0 on b (GPUs 0,1): gpucoord run --join L1 --rank 0 -- python train.py --lr '1e-3 x'",
                    "rank 1 on a (GPUs 0,1): gpucoord run --join L1 --rank 1 -- python train.py --lr '1e-3 x'"]


def test_a_launcher_without_a_part_holds_the_lease_until_a_notice_then_releases_it() -> None:
    import asyncio

    from agent_client.command import hold
    from agent_client.lease import EvictionNotice

    class Session:
        done = asyncio.Event()

    released: list[str] = []

    class Releasing(Holder):
        async def release(self, lease_id: str) -> bool:
            released.append(lease_id)
            return True

    async def scene() -> int:
        records = gang_records()
        lease = AsyncLease(Releasing(), lease_pb(records[0], parts=records))
        asyncio.get_running_loop().call_later(0.05, lease._notify,
                                              EvictionNotice("L1", "GPU-b0", "host-lost", "x", 0.0, deadline=1.0))
        return await hold(lease, Session(), lambda msg: None)  # type: ignore[arg-type]

    assert asyncio.run(scene()) == 0 and released == ["L1"]


def test_run_without_multi_host_flags_parses_to_one_host() -> None:
    from coordinator.cli.main import build_parser

    args = build_parser().parse_args(["run", "--agent", "a", "--vram", "1GiB", "--", "true"])
    assert (args.hosts, args.same, args.prefer) == (1, "", "")
    args = build_parser().parse_args(["run", "--agent", "a", "--exclusive", "--gpus", "8", "--hosts", "4",
                                      "--same", "rack", "--prefer", "example.com/block", "--", "true"])
    assert (args.hosts, args.same, args.prefer) == (4, "rack", "example.com/block")


# -- display: status, queue, console -----------------------------------------------------------------------
def _part(host: str, rank: int) -> dict[str, Any]:
    return {"id": "L1", "host": host, "agent": "ag", "gpu_index": 0, "vram_mb": 0, "exclusive": True, "priority": 5,
            "preemptible": True, "token": 3, "ttl_remaining": 9, "hosts": ["b", "a"],
            "gpus": [{"index": i, "host": host, "rank": rank} for i in (0, 1)]}


def _gpu(i: int) -> dict[str, Any]:
    return {"index": i, "uuid": f"GPU-{i}", "total_mb": 16384, "usable_mb": 16384, "leased_mb": 0, "used_mb": -1,
            "untracked_mb": 0, "free_mb": 16384}


def status_doc() -> dict[str, Any]:
    single = {"id": "S1", "host": "a", "agent": "solo", "gpu_index": 2, "vram_mb": 1024, "priority": 0,
              "preemptible": True, "token": 1, "hosts": [], "gpus": [{"index": 2, "host": "a", "rank": 0}]}
    reserving = {"rank": "r9", "agent": "big", "vram_mb": 0, "priority": 7, "gpu_count": 2, "exclusive": True,
                 "hosts": 3, "same": "rack", "reserve": ["GPU-3", "GPU-2"], "reason": "r"}
    waiting = {"rank": "r10", "agent": "c", "vram_mb": 1024, "priority": 1, "hosts": 1, "reserve": []}
    return {"revision": 3, "hosts": [
        {"host": "a", "alive": True, "gpus": [_gpu(i) for i in range(4)], "leases": [_part("a", 1), single],
         "queue": [reserving, waiting]},
        {"host": "b", "alive": True, "gpus": [_gpu(i) for i in range(2)], "leases": [_part("b", 0)], "queue": []}]}


def test_status_shows_a_multi_host_lease_as_one_row_over_its_hosts_and_each_part_with_its_rank() -> None:
    from coordinator.cli.render import render_status

    table = render_status(status_doc(), now=0.0)
    rows = table.splitlines()
    assert rows[rows.index("multi-host leases:") + 1:] == [
        "  L1                   ag             hosts b,a (2x2 GPUs), whole GPUs, priority 5"]
    assert sum(1 for r in rows if r.startswith("  L1 ") and "rank 1 of hosts b,a (2x2 GPUs)" in r) == 1
    assert sum(1 for r in rows if r.startswith("  L1 ") and "rank 0 of hosts b,a (2x2 GPUs)" in r) == 1
    solo = next(r for r in rows if r.startswith("  S1 "))
    assert "hosts" not in solo and "rank" not in solo


def test_status_shows_a_reservation_of_a_multi_host_gang_with_its_hosts_and_gpu_indexes() -> None:
    from coordinator.cli.render import render_status

    table = render_status(status_doc(), now=0.0)
    assert "reserved: big 2 whole GPUs gpus=any priority 7; reserves GPUs 3,2 for a 3-host gang (same rack)" in table
    assert "waiting: c 1GiB gpu=any priority 1\n" in table + "\n"


def test_the_queue_names_a_reservations_gpus_by_index() -> None:
    from coordinator.cli.queue import queue_doc, render_queue

    doc = queue_doc(status_doc())
    assert doc["waiting"][0]["reserve_gpus"] == [3, 2] and "reserve_gpus" not in doc["waiting"][1]
    table = render_queue(doc, 0.0)
    assert "  reserves GPUs 3,2 for a 3-host gang (same rack)" in table.splitlines()


def test_the_console_shows_a_multi_host_lease_once_over_its_hosts() -> None:
    from coordinator.web import pages
    from coordinator.web.events import changes

    page = pages.leases(status_doc(), [])
    assert page.count(">L1<") == 1 and "hosts b,a (2x2 GPUs)" in page
    assert "reserves GPUs 3,2 for a 3-host gang (same rack)" in page
    part = pages.host(status_doc(), [], "a")
    assert part is not None and "0,1 (rank 1 of hosts b,a (2x2 GPUs))" in part
    grant = changes({"hosts": []}, status_doc())
    assert [e["text"] for e in grant if e["lease"] == "L1"] == ["granted L1: 0.0 GiB to ag on hosts b,a (2x2 GPUs)"]


def test_a_command_run_on_this_host_s_part_sees_that_part_s_gpus_and_its_end_releases_the_lease(
        tmp_path: Any) -> None:
    import asyncio
    import sys

    from agent_client.command import Granted
    from agent_client.run import AsyncBoundProcess

    released: list[str] = []
    attached: list[str] = []

    class Session(Holder):
        agent, keepalive_interval, expired = "ag", 0.2, False

        def __init__(self) -> None:
            self.done = asyncio.Event()

        async def release(self, lease_id: str) -> bool:
            released.append(lease_id)
            return True

        async def attach_processes(self, lease_id: str, pids: Any, pgid: int = 0) -> bool:
            attached.append(lease_id)
            return True

        async def partition(self) -> dict[str, object]:
            return {}

    async def scene() -> int:
        session = Session()
        records = gang_records()
        lease = AsyncLease(session, lease_pb(records[0], parts=records))
        out = tmp_path / "env"
        with out.open("wb") as f:
            proc = AsyncBoundProcess(Granted(session, lease.on_part(1)), [  # type: ignore[arg-type]
                sys.executable, "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'], "
                "os.environ['GPUCOORD_TOKEN'])"], 0, stdout=f, say=lambda msg: None)
            await proc.start()
            return await proc.wait()

    assert asyncio.run(scene()) == 0
    assert (tmp_path / "env").read_text().split() == ["GPU-a0,GPU-a1", "6"]
    assert released == ["L1"] and attached and set(attached) == {"L1"}


def test_a_reservation_with_a_known_earliest_start_says_when_the_gang_starts_and_that_it_backfills() -> None:
    from coordinator.web.gangs import reservation
    entry = {"reserve": ["u1"], "hosts": 2, "start_after": 3600.0}
    assert reservation(entry, {"u1": 0}) == \
        "reserves GPU 0 for a 2-host gang, starts by 01:00:00 UTC (backfill until then)"
    assert reservation({**entry, "start_after": 0.0}, {"u1": 0}) == "reserves GPU 0 for a 2-host gang"
