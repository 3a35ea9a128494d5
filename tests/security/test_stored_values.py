"""Bad stored values are one host's problem: a malformed value under ``hosts/``, ``usage/``, ``gpus/``,
``leases/``, ``queue/``, ``departing/`` or ``partitions/`` (a node's etcd user may write its own usage, a bug may write
anything) makes that host INVALID in status, with the reason, and admission there fails closed, while every
other host keeps working; the value is counted in ``gpucoord_invalid_records_total`` and logged once.
Real coordinator, real node daemons, real etcd; the values are written straight into etcd."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import time
import uuid
from typing import Any, Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from coordinator import metrics
from coordinator.records import dumps
from coordinator.txn import Put, Range
from tests.support.cluster import Cluster
from tests.support.waiting import LIVENESS_S, pass_time, wait_for

pytestmark = pytest.mark.integration
C = grpc.StatusCode
AGENT = "stored-agent"
EXAMPLES = int(os.environ.get("GPUCOORD_STORED_FUZZ_EXAMPLES", "60"))


class World:
    def __init__(self, cluster: Cluster, addr: str) -> None:
        self.cluster, self.addr = cluster, addr
        self.channel = grpc.insecure_channel(addr)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.sessions = {h: self.stub.OpenSession(pb.OpenSessionRequest(agent=AGENT, host=h, ttl_seconds=120),
                                                  timeout=10).session_id for h in ("h1", "h2")}

    def ref(self, host: str) -> pb.SessionRef:
        return pb.SessionRef(agent=AGENT, session_id=self.sessions[host])

    def acquire(self, host: str) -> Any:
        return self.stub.Acquire(pb.AcquireRequest(session=self.ref(host), vram_mb=64, request_id=uuid.uuid4().hex),
                                 timeout=10).lease

    def release(self, host: str, lease: Any) -> None:
        assert self.stub.Release(pb.ReleaseRequest(session=self.ref(host), lease_id=lease.id), timeout=10).released

    def status(self, host: str = "") -> dict[str, Any]:
        return {h.host: h for h in self.stub.GetStatus(pb.GetStatusRequest(host=host), timeout=10).hosts}

    def put(self, key: bytes, value: bytes, etcd_lease: int = 0) -> None:
        """Write ``value`` as the key's writer would: on the etcd lease it hangs on (the node's, for hosts/ and
        usage/: a value off it would read to the node as its host taken over)."""
        self.cluster.lt.run(self.cluster.store.put(key, value, etcd_lease))

    def get(self, key: bytes) -> Any:
        return self.cluster.lt.run(self.cluster.store.get(key))

    def revision(self) -> int:
        return int(self.cluster.lt.run(self.cluster.store.snapshot([Range(b"/")])).revision)

    def state(self) -> dict[bytes, int]:
        """Every key under the prefix with its mod_revision, but the accountant's: its usage records and cursor
        follow the lease ends of the steps before a moment later (it gathers them for a quarter of a second), and
        may land at any time after them."""
        accounting = self.cluster.keys.kind("accounting")
        return {kv.key: kv.mod_revision for kv in self.cluster.get_prefix(self.cluster.keys.root())
                if not kv.key.startswith(accounting)}


@pytest.fixture(scope="module")
def world(own_etcd: list[str]) -> Iterator[World]:
    cluster = Cluster(own_etcd, f"/gpucoord-stored-{os.getpid()}-{uuid.uuid4().hex[:6]}/")
    try:
        # No heartbeats: a node rewrites usage/<host> only when its own view changes, so what a test writes stays.
        for host in ("h1", "h2"):
            cluster.start_node(host, "1x16GiB", heartbeat_s=3600)
        addr = cluster.start_coordinator()
        wait_for(lambda: cluster.get_prefix(cluster.keys.election()), 10, "the coordinator's election key")
        w = World(cluster, addr)
        yield w
        w.channel.close()
    finally:
        cluster.close()


def invalid_count(kind: str) -> float:
    return metrics.REGISTRY.get_sample_value("gpucoord_invalid_records_total", {"kind": kind}) or 0.0


@pytest.mark.parametrize("bad", [b'{"ts": 1.0, "gpus": [{"uuid": "GPU-', b"not json",
                                 b'{"ts": 1.0, "interval_s": 5, "gpus": [{"index": 0, "uuid": "x"}]}'],
                         ids=["truncated", "not-json", "no-vram_used_mb"])
def test_one_malformed_usage_report_is_one_hosts_problem(world: World, bad: bytes,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    key = world.cluster.keys.usage("h1")
    good = world.get(key)
    assert good is not None
    counted = invalid_count("usage")
    world.put(key, bad, good.etcd_lease)
    try:
        for _ in range(3):   # read again and again: counted and logged once
            hosts = world.status()
            assert hosts["h1"].invalid.startswith("usage/h1: ") and hosts["h2"].invalid == "", hosts["h1"].invalid
            assert hosts["h1"].alive and len(hosts["h1"].gpus) == 1   # what could be read is still shown
            assert world.status("h1")["h1"].invalid == hosts["h1"].invalid
            before = world.state()
            with pytest.raises(grpc.RpcError) as info:
                world.acquire("h1")
            assert info.value.code() == C.FAILED_PRECONDITION, (info.value.code(), info.value.details())
            assert info.value.details().startswith("host: ") and "INVALID" in info.value.details()
            assert world.state() == before, "a refused acquire on the INVALID host wrote"
            world.release("h2", world.acquire("h2"))    # every other host keeps working
        assert invalid_count("usage") == counted + 1
        lines = [r for r in caplog.records if "invalid stored value usage/h1" in r.getMessage()]
        assert len(lines) == 1 and not lines[0].exc_info, [r.getMessage() for r in lines]
    finally:
        world.put(key, good.value, good.etcd_lease)
    assert world.status()["h1"].invalid == ""
    world.release("h1", world.acquire("h1"))


@pytest.mark.parametrize("kind", ["leases", "usage"])
def test_a_malformed_value_under_a_notice_leaves_the_leaders_deadlines_running(
        world: World, kind: str, caplog: pytest.LogCaptureFixture, request: pytest.FixtureRequest) -> None:
    """A lease under an eviction notice whose own value (or its host's usage report) is malformed when its
    deadline passes: the host is INVALID meanwhile, and the leader's duties carry on, so once the value is
    rewritten the lease is revoked at the kill margin (G3), and no duty died."""
    caplog.set_level(logging.WARNING)
    keys = world.cluster.keys
    lease = world.acquire("h1")
    # Bound to a process of ours that no GPU lists (the node only reports): the leader then reads the usage
    # report. Only a process of the caller's own can be attached (G9).
    child = subprocess.Popen(["sleep", "120"])
    request.addfinalizer(lambda: (child.kill(), child.wait()))
    world.stub.AttachProcesses(pb.AttachProcessesRequest(session=world.ref("h1"), lease_id=lease.id,
                                                         pids=[child.pid]), timeout=10)
    key = keys.lease("h1", lease.gpu_uuid, lease.id) if kind == "leases" else keys.usage("h1")
    good = world.get(key)
    deadline = world.stub.EvictLease(pb.EvictLeaseRequest(lease_id=lease.id, grace_seconds=0.3),
                                     timeout=10).deadline_unix
    world.put(key, b"[]", good.etcd_lease)
    try:
        assert world.status()["h1"].invalid.startswith(f"{kind}/h1"), world.status()["h1"].invalid
        pass_time(max(0.0, deadline - time.time()) + 1.0, "the deadline, with the value malformed")
    finally:
        world.put(key, good.value, good.etcd_lease)
    lease_key = keys.lease("h1", lease.gpu_uuid, lease.id)
    wait_for(lambda: world.get(lease_key) is None, 15, "the lease revoked at the kill margin")
    died = [r.getMessage() for r in caplog.records if "died" in r.getMessage()]
    assert not died, died
    assert world.status()["h1"].invalid == ""


# -- fuzzing the stored values of every kind ----------------------------------------------------------------
def _mutations(doc: Any) -> st.SearchStrategy[bytes]:
    raw = dumps(doc)
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.sampled_from([10**30, 2**63, -1]),
                        st.floats(allow_nan=True), st.text(max_size=12), st.lists(st.integers(), max_size=2))
    paths = _paths(doc)

    def swap(path_value: tuple[tuple[Any, ...], Any]) -> bytes:
        path, value = path_value
        d = json.loads(raw)
        target = d
        for step in path[:-1]:
            target = target[step]
        target[path[-1]] = value
        return json.dumps(d, allow_nan=True).encode()
    return st.one_of(st.integers(0, max(0, len(raw) - 1)).map(lambda n: raw[:n]),
                     st.tuples(st.sampled_from(paths), scalars).map(swap),
                     st.sampled_from([b"[]", b"null", b"7", b'"x"', b"[" * 5000 + b"]" * 5000, b"\xff\xfe"]))


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, prefix + (i,))
    return out


def test_fuzz_stored_values(world: World) -> None:
    """Each kind of record of h1 replaced by a mutation of a real one (truncated, a field of another type, a
    huge number, not an object, not JSON): status never fails (no UNKNOWN or INTERNAL), h1 is INVALID or its
    acquire is answered as a valid value's would be, and h2 is served throughout."""
    keys = world.cluster.keys
    lease = world.acquire("h1")           # a real lease and queue entry of h1 give leases/ and gpus/ values
    gpu = lease.gpu_uuid
    records = {"hosts": keys.host("h1"), "usage": keys.usage("h1"), "gpus": keys.gpu("h1", gpu),
               "leases": keys.lease("h1", gpu, lease.id)}
    world.stub.ApplyPartition(pb.ApplyPartitionRequest(spec_json=json.dumps({"host": "h1", "mode": "shared"})),
                              timeout=10)
    records["partitions"] = keys.partition("h1")
    originals = {kind: world.get(key) for kind, key in records.items()}
    assert all(originals.values()), originals
    queue_key = keys.queue_entry("h1", "1000000-00000000000000000001-fuzz")
    queue_doc = {"agent": AGENT, "session_id": world.sessions["h1"], "etcd_lease": 1, "vram_mb": 1, "gpu": "",
                 "priority": 0, "preemptible": True, "request_id": "fuzz", "lease_id": "fuzz-lease",
                 "deadline_unix": 1e12, "replica": "nobody", "victims": [], "wait_s": 3600.0}
    departing_key = keys.departing("h1", gpu, "fuzz-departing")
    departing_doc = {"lease_id": "fuzz-departing", "host": "h1", "gpu_uuid": gpu, "agent": AGENT, "vram_mb": 64,
                     "pids": [1], "pgid": 0, "requested_by": "operator", "reason": "fuzz", "created_at": 1.0,
                     "bound_unix": 3.0, "forced": False, "revoke": True}
    extra = {"queue": (queue_key, queue_doc), "departing": (departing_key, departing_doc)}   # no etcd lease
    kinds = sorted([*records, *extra])
    seen: dict[str, int] = {}
    mirror = world.cluster.service(world.addr).ctx.mirror

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def one(data: st.DataObject) -> None:
        kind = data.draw(st.sampled_from(kinds))
        doc = extra[kind][1] if kind in extra else json.loads(originals[kind].value)
        value = data.draw(_mutations(doc))
        key = extra[kind][0] if kind in extra else records[kind]
        world.put(key, value, 0 if kind in extra else originals[kind].etcd_lease)
        # The coordinator's mirror has the value before the acquire: a grant it decides must see it. (One decided
        # from a copy older than a value it did not compare, its usage report's, may commit; the test after
        # this one covers the records it does compare, written between its read and its commit.)
        written = world.revision()
        wait_for(lambda: mirror.revision >= written, LIVENESS_S, "the coordinator's mirror to see the value")
        try:
            try:
                hosts = world.status()
            except grpc.RpcError as e:
                raise AssertionError(f"GetStatus failed with {kind}={value[:80]!r}: {e.code()} {e.details()}") from e
            assert hosts["h2"].invalid == ""
            invalid = hosts["h1"].invalid if "h1" in hosts else "(no h1)"
            seen["invalid" if invalid else "valid"] = seen.get("invalid" if invalid else "valid", 0) + 1
            try:
                got = world.acquire("h1")
                assert not invalid, f"granted on an INVALID host ({invalid})"
                world.release("h1", got)
            except grpc.RpcError as e:
                assert e.code() not in (C.UNKNOWN, C.INTERNAL), (kind, value[:80], e.code(), e.details())
                if invalid:
                    assert e.code() == C.FAILED_PRECONDITION, (kind, value[:80], e.code(), e.details())
            world.release("h2", world.acquire("h2"))
        finally:
            if kind in extra:
                world.cluster.lt.run(world.cluster.store.delete(key))
            else:
                world.put(key, originals[kind].value, originals[kind].etcd_lease)

    try:
        one()
    finally:
        world.release("h1", lease)
    print(f"\nstored-value fuzz: {EXAMPLES} values: {seen}")
    assert seen.get("invalid", 0) > EXAMPLES // 2, seen
    assert world.status()["h1"].invalid == ""
    # The node daemon of h1 still holds its host: its registration never left its etcd lease.
    daemon = world.cluster.nodes["h1"][0]
    assert world.get(keys.host("h1")).etcd_lease == daemon.etcd_lease


def test_a_record_made_malformed_between_a_rounds_read_and_its_commit_fails_the_grant(world: World) -> None:
    """The loaded CI run's finding: a grant decided from what the coordinator read (its mirror, or a snapshot) was
    committed after one of the host's lease records had been made malformed, so granted on a host INVALID at the
    commit. The grant compares that none of the records it read (the host's, its leases, its departing ones) was
    written since: here the corruption is written by the commit's own hook, just before it, every time."""
    from tests.support.patching import is_put, patch_commit

    keys, cluster = world.cluster.keys, world.cluster
    held = world.acquire("h1")
    key = keys.lease("h1", held.gpu_uuid, held.id)
    original = world.get(key)
    svc = cluster.service(world.addr)
    real_commit = svc.store.commit
    corrupted: list[int] = []

    async def hook(compares: Any, success: Any, commit: Any) -> Any:
        if any(is_put(op, b"/leases/h1/") for op in success) and not corrupted:
            res = await real_commit([], [Put(key, b'{"id": "trunc', original.etcd_lease)])
            corrupted.append(res.revision)
        return await commit()

    undo = patch_commit(cluster, svc, hook)
    try:
        with pytest.raises(grpc.RpcError) as refused:
            world.acquire("h1")
        assert corrupted, "the hook never saw a grant"
        assert refused.value.code() == C.FAILED_PRECONDITION, refused.value.details()
        assert world.status()["h1"].invalid
    finally:
        undo()
        world.put(key, original.value, original.etcd_lease)
    wait_for(lambda: not world.status()["h1"].invalid, LIVENESS_S, "h1 valid again once the record is rewritten")
    world.release("h1", held)
    world.release("h2", world.acquire("h2"))
