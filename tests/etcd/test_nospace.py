"""A full etcd (alarm NOSPACE) is reported as a clear error and a metric, reads go on working, and the
docs/etcd.md's recovery (compact, defrag, alarm disarm) brings writes back."""
from __future__ import annotations

import json
import pathlib
import subprocess

import grpc
import pytest

from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from coordinator import errors, metrics
from coordinator.etcd.process import EtcdCluster, EtcdOptions, etcd_binary
from coordinator.etcd.store import Store
from tests.support.cluster import Cluster

pytestmark = pytest.mark.integration

QUOTA = 2 * 2**20       # 2 MiB: a handful of 100 kB values fill it
FILL = b"/fill/"


def _nospace_count() -> float:
    return metrics.REGISTRY.get_sample_value("gpucoord_etcd_nospace_total") or 0.0


def _etcdctl(endpoint: str, *args: str) -> str:
    out = subprocess.run([etcd_binary("etcdctl"), f"--endpoints={endpoint}", *args], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_nospace_is_a_clear_error_a_metric_and_recoverable(tmp_path: pathlib.Path) -> None:
    with EtcdCluster(1, base_dir=tmp_path, options=EtcdOptions(quota_backend_bytes=QUOTA)) as etcd:
        ep = etcd.endpoints[0]
        cluster = Cluster(etcd.endpoints, "/gpucoord/")
        try:
            cluster.start_node("h1", "1x16GiB")
            addr = cluster.start_coordinator()
            stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(addr))
            before = _nospace_count()

            async def fill() -> errors.GpucoordError:
                for i in range(1000):
                    try:
                        await cluster.store.put(FILL + b"%04d" % i, b"x" * 100_000)
                    except errors.GpucoordError as e:
                        return e
                raise AssertionError("etcd never ran out of space")
            err = cluster.lt.run(fill())
            assert isinstance(err, errors.EtcdNoSpace) and err.code == "UNAVAILABLE"
            assert "alarm disarm" in err.message and "defrag" in err.message and "compact" in err.message
            assert "NOSPACE" in _etcdctl(ep, "alarm", "list")
            # Reads are Ranges, which a full etcd still serves.
            filled = cluster.get_prefix(FILL)
            assert filled

            # Through the API: a new session needs an etcd_lease, which a full etcd refuses.
            with pytest.raises(grpc.RpcError) as e:
                stub.OpenSession(pb.OpenSessionRequest(agent="agent-a", host="h1", ttl_seconds=10), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "out of space" in (e.value.details() or "")
            assert _nospace_count() >= before + 2

            # docs/etcd.md's recovery: delete what filled it (a plain delete is allowed under NOSPACE), compact
            # to the current revision, defragment, disarm.
            _etcdctl(ep, "del", "--prefix", FILL.decode())
            status = json.loads(_etcdctl(ep, "endpoint", "status", "--write-out=json"))
            _etcdctl(ep, "compact", str(status[0]["Status"]["header"]["revision"]))
            _etcdctl(ep, "defrag")
            _etcdctl(ep, "alarm", "disarm")
            assert "NOSPACE" not in _etcdctl(ep, "alarm", "list")
            session = stub.OpenSession(pb.OpenSessionRequest(agent="agent-a", host="h1", ttl_seconds=10), timeout=10)
            assert session.session_id
        finally:
            cluster.close()


def test_a_store_error_that_is_not_nospace_is_not_counted(tmp_path: pathlib.Path) -> None:
    import asyncio

    async def go() -> None:
        s = Store(["127.0.0.1:1"], timeout=0.2, retry_for=0)
        await s.connect()
        try:
            with pytest.raises(errors.Unavailable) as e:
                await s.put(b"/k", b"v")
            assert not isinstance(e.value, errors.EtcdNoSpace)
        finally:
            await s.close()
    before = _nospace_count()
    asyncio.run(go())
    assert _nospace_count() == before
