"""Which transactions may share one etcd transaction, each nested in its branch (``shared_commits.py``): pure.

etcd evaluates every compare of a transaction, nested ones included, against the store as it was before the
transaction, then applies the branches it chose in order, all at one revision. Transactions nested in one
outer transaction are therefore executed as if one after the other, in some order, only when none of them
writes what another one reads or writes: if A writes a key that B compares, B's compare saw the key before
A's write, which no serial order gives (two grants each comparing the other's key would both pass: write
skew). So a transaction joins a shared one only when its writes touch nothing the others read or write, and
its reads touch nothing they write. That also keeps etcd's own rule (no key put twice, no put inside a
delete's range, across the nested branches: "duplicate key given in txn request").

etcd's operations limit counts nested transactions against what their parent leaves: a transaction with ``n``
operations (the largest of its compares, its success and its failure operations) gives each transaction
nested in it ``limit - n`` (etcd's ``checkTxnRequest``). A shared transaction of ``n`` parts fits when
``n + need`` of every part is within the limit.
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Iterable, Sequence

from coordinator.keys import prefix_range_end
from coordinator.txn import (
    Absent,
    Compare,
    CreateRevisionIs,
    Delete,
    Exists,
    Get,
    LeaseIs,
    ModRevisionIs,
    NothingWrittenSince,
    Op,
    Put,
    Txn,
)

# A key range [start, end) of a prefix; single keys are kept as keys.
Span = tuple[bytes, bytes]


@dataclasses.dataclass(frozen=True)
class Footprint:
    """What a transaction reads (its compares, its gets) and writes (its puts and deletes), in both branches,
    nested transactions included, as single keys and as prefix ranges; ``need`` is the operations limit it
    needs (etcd's count, see the module) and ``size`` its keys' and values' bytes."""

    read_keys: frozenset[bytes]
    read_ranges: tuple[Span, ...]
    write_keys: frozenset[bytes]
    write_ranges: tuple[Span, ...]
    need: int
    size: int


class _Walk:
    def __init__(self) -> None:
        self.read_keys: set[bytes] = set()
        self.write_keys: set[bytes] = set()
        self.read_ranges: list[Span] = []
        self.write_ranges: list[Span] = []
        self.size = 0

    def compare(self, c: Compare) -> None:
        if isinstance(c, NothingWrittenSince):
            self.read_ranges.append((c.prefix, prefix_range_end(c.prefix)))
            self.size += len(c.prefix)
        elif isinstance(c, (ModRevisionIs, Exists, Absent, CreateRevisionIs, LeaseIs)):
            self.read_keys.add(c.key)
            self.size += len(c.key)
        else:
            raise TypeError(f"unknown compare {c!r}")

    def txn(self, compares: Sequence[Compare], ops: Iterable[Op]) -> int:
        """Adds ``compares`` and ``ops`` (nested ones included); returns the operations limit their nested
        transactions need beyond this level."""
        for c in compares:
            self.compare(c)
        deepest = 0
        for op in ops:
            if isinstance(op, Put):
                self.write_keys.add(op.key)
                self.size += len(op.key) + len(op.value)
            elif isinstance(op, Delete):
                if op.prefix:
                    self.write_ranges.append((op.key, prefix_range_end(op.key)))
                else:
                    self.write_keys.add(op.key)
                self.size += len(op.key)
            elif isinstance(op, Get):
                self.read_keys.add(op.key)
                self.size += len(op.key)
            elif isinstance(op, Txn):
                inner = self.txn(op.compares, (*op.success, *op.failure))
                deepest = max(deepest, _count(op.compares, op.success, op.failure) + inner)
            else:
                raise TypeError(f"unknown operation {op!r}")
        return deepest


def _count(compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op]) -> int:
    return max(len(compares), len(success), len(failure))


def footprint(compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()) -> Footprint:
    w = _Walk()
    deeper = w.txn(compares, (*success, *failure))
    return Footprint(frozenset(w.read_keys), tuple(w.read_ranges), frozenset(w.write_keys), tuple(w.write_ranges),
                     _count(compares, success, failure) + deeper, w.size)


class _Touched:
    """Keys and prefix ranges, answering "does this key, or this range, touch any of them"."""

    def __init__(self) -> None:
        self._keys: set[bytes] = set()
        self._sorted: list[bytes] = []
        self._ranges: list[Span] = []

    def add(self, keys: Iterable[bytes], ranges: Iterable[Span]) -> None:
        for k in keys:
            if k not in self._keys:
                self._keys.add(k)
                bisect.insort(self._sorted, k)
        self._ranges.extend(ranges)

    def key(self, k: bytes) -> bool:
        return k in self._keys or any(s <= k < e for s, e in self._ranges)

    def range(self, span: Span) -> bool:
        start, end = span
        i = bisect.bisect_left(self._sorted, start)
        if i < len(self._sorted) and self._sorted[i] < end:
            return True
        return any(s < end and start < e for s, e in self._ranges)

    def any_of(self, keys: Iterable[bytes], ranges: Iterable[Span]) -> bool:
        return any(self.key(k) for k in keys) or any(self.range(r) for r in ranges)


def share(parts: Sequence[Footprint], max_txn_ops: int, max_parts: int, max_bytes: int) -> list[int]:
    """The indices of ``parts`` (in their order; the first always) that may share one etcd transaction: none
    writes what another reads or writes, and together they fit etcd's operations limit (``max_txn_ops``),
    ``max_parts`` and ``max_bytes``. A part that cannot join is left for a later transaction."""
    if not parts:
        return []
    chosen = [0]
    reads, writes = _Touched(), _Touched()
    reads.add(parts[0].read_keys, parts[0].read_ranges)
    writes.add(parts[0].write_keys, parts[0].write_ranges)
    need, size = parts[0].need, parts[0].size
    for i in range(1, len(parts)):
        if len(chosen) >= max_parts:
            break
        p = parts[i]
        if len(chosen) + 1 + max(need, p.need) > max_txn_ops or size + p.size > max_bytes:
            continue
        if (writes.any_of(p.read_keys, p.read_ranges) or writes.any_of(p.write_keys, p.write_ranges)
                or reads.any_of(p.write_keys, p.write_ranges)):
            continue
        chosen.append(i)
        reads.add(p.read_keys, p.read_ranges)
        writes.add(p.write_keys, p.write_ranges)
        need, size = max(need, p.need), size + p.size
    return chosen
