"""Fuzzing every RPC of both services (Hypothesis, >= 2,000 requests): huge strings, NUL and '/' in names,
NaN/inf, negative and huge numbers, wrong session ids, garbage and deeply nested partition JSON, and bytes
that are not a message at all. No answer is UNKNOWN or INTERNAL, every refusal names a field, a refused
request writes nothing to etcd, and the coordinator keeps serving."""
from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import re
import uuid
from typing import Any, Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from agent_client.api import node_pb2, node_pb2_grpc
from coordinator.txn import Range
from tests.support.cluster import Cluster, writes_since
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration
C = grpc.StatusCode
HOST = "h1"
AGENT = "fuzz-agent"
EXAMPLES = int(os.environ.get("GPUCOORD_FUZZ_EXAMPLES", "2100"))
# A refusal names the field at fault first: "vram_mb: ...", "session.session_id: ...", "agents[3]: ...", or a
# key inside the partition spec ("allocations.agent-a.cpu: ...", "0: unknown key").
FIELD_FIRST = re.compile(r"^\S.{0,300}?: ")


@dataclasses.dataclass
class Target:
    cluster: Cluster
    coord: Any
    node: Any
    channels: list[grpc.Channel]
    session_id: str = ""
    lease: Any = None
    gpu_uuid: str = ""
    counts: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)

    def revision(self) -> int:
        return int(self.cluster.lt.run(self.cluster.store.snapshot([Range(b"/")])).revision)


@pytest.fixture(scope="module")
def target(own_etcd: list[str]) -> Iterator[Target]:
    cluster = Cluster(own_etcd, f"/gpucoord-fuzz-{os.getpid()}-{uuid.uuid4().hex[:6]}/")
    try:
        daemon = cluster.start_node(HOST, "2x16GiB", heartbeat_s=3600)
        addr = cluster.start_coordinator()
        wait_for(lambda: cluster.get_prefix(cluster.keys.election()), 10, "the coordinator's election key")
        chans = [grpc.insecure_channel(addr), grpc.insecure_channel(daemon.address)]
        t = Target(cluster, pb_grpc.CoordinatorStub(chans[0]), node_pb2_grpc.NodeStub(chans[1]), chans)
        t.session_id = t.coord.OpenSession(pb.OpenSessionRequest(agent=AGENT, host=HOST, ttl_seconds=300),
                                           timeout=10).session_id
        t.lease = t.coord.Acquire(pb.AcquireRequest(session=pb.SessionRef(agent=AGENT, session_id=t.session_id),
                                                    vram_mb=1000), timeout=10).lease
        t.gpu_uuid = t.lease.gpu_uuid
        yield t
        for ch in chans:
            ch.close()
    finally:
        cluster.close()


# -- strategies ------------------------------------------------------------------------------------------
EDGY_TEXT = ["", "a", "a/b", "/", "nul\0byte", "x" * 300, "x" * 100_000, "ü" * 50, "..", "-lead", HOST, AGENT,
             "GPU-0", "0", "1", " ", "a b", "\n", "%s", "' OR 1=1"]
texts = st.one_of(st.sampled_from(EDGY_TEXT), st.text(max_size=60))
int64s = st.one_of(st.sampled_from([0, 1, -1, 2**31 - 1, -2**31, 2**62, -2**63, 2**63 - 1]),
                   st.integers(-2**63, 2**63 - 1))
int32s = st.one_of(st.sampled_from([0, 1, -1, 2**31 - 1, -2**31, 10]), st.integers(-2**31, 2**31 - 1))
floats = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, -0.0, 1e308, 3601.0, 0.5]),
                   st.floats(allow_nan=True, allow_infinity=True))
json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                                     texts), lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                     st.dictionaries(texts, inner, max_size=4)),
                           max_leaves=20)
spec_dicts = st.fixed_dictionaries({"host": st.one_of(st.just(HOST), texts)},
                                   optional={"mode": st.one_of(st.sampled_from(["shared", "auto-split", "manual"]),
                                                               texts),
                                             "agents": st.one_of(st.lists(texts, max_size=5), json_values),
                                             "reserved": st.one_of(st.dictionaries(
                                                 st.sampled_from(["cpu", "mem", "disk", "vram_headroom", "x"]),
                                                 st.one_of(st.integers(), texts, floats.map(str))), json_values),
                                             "allocations": json_values})
spec_json = st.one_of(spec_dicts.map(json.dumps), json_values.map(json.dumps), texts,
                      st.integers(1, 50_000).map(lambda n: "[" * n + "]" * n),
                      st.integers(1, 50_000).map(lambda n: '{"a":' * n + "1" + "}" * n))


def session_refs(t_session: str) -> st.SearchStrategy[pb.SessionRef]:
    return st.builds(lambda a, s: pb.SessionRef(agent=a, session_id=s),
                     st.one_of(st.just(AGENT), texts),
                     st.one_of(st.just(t_session), st.sampled_from(["zz", "123abc", "0", "-1", "ffffffffffffffffff"]),
                               texts))


def requests(t: Target) -> st.SearchStrategy[tuple[str, Any]]:
    live = session_refs(t.session_id)
    dead = session_refs("123abc")   # never a live session: CloseSession must not end the module's session
    lease_ids = st.one_of(st.sampled_from(["", "x", "a/b", "0123456789abcdef0123"]), texts)
    return st.one_of(
        st.builds(lambda *a: ("OpenSession", pb.OpenSessionRequest(agent=a[0], host=a[1], ttl_seconds=a[2], pid=a[3],
                                                                   client_version=a[4])),
                  st.one_of(st.just(AGENT), texts), st.one_of(st.just(HOST), texts), int32s, int64s, texts),
        st.builds(lambda s, n: ("KeepAlive", [pb.KeepAliveRequest(session=s)] * n), live, st.integers(1, 3)),
        st.builds(lambda s: ("CloseSession", pb.CloseSessionRequest(session=s)), dead),
        st.builds(lambda *a: ("Acquire", pb.AcquireRequest(session=a[0], vram_mb=a[1], gpu=a[2], priority=a[3],
                                                           preemptible=a[4], request_id=a[5], wait_seconds=a[6])),
                  live, int64s, st.one_of(st.sampled_from(["", "0", "1", "7", t.gpu_uuid]), texts), int32s,
                  st.booleans(), texts,
                  st.sampled_from([0.0, -1.0, math.nan, math.inf, -math.inf, 1e9, 3601.0, -0.0])),
        st.builds(lambda s, i: ("Release", pb.ReleaseRequest(session=s, lease_id=i)), live, lease_ids),
        st.builds(lambda s, i, p, g: ("AttachProcesses", pb.AttachProcessesRequest(session=s, lease_id=i, pids=p,
                                                                                  pgid=g)),
                  live, st.one_of(st.just(t.lease.id), lease_ids), st.lists(int64s, max_size=70), int64s),
        st.builds(lambda h: ("GetStatus", pb.GetStatusRequest(host=h)), st.one_of(st.just(HOST), texts)),
        st.builds(lambda s, d, e: ("ApplyPartition", pb.ApplyPartitionRequest(spec_json=s, dry_run=d, evict=e)),
                  spec_json, st.booleans(), st.just(False)),
        st.builds(lambda h: ("GetPartition", pb.GetPartitionRequest(host=h)), st.one_of(st.just(HOST), texts)),
        st.builds(lambda i, g, r: ("EvictLease", pb.EvictLeaseRequest(lease_id=i, grace_seconds=g, reason=r)),
                  lease_ids, floats, texts),
        st.builds(lambda i: ("RevokeLease", pb.RevokeLeaseRequest(lease_id=i)), lease_ids),
        st.builds(lambda *a: ("RevokeCertificate", pb.RevokeCertificateRequest(certificate=pb.RevokedCertificate(
            serial=a[0], role=a[1], name=a[2], not_after=a[3], reason=a[4], revoked_at=a[5], revoked_by=a[6]))),
                  st.one_of(st.sampled_from(["ab12", "0", "00ff", "F" * 64, "f" * 65]), texts), texts, texts, texts,
                  texts, st.one_of(st.just(""), texts), st.one_of(st.just(""), texts)),
        st.just(("ListRevokedCertificates", pb.ListRevokedCertificatesRequest())),
        st.just(("Ping", pb.PingRequest())),
        st.builds(lambda g, k: ("Node.CheckToken", node_pb2.CheckTokenRequest(gpu_uuid=g, token=k)),
                  st.one_of(st.just(t.gpu_uuid), texts), int64s),
        st.just(("Node.GetInventory", node_pb2.GetInventoryRequest())),
        st.builds(lambda m, b: ("raw:" + m, b),
                  st.sampled_from(["OpenSession", "Acquire", "Release", "AttachProcesses", "CloseSession", "GetStatus", "ApplyPartition",
                                   "GetPartition", "EvictLease", "RevokeLease", "KeepAlive", "Node.CheckToken",
                                   "RevokeCertificate"]),
                  st.binary(max_size=300)),
    )


def _send(t: Target, method: str, request: Any) -> Any:
    if method.startswith("raw:"):
        name = method[4:]
        if name == "KeepAlive":
            return list(t.channels[0].stream_stream("/gpucoord.v1.Coordinator/KeepAlive")(iter([request]),
                                                                                        timeout=10))
        if name.startswith("Node."):
            return t.channels[1].unary_unary(f"/gpucoord.v1.Node/{name[5:]}")(request, timeout=10)
        return t.channels[0].unary_unary(f"/gpucoord.v1.Coordinator/{name}")(request, timeout=10)
    if method == "KeepAlive":
        return list(t.coord.KeepAlive(iter(request), timeout=10))
    if method.startswith("Node."):
        return getattr(t.node, method[5:])(request, timeout=10)
    return getattr(t.coord, method)(request, timeout=10)


def _undo(t: Target, method: str, request: Any, response: Any) -> None:
    """A request that was granted is undone, so the module's state stays as it started."""
    if method == "OpenSession":
        t.coord.CloseSession(pb.CloseSessionRequest(session=pb.SessionRef(agent=request.agent,
                                                                          session_id=response.session_id)), timeout=10)
    elif method == "Acquire" and response.lease.id != t.lease.id:
        t.coord.Release(pb.ReleaseRequest(session=request.session, lease_id=response.lease.id), timeout=10)
    elif method == "RevokeCertificate" and response.created:   # no certificate of the module: lifted again
        t.cluster.lt.run(t.cluster.store.delete(t.cluster.keys.revoked(response.certificate.serial)))
    elif method == "ApplyPartition" and response.applied:
        t.coord.ApplyPartition(pb.ApplyPartitionRequest(spec_json=json.dumps({"host": HOST, "mode": "shared"})),
                               timeout=10)


def test_fuzz_every_rpc(target: Target) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(req=requests(target))
    def one(req: tuple[str, Any]) -> None:
        method, request = req
        before = target.revision()
        try:
            response = _send(target, method, request)
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
            target.counts[code.name] += 1
            assert code not in (C.UNKNOWN, C.INTERNAL), (method, request, code, details)
            assert FIELD_FIRST.match(details), (method, request, code, details)
            assert len(details) < 2000, (method, code, details[:200])
            written = writes_since(target.cluster, before)
            assert not written, f"a refused {method} wrote to etcd: {code.name} {details}: {written}"
            return
        target.counts["OK"] += 1
        _undo(target, method, request, response)

    one()
    total = sum(target.counts.values())
    print(f"\nfuzz: {total} requests: {dict(sorted(target.counts.items()))}")
    assert total >= EXAMPLES * 0.95   # Hypothesis may stop a few short when it exhausts a strategy
    assert target.counts["OK"] > 0 and target.counts["INVALID_ARGUMENT"] > target.counts["OK"]


def test_coordinator_still_serves_after_the_fuzz(target: Target) -> None:
    ref = pb.SessionRef(agent=AGENT, session_id=target.session_id)
    assert next(iter(target.coord.KeepAlive(iter([pb.KeepAliveRequest(session=ref)]), timeout=10))).ttl_seconds > 0
    lease = target.coord.Acquire(pb.AcquireRequest(session=ref, vram_mb=512), timeout=10).lease
    assert target.coord.Release(pb.ReleaseRequest(session=ref, lease_id=lease.id), timeout=10).released
    status = target.coord.GetStatus(pb.GetStatusRequest(host=HOST), timeout=10)
    assert [h.host for h in status.hosts] == [HOST] and len(status.hosts[0].leases) == 1


# -- 200 kB in every string field of every request, unary and as Session stream messages -------------------
def _with_big_fields(message: Any, size: int = 200_000) -> list[Any]:
    """One copy of ``message`` per string field (nested ones included), that field set to ``size`` characters."""
    out = []

    def fields(msg: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
        found = []
        for f in msg.DESCRIPTOR.fields:
            if f.type == f.TYPE_STRING and not f.is_repeated:
                found.append(path + (f.name,))
            elif f.type == f.TYPE_MESSAGE and not f.is_repeated:
                found += fields(getattr(msg, f.name), path + (f.name,))
        return found
    for path in fields(message):
        copy = type(message)()
        copy.CopyFrom(message)
        target = copy
        for step in path[:-1]:
            target = getattr(target, step)
        setattr(target, path[-1], "x" * size)
        out.append(copy)
    return out


def test_200kB_in_any_field_of_any_request_is_refused_with_a_short_message_and_writes_nothing(target: Target) -> None:
    ref = pb.SessionRef(agent=AGENT, session_id=target.session_id)
    base: list[tuple[str, Any]] = [
        ("OpenSession", pb.OpenSessionRequest(agent=AGENT, host=HOST, client_version="v")),
        ("Acquire", pb.AcquireRequest(session=ref, vram_mb=1, gpu="0", request_id="r")),
        ("Release", pb.ReleaseRequest(session=ref, lease_id="l")),
        ("AttachProcesses", pb.AttachProcessesRequest(session=ref, lease_id="l")),
        ("CloseSession", pb.CloseSessionRequest(session=pb.SessionRef(agent=AGENT, session_id="123abc"))),
        ("GetStatus", pb.GetStatusRequest(host=HOST)), ("GetPartition", pb.GetPartitionRequest(host=HOST)),
        ("ApplyPartition", pb.ApplyPartitionRequest(spec_json="{}", dry_run=True)),
        ("EvictLease", pb.EvictLeaseRequest(lease_id="l", reason="r")), ("RevokeLease", pb.RevokeLeaseRequest(lease_id="l")),
        ("RevokeCertificate", pb.RevokeCertificateRequest(certificate=pb.RevokedCertificate(serial="ab12"))),
        ("Node.CheckToken", node_pb2.CheckTokenRequest(gpu_uuid="0", token=1)),
        ("KeepAlive", [pb.KeepAliveRequest(session=ref)])]
    stream_calls = [("acquire", pb.AcquireRequest(session=ref, vram_mb=1, gpu="0", request_id="r")),
                    ("release", pb.ReleaseRequest(session=ref, lease_id="l")),
                    ("keepalive", pb.KeepAliveRequest(session=ref))]
    codes: collections.Counter[str] = collections.Counter()
    before = target.revision()
    for method, request in base:
        for big in (_with_big_fields(request[0]) if isinstance(request, list) else _with_big_fields(request)):
            try:
                _send(target, method, [big] if isinstance(request, list) else big)
                codes["OK"] += 1
                continue
            except grpc.RpcError as e:
                code, details = e.code(), e.details() or ""
            codes[code.name] += 1
            assert code not in (C.UNKNOWN, C.INTERNAL, C.RESOURCE_EXHAUSTED), (method, code, details[:200])
            assert len(details) < 600 and "x" * 33 not in details, (method, details[:300])
    messages = [pb.SessionRequest(call_id=i + 1, **{field: big})
                for i, (field, big) in enumerate((f, b) for f, r in stream_calls for b in _with_big_fields(r))]
    answers = list(target.coord.Session(iter(messages), timeout=60))
    assert len(answers) == len(messages)
    for a in answers:
        codes[f"stream {next(c for c in C if c.value[0] == a.code).name}"] += 1
        assert a.code not in (C.UNKNOWN.value[0], C.INTERNAL.value[0], C.OK.value[0]), a
        assert len(a.message) < 600 and "x" * 33 not in a.message, a.message[:300]
    assert codes["OK"] == 0, codes
    assert not writes_since(target.cluster, before)
    print(f"\n200 kB fields: {dict(codes)}")
