"""Builders of etcd requests: ranges, puts, deletes and the compares of a transaction.

The only place, with the store, that knows etcd's protobuf messages: callers build their transactions from
these and hand them to ``Store.commit`` / ``Store.snapshot``.
"""
from __future__ import annotations

from typing import Any, Sequence

from aetcd import rpc

from coordinator.etcd import _compile
from coordinator.keys import prefix_range_end
from coordinator.txn import Compare, Op


def range_req(key: bytes, prefix: bool = False, keys_only: bool = False) -> Any:
    r = rpc.RangeRequest(key=key, keys_only=keys_only)
    if prefix:
        r.range_end = prefix_range_end(key)
    return r


def op_get(key: bytes, prefix: bool = False) -> Any:
    return rpc.RequestOp(request_range=range_req(key, prefix))


def op_put(key: bytes, value: bytes, etcd_lease: int = 0) -> Any:
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=etcd_lease))


def op_delete(key: bytes, prefix: bool = False, prev_kv: bool = False) -> Any:
    d = rpc.DeleteRangeRequest(key=key, prev_kv=prev_kv)
    if prefix:
        d.range_end = prefix_range_end(key)
    return rpc.RequestOp(request_delete_range=d)


def cmp_mod_revision(key: bytes, mod_revision: int) -> Any:
    """True while ``key`` was not written since ``mod_revision`` (0: while it does not exist)."""
    return rpc.Compare(key=key, target=rpc.Compare.MOD, result=rpc.Compare.EQUAL, mod_revision=mod_revision)


def cmp_exists(key: bytes) -> Any:
    return rpc.Compare(key=key, target=rpc.Compare.VERSION, result=rpc.Compare.GREATER, version=0)


def cmp_absent(key: bytes) -> Any:
    return rpc.Compare(key=key, target=rpc.Compare.VERSION, result=rpc.Compare.EQUAL, version=0)


def cmp_lease(key: bytes, etcd_lease: int) -> Any:
    """True while ``key`` exists on ``etcd_lease`` (an absent key compares as etcd_lease 0)."""
    return rpc.Compare(key=key, target=rpc.Compare.LEASE, result=rpc.Compare.EQUAL, lease=etcd_lease)


def op_txn(compares: Sequence[Any], success: Sequence[Any], failure: Sequence[Any] = ()) -> Any:
    """A transaction nested in another one's branch: how one transaction says "A, or else B"."""
    return rpc.RequestOp(request_txn=rpc.TxnRequest(compare=list(compares), success=list(success),
                                                    failure=list(failure)))


def cmp_range_unchanged(prefix: bytes, revision: int) -> Any:
    """True while no key under ``prefix`` was created or modified after ``revision``."""
    return rpc.Compare(key=prefix, range_end=prefix_range_end(prefix), target=rpc.Compare.MOD,
                       result=rpc.Compare.LESS, mod_revision=revision + 1)


def cmp_create_revision(key: bytes, create_revision: int) -> Any:
    """True while ``key`` is the very key created at ``create_revision`` (not deleted and written again)."""
    return rpc.Compare(key=key, target=rpc.Compare.CREATE, result=rpc.Compare.EQUAL, create_revision=create_revision)


def compile_compare(c: Compare) -> Any:
    """etcd's message for a compare of ``coordinator.txn``."""
    return _compile.compare(c)


def compile_op(o: Op) -> Any:
    """etcd's message for an operation of ``coordinator.txn``."""
    return _compile.op(o)
