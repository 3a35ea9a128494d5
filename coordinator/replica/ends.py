"""How each lease ended, for ``gpucoord_releases_total{reason}``: counted once, by the replica that ended it.

* ``release``: a Release (``Leases.release``);
* ``revoke``: an operator's RevokeLease, or a revoke notice's deadline (``Leases.revoke``);
* ``eviction``, ``reclaim``: the leader at an eviction notice's deadline (a team reclaim's notice: ``reclaim``);
* ``close``: a CloseSession, here: the session's leases, from the mirror, before its etcd lease is revoked;
* ``expiry``: a session that stopped keeping alive. etcd deletes it with its leases; the replica that kept it
  alive (the last KeepAlive or OpenSession of it was here) and did not close it counts its leases, from the
  mirror as it was before the watch applied the deletion.

A gang is one lease (its records on several GPUs count once).
"""
from __future__ import annotations

from coordinator import metrics
from coordinator.etcd.types import WatchBatch
from coordinator.keys import Keys
from coordinator.records import InvalidRecord, SessionInfo
from coordinator.replica.mirror import Mirror
from coordinator.replica.view import lease_of

MAX_TRACKED = 200_000   # sessions remembered as kept alive here (a bound, well above max sessions per replica)


class LeaseEnds:
    def __init__(self, keys: Keys, mirror: Mirror) -> None:
        self.keys, self.mirror = keys, mirror
        self._kept: dict[tuple[str, str], str] = {}     # (agent, session id) -> host: sessions kept alive here
        self._closing: set[tuple[str, str]] = set()      # closed here: their deletion is no expiry

    def kept(self, info: SessionInfo) -> None:
        key = (info.agent, info.session_id)
        if key not in self._kept:
            if len(self._kept) >= MAX_TRACKED:
                del self._kept[next(iter(self._kept))]
            self._kept[key] = info.host

    def _session_leases(self, agent: str, session_id: str, host: str) -> int:
        ids = set()
        for kv in self.mirror.host_items("leases", host):
            try:
                lease = lease_of(kv)
            except InvalidRecord:
                continue
            if lease.session_id == session_id and lease.agent == agent:
                ids.add(lease.id)
        return len(ids)

    def closing(self, info: SessionInfo) -> None:
        """CloseSession of ``info`` is about to revoke it: its leases end as ``close``."""
        key = (info.agent, info.session_id)
        self._kept.pop(key, None)
        if len(self._closing) >= MAX_TRACKED:
            self._closing.clear()
        self._closing.add(key)
        n = self._session_leases(info.agent, info.session_id, info.host)
        if n:
            metrics.RELEASES.labels("close").inc(n)

    def before(self, batch: WatchBatch) -> None:
        """A watch batch about to be applied to the mirror: the sessions it deletes that were kept alive here
        and not closed here expired; their leases count as ``expiry``. Their etcd lease's revoke deleted the
        leases in the same revision, so in the same batch: those deletions are looked up (their records still
        in the mirror), not every lease of the host for each session (10,000 sessions expiring together made
        that quadratic)."""
        sessions, leases = self.keys.kind("sessions"), self.keys.kind("leases")
        expired: set[tuple[str, str]] = set()
        for ev in batch.events:
            if ev.kind == "PUT" or not ev.kv.key.startswith(sessions):
                continue
            try:
                _, parts = self.keys.parse(ev.kv.key)
            except ValueError:
                continue
            if len(parts) != 2:
                continue
            key = (parts[0], parts[1])
            host = self._kept.pop(key, None)
            if key in self._closing:
                self._closing.discard(key)
                continue
            if host is not None:
                expired.add(key)
        if not expired:
            return
        ids = set()
        for ev in batch.events:
            if ev.kind == "PUT" or not ev.kv.key.startswith(leases):
                continue
            kv = self.mirror.get(ev.kv.key)
            try:
                lease = lease_of(kv) if kv is not None else None
            except InvalidRecord:
                continue
            if lease is not None and (lease.agent, lease.session_id) in expired:
                ids.add(lease.id)
        if ids:
            metrics.RELEASES.labels("expiry").inc(len(ids))


__all__ = ["LeaseEnds"]
