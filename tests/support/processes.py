"""Child processes for kill and restart tests: ``spawn_coordinator``, ``spawn_node``, ``spawn_agent``,
``replica_processes`` (N coordinator processes, by replica id), ``LinkedReplica`` (a coordinator process behind
FaultLinks), ``stop_process``, ``child_env``; bound processes:
``gpucoord_run`` and ``command_pid``, ``write_fake_processes``, ``ProcessGone`` (when a process exited)."""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
from typing import Any, Iterator, Sequence

from tests.faultlink import FaultLink
from tests.support import REPO
from tests.support.cluster import Cluster
from tests.support.waiting import LIVENESS_S, liveness, wait_for


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def gpucoord_run(addr: str, *args: str, stdin: Any = subprocess.DEVNULL) -> subprocess.Popen[str]:
    """``gpucoord run --coordinator ADDR ARGS...`` as a child process, its stdout and stderr piped."""
    return subprocess.Popen([sys.executable, "-m", "coordinator.cli", "run", "--coordinator", addr, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=stdin, text=True,
                            env=child_env(), cwd=REPO)


def command_pid(run: subprocess.Popen[str], started: list[int]) -> int:
    """The pid of the command that a ``gpucoord run`` child (``run``) started, from the first line the command
    prints; added to ``started`` (the PIDs the test kills at its end)."""
    assert run.stdout is not None
    line = run.stdout.readline()
    if not line.strip():
        run.kill()
        raise AssertionError(f"the command did not start: {run.communicate(timeout=10)[1]}")
    pid = int(line)
    started.append(pid)
    return pid


def write_fake_processes(path: pathlib.Path, doc: dict[int, dict[int, Any]]) -> None:
    """A ``--fake-processes`` file, written atomically (the node never reads half a file): GPU index ->
    {pid: MiB, or {"mib": MiB, "until": unix seconds}}."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({str(g): {str(p): mb for p, mb in procs.items()} for g, procs in doc.items()}))
    tmp.replace(path)


class ProcessGone:
    """When a process (not necessarily our child) is gone: exited, as a zombie or reaped. A small watcher
    process waits on its pidfd, which becomes readable the moment the process exits, and prints the wall
    time then. A process of its own, so that the time is taken at once, not when a thread of this process
    (which may run a busy coordinator) gets the GIL back."""

    _WATCH = ("import os, select, sys, time\n"
              "try:\n fd = os.pidfd_open(int(sys.argv[1]))\n"
              "except ProcessLookupError:\n print(repr(time.time()), flush=True); sys.exit()\n"
              "print('watching', flush=True)\n"
              "select.select([fd], [], [])\n"
              "print(repr(time.time()), flush=True)\n")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.at: float | None = None
        self._proc = subprocess.Popen([sys.executable, "-S", "-c", self._WATCH, str(pid)], stdout=subprocess.PIPE,
                                      text=True)
        assert self._proc.stdout is not None
        first = self._proc.stdout.readline().strip()
        if first != "watching":     # it was gone already
            self.at = float(first)

    def wait(self, timeout: float) -> float:
        """When it went (wall time), waiting at least ``LIVENESS_S`` (a deadline only tells a defect from a pass)."""
        timeout = liveness(timeout)
        if self.at is None:
            try:
                out, _ = self._proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
                raise AssertionError(f"pid {self.pid} did not exit within {timeout}s") from None
            self.at = float(out.strip())
        else:
            self._proc.wait(timeout)
        return self.at

    @staticmethod
    def now_gone(pid: int) -> bool:
        """/proc says so: no such process, or a zombie."""
        try:
            stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            return True
        return stat.rsplit(")", 1)[1].split()[0] == "Z"


def spawn_coordinator(endpoints: list[str], prefix: str, listen: str, log_path: str,
                      extra: list[str] | None = None,
                      env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], int]:
    """A coordinator as a real child process; returns it once it serves, with its port."""
    log = open(log_path, "ab")
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "coordinator", "--etcd", ",".join(endpoints),
                             "--prefix", prefix, "--listen", listen, *(extra or [])],
                            stdout=subprocess.PIPE, stderr=log, env={**child_env(), **(env or {})}, cwd=REPO)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if not line.startswith("READY coordinator port="):
        proc.kill()
        raise AssertionError(f"coordinator did not start: {line!r}; see {log_path}")
    return proc, int(line.split("port=")[1])


@contextlib.contextmanager
def replica_processes(cluster: Cluster, log_dir: pathlib.Path, extra: Sequence[str] = (),
                      count: int = 2) -> Iterator[dict[str, tuple[subprocess.Popen[bytes], str]]]:
    """``count`` coordinator processes on ``cluster`` (logs ``c0.log``... in ``log_dir``), once each has registered
    under ``coordinators/``: replica id -> (process, address). At the end the live ones are stopped, by PID."""
    procs = []
    try:
        for i in range(count):
            proc, port = spawn_coordinator(cluster.endpoints, cluster.prefix, "127.0.0.1:0",
                                           str(log_dir / f"c{i}.log"), extra=list(extra))
            procs.append((proc, f"127.0.0.1:{port}"))
        by_id: dict[str, tuple[subprocess.Popen[bytes], str]] = {}

        def registered() -> bool:
            addresses = cluster.replicas()
            by_id.update({replica: (proc, addr) for replica, address in addresses.items()
                          for proc, addr in procs if addr == address})
            return len(by_id) == count
        wait_for(registered, LIVENESS_S, f"the {count} replicas to register")
        yield by_id
    finally:
        for proc, _ in procs:
            stop_process(proc)


class LinkedReplica:
    """A coordinator as a real child process whose etcd connection runs through ``etcd_link`` and whose clients
    reach it through ``link``: ``address`` is that link's endpoint, which it advertises, so the other
    replicas' forwarded calls and the clients it names as owner take the link too. ``restart()`` (after a
    kill) brings it back on the same port, behind the same links."""

    def __init__(self, endpoints: list[str], prefix: str, log_path: str, extra: Sequence[str] = ()) -> None:
        from coordinator.etcd.process import free_port
        self.port = free_port()
        self.link = FaultLink(f"127.0.0.1:{self.port}", "clients")
        self.etcd_link = FaultLink(endpoints, "etcd")
        self.address = self.link.endpoint
        self.prefix, self.log_path, self.extra = prefix, log_path, list(extra)
        self.id = ""    # the replica id, once ``registered`` has seen it
        self.proc = self._spawn()

    def _spawn(self) -> subprocess.Popen[bytes]:
        proc, _ = spawn_coordinator(self.etcd_link.endpoints, self.prefix, f"127.0.0.1:{self.port}", self.log_path,
                                    extra=[*self.extra, "--advertise", self.address])
        return proc

    def restart(self) -> None:
        self.proc = self._spawn()
        self.id = ""

    def registered(self, cluster: Cluster) -> bool:
        """Whether it has registered under ``coordinators/`` (and learn its id)."""
        for replica, address in cluster.replicas().items():
            if address == self.address:
                self.id = replica
        return bool(self.id)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def close(self) -> None:
        self.link.heal()
        self.etcd_link.heal()
        stop_process(self.proc)
        self.link.close()
        self.etcd_link.close()


def spawn_node(endpoints: list[str], prefix: str, host: str, fake_gpus: str, log_path: str,
               extra: list[str] | None = None, env: dict[str, str] | None = None,
               coordinators: list[str] | None = None) -> subprocess.Popen[bytes]:
    """A node daemon (``gpucoord node --fake-gpus``) as a real child process; returns it once it serves.
    With ``coordinators`` it runs in the registry mode (``--coordinator``: no etcd endpoints, no etcd
    credentials, nothing of etcd in its environment); else with ``--etcd endpoints``."""
    log = open(log_path, "ab")
    mode = ["--coordinator", ",".join(coordinators)] if coordinators else ["--etcd", ",".join(endpoints)]
    base_env = child_env()
    if coordinators:
        base_env = {k: v for k, v in base_env.items() if not k.startswith("GPUCOORD_ETCD")}
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "node", *mode,
                             "--prefix", prefix, "--host", host, "--listen", "127.0.0.1:0", "--fake-gpus", fake_gpus,
                             *(extra or [])],
                            stdout=subprocess.PIPE, stderr=log, env={**base_env, **(env or {})}, cwd=REPO)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if not line.startswith("READY node port="):
        proc.kill()
        raise AssertionError(f"node did not start: {line!r}; see {log_path}")
    return proc


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10) -> None:
    """SIGCONT (it may be stopped), then SIGTERM, then SIGKILL: by PID, only our own child."""
    if proc.poll() is not None:
        return
    try:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    except ProcessLookupError:
        pass


def spawn_agent(addr: str, host: str, agent: str, vram_mb: int, ttl: int, log_path: str = os.devnull,
                wait: float = 0.0, read_answer: bool = True,
                extra: list[str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """A real agent process (``coordinator.cli.demo agent``) that acquires and holds; returns it and its answer."""
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli.demo", "agent", "--coordinator", addr, "--host", host,
                             "--agent", agent, "--vram-mb", str(vram_mb), "--ttl", str(ttl), "--wait", str(wait),
                             *(extra or [])],
                            stdout=subprocess.PIPE, stdin=subprocess.PIPE, stderr=open(log_path, "ab"),
                            env=child_env(), cwd=REPO)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().decode().strip() if read_answer else ""
