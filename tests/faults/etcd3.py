"""A 3-member etcd cluster on loopback for the fault tier: find the leader, kill -9, SIGSTOP, bring back.

Members run with ``--unsafe-no-fsync``: this machine's disk is slow and shared, and the tests kill whole
processes (not machines), so what a member acknowledged is in its page cache and survives."""
from __future__ import annotations

import signal
import time
from typing import Iterator

import pytest

from coordinator.etcd.process import EtcdCluster, EtcdMember, EtcdOptions


class Etcd3:
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


@pytest.fixture
def etcd3() -> Iterator[Etcd3]:
    e = Etcd3()
    e.cluster.start()
    try:
        yield e
    finally:
        e.close()
