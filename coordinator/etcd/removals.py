"""Conditional deletes in batches: many keys (queue entries) removed in few transactions, each on its own
compares, with what happened to each.

etcd's transactions are all-or-nothing, so a batch whose compares all hold deletes every key of it (and
``prev_kv`` says what was deleted); one whose compares do not hold reads every key instead, so the caller
learns which changed and the others are tried again.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Sequence

from aetcd import rpc

from coordinator.etcd.contract import KVStore
from coordinator.etcd.ops import cmp_mod_revision, op_delete, range_req
from coordinator.etcd.types import KV, TxnResult

# Each removal takes one compare (plus its own extra ones), one delete and one read: etcd's limit of 128 per
# transaction (--max-txn-ops) bounds how many go into one transaction.
REMOVALS_PER_TXN = 120


@dataclasses.dataclass(frozen=True)
class Removal:
    """Delete ``key`` if it was not written since ``mod_revision`` and every compare in ``also`` holds."""

    key: bytes
    mod_revision: int
    also: tuple[Any, ...] = ()


@dataclasses.dataclass(frozen=True)
class RemovalOutcome:
    removed: KV | None   # the entry as it was when this call deleted it
    current: KV | None   # not removed: the entry as it is now (None: it is gone)


async def remove_entries(store: KVStore, removals: Sequence[Removal], common: Sequence[Any] = (),
                         attempts: int = 3) -> list[RemovalOutcome]:
    """Remove many keys in few transactions, each key only if its compares hold.

    ``common`` compares go into every transaction once (a leader's fence). One transaction per
    ``REMOVALS_PER_TXN`` entries (run concurrently): it compares every entry and deletes them all, or, if
    any compare fails, reads them all. An entry that changed is reported with its
    current value; the others of that transaction are tried again (at most ``attempts`` times in all).
    Raises what ``Store.commit`` raises (then some entries may be gone, and a caller that tries again sees
    them as gone).
    """
    out: list[RemovalOutcome | None] = [None] * len(removals)
    current: dict[int, KV | None] = {}
    budget = REMOVALS_PER_TXN - len(common)
    todo = list(range(len(removals)))
    for _ in range(attempts):
        if not todo:
            break
        chunks: list[list[int]] = []
        size = 0
        for i in todo:
            cost = 1 + len(removals[i].also)
            if not chunks or size + cost > budget:
                chunks.append([])
                size = 0
            chunks[-1].append(i)
            size += cost

        async def one(chunk: list[int]) -> TxnResult:
            compares = list(common)
            for i in chunk:
                compares += [cmp_mod_revision(removals[i].key, removals[i].mod_revision), *removals[i].also]
            return await store.commit(compares, [op_delete(removals[i].key, prev_kv=True) for i in chunk],
                                      [rpc.RequestOp(request_range=range_req(removals[i].key)) for i in chunk])
        results = await asyncio.gather(*(one(chunk) for chunk in chunks))
        todo = []
        for chunk, res in zip(chunks, results):
            for i, resp in zip(chunk, res.responses):
                if res.succeeded:
                    prev = resp.response_delete_range.prev_kvs
                    out[i] = RemovalOutcome(KV.from_pb(prev[0]) if prev else None, None)
                    continue
                kvs = resp.response_range.kvs
                current[i] = KV.from_pb(kvs[0]) if kvs else None
                now = current[i]
                if now is not None and now.mod_revision == removals[i].mod_revision:
                    todo.append(i)     # unchanged: another entry (or an extra compare) failed the transaction
                else:
                    out[i] = RemovalOutcome(None, now)
    return [o if o is not None else RemovalOutcome(None, current.get(i)) for i, o in enumerate(out)]
