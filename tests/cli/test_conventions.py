"""CLI conventions (docs/cli.md, "Command-line conventions"): global options before or after the subcommand; every
failure is one ``gpucoord: error:`` line with the documented exit code; quiet on a closed pipe; ``status
--watch``; ``status --json`` numbers; the status table's partition and eviction marks."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from agent_client import Client
from coordinator.cli import commands as cli_commands
from coordinator.cli import main as cli_main
from coordinator.cli.common import CliError
from coordinator.etcd.process import free_port
from tests.support import REPO
from tests.support.cluster import Cluster
from tests.support.processes import child_env
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

SPEC = """host = "h1"
mode = "manual"
agents = ["agent-a"]

[allocations.agent-a]
vram = { 1 = "4GiB" }
"""


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *args], capture_output=True, text=True,
                          env=child_env(), cwd=REPO, timeout=timeout)


def one_error_line(proc: subprocess.CompletedProcess[str], code: int) -> str:
    """The command failed with ``code`` and said so in exactly one ``gpucoord: error:`` line, with a hint."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("gpucoord: error: "), proc.stderr
    assert "; " in lines[0], f"no hint: {lines[0]}"
    assert "Traceback" not in proc.stderr
    return lines[0]


@pytest.fixture
def coord(cluster: Cluster) -> str:
    cluster.start_node("h1", "2x16GiB")
    return cluster.start_coordinator()


def test_global_options_go_before_or_after_the_subcommand(coord: str, cluster: Cluster, tmp_path: Path) -> None:
    spec = tmp_path / "f.toml"
    spec.write_text(SPEC)
    forms = [
        ("partition", "apply", str(spec), "--dry-run", "--coordinator", coord),   # after everything
        ("--coordinator", coord, "partition", "apply", str(spec), "--dry-run"),   # before the subcommand
        ("partition", "--coordinator", coord, "apply", str(spec), "--dry-run"),   # between the two names
        ("-v", "--coordinator", "127.0.0.1:1", "partition", "apply", str(spec), "--dry-run", "--coordinator", coord),
    ]
    outputs = set()
    for form in forms:
        proc = cli(*form)
        assert proc.returncode == 0, (form, proc.stderr)
        outputs.add(proc.stdout)
    assert len(outputs) == 1 and "agent-a" in outputs.pop()
    # --etcd and --prefix likewise, on the commands that read etcd.
    before = cli("--etcd", cluster.endpoints[0], "--prefix", cluster.prefix, "keys")
    after = cli("keys", "--etcd", cluster.endpoints[0], "--prefix", cluster.prefix)
    assert before.returncode == after.returncode == 0, before.stderr + after.stderr
    assert f"{cluster.prefix}hosts/h1" in before.stdout and f"{cluster.prefix}hosts/h1" in after.stdout
    assert cli("status", "-v", "--coordinator", coord).returncode == 0


def test_bad_command_lines_exit_2_with_one_line() -> None:
    for argv in ([], ["status", "--bogus"], ["lease"], ["--etcd", "127.0.0.1:2379", "status"],
                 ["status", "--etcd", "127.0.0.1:2379"], ["up", "--fake-mem", "lots"], ["status", "--watch", "0"],
                 ["run", "--agent", "a", "--vram", "12", "--", "true"]):
        one_error_line(cli(*argv), 2)
    line = one_error_line(cli("--etcd", "127.0.0.1:2379", "status"), 2)
    assert "does not use --etcd" in line


def test_unreachable_coordinator_and_etcd_exit_3_naming_the_address() -> None:
    addr = f"127.0.0.1:{free_port()}"
    for argv in (["status"], ["partition", "show", "h1"], ["lease", "revoke", "x"], ["lease", "evict", "x"]):
        line = one_error_line(cli(*argv, "--coordinator", addr), 3)
        assert f"cannot reach the coordinator at {addr}" in line and "--coordinator" in line
    line = one_error_line(cli("keys", "--etcd", "127.0.0.1:1"), 3)
    assert "cannot reach etcd at 127.0.0.1:1" in line and "--etcd" in line


def test_refused_operations_exit_1(coord: str, tmp_path: Path) -> None:
    for verb in ("revoke", "evict"):
        line = one_error_line(cli("lease", verb, "no-such-lease", "--coordinator", coord), 1)
        assert "NOT_FOUND" in line and "no-such-lease" in line
    bad = tmp_path / "bad.toml"
    bad.write_text(SPEC.replace('1 = "4GiB"', '7 = "4GiB"'))
    line = one_error_line(cli("partition", "apply", str(bad), "--coordinator", coord), 1)
    assert "INVALID_ARGUMENT" in line and "vram" in line
    one_error_line(cli("partition", "apply", str(tmp_path / "missing.toml"), "--coordinator", coord), 1)


def test_output_into_a_closed_pipe_ends_quietly(cluster: Cluster) -> None:
    # Far more than a pipe holds, so that the writer meets the closed pipe for certain.
    async def fill() -> None:
        for i in range(600):
            await cluster.store.put(f"{cluster.prefix}filler/{i:04d}".encode(), json.dumps({"pad": "x" * 200}).encode())
    cluster.lt.run(fill())
    script = (f"{sys.executable} -m coordinator.cli keys --etcd {cluster.endpoints[0]} --prefix {cluster.prefix} "
              "| head -1; echo rc=${PIPESTATUS[0]}")
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=60)
    assert proc.stdout.splitlines()[0].startswith(f"{cluster.prefix}filler/0000")
    assert proc.stdout.splitlines()[-1] == "rc=0" and proc.stderr == "", proc.stderr


def test_an_unexpected_error_is_one_line_and_a_traceback_only_with_v(monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    def broken(address: str, host: str = "", tls: object = None) -> None:
        raise KeyError("boom")
    monkeypatch.setattr(cli_commands, "fetch_status", broken)
    assert cli_main.main(["status"]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["gpucoord: error: unexpected KeyError: 'boom'; run with -v for the traceback"]
    assert cli_main.main(["status", "-v"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("gpucoord: error: unexpected KeyError")


def test_cli_error_line_format() -> None:
    assert CliError("x", "do y", 3).line() == "gpucoord: error: x; do y"


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("flag", ["--listen", "--metrics-listen", "--node-listen", "--node-metrics-listen",
                                  "--etcd-listen"])
def test_up_on_a_busy_port_is_one_line(busy_port: int, flag: str, tmp_path: Path) -> None:
    others = {f: "127.0.0.1:0" for f in ("--listen", "--metrics-listen", "--node-listen", "--node-metrics-listen",
                                        "--etcd-listen")}
    others[flag] = f"127.0.0.1:{busy_port}"
    proc = cli("up", "--fake-gpus", "1x16GiB", "--data-dir", str(tmp_path / "d"),
               *[x for kv in others.items() for x in kv])
    line = one_error_line(proc, 1)
    assert f"{flag} 127.0.0.1:{busy_port}: the address is already in use" in line
    assert not (tmp_path / "d").exists(), "up started something before it checked its addresses"


def test_status_json_has_numbers_and_the_table_marks_evictions_and_names_gpus(coord: str, tmp_path: Path) -> None:
    spec = tmp_path / "f.toml"
    spec.write_text(SPEC)
    assert cli("partition", "apply", str(spec), "--coordinator", coord).returncode == 0
    with Client(coord, agent="agent-a", host="h1") as c:
        lease = c.acquire(vram_mb=1000, gpu=1)
        doc = json.loads(cli("status", "--json", "--coordinator", coord).stdout)
        (host,) = doc["hosts"]
        assert host["gpus"][0]["total_mb"] == 16384 and host["leases"][0]["token"] == lease.token
        assert isinstance(host["mem_bytes"], int) and isinstance(host["leases"][0]["vram_mb"], int)
        assert "eviction" not in host["leases"][0]
        table = cli("status", "--coordinator", coord).stdout
        assert "caps=[GPU 1: 4GiB]" in table, table           # the GPU's index, not a cut uuid
        assert "EVICTING" not in table
        assert cli("lease", "evict", lease.id, "--grace", "600", "--reason", "maintenance",
                   "--coordinator", coord).returncode == 0
        table = cli("status", "--coordinator", coord).stdout
        (row,) = [x for x in table.splitlines() if lease.id in x]
        assert "EVICTING: deadline in" in row and "operator" in row and "maintenance" in row
        notice = json.loads(cli("status", "--json", "--coordinator", coord).stdout)["hosts"][0]["leases"][0]["eviction"]
        assert notice["reason"] == "maintenance" and notice["deadline_unix"] > time.time() + 500


@pytest.fixture
def ctrl_c_reaches_children() -> Iterator[None]:
    """A shell starts background jobs with SIGINT ignored, and an ignored signal stays ignored across exec,
    so under ``pytest &`` (or a CI runner that does so) the watch would never see the Ctrl-C these tests send.
    A handled signal is reset to its default at exec: handle it here while the test starts its children."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def _frames(proc: subprocess.Popen[str], n: int) -> list[str]:
    assert proc.stdout is not None
    frames: list[str] = []
    for line in proc.stdout:
        if line.startswith("Every 0.2s: gpucoord status"):
            frames.append("")
            if len(frames) > n:
                break
        elif frames:
            frames[-1] += line
    return frames[:n]


@pytest.mark.parametrize("reachable", [True, False])
@pytest.mark.usefixtures("ctrl_c_reaches_children")
def test_status_watch_redraws_until_ctrl_c(coord: str, reachable: bool) -> None:
    addr = coord if reachable else f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "status", "--watch", "0.2", "--coordinator", addr],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), cwd=REPO)
    try:
        frames = _frames(proc, 2)
        expected = "host h1 alive simulated" if reachable else f"cannot reach the coordinator at {addr}"
        assert len(frames) == 2 and all(expected in f for f in frames), frames
        proc.send_signal(signal.SIGINT)
        assert proc.wait(15) == 0
        assert proc.stderr is not None and "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.usefixtures("ctrl_c_reaches_children")
def test_status_watch_json_prints_one_document_per_line(coord: str) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "status", "--watch", "0.2", "--json",
                             "--coordinator", coord], stdout=subprocess.PIPE, text=True, env=child_env(), cwd=REPO)
    try:
        assert proc.stdout is not None
        docs = [json.loads(proc.stdout.readline()) for _ in range(2)]
        assert all(d["hosts"][0]["host"] == "h1" for d in docs)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(15)


def test_revoke_prints_revoked_and_exits_0(coord: str) -> None:
    with Client(coord, agent="agent-a", host="h1") as c:
        lease = c.acquire(vram_mb=100)
        proc = cli("lease", "revoke", lease.id, "--coordinator", coord)
        assert proc.returncode == 0 and proc.stdout.strip() == "revoked"
        wait_for(lambda: not c.status("h1").hosts[0].leases, 10, "the revoked lease to go")


def test_a_port_left_in_time_wait_is_free_for_up(tmp_path: Path) -> None:
    """`up` takes etcd's 2379 (or any port) right after its last user closed it: connections lingering in
    TIME_WAIT do not stop a server that sets SO_REUSEADDR, as etcd and gRPC do, so they must not make `up`
    think the port is taken."""
    from coordinator.etcd.process import port_is_free
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as the etcd that had the port did
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()            # the side that closes first keeps the port in TIME_WAIT
    client.close()
    server.close()
    assert port_is_free(port)


def test_node_advertises_the_given_address(cluster: Cluster) -> None:
    addr = cluster.start_coordinator()
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "node", "--etcd", cluster.endpoints[0],
                             "--prefix", cluster.prefix, "--host", "h9", "--fake-gpus", "1x16GiB",
                             "--listen", "127.0.0.1:0", "--advertise", "gpu-node-9.example:7170"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env(), cwd=REPO)
    try:
        def address() -> str:
            doc = json.loads(cli("status", "--json", "--host", "h9", "--coordinator", addr).stdout or "{}")
            hosts = doc.get("hosts", [])
            return str(hosts[0]["address"]) if hosts and hosts[0]["alive"] else ""
        assert wait_for(address, 30, "node h9 to register", interval=0.2) == "gpu-node-9.example:7170"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
