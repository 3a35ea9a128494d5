"""Multi-host requests at the RPC edge (issue 30), against a real etcd and in-process replicas: a bad field is
refused naming it before anything is read or written; the fields reach the admission as the Gang's; a
multi-host request is decided where it is received (no host-owner forwarding); a replica that answers a
multi-host request with a lease of one host (a release before multi-host gangs) gets it back and the
client raises naming ``hosts``. The decision itself is the replica's (tests of its own)."""
from __future__ import annotations

from typing import Any

import grpc
import pytest

from agent_client import Client, errors
from agent_client.api import coordinator_pb2 as pb
from coordinator import errors as server_errors
from coordinator.records import Gang
from coordinator.replica.service import CoordinatorService
from tests.support.cluster import Cluster
from tests.support.rpcs import acquire_req, coordinator_stub, expect_refused
from tests.support.waiting import LIVENESS_S, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("history_checked")]


@pytest.mark.parametrize("fields,field", [({"hosts": 2, "gpu": "0"}, "gpu"), ({"hosts": 65}, "hosts"),
                                          ({"hosts": 2, "gpus": ["0"]}, "gpus"), ({"same": "rack"}, "same"),
                                          ({"hosts": 3, "prefer": "Rack"}, "prefer")])
def test_a_bad_multi_host_field_is_refused_at_the_edge_naming_it(cluster: Cluster, fields: dict[str, Any],
                                                                 field: str) -> None:
    cluster.start_node("h1", "2x16GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="agent-a", host="h1") as c:
        stub = coordinator_stub(addr)
        expect_refused(cluster, lambda: stub.Acquire(acquire_req("agent-a", c.session_id, 1024, "r", **fields)),
                       grpc.StatusCode.INVALID_ARGUMENT, field)


def _recording(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Gang]]:
    """Every acquire the admission receives, (the replica's id, its Gang); a multi-host one is refused there
    (FAILED_PRECONDITION naming hosts), so that the test sees where it went and what it carried."""
    seen: list[tuple[str, Gang]] = []
    plain = CoordinatorService.acquire

    async def acquire(self: CoordinatorService, *args: Any, **kw: Any) -> Any:
        gang: Gang = kw["gang"]
        seen.append((self.replica_id, gang))
        if gang.hosts > 1:
            raise server_errors.FailedPrecondition("hosts: recorded by the test", "hosts")
        return await plain(self, *args, **kw)
    monkeypatch.setattr(CoordinatorService, "acquire", acquire)
    return seen


def test_a_multi_host_request_reaches_the_admission_of_the_replica_that_received_it(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _recording(monkeypatch)
    cluster.start_node("h1", "2x16GiB")
    addrs = [cluster.start_coordinator(), cluster.start_coordinator()]
    services = {addr: cluster.coordinators[addr][1] for addr in addrs}
    wait_for(lambda: all(len(s.live_replicas()) == 2 and s.owner("h1") is not None for s in services.values()),
             LIVENESS_S, "both replicas to see each other")
    owner_id = services[addrs[0]].owner("h1")[0]   # type: ignore[index]
    other = next(a for a in addrs if services[a].replica_id != owner_id)
    with Client(other, agent="agent-a", host="h1") as c:
        with pytest.raises(errors.FailedPrecondition) as e:
            c.acquire(exclusive=True, gpu_count=2, hosts=2, same="rack", prefer="block")
        assert e.value.field == "hosts"
        with c.acquire(vram_mb=1024):      # one host: forwarded to the host's owner, as before
            pass
    assert seen[0] == (services[other].replica_id, Gang(2, True, "any", (), hosts=2, same="rack", prefer="block"))
    assert seen[-1] == (owner_id, Gang())


def test_a_one_host_answer_to_a_multi_host_request_is_given_back_and_refused_naming_hosts(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    import coordinator.rpc.coordinator_server as server
    plain = server.lease_pb

    def old_release_answer(lease: Any, ttl_remaining: int = 0, parts: Any = ()) -> pb.Lease:
        msg = plain(lease, ttl_remaining, parts)
        del msg.hosts[:]
        return msg

    async def one_host(self: CoordinatorService, *args: Any, **kw: Any) -> Any:   # as a release that ignores hosts
        return await plain_acquire(self, *args, **{**kw, "gang": Gang()})
    plain_acquire = CoordinatorService.acquire
    monkeypatch.setattr(server, "lease_pb", old_release_answer)
    monkeypatch.setattr(CoordinatorService, "acquire", one_host)
    cluster.start_node("h1", "2x16GiB")
    addr = cluster.start_coordinator()
    with Client(addr, agent="agent-a", host="h1") as c:
        with pytest.raises(errors.FailedPrecondition, match="hosts") as e:
            c.acquire(vram_mb=1000, hosts=2)
        assert e.value.field == "hosts"
        assert not cluster.get_prefix(cluster.keys.leases())
