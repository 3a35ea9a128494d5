"""G5 fencing: a token is greater than every token issued before it on that GPU, and ``Node.CheckToken``
answers whether a token is still live (how it names GPUs: test_check_token_gpu_ref.py).

Every test ends with the history checker (G5 at every revision: each new lease's token exceeds every
earlier one on its GPU, and the ledger's sequence number is the highest token).
"""
from __future__ import annotations

from typing import Any

import grpc
import pytest

from agent_client import Client
from agent_client.api import node_pb2
from coordinator import errors as cerrors
from coordinator.etcd.store import WatchBatch
from tests.support.cluster import Cluster
from tests.support.rpcs import node_stub
from tests.support.waiting import LIVENESS_S, wait_for

pytestmark = pytest.mark.usefixtures("history_checked")


def test_tokens_strictly_increase_per_gpu(cluster: Cluster) -> None:
    cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="agent-a", host="h1") as c:
        tokens = []
        for _ in range(5):
            lease = c.acquire(1000)
            tokens.append(lease.token)
            lease.release()
        assert tokens == sorted(tokens) and len(set(tokens)) == 5


def test_check_token_follows_releases_and_grants_after_an_etcd_error_in_the_nodes_watch(
        cluster: Cluster, monkeypatch: Any) -> None:
    """The node daemon's lease watch survives an etcd error while it resynchronises (after a compaction,
    a re-read that fails because etcd is out of reach longer than the Store retries): CheckToken then says
    a released lease's token is no longer live and a new lease's token is, within moments; while it
    resynchronises it answers UNAVAILABLE rather than from a stale copy. (Review finding R5: the watch task
    ended on the error, and CheckToken answered from a frozen copy for ever, saying yes to stale tokens.)"""
    from coordinator.etcd.store import Store
    leases_prefix = cluster.keys.leases("h1")
    orig_watch, orig_get_prefix = Store.watch, Store.get_prefix
    arm = {"resync": False, "fail": False}

    async def watch(self: Any, key: bytes, **kw: Any) -> Any:
        async for batch in orig_watch(self, key, **kw):
            if arm["resync"] and key == leases_prefix and batch.events:
                arm["resync"], arm["fail"] = False, True
                yield WatchBatch(batch.revision, (), resync=True)   # as after a compaction
                return
            yield batch

    async def get_prefix(self: Any, prefix: bytes) -> Any:
        if arm["fail"] and prefix == leases_prefix and self is daemon.store:
            arm["fail"] = False
            raise cerrors.Unavailable("etcd unavailable: injected (longer than retry_for)")
        return await orig_get_prefix(self, prefix)

    monkeypatch.setattr(Store, "watch", watch)
    monkeypatch.setattr(Store, "get_prefix", get_prefix)
    daemon = cluster.start_node("h1", "1x8GiB")
    addr = cluster.start_coordinator()
    node = node_stub(daemon.address)

    def live(lease: Any) -> bool | None:
        req = node_pb2.CheckTokenRequest(gpu_uuid=lease.gpu_uuid, token=lease.token)
        try:
            return bool(node.CheckToken(req, timeout=5).live)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE   # resynchronising: no answer rather than a stale one
            return None
    with Client(addr, agent="a", host="h1") as a:
        arm["resync"] = True
        first = a.acquire(1000)                 # its event carries the injected resync, then the failure
        wait_for(lambda: not arm["resync"] and not arm["fail"], LIVENESS_S, "the injected resync and failure")
        first.release()
        second = a.acquire(1000)
        wait_for(lambda: live(first) is False and live(second) is True, 5,
                 "CheckToken to reflect the release of the first lease and the grant of the second")


class _NothingSeen(dict[str, int]):
    """A node's highest-token table that its watch never advances: the node has seen no grant yet."""

    def get(self, key: str, default: int | None = None) -> int:   # type: ignore[override]
        return 0

    def __setitem__(self, key: str, value: int) -> None:
        pass


def test_check_token_of_a_grant_the_node_has_not_seen_yet_is_live(cluster: Cluster,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent checks its token right after its acquire returned, possibly before the node's watch shows the
    grant: the node asks etcd about a token newer than any it has seen, rather than answer "not live"."""
    daemon = cluster.start_node("h1", "1x16GiB")
    addr = cluster.start_coordinator()
    monkeypatch.setattr(daemon, "check_token", lambda gpu_uuid, token: (False, ""))   # a view that lags
    monkeypatch.setattr(daemon, "highest_token", _NothingSeen())
    node = node_stub(daemon.address)

    def check(lease: Any) -> Any:
        return node.CheckToken(node_pb2.CheckTokenRequest(gpu_uuid=lease.gpu_uuid, token=lease.token), timeout=10)
    with Client(addr, agent="agent-a", host="h1") as c:
        lease = c.acquire(vram_mb=100)
        answer = check(lease)
        assert answer.live and answer.lease_id == lease.id
        lease.release()
        assert not check(lease).live
