"""G9 with real processes: plaintext only on loopback, one daemon per port, and ``gpucoord up --secure``
(etcd with client-certificate TLS and auth, mTLS coordinator and node, the demo over mTLS)."""
from __future__ import annotations

import pathlib
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from typing import Iterator

import pytest

from coordinator.etcd.process import etcd_binary, free_port
from tests.support import REPO
from tests.support.cluster import Cluster, EtcdEndpoint
from tests.support.processes import child_env
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration


def _gpucoord(*argv: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *argv], capture_output=True, text=True,
                          env=env or child_env(), cwd=REPO, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("kind", ["coordinator", "node"])
def test_plaintext_server_on_a_non_loopback_address_needs_insecure(etcd: EtcdEndpoint, kind: str) -> None:
    argv = [kind, "--etcd", etcd.endpoints[0], "--listen", f"0.0.0.0:{free_port()}"]
    if kind == "node":
        argv += ["--host", "h-insecure", "--fake-gpus", "1x16GiB"]
    env = {k: v for k, v in child_env().items() if not k.startswith("GPUCOORD_TLS_")}
    done = _gpucoord(*argv, env=env)
    assert done.returncode == 2, done.stderr
    assert "--insecure" in done.stderr and "0.0.0.0" in done.stderr, done.stderr
    assert "READY" not in done.stdout


def test_node_refuses_a_port_already_in_use(cluster: Cluster) -> None:
    daemon = cluster.start_node("h-first")
    port = daemon.address.rsplit(":", 1)[1]
    done = _gpucoord("node", "--etcd", ",".join(cluster.endpoints), "--prefix", cluster.prefix, "--host", "h-second",
                     "--fake-gpus", "1x16GiB", "--listen", f"127.0.0.1:{port}")
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert "cannot bind" in done.stderr and port in done.stderr, done.stderr[-2000:]
    assert "READY" not in done.stdout
    assert not cluster.get_prefix(cluster.keys.host("h-second")), "the second daemon registered its host"


# -- gpucoord up --secure --demo --keep ----------------------------------------------------------------------
class Up:
    def __init__(self, data_dir: pathlib.Path) -> None:
        self.data_dir = data_dir
        self.log = open(data_dir.parent / "up.out", "w+")
        env = {k: v for k, v in child_env().items() if not k.startswith("GPUCOORD_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", "up", "--secure", "--demo", "--keep", "--host", "sec-host",
             "--data-dir", str(data_dir), "--listen", "127.0.0.1:0", "--node-listen", "127.0.0.1:0",
             "--metrics-listen", "127.0.0.1:0", "--node-metrics-listen", "127.0.0.1:0", "--fake-gpus", "1x16GiB"],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO, stdin=subprocess.DEVNULL)

    def output(self) -> str:
        return (self.data_dir.parent / "up.out").read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return int(self.proc.returncode)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    u = Up(tmp_path_factory.mktemp("up-secure") / "data")
    try:
        wait_for(lambda: "gpucoord is up" in u.output() or u.proc.poll() is not None, 120, "up --secure --demo")
        assert u.proc.poll() is None, u.output()[-4000:]
        yield u
    finally:
        u.stop()


def _etcdctl(up: Up, *argv: str, creds: str | None = None) -> subprocess.CompletedProcess[str]:
    ep = re.search(r"etcd: +(127\.0\.0\.1:\d+)", up.output())
    assert ep is not None, up.output()
    pki = up.data_dir / "pki"
    # etcd's server certificate comes from the etcd CA (from the one CA, before there were two).
    server_ca = pki / "etcd-ca.crt" if (pki / "etcd-ca.crt").exists() else pki / "ca.crt"
    flags = [f"--endpoints=https://{ep.group(1)}", f"--cacert={server_ca}", "--dial-timeout=3s",
             "--command-timeout=5s"]
    if creds is not None:
        flags += [f"--cert={pki / (creds + '.crt')}", f"--key={pki / (creds + '.key')}"]
    return subprocess.run([etcd_binary("etcdctl"), *flags, *argv], capture_output=True, text=True, timeout=30)


def test_up_secure_plays_the_demo_over_mtls(up: Up) -> None:
    out = up.output()
    assert "client-certificate TLS, auth enabled" in out
    assert out.count("GRANTED lease") == 4 and "REFUSED (RESOURCE_EXHAUSTED)" in out, out[-4000:]
    assert "every agent released and closed its session" in out
    # The three variables an agent needs, for a certificate of its own.
    ca = up.data_dir / "pki" / "ca.crt"
    assert f"export GPUCOORD_TLS_CA={ca}" in out
    assert f"GPUCOORD_TLS_CERT={up.data_dir / 'pki' / 'agent-agent-a.crt'}" in out


BREAK_GLASS = ("etcd-etcd", "etcd-root-root")   # etcd's own server certificate, and its administrator's


def _principals(up: Up) -> list[str]:
    """Every certificate of the install but etcd's own and its root's: the agents', the operator's, the
    node's, the metrics scraper's, and the coordinator's (gRPC and etcd)."""
    pki = up.data_dir / "pki"
    return sorted(p.name[:-4] for p in pki.glob("*.crt")
                  if not p.name.startswith(("ca.", "etcd-ca.")) and p.name[:-4] not in BREAK_GLASS)


def test_up_secure_only_the_coordinators_certificate_opens_etcd(up: Up) -> None:
    """Only coordinators talk to etcd (G9): the node daemon runs with no etcd credentials at all (it registers
    and publishes through the coordinator), the operator has none (its commands go through the coordinator),
    and of every certificate of the install only the coordinator's etcd client certificate opens a
    connection to etcd (and etcd's root's, the break-glass path)."""
    pki = up.data_dir / "pki"
    assert not list(pki.glob("node-*.etcd.*")), "a node got an etcd certificate"
    assert not list(pki.glob("operator-*.etcd.*")), "the operator got an etcd certificate"
    node_log = (up.data_dir / "node.log").read_text()
    assert "talks to etcd directly" not in node_log and "registered through coordinator" in node_log, node_log[-2000:]
    anonymous = _etcdctl(up, "get", "--prefix", "/gpucoord/")
    assert anonymous.returncode != 0, anonymous.stdout
    opened = {}
    for stem in _principals(up):
        got = _etcdctl(up, "get", "/gpucoord/hosts/sec-host", "--keys-only", creds=stem)
        opened[stem] = got.returncode == 0 and "sec-host" in got.stdout
    assert {stem for stem, ok in opened.items() if ok} == {"coordinator-coordinator.etcd"}, opened
    assert {"node-sec-host", "agent-agent-a", "operator-operator"} <= set(opened)   # tried, and refused
    root = _etcdctl(up, "get", "/gpucoord/hosts/sec-host", "--keys-only", creds="etcd-root-root")
    assert root.returncode == 0 and "sec-host" in root.stdout, root   # break glass still works


def test_up_secure_no_operator_agent_or_node_certificate_keeps_an_agents_session_alive(up: Up) -> None:
    """An abandoned session (its agent sends no keepalive): ``etcdctl lease keep-alive`` of its etcd lease
    fails with every certificate of the install but the coordinator's (etcd checks no permission on a
    keepalive, so any identity etcd accepted could keep it), the operator's included, and the session
    expires."""
    import grpc

    from agent_client.api import coordinator_pb2 as pb
    from agent_client.api import coordinator_pb2_grpc as pb_grpc
    addr = re.search(r"coordinator: +(127\.0\.0\.1:\d+)", up.output())
    assert addr is not None
    pki = up.data_dir / "pki"
    creds = grpc.ssl_channel_credentials((pki / "ca.crt").read_bytes(), (pki / "agent-agent-b.key").read_bytes(),
                                         (pki / "agent-agent-b.crt").read_bytes())
    with grpc.secure_channel(addr.group(1), creds) as channel:
        opened = pb_grpc.CoordinatorStub(channel).OpenSession(
            pb.OpenSessionRequest(agent="agent-b", host="sec-host", ttl_seconds=5), timeout=10)
    key = f"/gpucoord/sessions/agent-b/{opened.session_id}"
    read = _etcdctl(up, "get", key, "-w", "fields", creds="etcd-root-root")
    lease = re.search(r'"Lease" : (\d+)', read.stdout)
    assert read.returncode == 0 and lease is not None, read
    lease_hex = format(int(lease.group(1)), "x")
    others = [stem for stem in _principals(up) if stem != "coordinator-coordinator.etcd"]
    assert {"operator-operator", "node-sec-host", "agent-agent-a", "agent-agent-b"} <= set(others), others
    attempts = {stem: _etcdctl_start(up, "lease", "keep-alive", "--once", lease_hex, creds=stem) for stem in others}
    outcomes = {stem: _finish(proc, 8) for stem, proc in attempts.items()}
    kept = {stem: out for stem, (code, out) in outcomes.items() if code == 0 and "keepalived" in out}
    assert not kept, kept
    wait_for(lambda: _etcdctl(up, "get", key, "--keys-only", creds="etcd-root-root").stdout.strip() == "",
             5 + 5, "the abandoned session to expire")


def test_up_secure_etcd_refuses_every_agent_certificate(up: Up) -> None:
    """Two trust domains: etcd trusts only the etcd CA, which signs no agent certificate. With agent-a's
    certificate the TLS handshake with etcd fails, so nothing works: keeping an etcd lease alive (another
    agent's session), compacting etcd's history, granting or listing etcd leases, reading a lease's keys
    (each of which worked when etcd trusted the CA that signs agents). etcd's root still reads, so the
    refusal is the agent's."""
    pki = up.data_dir / "pki"
    root = "etcd-root-root"   # etcd's administrator: from the etcd CA (the one CA, before there were two)
    granted = _etcdctl(up, "lease", "grant", "30", creds=root)
    assert granted.returncode == 0, granted
    lease = granted.stdout.split()[1]        # "lease 694d... granted with TTL(30s)"
    t0 = time.monotonic()
    attempts = {name: _etcdctl_start(up, *argv, creds="agent-agent-a") for name, argv in {
        "keep-alive": ["lease", "keep-alive", "--once", lease], "compact": ["compaction", "1"],
        "grant": ["lease", "grant", "60"], "list": ["lease", "list"],
        "timetolive": ["lease", "timetolive", lease, "--keys"],
        "get": ["get", "--prefix", "/gpucoord/", "--keys-only"]}.items()}
    outcomes = {name: _finish(proc, 8) for name, proc in attempts.items()}
    worked = {name: out for name, (code, out) in outcomes.items() if code == 0 and "expired or revoked" not in out}
    assert not worked, worked
    # The lease was not kept alive: its TTL kept running down (a keepalive resets it to 30 s).
    ttl = _etcdctl(up, "lease", "timetolive", lease, creds=root)
    remaining = int(re.search(r"remaining\((-?\d+)s\)", ttl.stdout).group(1))  # type: ignore[union-attr]
    assert remaining <= 30 - (time.monotonic() - t0) + 1.5, (remaining, time.monotonic() - t0)
    # Not even a TLS connection: the handshake (or, with TLS 1.3, the first read after it) fails.
    server_ca = pki / "etcd-ca.crt" if (pki / "etcd-ca.crt").exists() else pki / "ca.crt"
    ep = re.search(r"etcd: +127\.0\.0\.1:(\d+)", up.output())
    assert ep is not None
    ctx = ssl.create_default_context(cafile=str(server_ca))
    ctx.load_cert_chain(str(pki / "agent-agent-a.crt"), str(pki / "agent-agent-a.key"))
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", int(ep.group(1))), timeout=10) as raw:
        with pytest.raises((ssl.SSLError, ConnectionError)):
            with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls_sock:
                tls_sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                if not tls_sock.recv(1):
                    raise ConnectionError("etcd closed the connection")
    root_read = _etcdctl(up, "get", "--prefix", "/gpucoord/hosts/", "--keys-only", creds=root)
    assert root_read.returncode == 0 and "sec-host" in root_read.stdout, root_read


def _etcdctl_start(up: Up, *argv: str, creds: str) -> subprocess.Popen[str]:
    ep = re.search(r"etcd: +(127\.0\.0\.1:\d+)", up.output())
    assert ep is not None
    pki = up.data_dir / "pki"
    server_ca = pki / "etcd-ca.crt" if (pki / "etcd-ca.crt").exists() else pki / "ca.crt"
    return subprocess.Popen([etcd_binary("etcdctl"), f"--endpoints=https://{ep.group(1)}", f"--cacert={server_ca}",
                             "--dial-timeout=3s", "--command-timeout=5s", f"--cert={pki / (creds + '.crt')}",
                             f"--key={pki / (creds + '.key')}", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str]:
    """(exit status, output); a command still retrying after ``timeout`` s is stopped and counts as failed."""
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return 124, out


def test_up_secure_cli_uses_the_environment(up: Up) -> None:
    addr = re.search(r"coordinator: +(127\.0\.0\.1:\d+)", up.output())
    assert addr is not None
    pki = up.data_dir / "pki"

    def env_for(stem: str) -> dict[str, str]:
        return {**child_env(), "GPUCOORD_TLS_CA": str(pki / "ca.crt"), "GPUCOORD_TLS_CERT": str(pki / f"{stem}.crt"),
                "GPUCOORD_TLS_KEY": str(pki / f"{stem}.key")}
    as_operator = _gpucoord("status", "--coordinator", addr.group(1), env=env_for("operator-operator"))
    assert as_operator.returncode == 0 and "host sec-host alive" in as_operator.stdout, as_operator.stderr
    as_agent = _gpucoord("lease", "--coordinator", addr.group(1), "revoke", "0123456789abcdef0123",
                         env=env_for("agent-agent-a"))
    assert as_agent.returncode == 1
    assert "PERMISSION_DENIED" in as_agent.stderr and "gpucoord://agent/agent-a" in as_agent.stderr
    # The operator revokes and lists revocations through the coordinator, with its certificate and no etcd
    # credentials (the printed variables have none for it).
    operator_env = {k: v for k, v in env_for("operator-operator").items() if not k.startswith("GPUCOORD_ETCD")}
    revoked = _gpucoord("certs", "revoke", "abc123", "--reason", "up test", "--coordinator", addr.group(1),
                        env=operator_env)
    assert revoked.returncode == 0 and "revoked: abc123" in revoked.stdout, revoked.stderr
    listed = _gpucoord("certs", "list", "--dir", str(pki), "--coordinator", addr.group(1), env=operator_env)
    assert listed.returncode == 0 and "abc123" in listed.stdout and "REVOKED" in listed.stdout, listed.stderr
    as_agent_revoke = _gpucoord("certs", "revoke", "abc124", "--coordinator", addr.group(1), env=env_for("agent-agent-a"))
    assert as_agent_revoke.returncode == 1 and "PERMISSION_DENIED" in as_agent_revoke.stderr, as_agent_revoke.stderr
    # Break glass: the root etcd variables that up printed (and nothing else) read etcd.
    glass = re.search(r"# break glass only.*\n(.*)\n", up.output())
    assert glass is not None, up.output()[-3000:]
    printed = dict(re.findall(r"export (GPUCOORD_ETCD_(?:CA|CERT|KEY))=(\S+)", glass.group(1)))
    assert set(printed) == {"GPUCOORD_ETCD_CA", "GPUCOORD_ETCD_CERT", "GPUCOORD_ETCD_KEY"}, glass.group(1)
    assert "etcd-root-root" in printed["GPUCOORD_ETCD_CERT"] and "operator-operator.etcd" not in up.output()
    root_env = {**child_env(), **printed}
    ep = re.search(r"etcd: +(127\.0\.0\.1:\d+)", up.output())
    assert ep is not None
    keys = _gpucoord("keys", "--etcd", ep.group(1), env=root_env)
    assert keys.returncode == 0 and "/gpucoord/revoked/abc123" in keys.stdout, keys.stderr
    plaintext = _gpucoord("status", "--coordinator", addr.group(1),
                          env={k: v for k, v in child_env().items() if not k.startswith("GPUCOORD_TLS_")})
    # The handshake fails: unreachable as far as a plaintext client can tell (exit 3), with the TLS flags as hint.
    assert plaintext.returncode == 3 and "UNAVAILABLE" in plaintext.stderr, plaintext.stderr
    assert "--tls-ca" in plaintext.stderr, plaintext.stderr


def test_up_secure_tls_flags_go_before_or_after_the_command(up: Up) -> None:
    """--tls-ca/--tls-cert/--tls-key are global options (docs/cli.md, "Command-line conventions"): accepted
    before the command, between its words or after it, and they win over GPUCOORD_TLS_*."""
    addr = re.search(r"coordinator: +(127\.0\.0\.1:\d+)", up.output())
    assert addr is not None
    pki = up.data_dir / "pki"
    flags = ["--tls-ca", str(pki / "ca.crt"), "--tls-cert", str(pki / "operator-operator.crt"),
             "--tls-key", str(pki / "operator-operator.key")]
    # The environment names an agent, which may not see the host without a session: the flags must win.
    agent_env = {**child_env(), "GPUCOORD_TLS_CA": str(pki / "ca.crt"),
                 "GPUCOORD_TLS_CERT": str(pki / "agent-agent-a.crt"), "GPUCOORD_TLS_KEY": str(pki / "agent-agent-a.key")}
    for argv in ([*flags, "status", "--coordinator", addr.group(1)],
                 ["status", "--coordinator", addr.group(1), *flags],
                 ["partition", *flags, "show", "sec-host", "--coordinator", addr.group(1)]):
        done = _gpucoord(*argv, env=agent_env)
        assert done.returncode == 0 and "sec-host" in done.stdout, (argv, done.stderr)


def test_tls_flags_are_checked_before_anything_is_sent(tmp_path: pathlib.Path) -> None:
    env = {k: v for k, v in child_env().items() if not k.startswith("GPUCOORD_TLS_")}
    addr = f"127.0.0.1:{free_port()}"
    for argv in (["--tls-ca", "ca.crt", "status", "--coordinator", addr],
                 ["status", "--coordinator", addr, "--tls-cert", "x.crt"]):
        done = _gpucoord(*argv, env=env)
        assert done.returncode == 2, (argv, done.stderr)
        (line,) = done.stderr.strip().splitlines()
        assert line.startswith("gpucoord: error: --tls-") and "TLS needs all of" in line, line
    missing = [x for part in ("ca", "cert", "key") for x in (f"--tls-{part}", str(tmp_path / f"none.{part}"))]
    done = _gpucoord("status", "--coordinator", addr, *missing, env=env)
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "cannot read" in done.stderr, done.stderr
    # keys reads etcd: gRPC's TLS flags are not its options.
    done = _gpucoord("--tls-ca", "ca.crt", "keys", env=env)
    assert done.returncode == 2 and "does not use --tls-ca" in done.stderr, done.stderr
    assert _gpucoord("keys", "--tls-ca", "ca.crt", env=env).returncode == 2
