"""Pure pieces of G9: identities, certificates, where TLS files come from, the authorization table."""
from __future__ import annotations

import asyncio
import ipaddress
import pathlib
from typing import Any

import pytest
from cryptography import x509

from agent_client.api import coordinator_pb2 as pb
from agent_client.api import node_pb2
from coordinator.config import ConfigError, CoordinatorConfig
from coordinator.security import authz, certs, tls
from coordinator.security.identity import Identity, identity_of_certificate

pytestmark = pytest.mark.unit


def test_identity_uri_round_trip_and_rejects() -> None:
    assert Identity.parse("gpucoord://agent/agent-a") == Identity("agent", "agent-a")
    assert str(Identity("operator", "ops")) == "gpucoord://operator/ops"
    for bad in ("gpucoord://root/x", "gpucoord://agent/", "gpucoord://agent/a/b", "spiffe://agent/a", "agent/a",
                "gpucoord://agent/" + "x" * 200):
        with pytest.raises(ValueError):
            Identity.parse(bad)


def test_issued_certificates_carry_identity_cn_and_server_sans(tmp_path: pathlib.Path) -> None:
    certs.init_ca(tmp_path)
    with pytest.raises(FileExistsError):
        certs.init_ca(tmp_path)
    agent = certs.issue(tmp_path, "agent", "agent-a")
    node = certs.issue(tmp_path, "node", "gpu-1", hosts=["10.1.2.3", "gpu-1.example"])
    a = x509.load_pem_x509_certificate(agent.cert.read_bytes())
    n = x509.load_pem_x509_certificate(node.cert.read_bytes())
    assert identity_of_certificate(agent.cert.read_bytes()) == Identity("agent", "agent-a")
    assert identity_of_certificate(node.cert.read_bytes()) == Identity("node", "gpu-1")
    assert a.subject.rfc4514_string() == "CN=gpucoord-agent-agent-a"
    days = (a.not_valid_after_utc - a.not_valid_before_utc).days
    assert 6 <= days <= 7                                                 # agents: 7 days by default
    san = n.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("10.1.2.3") in san.get_values_for_type(x509.IPAddress)
    assert ipaddress.ip_address("127.0.0.1") in san.get_values_for_type(x509.IPAddress)
    assert "gpu-1.example" in san.get_values_for_type(x509.DNSName)
    assert not a.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.IPAddress)
    assert oct(agent.key.stat().st_mode & 0o777) == "0o600"
    root = certs.issue(tmp_path, "etcd-root", "root")
    assert identity_of_certificate(root.cert.read_bytes()) is None        # no gpucoord identity
    for kind, name in (("admin", "x"), ("agent", "a/b"), ("agent", "")):
        with pytest.raises(ValueError):
            certs.issue(tmp_path, kind, name)
    assert 29 <= _days(certs.issue(tmp_path, "agent", "long", days=30).cert) <= 30   # --days


def _days(path: pathlib.Path) -> int:
    c = x509.load_pem_x509_certificate(path.read_bytes())
    return (c.not_valid_after_utc - c.not_valid_before_utc).days


def test_two_trust_domains_agents_and_operators_never_get_an_etcd_certificate(tmp_path: pathlib.Path) -> None:
    """gRPC identities come from ca.crt, etcd's clients from etcd-ca.crt: an agent, an operator and a node (of
    this release) get nothing etcd trusts; only coordinators (and root) do."""
    certs.init_ca(tmp_path)
    grpc_ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    etcd_ca = x509.load_pem_x509_certificate((tmp_path / "etcd-ca.crt").read_bytes())
    assert grpc_ca.subject != etcd_ca.subject and grpc_ca.public_key() != etcd_ca.public_key()

    def issuer(path: pathlib.Path | None) -> Any:
        assert path is not None
        return x509.load_pem_x509_certificate(path.read_bytes()).issuer

    agent = certs.issue(tmp_path, "agent", "agent-a")
    assert agent.etcd_cert is None and issuer(agent.cert) == grpc_ca.subject
    assert sorted(p.name for p in tmp_path.glob("agent-*")) == ["agent-agent-a.crt", "agent-agent-a.key"]
    node = certs.issue(tmp_path, "node", "gpu-0")     # talks to the coordinator only
    assert node.etcd_cert is None and issuer(node.cert) == grpc_ca.subject
    with pytest.raises(ValueError, match="etcd_client"):
        certs.issue(tmp_path, "agent", "agent-b", etcd_client=True)
    operator = certs.issue(tmp_path, "operator", "alice")   # acts through a coordinator: no etcd certificate
    assert operator.etcd_cert is None and not list(tmp_path.glob("operator-*.etcd.*"))
    with pytest.raises(ValueError, match="etcd_client"):
        certs.issue(tmp_path, "operator", "bob", etcd_client=True)
    for kind, user in (("coordinator", "gpucoord-coordinator"), ("node", "gpucoord-node-gpu-1")):
        f = certs.issue(tmp_path, kind, "gpu-1", etcd_client=kind == "node")   # a node of an earlier release
        assert issuer(f.cert) == grpc_ca.subject and issuer(f.etcd_cert) == etcd_ca.subject
        assert f.etcd_cert is not None and f.etcd_cert.name == f"{kind}-gpu-1.etcd.crt"
        etcd_client = x509.load_pem_x509_certificate(f.etcd_cert.read_bytes())
        assert etcd_client.subject.rfc4514_string() == f"CN={user}"      # the etcd user it acts as
        assert identity_of_certificate(f.etcd_cert.read_bytes()) is None   # no gRPC identity in it
    for kind in ("etcd", "etcd-root"):
        f = certs.issue(tmp_path, kind, "e1")
        assert issuer(f.cert) == etcd_ca.subject and f.etcd_cert is None
    listed = certs.issued(tmp_path)
    assert [(e["role"], e["ca"]) for e in listed][:5] == [("agent", "ca"), ("node", "ca"), ("operator", "ca"),
                                                          ("coordinator", "ca"), ("coordinator", "etcd-ca")]
    assert all(len(e["serial"]) > 10 for e in listed)
    # A directory from before the etcd CA: init adds it; issuing an etcd client without it is refused.
    old = tmp_path / "old"
    certs.init_ca(old)
    (old / "etcd-ca.crt").unlink()
    with pytest.raises(ValueError, match="certs init"):
        certs.issue(old, "node", "n1", etcd_client=True)
    certs.init_ca(old)
    assert certs.issue(old, "node", "n1", etcd_client=True).etcd_cert is not None


def test_tls_files_flags_then_env_then_config(tmp_path: pathlib.Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[tls]\nca = "/cfg/ca"\ncert = "/cfg/cert"\nkey = "/cfg/key"\n')
    env = {"GPUCOORD_TLS_CA": "/env/ca", "GPUCOORD_TLS_CERT": "/env/cert", "GPUCOORD_TLS_KEY": "/env/key"}
    assert tls.resolve(env={}, config_file=str(cfg)) == tls.TlsFiles("/cfg/ca", "/cfg/cert", "/cfg/key")
    assert tls.resolve(env=env, config_file=str(cfg)) == tls.TlsFiles("/env/ca", "/env/cert", "/env/key")
    assert tls.resolve(ca="/f/ca", env=env).ca == "/f/ca"
    assert tls.resolve(env={}) is None
    with pytest.raises(tls.TlsError, match="--tls-key"):
        tls.resolve(ca="/a", cert="/b", env={})


def test_loopback_only_without_tls_unless_insecure() -> None:
    assert tls.is_loopback("127.0.0.1:7070") and tls.is_loopback("[::1]:1") and tls.is_loopback("localhost:1")
    assert not tls.is_loopback("0.0.0.0:7070") and not tls.is_loopback("10.0.0.1:1")
    assert tls.listen_error("127.0.0.1:1", None, False) is None
    assert "--insecure" in (tls.listen_error("0.0.0.0:1", None, False) or "")
    assert tls.listen_error("0.0.0.0:1", None, True) is None
    assert tls.listen_error("0.0.0.0:1", tls.TlsFiles("a", "b", "c"), False) is None
    with pytest.raises(ConfigError, match="--insecure") as info:
        CoordinatorConfig(listen="0.0.0.0:7070").validate()
    assert info.value.field == "listen"
    CoordinatorConfig(listen="0.0.0.0:7070", insecure=True).validate()
    CoordinatorConfig(listen="0.0.0.0:7070", tls_ca="a", tls_cert="b", tls_key="c").validate()
    with pytest.raises(ConfigError) as info:
        CoordinatorConfig(tls_ca="a").validate()
    assert info.value.field == "tls_cert"
    assert "hunter2" not in repr(CoordinatorConfig(etcd_user="u", etcd_password="hunter2"))
    c = CoordinatorConfig.load(env={"GPUCOORD_TLS_CA": "a", "GPUCOORD_TLS_CERT": "b", "GPUCOORD_TLS_KEY": "c",
                                    "GPUCOORD_ETCD_USER": "u", "GPUCOORD_ETCD_PASSWORD": "p"})
    assert c.tls_files() == tls.TlsFiles("a", "b", "c") and c.etcd_security().password == "p"


AGENT_A, AGENT_B = Identity("agent", "agent-a"), Identity("agent", "agent-b")
OPERATOR, NODE = Identity("operator", "ops"), Identity("node", "h1")
REF_A = pb.SessionRef(agent="agent-a", session_id="1a")


async def _hosts(agent: str) -> set[str]:
    return {"h1"} if agent == "agent-a" else set()


def _decide(identity: Identity | None, method: str, request: Any, tls_on: bool = True) -> str:
    try:
        asyncio.run(authz.authorize(identity, tls_on, method, request, _hosts))
    except authz.Denied as e:
        assert str(identity) in e.message or identity is None
        return "denied"
    return "ok"


@pytest.mark.parametrize("identity, method, request_, want", [
    (AGENT_A, "OpenSession", pb.OpenSessionRequest(agent="agent-a", host="h1"), "ok"),
    (AGENT_A, "OpenSession", pb.OpenSessionRequest(agent="agent-b", host="h1"), "denied"),
    (AGENT_A, "Acquire", pb.AcquireRequest(session=REF_A), "ok"),
    (AGENT_B, "Acquire", pb.AcquireRequest(session=REF_A), "denied"),
    (AGENT_B, "Release", pb.ReleaseRequest(session=REF_A), "denied"),
    (AGENT_B, "CloseSession", pb.CloseSessionRequest(session=REF_A), "denied"),
    (AGENT_B, "KeepAlive", pb.KeepAliveRequest(session=REF_A), "denied"),
    (AGENT_B, "KeepAlive", None, "ok"),                      # the stream opens; its messages are checked
    (AGENT_A, "GetStatus", pb.GetStatusRequest(host="h1"), "ok"),
    (AGENT_A, "GetStatus", pb.GetStatusRequest(host="h2"), "denied"),
    (AGENT_A, "GetStatus", pb.GetStatusRequest(), "ok"),          # its own view: the hosts it has a session on
    (AGENT_B, "GetPartition", pb.GetPartitionRequest(host="h1"), "denied"),
    (AGENT_A, "EvictLease", pb.EvictLeaseRequest(lease_id="x"), "denied"),
    (AGENT_A, "RevokeLease", pb.RevokeLeaseRequest(lease_id="x"), "denied"),
    (AGENT_A, "ApplyPartition", pb.ApplyPartitionRequest(spec_json="{}"), "denied"),
    (AGENT_A, "Ping", pb.PingRequest(), "ok"),
    (OPERATOR, "RevokeLease", pb.RevokeLeaseRequest(lease_id="x"), "ok"),
    (OPERATOR, "OpenSession", pb.OpenSessionRequest(agent="anyone", host="h1"), "ok"),
    (OPERATOR, "GetStatus", pb.GetStatusRequest(), "ok"),
    (NODE, "GetStatus", pb.GetStatusRequest(host="h1"), "denied"),
    (NODE, "Ping", pb.PingRequest(), "denied"),
    (None, "Ping", pb.PingRequest(), "denied"),              # a certificate without a gpucoord identity
    (Identity("coordinator", "c1"), "Acquire", pb.AcquireRequest(session=REF_A), "denied"),
])
def test_authorization_table(identity: Identity | None, method: str, request_: Any, want: str) -> None:
    assert _decide(identity, authz.COORDINATOR + method, request_) == want


def test_authorization_of_node_health_and_reflection() -> None:
    check = node_pb2.CheckTokenRequest(gpu_uuid="g", token=1)
    assert _decide(AGENT_B, authz.NODE + "CheckToken", check) == "ok"
    assert _decide(Identity("coordinator", "c"), authz.NODE + "GetInventory", None) == "ok"
    assert _decide(NODE, authz.NODE + "CheckToken", check) == "denied"
    assert _decide(NODE, authz.HEALTH + "Check", None) == "ok"
    assert _decide(NODE, authz.REFLECTION[0] + "ServerReflectionInfo", None) == "denied"
    assert _decide(AGENT_A, "/some.Other/Method", None) == "denied"


def test_without_tls_every_caller_is_trusted() -> None:
    assert _decide(None, authz.COORDINATOR + "RevokeLease", pb.RevokeLeaseRequest(lease_id="x"), tls_on=False) == "ok"


def test_a_session_stream_message_is_authorized_as_the_call_it_carries() -> None:
    def as_call(message: pb.SessionRequest) -> tuple[str, Any]:
        return authz.unwrap(authz.SESSION_STREAM, message)

    acquire = pb.AcquireRequest(session=REF_A, vram_mb=64)
    assert as_call(pb.SessionRequest(call_id=1, acquire=acquire)) == (authz.COORDINATOR + "Acquire", acquire)
    release = pb.ReleaseRequest(session=REF_A, lease_id="x")
    assert as_call(pb.SessionRequest(call_id=2, release=release)) == (authz.COORDINATOR + "Release", release)
    keepalive = pb.KeepAliveRequest(session=REF_A)
    assert as_call(pb.SessionRequest(call_id=3, keepalive=keepalive)) == (authz.COORDINATOR + "KeepAlive", keepalive)
    for bare in (pb.SessionRequest(call_id=4), pb.SessionRequest(cancel=1)):
        assert as_call(bare) == (authz.SESSION_STREAM, bare)         # nothing to act on: the stream itself
    assert authz.unwrap(authz.COORDINATOR + "Acquire", acquire) == (authz.COORDINATOR + "Acquire", acquire)
    # The unwrapped call is decided as the unary call would be; the stream itself is open to agents only.
    assert _decide(AGENT_B, *as_call(pb.SessionRequest(call_id=1, acquire=acquire))) == "denied"
    assert _decide(AGENT_A, *as_call(pb.SessionRequest(call_id=1, acquire=acquire))) == "ok"
    assert _decide(AGENT_B, authz.SESSION_STREAM, None) == "ok"
    assert _decide(NODE, authz.SESSION_STREAM, None) == "denied"
    assert _decide(NODE, authz.SESSION_STREAM, pb.SessionRequest(cancel=1)) == "denied"
