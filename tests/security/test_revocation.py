"""G9: certificates are revoked without restarts. ``gpucoord certs revoke`` has a coordinator write
``revoked/<serial>`` (RevokeCertificate, the operator's certificate; ``--etcd`` is break glass); every
coordinator replica and node daemon watches it and refuses the certificate within 2 s of the write, on new
calls and on the messages of streams already open; other certificates are not affected."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from typing import Iterator

import grpc
import pytest

from agent_client.api import coordinator_pb2 as pb
from agent_client.api import coordinator_pb2_grpc as pb_grpc
from agent_client.api import node_pb2, node_pb2_grpc
from coordinator.security.tls import channel_credentials
from tests.support import REPO
from tests.support.cluster import Cluster, revision, writes_since
from tests.support.pki import Pki, coordinator_tls
from tests.support.processes import child_env
from tests.support.waiting import LIVENESS_S, wait_for

pytestmark = pytest.mark.integration
C = grpc.StatusCode
HOST = "h1"


@pytest.fixture
def world(own_etcd: list[str], pki: Pki) -> Iterator[tuple[Cluster, list[str], str]]:
    cluster = Cluster(own_etcd, f"/gpucoord-revoke-{os.getpid()}-{uuid.uuid4().hex[:6]}/")
    try:
        daemon = cluster.start_node(HOST, "1x16GiB", heartbeat_s=3600, tls=pki["node"])
        addrs = [cluster.start_coordinator(**coordinator_tls(pki)) for _ in range(2)]
        yield cluster, addrs, daemon.address
    finally:
        cluster.close()


def _gpucoord(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *argv], capture_output=True, text=True,
                          env=child_env(), cwd=REPO, timeout=60, stdin=subprocess.DEVNULL)


def test_a_revoked_certificate_is_refused_by_every_replica_and_node_within_2s(
        world: tuple[Cluster, list[str], str], pki: Pki, caplog: pytest.LogCaptureFixture) -> None:
    cluster, addrs, node_addr = world
    caplog.set_level(logging.INFO, logger="gpucoord.audit")
    chans = {(who, a): grpc.secure_channel(a, channel_credentials(pki[who]))
             for who in ("agent-a", "agent-b") for a in [*addrs, node_addr]}
    coord = {k: pb_grpc.CoordinatorStub(ch) for k, ch in chans.items() if k[1] != node_addr}
    node = {who: node_pb2_grpc.NodeStub(chans[(who, node_addr)]) for who in ("agent-a", "agent-b")}
    try:
        a0 = coord[("agent-a", addrs[0])]
        sid = a0.OpenSession(pb.OpenSessionRequest(agent="agent-a", host=HOST, ttl_seconds=30), timeout=10).session_id
        ref = pb.SessionRef(agent="agent-a", session_id=sid)
        # A Session stream opened before the revocation: its next message is refused too.
        requests: list[pb.SessionRequest] = []
        sent = threading.Event()

        def messages() -> Iterator[pb.SessionRequest]:
            yield pb.SessionRequest(call_id=1, keepalive=pb.KeepAliveRequest(session=ref))
            assert sent.wait(30)
            yield from requests
        stream = coord[("agent-a", addrs[1])].Session(messages(), timeout=60)
        assert next(stream).keepalive.ttl_seconds > 0

        # Through a coordinator, with the operator's certificate: the operator needs no etcd credentials.
        done = _gpucoord("certs", "revoke", "--dir", str(pki.dir), "agent/agent-a", "--reason", "leaked",
                         "--coordinator", addrs[1], *_tls_flags(pki, "operator"))
        written = time.monotonic()
        assert done.returncode == 0, done.stderr
        assert done.stdout.count("revoked: ") == 1 and "agent agent-a" in done.stdout, done.stdout

        def refused_everywhere() -> bool:
            for a in addrs:
                try:
                    coord[("agent-a", a)].Ping(pb.PingRequest(), timeout=5)
                    return False
                except grpc.RpcError as e:
                    assert e.code() == C.PERMISSION_DENIED, (e.code(), e.details())
            try:
                node["agent-a"].GetInventory(node_pb2.GetInventoryRequest(), timeout=5)
                return False
            except grpc.RpcError as e:
                assert e.code() == C.PERMISSION_DENIED, (e.code(), e.details())
            return True
        wait_for(refused_everywhere, LIVENESS_S, "every replica and the node to refuse the revoked certificate")
        took = time.monotonic() - written
        print(f"\nrevoked: refused everywhere {took * 1000:.0f} ms after the write")

        with pytest.raises(grpc.RpcError) as info:
            a0.Acquire(pb.AcquireRequest(session=ref, vram_mb=64), timeout=10)
        assert info.value.code() == C.PERMISSION_DENIED and "revoked" in info.value.details()
        assert "gpucoord://agent/agent-a" in info.value.details()
        requests.append(pb.SessionRequest(call_id=2, keepalive=pb.KeepAliveRequest(session=ref)))
        sent.set()
        answer = next(stream)
        assert answer.call_id == 2 and answer.code == C.PERMISSION_DENIED.value[0] and "revoked" in answer.message
        stream.cancel()
        # agent-b's certificate is not affected, anywhere.
        for a in addrs:
            assert coord[("agent-b", a)].Ping(pb.PingRequest(), timeout=5) is not None
        assert node["agent-b"].GetInventory(node_pb2.GetInventoryRequest(), timeout=5).host == HOST
        lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "gpucoord.audit"]
        assert any(x["identity"] == "gpucoord://agent/agent-a" and "revoked" in x["outcome"] for x in lines)

        # The record in etcd; certs list shows it; revoking again keeps the first record.
        (kv,) = cluster.get_prefix(cluster.keys.revocations())
        record = json.loads(kv.value)
        assert record["name"] == "agent-a" and record["role"] == "agent" and record["reason"] == "leaked"
        assert record["revoked_by"] == "gpucoord://operator/ops", record   # the caller, as its certificate says
        listed = _gpucoord("certs", "list", "--dir", str(pki.dir), "--coordinator", addrs[0],
                           *_tls_flags(pki, "operator"))
        assert listed.returncode == 0, listed.stderr
        state = {line.split()[0]: line for line in listed.stdout.splitlines()[1:]}
        assert "REVOKED" in state[record["serial"]] and "agent-a" in state[record["serial"]]
        assert sum("REVOKED" in line for line in state.values()) == 1, listed.stdout
        again = _gpucoord("certs", "revoke", record["serial"], "--coordinator", addrs[0], *_tls_flags(pki, "operator"))
        assert again.returncode == 0 and "already revoked" in again.stdout, (again.stdout, again.stderr)
        # The break-glass path (etcd itself, as etcd's root would; this etcd has no auth) agrees.
        glass = _gpucoord("certs", "revoke", record["serial"], "--etcd", cluster.endpoints[0], "--prefix",
                          cluster.prefix)
        assert glass.returncode == 0 and "already revoked" in glass.stdout, (glass.stdout, glass.stderr)
        assert cluster.get_prefix(cluster.keys.revocations())[0].mod_revision == kv.mod_revision

        # Deleting the record (the operator's undo) lifts the refusal, again without a restart.
        cluster.lt.run(cluster.store.delete(kv.key))
        wait_for(lambda: _pings(coord[("agent-a", addrs[0])]), LIVENESS_S, "the certificate to be accepted again")
    finally:
        for ch in chans.values():
            ch.close()


def _tls_flags(pki: Pki, who: str) -> list[str]:
    files = pki[who]
    return ["--tls-ca", files.ca, "--tls-cert", files.cert, "--tls-key", files.key]


def test_revoke_certificate_rpc_takes_only_an_operator_and_checks_its_fields(
        world: tuple[Cluster, list[str], str], pki: Pki) -> None:
    """RevokeCertificate: an agent is PERMISSION_DENIED, a bad serial or an over-long reason INVALID_ARGUMENT
    naming the field; none of them writes anything."""
    cluster, addrs, _ = world
    before = revision(cluster)
    cases = {("agent-a", "ab12", ""): (C.PERMISSION_DENIED, "operator role"),
             ("operator", "not-hex", ""): (C.INVALID_ARGUMENT, "certificate.serial: "),
             ("operator", "f" * 65, ""): (C.INVALID_ARGUMENT, "certificate.serial: "),
             ("operator", "ab12", "x" * 257): (C.INVALID_ARGUMENT, "certificate.reason")}
    for (who, serial, reason), (code, named) in cases.items():
        with grpc.secure_channel(addrs[0], channel_credentials(pki[who])) as ch:
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.CoordinatorStub(ch).RevokeCertificate(pb.RevokeCertificateRequest(
                    certificate=pb.RevokedCertificate(serial=serial, reason=reason)), timeout=10)
        assert info.value.code() == code and named in (info.value.details() or ""), (who, info.value.details())
    assert not writes_since(cluster, before)
    assert not cluster.get_prefix(cluster.keys.revocations())


def _pings(stub: pb_grpc.CoordinatorStub) -> bool:
    try:
        stub.Ping(pb.PingRequest(), timeout=5)
        return True
    except grpc.RpcError:
        return False


def test_revoke_refuses_a_name_it_did_not_issue_and_names_etcd_when_unreachable(pki: Pki) -> None:
    missing = _gpucoord("certs", "revoke", "--dir", str(pki.dir), "nobody", "--etcd", "127.0.0.1:1")
    assert missing.returncode == 1 and "no certificate named 'nobody'" in missing.stderr, missing.stderr
    no_dir = _gpucoord("certs", "revoke", "agent-a", "--etcd", "127.0.0.1:1")
    assert no_dir.returncode == 2 and "--dir" in no_dir.stderr, no_dir.stderr
    unreachable = _gpucoord("certs", "revoke", "abc123", "--etcd", "127.0.0.1:1")
    assert unreachable.returncode == 3 and "127.0.0.1:1" in unreachable.stderr, unreachable.stderr
    no_coordinator = _gpucoord("certs", "revoke", "abc123", "--coordinator", "127.0.0.1:1")
    assert no_coordinator.returncode == 3 and "coordinator at 127.0.0.1:1" in no_coordinator.stderr, no_coordinator.stderr
    both = _gpucoord("certs", "revoke", "abc123", "--coordinator", "127.0.0.1:1", "--etcd", "127.0.0.1:1")
    assert both.returncode == 2 and "give one" in both.stderr, both.stderr
    # etcd credentials are for the break-glass path only (--etcd): an operator's revoke needs none.
    stray = _gpucoord("certs", "revoke", "abc123", "--coordinator", "127.0.0.1:1", "--etcd-ca", "etcd-ca.crt")
    assert stray.returncode == 2 and "--etcd-ca: only with --etcd" in stray.stderr, stray.stderr
