"""Cordon and drain (issue 31, docs/policies.md "Cordon and drain"): ``cordons/<host>`` and a drain's eviction notices.

The cordon is one compare-and-set on its own key. Admission compares that key in every grant
(``policy/cordon.py``), so once the cordon's transaction has committed no grant lands on the host at any later
revision, whichever replica decides it. A drain then reads the host's leases (every lease granted before the
cordon, and no later one can be) and gives each an operator's eviction notice with the reason ``drain``
(``Leases.evict``): the usual grace, the leader's revoke at the deadline, and G3's order for leases bound to
processes (their VRAM counts as free only once the processes are gone). A drain cut short (the replica killed
between the cordon and its notices) is finished by the leader (``Cordons.finish_drains``, a leader duty): every
``DRAIN_SWEEP_S`` it gives each lease of a host cordoned by a drain that has no notice yet the drain's notice,
as the drain would have; running the drain again does the same at once.
"""
from __future__ import annotations

import asyncio
import logging

from coordinator import clock, errors
from coordinator.etcd.types import KV
from coordinator.host_records import CordonRecord
from coordinator.keys import last_segment
from coordinator.limits import quote
from coordinator.records import InvalidRecord, dumps, load_record
from coordinator.replica.context import ReplicaContext
from coordinator.replica.leases import Leases
from coordinator.txn import Delete, ModRevisionIs, Put, Range

log = logging.getLogger(__name__)

DRAIN_SWEEP_S = 2.0   # how often the leader finishes drains cut short


def stored_cordon(kv: KV | None) -> CordonRecord | None:
    """The cordon stored in ``kv``; None when there is none or it is malformed (a write replaces it)."""
    if kv is None:
        return None
    try:
        return CordonRecord.from_json(load_record(kv.value))
    except InvalidRecord:
        return None


class Cordons:
    def __init__(self, ctx: ReplicaContext, leases: Leases) -> None:
        self.ctx, self.leases = ctx, leases
        self.store, self.keys, self.config = ctx.store, ctx.keys, ctx.config

    async def _read(self, host: str) -> tuple[KV | None, int]:
        """The host's cordon key (None: absent) and its mod_revision; NOT_FOUND naming ``host`` when gpucoord
        has never seen the host (no registration, no GPU ledger, no cordon)."""
        snap = await self.store.snapshot([Range(self.keys.host(host)), Range(self.keys.cordon(host)),
                                          Range(self.keys.gpus(host), prefix=True, keys_only=True)])
        registered, cordon, ledgers = snap.ranges
        if not registered and not cordon and not ledgers:
            raise errors.NotFound(f"host: no host {quote(host)} ('gpucoord status' lists them)", "host")
        kv = cordon[0] if cordon else None
        return kv, kv.mod_revision if kv is not None else 0

    async def cordon(self, host: str, reason: str, drain: bool, grace_s: float,
                     asked_by: str) -> tuple[CordonRecord, bool, int, int]:
        """Cordon ``host`` (and with ``drain`` send the notices): (the record, created, leases on the host once
        it was written, notices sent). A cordoned host keeps its reason unless another is given, and stays a
        drain once drained. The fields are validated by the caller (``rpc.validate.cordon``)."""
        key = self.keys.cordon(host)
        for _ in range(self.config.commit_attempts):
            kv, revision = await self._read(host)
            old = stored_cordon(kv)
            record = CordonRecord(
                host=host, reason=reason or (old.reason if old is not None else ""), drain=drain or (old is not None and old.drain),
                grace_s=grace_s if drain else (old.grace_s if old is not None else 0.0), asked_by=asked_by,
                created_at=old.created_at if old is not None else clock.wall())
            res = await self.store.commit([ModRevisionIs(key, revision)], [Put(key, dumps(record.to_json()))])
            if res.succeeded:
                break
        else:
            raise errors.Unavailable("cordon: too much contention on the host's cordon; retry")
        # Read after the cordon committed: every lease granted before it, and none can be granted after it.
        lease_ids = sorted({last_segment(x.key) for x in (await self.store.get_prefix(self.keys.leases(host))).kvs})
        sent = 0
        if drain:
            for lease_id in lease_ids:
                try:
                    await self.leases.evict(lease_id, grace_s, "drain", asked_by)
                    sent += 1
                except errors.NotFound:
                    continue   # released meanwhile
            log.info("host %s drained by %s: %d eviction notices sent", host, asked_by or "an operator", sent)
        return record, kv is None, len(lease_ids), sent

    async def uncordon(self, host: str) -> bool:
        """Delete the cordon; False if the host was not cordoned."""
        key = self.keys.cordon(host)
        for _ in range(self.config.commit_attempts):
            kv, revision = await self._read(host)
            if kv is None:
                return False
            res = await self.store.commit([ModRevisionIs(key, revision)], [Delete(key)])
            if res.succeeded:
                return True
        raise errors.Unavailable("uncordon: too much contention on the host's cordon; retry")

    def unfinished(self) -> list[tuple[CordonRecord, str]]:
        """(the drain's cordon, lease id) for each lease of a host cordoned by a drain that has no eviction notice,
        as this replica's mirror shows them."""
        out = []
        for kv in self.ctx.mirror.items("cordons"):
            record = stored_cordon(kv)
            if record is None or not record.drain:
                continue
            for lease_id in sorted({last_segment(x.key) for x in self.ctx.mirror.host_items("leases", record.host)}):
                if self.ctx.mirror.get(self.keys.eviction(lease_id)) is None:
                    out.append((record, lease_id))
        return out

    async def finish_drains(self) -> None:
        """The leader's duty: send the notices a drain cut short did not (see the module's docstring). Notices
        are operator notices, idempotent per lease (``Leases.evict``), so racing a drain call is harmless."""
        while True:
            for record, lease_id in self.unfinished():
                try:
                    await self.leases.evict(lease_id, record.grace_s, "drain", record.asked_by)
                    log.info("drain of host %s: sent the notice it had not sent to lease %s", record.host, lease_id)
                except errors.NotFound:
                    continue   # released meanwhile
                except errors.GpucoordError as e:
                    log.warning("drain of host %s: could not send the notice to lease %s: %s", record.host,
                                lease_id, e)
            await asyncio.sleep(DRAIN_SWEEP_S)
