"""A 3-member etcd for the fault tier (``Etcd3``), and ``ClientFailovers``, what the agent clients were
answered when they moved to another replica."""
from __future__ import annotations

import collections
import logging
import signal
import time
from typing import Any

from coordinator.etcd.process import EtcdCluster, EtcdMember, EtcdOptions


class Etcd3:
    """A 3-member etcd cluster on loopback for the fault tier: find the leader, kill -9, SIGSTOP, bring back.

    Members run with ``--unsafe-no-fsync``: this machine's disk is slow and shared, and the tests kill whole
    processes (not machines), so what a member acknowledged is in its page cache and survives. The fixture
    ``etcd3`` (tests/faults/conftest.py) starts one and closes it."""

    def __init__(self) -> None:
        self.cluster = EtcdCluster(3, options=EtcdOptions(unsafe_no_fsync=True))
        self.stopped: set[str] = set()

    @property
    def endpoints(self) -> list[str]:
        return self.cluster.endpoints

    @property
    def members(self) -> list[EtcdMember]:
        return self.cluster.members

    def leader(self, timeout: float = 10.0) -> EtcdMember:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for m in self.members:
                if m.proc is not None and m.name not in self.stopped and m.is_leader():
                    return m
            time.sleep(0.05)
        raise TimeoutError("no etcd leader")

    def followers(self) -> list[EtcdMember]:
        lead = self.leader()
        return [m for m in self.members if m is not lead]

    def kill(self, m: EtcdMember) -> None:
        m.kill()

    def restart(self, m: EtcdMember, timeout: float = 20.0) -> None:
        m.restart(self.cluster.initial_cluster)
        deadline = time.monotonic() + timeout
        while not m.healthy():
            if time.monotonic() > deadline:
                raise TimeoutError(f"etcd member {m.name} did not come back; log {m.log_path}")
            time.sleep(0.05)

    def stop(self, m: EtcdMember) -> None:
        m.signal(signal.SIGSTOP)
        self.stopped.add(m.name)

    def cont(self, m: EtcdMember) -> None:
        m.signal(signal.SIGCONT)
        self.stopped.discard(m.name)

    def close(self) -> None:
        for m in self.members:
            m.signal(signal.SIGCONT)
        self.cluster.stop()


class ClientFailovers(logging.Handler):
    """What the agent clients of this process were answered when they moved to another replica, counted by
    call and status ("Acquire UNAVAILABLE", "KeepAlive no answer", ...), from agent_client's own log. Use
    ``with ClientFailovers() as seen:``."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.counts: collections.Counter[str] = collections.Counter()
        self._logger = logging.getLogger("agent_client.client")
        self._level = self._logger.level

    def emit(self, record: logging.LogRecord) -> None:
        msg, args = str(record.msg), record.args if isinstance(record.args, tuple) else ()
        if msg.startswith("%s: coordinator %s failed") and len(args) == 3:
            self.counts[f"{args[0]} {str(args[2]).split(':')[0]}"] += 1
        elif msg.startswith("keepalive stream broke") and args:
            self.counts[f"KeepAlive {args[0]}"] += 1
        elif msg.startswith("keepalive: no answer"):
            self.counts["KeepAlive no answer"] += 1

    def __enter__(self) -> ClientFailovers:
        self._logger.addHandler(self)
        self._logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)
