"""Sessions ended together (``coordinator/replica/ended_together.py``) against a real etcd: each session's keys,
as the mirror holds them, go in one revision shared with the others; a session one of whose keys was rewritten
after the mirror read it (its etcd lease may be another's now) is left to the revoke, its keys untouched."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from coordinator.config import CoordinatorConfig
from coordinator.etcd.store import Store
from coordinator.etcd.types import KV
from coordinator.keys import Keys
from coordinator.records import SessionInfo
from coordinator.replica.ended_together import delete_together
from coordinator.txn import Range
from tests.support.cluster import EtcdEndpoint
from tests.support.waiting import LoopThread


class _Mirror:
    """What the replica's mirror held when expiry decided: the keys as read then."""

    def __init__(self, kvs: list[KV]) -> None:
        self.kvs = kvs

    def on_etcd_leases(self, etcd_leases: set[int]) -> dict[int, list[KV]]:
        out: dict[int, list[KV]] = {}
        for kv in self.kvs:
            if kv.etcd_lease in etcd_leases:
                out.setdefault(kv.etcd_lease, []).append(kv)
        return out


def test_each_sessions_keys_go_in_one_shared_revision_and_one_rewritten_meanwhile_is_left_alone(
        etcd: EtcdEndpoint, prefix: str, lt: LoopThread) -> None:
    keys = Keys(prefix)

    async def go() -> None:
        async with Store(etcd.endpoints) as s:
            infos, owned = [], {}
            for i in range(6):
                etcd_lease = await s.grant(600)
                info = SessionInfo(f"a{i}", f"{etcd_lease:016x}", "h1", etcd_lease, 5)
                mine = [keys.session(info.agent, info.session_id), keys.lease("h1", "GPU-0", f"l{i}"),
                        keys.queue_entry("h1", f"{i:04d}-q{i}")]
                for k in mine:
                    await s.put(k, b"{}", etcd_lease)
                infos.append(info)
                owned[info.session_id] = mine
            snap = await s.snapshot([Range(keys.root(), prefix=True)])
            mirror = _Mirror(list(snap.ranges[0]))
            rewritten = owned[infos[2].session_id][1]
            await s.put(rewritten, b'{"rewritten": 1}', infos[2].etcd_lease)    # after the mirror's read
            ctx: Any = SimpleNamespace(keys=keys, config=CoordinatorConfig(etcd_max_txn_ops=16), mirror=mirror,
                                       store=s)
            before = (await s.snapshot([Range(keys.root(), prefix=True, keys_only=True)])).revision
            ended, left = await delete_together(ctx, infos)
            assert [i.session_id for i in left] == [infos[2].session_id]
            assert {i.session_id for i in ended} == {i.session_id for i in infos} - {infos[2].session_id}
            after = await s.snapshot([Range(k) for i in infos for k in owned[i.session_id]])
            for n, info in enumerate(infos):
                found = after.ranges[3 * n: 3 * n + 3]
                assert all(bool(r) == (info is infos[2]) for r in found), (info.agent, found)
            snap = await s.snapshot([Range(keys.root(), prefix=True)])
            assert {kv.key for kv in snap.ranges[0]} == set(owned[infos[2].session_id])
            # Each session's keys at one revision, several sessions at each (16 operations: 4 parts a transaction).
            deleted: dict[bytes, int] = {}
            async for batch in s.watch(keys.root(), start_revision=before + 1):
                deleted |= {ev.kv.key: ev.kv.mod_revision for ev in batch.events if ev.kind == "DELETE"}
                if len(deleted) == 3 * len(ended):
                    break
            at = {i.session_id: {deleted[k] for k in owned[i.session_id]} for i in ended}
            assert all(len(revisions) == 1 for revisions in at.values()), at
            assert len(set().union(*at.values())) < len(ended), at
    lt.run(go())


def test_more_sessions_than_one_etcd_transaction_takes_end_in_several(etcd: EtcdEndpoint, prefix: str,
                                                                      lt: LoopThread) -> None:
    """etcd's --max-txn-ops (128 by default) bounds a shared transaction's parts plus its widest part's operations."""
    keys = Keys(prefix)

    async def go() -> None:
        async with Store(etcd.endpoints) as s:
            infos = []
            for i in range(140):
                etcd_lease = await s.grant(600)
                info = SessionInfo(f"b{i}", f"{etcd_lease:016x}", "h1", etcd_lease, 5)
                await s.put(keys.session(info.agent, info.session_id), b"{}", etcd_lease)
                await s.put(keys.lease("h1", "GPU-0", f"l{i}"), b"{}", etcd_lease)
                infos.append(info)
            snap = await s.snapshot([Range(keys.root(), prefix=True)])
            mirror = _Mirror(list(snap.ranges[0]))
            ctx: Any = SimpleNamespace(keys=keys, config=CoordinatorConfig(), mirror=mirror, store=s)
            ended, left = await delete_together(ctx, infos)
            assert not left and len(ended) == len(infos)
            assert not (await s.snapshot([Range(keys.root(), prefix=True, keys_only=True)])).ranges[0]
    lt.run(go())
