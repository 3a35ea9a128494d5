"""Node.CheckToken names the GPU by uuid or by index; anything else is INVALID_ARGUMENT naming gpu_uuid."""
from __future__ import annotations

import grpc
import pytest

from agent_client import Client
from agent_client.api import node_pb2 as npb
from agent_client.api import node_pb2_grpc as npb_grpc
from tests.support.cluster import Cluster
from tests.support.waiting import LIVENESS_S, wait_for


def test_check_token_accepts_a_gpu_index_and_refuses_what_is_neither(cluster: Cluster) -> None:
    daemon = cluster.start_node("h1", "2x16GiB")
    addr = cluster.start_coordinator()
    stub = npb_grpc.NodeStub(grpc.insecure_channel(daemon.address))

    def check(ref: str, token: int) -> npb.CheckTokenResponse:
        return stub.CheckToken(npb.CheckTokenRequest(gpu_uuid=ref, token=token), timeout=5)

    def refused(ref: str) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as e:
            check(ref, 1)
        return e.value

    with Client(addr, agent="agent-a", host="h1") as c:
        lease = c.acquire(1000, gpu=1)
        assert lease.gpu_index == 1
        wait_for(lambda: check(lease.gpu_uuid, lease.token).live, LIVENESS_S, "the node to see the lease")
        by_index = check("1", lease.token)
        assert (by_index.live, by_index.lease_id, by_index.highest_token) == (True, lease.id, lease.token)
        # The other GPU has no lease: an index names that GPU, not the first one found.
        other = check("0", lease.token)
        assert (other.live, other.highest_token) == (False, 0)
        lease.release()
        wait_for(lambda: not check("1", lease.token).live, LIVENESS_S, "the node to see the release")
        assert check("1", lease.token).highest_token == lease.token

    # Well formed, but this host has no such GPU: NOT_FOUND.
    for ref in ("2", "007", "GPU-nope", "1.5"):
        e = refused(ref)
        assert e.code() == grpc.StatusCode.NOT_FOUND and e.details().startswith("gpu_uuid:"), (ref, e.details())
    # Neither an index nor a uuid: INVALID_ARGUMENT, quoting at most a short prefix.
    for ref in ("-", "a/b", "GPU 0", "\u00b2", "x" * 129, "y" * 100_000):
        e = refused(ref)
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("gpu_uuid:"), (ref[:20],
                                                                                                     e.details())
        assert len(e.details()) < 200
