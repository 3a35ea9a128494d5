"""A 3-member etcd for the fault tier (``Etcd3``), and ``ClientFailovers``, what the agent clients were
answered when they moved to another replica."""
from __future__ import annotations

import asyncio
import collections
import logging
import signal
import time
from typing import Any

from coordinator.etcd.consistency import HashReport, compare_members
from coordinator.etcd.process import EtcdCluster, EtcdMember, EtcdOptions

# Every HashKV comparison of this test process, (test id, report): the terminal summary prints them.
HASH_REPORTS: list[tuple[str, HashReport]] = []


class Etcd3:
    """A 3-member etcd cluster on loopback for the fault tier: find the leader, kill -9, SIGSTOP, bring back.

    Members run with ``--unsafe-no-fsync``: this machine's disk is slow and shared, and the tests kill whole
    processes (not machines), so what a member acknowledged is in its page cache and survives. The fixture
    ``etcd3`` (tests/faults/conftest.py) starts one and closes it."""

    def __init__(self, binary: str | None = None, options: EtcdOptions | None = None) -> None:
        self.cluster = EtcdCluster(3, binary=binary, options=options or EtcdOptions(unsafe_no_fsync=True))
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

    def compare_hashes(self, timeout: float = 30.0) -> HashReport:
        """etcd's corruption check over the members (``coordinator.etcd.consistency``): each member's
        HashKV at the lowest revision every member reports. Stopped members are continued and killed ones
        restarted on their data dirs first, so that a member that drifted while down is compared too."""
        for m in self.members:
            self.cont(m)
            if m.proc is None:
                self.restart(m, timeout)
        deadline = time.monotonic() + timeout
        while True:
            report = asyncio.run(compare_members(self.endpoints, names={m.endpoint: m.name for m in self.members}))
            # A member that was just restarted may answer Status before it serves HashKV: ask again.
            if report.consistent or not report.unreachable or time.monotonic() > deadline:
                return report
            time.sleep(0.2)

    def check_consistent(self, test: str) -> HashReport:
        """``compare_hashes``, recorded for the terminal summary; AssertionError naming the members when
        their hashes differ."""
        report = self.compare_hashes()
        HASH_REPORTS.append((test, report))
        assert report.consistent, f"etcd members drifted apart: {report.describe()}"
        return report

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
        # The parent of the loggers that say so (agent_client.transport for calls, .keepalive for sessions):
        # their records reach its handlers. (On agent_client.client alone it heard none of them.)
        self._logger = logging.getLogger("agent_client")
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
