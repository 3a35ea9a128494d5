"""``run --join``'s supervision of a real command (agent_client.join), on a client with no coordinator
(tests/support/join_fakes.py): the command sees its rank's GPUs and torchrun's variables, its process group is
attached before it runs; an eviction notice for the lease that reaches the session sends SIGTERM (then SIGKILL
at the deadline); the lease gone sends SIGKILL at once; and the part never releases the lease.

What a coordinator must add for these to happen against it (the server side of joined sessions: attaching on
a lease another session of the agent holds, and its notices reaching the joined session) is not tested here."""
from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest

from agent_client.join import AsyncJoinedProcess
from agent_client.lease import EvictionNotice
from agent_client.process import exit_status
from tests.support.join_fakes import LID, FakeJoiningClient

pytestmark = pytest.mark.integration

SCRIPT = ('echo "$PET_NODE_RANK $PET_NNODES $PET_NPROC_PER_NODE $CUDA_VISIBLE_DEVICES $GPUCOORD_RANK" > {out}; '
          "exec sleep 60")


async def started(tmp_path: Path, **kw: float) -> tuple[FakeJoiningClient, AsyncJoinedProcess, str]:
    client = FakeJoiningClient("h2", keepalive_interval=0.1)
    out = tmp_path / "env.txt"
    said: list[str] = []
    proc = AsyncJoinedProcess(client, ["sh", "-c", SCRIPT.format(out=out)], LID, 1,  # type: ignore[arg-type]
                              say=said.append, **kw)
    await proc.start()
    until = time.monotonic() + 10
    while not (out.exists() and out.read_text().endswith("\n")):
        assert time.monotonic() < until, "the command did not start"
        await asyncio.sleep(0.02)
    return client, proc, out.read_text().strip()


def test_a_joined_command_gets_its_rank_and_stops_at_an_eviction_notice(tmp_path: Path) -> None:
    async def scene() -> None:
        client, proc, seen = await started(tmp_path)
        assert seen == "1 2 3 GPU-c,GPU-d,GPU-e 1"
        assert client.attached[0] == (LID, [proc.pid], proc.pgid)      # attached before it ran
        client._leases[LID]._notify(EvictionNotice(LID, "GPU-c", "priority", "b/r1", time.time() + 5,
                                                   deadline=time.monotonic() + 5))
        status = await asyncio.wait_for(proc.wait(), 10)
        assert status == exit_status(-signal.SIGTERM) and proc.reason == "evicted", proc.message
    asyncio.run(scene())


def test_a_joined_command_is_killed_at_once_when_the_lease_is_gone(tmp_path: Path) -> None:
    async def scene() -> None:
        client, proc, _ = await started(tmp_path, check_interval=0.1)
        client.gone = True
        status = await asyncio.wait_for(proc.wait(), 10)
        assert status == exit_status(-signal.SIGKILL) and proc.reason == "lease lost", proc.message
        assert "the lease is gone" in proc.message
    asyncio.run(scene())


def test_a_joined_command_that_exits_leaves_the_lease_to_its_holder(tmp_path: Path) -> None:
    async def scene() -> None:
        client = FakeJoiningClient("h1")
        proc = AsyncJoinedProcess(client, ["sh", "-c", "exit 3"], LID, 0, say=lambda _: None)  # type: ignore[arg-type]
        await proc.start()
        assert await asyncio.wait_for(proc.wait(), 10) == 3 and proc.reason == "exited"
        assert proc.lease is not None and proc.lease.released        # FakeJoiningClient.release was never called
    asyncio.run(scene())
