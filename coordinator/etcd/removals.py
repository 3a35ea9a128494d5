"""Conditional deletes in batches: many keys (queue entries) removed in few transactions, each on its own
compares, with what happened to each.

etcd's transactions are all-or-nothing, so a batch whose compares all hold deletes every key of it (and
``prev_kv`` says what was deleted); one whose compares do not hold reads every key instead, so the caller
learns which changed and the others are tried again.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Sequence

from coordinator.etcd.contract import KVStore
from coordinator.etcd.types import KV, DeleteResult, GetResult, TxnResult
from coordinator.txn import Compare, Delete, Get, ModRevisionIs

# Each removal takes one compare (plus its own extra ones), one delete and one read: etcd's limit of 128 per
# transaction (--max-txn-ops) bounds how many go into one transaction.
REMOVALS_PER_TXN = 120


@dataclasses.dataclass(frozen=True)
class Removal:
    """Delete ``key`` if it was not written since ``mod_revision`` and every compare in ``also`` holds."""

    key: bytes
    mod_revision: int
    also: tuple[Compare, ...] = ()


@dataclasses.dataclass(frozen=True)
class RemovalOutcome:
    removed: KV | None   # the entry as it was when this call deleted it
    current: KV | None   # not removed: the entry as it is now (None: it is gone)


async def remove_entries(store: KVStore, removals: Sequence[Removal], common: Sequence[Compare] = (),
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
                compares += [ModRevisionIs(removals[i].key, removals[i].mod_revision), *removals[i].also]
            return await store.commit(compares, [Delete(removals[i].key, prev_kv=True) for i in chunk],
                                      [Get(removals[i].key) for i in chunk])
        results = await asyncio.gather(*(one(chunk) for chunk in chunks))
        todo = []
        for chunk, res in zip(chunks, results):
            for i, resp in zip(chunk, res.responses):
                if res.succeeded:
                    assert isinstance(resp, DeleteResult)
                    out[i] = RemovalOutcome(resp.prev[0] if resp.prev else None, None)
                    continue
                assert isinstance(resp, GetResult)
                current[i] = resp.kvs[0] if resp.kvs else None
                now = current[i]
                if now is not None and now.mod_revision == removals[i].mod_revision:
                    todo.append(i)     # unchanged: another entry (or an extra compare) failed the transaction
                else:
                    out[i] = RemovalOutcome(None, now)
    return [o if o is not None else RemovalOutcome(None, current.get(i)) for i, o in enumerate(out)]
