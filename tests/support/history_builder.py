"""``History``: synthetic etcd histories for the tests of tests/history.check_history, built the way the
coordinator's transactions would produce them, and ``clean_history`` (one that must pass)."""
from __future__ import annotations

import json
from typing import Any

from coordinator.etcd.store import KV, WatchEvent
from coordinator.keys import Keys, lease_id_for
from tests.history import HistoryReport, check_history

K = Keys("/t/")
HOST = "h1"
G0 = "GPU-0"
G1 = "GPU-1"
CAP = 16384
SESSION = 0x1F


def dumps(d: Any) -> bytes:
    return json.dumps(d, separators=(",", ":"), sort_keys=True).encode()


class History:
    """Builds watch events the way the coordinator's transactions would produce them.

    Every ``txn()`` is one etcd revision; the events inside it share that mod_revision.
    """

    def __init__(self) -> None:
        self.rev = 1
        self.events: list[WatchEvent] = []
        self.kvs: dict[bytes, KV] = {}
        self.seq: dict[str, int] = {}
        self._pending: list[tuple[str, bytes, bytes, int]] | None = None

    # -- low level ---------------------------------------------------------------------------
    def txn(self) -> History:
        assert self._pending is None
        self._pending = []
        return self

    def __enter__(self) -> History:
        return self

    def __exit__(self, *exc: object) -> None:
        self.commit()

    def commit(self) -> None:
        ops, self._pending = self._pending or [], None
        self.rev += 1
        for kind, key, value, etcd_lease in ops:
            prev = self.kvs.get(key)
            if kind == "PUT":
                kv = KV(key, value, prev.create_revision if prev else self.rev, self.rev,
                        prev.version + 1 if prev else 1, etcd_lease)
                self.kvs[key] = kv
            else:
                assert prev is not None, key
                kv = KV(key, b"", 0, self.rev, 0, 0)
                del self.kvs[key]
            self.events.append(WatchEvent(kind, kv, prev))

    def put(self, key: bytes, value: Any, etcd_lease: int = 0) -> None:
        op = ("PUT", key, dumps(value), etcd_lease)
        if self._pending is None:
            self._pending = [op]
            self.commit()
        else:
            self._pending.append(op)

    def delete(self, key: bytes) -> None:
        op = ("DELETE", key, b"", 0)
        if self._pending is None:
            self._pending = [op]
            self.commit()
        else:
            self._pending.append(op)

    # -- coordinator-shaped writes -------------------------------------------------------------
    def ledger(self, gpu: str = G0, seq: int | None = None, capacity_mb: int = CAP, host: str = HOST) -> None:
        if seq is None:
            seq = self.seq.get(gpu, 0)
        self.seq[gpu] = seq
        self.put(K.gpu(host, gpu), {"capacity_mb": capacity_mb, "seq": seq})

    def lease(self, agent: str, request_id: str, vram_mb: int, gpu: str = G0, *, token: int | None = None,
              lease_id: str | None = None, priority: int = 0, host: str = HOST, bump: bool = True,
              extra: dict[str, Any] | None = None) -> str:
        """Put a new lease and, like an admission, bump the GPU's ledger in the same revision (own txn if none open);
        ``extra``: more fields of the record (a gang's, format 3's ``over_quota``)."""
        if token is None:
            token = self.seq.get(gpu, 0) + 1
        lease_id = lease_id or lease_id_for(agent, request_id, host)
        own_txn = self._pending is None
        if own_txn:
            self.txn()
        self.put(K.lease(host, gpu, lease_id), {
            "id": lease_id, "host": host, "gpu_uuid": gpu, "gpu_index": int(gpu.rsplit("-", 1)[1]),
            "agent": agent, "session_id": format(SESSION, "x"), "vram_mb": vram_mb, "priority": priority,
            "preemptible": True, "request_id": request_id, "token": token, "created_at": 1_700_000_000.0 + token,
        } | (extra or {}), etcd_lease=SESSION)
        if bump:
            self.ledger(gpu, max(token, self.seq.get(gpu, 0)), host=host)
        if own_txn:
            self.commit()
        return lease_id

    def team(self, name: str, members: list[str], quota_mb: int = 0, limit_mb: int | None = None) -> None:
        """An operator's ``team set``: the ``teams/<name>`` record."""
        self.put(K.team(name), {"name": name, "quota_mb": quota_mb, "limit_mb": limit_mb, "weight": 1.0,
                                "members": members, "quota_by_model": {}, "max_min_runtime_s": 0.0})

    def release(self, lease_id: str, gpu: str = G0, host: str = HOST) -> None:
        self.delete(K.lease(host, gpu, lease_id))

    def partition(self, caps: dict[str, list[tuple[str, int]]], headroom_mb: int = 0, mode: str = "manual",
                  host: str = HOST) -> None:
        self.put(K.partition(host), {"partition": {
            "host": host, "mode": mode, "agents": list(caps), "headroom_mb": headroom_mb,
            "allocations": [{"agent": a, "cores": [], "mem_bytes": 0, "disk_bytes": 0, "whole_gpus": [],
                             "vram_caps_mb": [[u, mb] for u, mb in c]} for a, c in caps.items()],
            "spec": None}})


def check(h: History) -> HistoryReport:
    return check_history(h.events, K)


def assert_one_violation(rep: HistoryReport, *needles: str) -> None:
    assert rep.violations, "the violation was not detected"
    assert all(any(n in v for v in rep.violations) for n in needles), rep.violations


def clean_history() -> History:
    """Two GPUs, two agents, a partition, admissions, a group commit, releases and an eviction."""
    h = History()
    h.ledger(G0)
    h.ledger(G1)
    h.partition({"a": [(G0, 12000), (G1, 16384)], "b": [(G0, 8000), (G1, 8000)]}, headroom_mb=512)
    a1 = h.lease("a", "r1", 8000)
    b1 = h.lease("b", "r1", 7000)           # same request_id, other agent: fine
    with h.txn():                            # group commit: two admissions on G1, one ledger bump
        h.lease("a", "r2", 4000, G1, token=1, bump=False)
        h.lease("b", "r2", 4000, G1, token=2, bump=False)
        h.ledger(G1, seq=2)
    h.release(a1)
    a3 = h.lease("a", "r3", 8800)           # G0: 7000 + 8800 = 15800 <= 16384 - 512
    h.release(b1)
    with h.txn():                            # victim gone and the waiter admitted in one revision
        h.release(a3)
        h.lease("b", "r4", 8000)
    return h
