"""The typed vocabulary (``coordinator.txn``) compiled to etcd's protobuf messages, and etcd's answers back.

Private to ``coordinator/etcd/``: the only place, with the store, that knows etcd's messages. aetcd ships no
type stubs, so mypy cannot check the messages themselves (``rpc.X`` below names them for the reader); what
goes in and what comes out is typed.
"""
from __future__ import annotations

from typing import Iterable, Protocol, assert_never

from aetcd import rpc

from coordinator.etcd.types import (
    KV,
    DeleteResult,
    GetResult,
    NestedResult,
    OpResult,
    PutResult,
)
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
    Range,
    Txn,
)


class PbKV(Protocol):
    """etcd's ``mvccpb.KeyValue``, as far as gpucoord reads it."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


_new = object.__new__
_set = object.__setattr__


def kv(pb: PbKV) -> KV:
    """The ``KV`` of an etcd key: every key read or watched goes through here (200,000 in a replica's first read at
    100,000 leases). Its fields are set in one step: a frozen dataclass's ``__init__`` sets each one through
    ``object.__setattr__`` (1.06 against 0.71 µs a key)."""
    out = _new(KV)
    _set(out, "__dict__", {"key": pb.key, "value": pb.value, "create_revision": pb.create_revision,
                           "mod_revision": pb.mod_revision, "version": pb.version, "etcd_lease": pb.lease})
    return out


def range_request(r: Range) -> rpc.RangeRequest:
    """etcd's ``RangeRequest`` for a read."""
    req = rpc.RangeRequest(key=r.key, keys_only=r.keys_only)
    if r.prefix:
        req.range_end = prefix_range_end(r.key)
    elif r.until:
        req.range_end = r.until
    return req


def compare(c: Compare) -> rpc.Compare:
    """etcd's ``Compare`` for a compare of ``coordinator.txn``."""
    if isinstance(c, ModRevisionIs):
        return rpc.Compare(key=c.key, target=rpc.Compare.MOD, result=rpc.Compare.EQUAL, mod_revision=c.mod_revision)
    if isinstance(c, Exists):
        return rpc.Compare(key=c.key, target=rpc.Compare.VERSION, result=rpc.Compare.GREATER, version=0)
    if isinstance(c, Absent):
        return rpc.Compare(key=c.key, target=rpc.Compare.VERSION, result=rpc.Compare.EQUAL, version=0)
    if isinstance(c, NothingWrittenSince):
        # MOD < revision + 1 over the whole prefix: no key under it created or modified after ``revision``.
        return rpc.Compare(key=c.prefix, range_end=prefix_range_end(c.prefix), target=rpc.Compare.MOD,
                           result=rpc.Compare.LESS, mod_revision=c.revision + 1)
    if isinstance(c, CreateRevisionIs):
        return rpc.Compare(key=c.key, target=rpc.Compare.CREATE, result=rpc.Compare.EQUAL,
                           create_revision=c.create_revision)
    if isinstance(c, LeaseIs):
        return rpc.Compare(key=c.key, target=rpc.Compare.LEASE, result=rpc.Compare.EQUAL, lease=c.etcd_lease)
    assert_never(c)


def op(o: Op) -> rpc.RequestOp:
    """etcd's ``RequestOp`` for an operation of ``coordinator.txn``."""
    if isinstance(o, Put):
        return rpc.RequestOp(request_put=rpc.PutRequest(key=o.key, value=o.value, lease=o.etcd_lease))
    if isinstance(o, Delete):
        d = rpc.DeleteRangeRequest(key=o.key, prev_kv=o.prev_kv)
        if o.prefix:
            d.range_end = prefix_range_end(o.key)
        return rpc.RequestOp(request_delete_range=d)
    if isinstance(o, Get):
        return rpc.RequestOp(request_range=range_request(Range(o.key)))
    if isinstance(o, Txn):
        return rpc.RequestOp(request_txn=txn_request(o.compares, o.success, o.failure))
    assert_never(o)


def txn_request(compares: Iterable[Compare], success: Iterable[Op], failure: Iterable[Op] = ()) -> rpc.TxnRequest:
    """etcd's ``TxnRequest``: one compiled message per compare and operation, in order (1:1, so the
    callers' budgets of operations per transaction hold)."""
    return rpc.TxnRequest(compare=[compare(c) for c in compares], success=[op(o) for o in success],
                          failure=[op(o) for o in failure])


def result(pb: rpc.ResponseOp) -> OpResult:
    """The typed answer for etcd's ``ResponseOp``."""
    kind = pb.WhichOneof("response")
    if kind == "response_range":
        return GetResult(tuple(kv(x) for x in pb.response_range.kvs))
    if kind == "response_delete_range":
        d = pb.response_delete_range
        return DeleteResult(int(d.deleted), tuple(kv(x) for x in d.prev_kvs))
    if kind == "response_txn":
        t = pb.response_txn
        return NestedResult(bool(t.succeeded), tuple(result(r) for r in t.responses))
    return PutResult()
