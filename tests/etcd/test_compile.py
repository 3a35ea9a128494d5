"""The typed vocabulary compiles to exactly the etcd messages the old builders (``etcd/ops.py``) made.

No etcd: each expected message is written out field by field, as ``ops.py`` built it before it was removed.
The compares here carry guarantees: ``NothingWrittenSince`` is G1's "no queue write since the view" (an
off-by-one lets a concurrent queue write through), ``CreateRevisionIs`` is a leader's fence (G5),
``LeaseIs`` the daemon's one-registration-per-host. This file may import aetcd and ``etcd._compile``:
it checks the raw messages themselves (tests/static/test_layers.py allows it by name).
"""
from __future__ import annotations

import dataclasses

import pytest
from aetcd import rpc
from hypothesis import given
from hypothesis import strategies as st

from coordinator.etcd import _compile
from coordinator.etcd.types import KV, DeleteResult, GetResult, NestedResult, PutResult
from coordinator.keys import prefix_range_end
from coordinator.txn import (
    Absent,
    CreateRevisionIs,
    Delete,
    Exists,
    Get,
    LeaseIs,
    ModRevisionIs,
    NothingWrittenSince,
    Put,
    Range,
    Txn,
    has_write,
)

pytestmark = pytest.mark.unit

K = b"/gpucoord/t/queue/h1/"


def _same(a: object, b: object) -> None:
    # protobuf equality is field by field; the serialized form also pins the defaults left unset.
    assert a == b, f"{a}\n!=\n{b}"
    assert a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)  # type: ignore[attr-defined]


@pytest.mark.parametrize("typed, expected", [
    (ModRevisionIs(K, 17), rpc.Compare(key=K, target=rpc.Compare.MOD, result=rpc.Compare.EQUAL, mod_revision=17)),
    (ModRevisionIs(K, 0), rpc.Compare(key=K, target=rpc.Compare.MOD, result=rpc.Compare.EQUAL, mod_revision=0)),
    (Exists(K), rpc.Compare(key=K, target=rpc.Compare.VERSION, result=rpc.Compare.GREATER, version=0)),
    (Absent(K), rpc.Compare(key=K, target=rpc.Compare.VERSION, result=rpc.Compare.EQUAL, version=0)),
    # G1: no key under the queue prefix created or modified after the view's revision: MOD < rev + 1.
    (NothingWrittenSince(K, 41), rpc.Compare(key=K, range_end=prefix_range_end(K), target=rpc.Compare.MOD,
                                             result=rpc.Compare.LESS, mod_revision=42)),
    # G5: the leader's fence, the candidacy key's CREATE revision.
    (CreateRevisionIs(K, 9), rpc.Compare(key=K, target=rpc.Compare.CREATE, result=rpc.Compare.EQUAL,
                                         create_revision=9)),
    (CreateRevisionIs(K, 0), rpc.Compare(key=K, target=rpc.Compare.CREATE, result=rpc.Compare.EQUAL,
                                         create_revision=0)),
    (LeaseIs(K, 0x1234), rpc.Compare(key=K, target=rpc.Compare.LEASE, result=rpc.Compare.EQUAL, lease=0x1234)),
])
def test_each_compare_compiles_to_the_message_the_old_builder_made(typed: object, expected: object) -> None:
    _same(_compile.compare(typed), expected)  # type: ignore[arg-type]


def test_nothing_written_since_covers_the_whole_prefix_and_the_revision_after_the_view() -> None:
    c = _compile.compare(NothingWrittenSince(b"/p/", 100))
    assert c.range_end == b"/p0"
    assert c.target == rpc.Compare.MOD and c.result == rpc.Compare.LESS and c.mod_revision == 101


@pytest.mark.parametrize("typed, expected", [
    (Put(K, b"v"), rpc.RequestOp(request_put=rpc.PutRequest(key=K, value=b"v", lease=0))),
    (Put(K, b"v", 77), rpc.RequestOp(request_put=rpc.PutRequest(key=K, value=b"v", lease=77))),
    (Delete(K), rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=K, prev_kv=False))),
    (Delete(K, prev_kv=True), rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=K, prev_kv=True))),
    (Delete(K, prefix=True), rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(
        key=K, range_end=prefix_range_end(K), prev_kv=False))),
    (Get(K), rpc.RequestOp(request_range=rpc.RangeRequest(key=K, keys_only=False))),
])
def test_each_op_compiles_to_the_message_the_old_builder_made(typed: object, expected: object) -> None:
    _same(_compile.op(typed), expected)  # type: ignore[arg-type]


def test_a_nested_txn_compiles_to_the_daemons_registration_message() -> None:
    put = Put(K, b"me", 5)
    typed = Txn((Absent(K),), (put,), (Get(K),))
    expected = rpc.RequestOp(request_txn=rpc.TxnRequest(
        compare=[rpc.Compare(key=K, target=rpc.Compare.VERSION, result=rpc.Compare.EQUAL, version=0)],
        success=[rpc.RequestOp(request_put=rpc.PutRequest(key=K, value=b"me", lease=5))],
        failure=[rpc.RequestOp(request_range=rpc.RangeRequest(key=K, keys_only=False))]))
    _same(_compile.op(typed), expected)


@pytest.mark.parametrize("typed, expected", [
    (Range(K), rpc.RangeRequest(key=K, keys_only=False)),
    (Range(K, prefix=True), rpc.RangeRequest(key=K, range_end=prefix_range_end(K), keys_only=False)),
    # keys_only reaches etcd: the leader's read of hosts/ and coordinators/ must not carry every value.
    (Range(K, prefix=True, keys_only=True), rpc.RangeRequest(key=K, range_end=prefix_range_end(K), keys_only=True)),
])
def test_each_range_compiles_to_the_request_the_old_builder_made(typed: Range, expected: object) -> None:
    _same(_compile.range_request(typed), expected)


def test_a_transaction_compiles_one_message_per_compare_and_op_in_order() -> None:
    compares = [ModRevisionIs(b"a", 1), NothingWrittenSince(b"q/", 5), CreateRevisionIs(b"c", 3)]
    success = [Put(b"a", b"1"), Delete(b"b")]
    req = _compile.txn_request(compares, success, [Get(b"a")])
    assert list(req.compare) == [_compile.compare(c) for c in compares]
    assert list(req.success) == [_compile.op(o) for o in success]
    assert list(req.failure) == [_compile.op(Get(b"a"))]


def test_responses_come_back_typed() -> None:
    pb_kv = rpc.KeyValue(key=b"k", value=b"v", create_revision=2, mod_revision=3, version=1, lease=9)
    typed_kv = KV(b"k", b"v", 2, 3, 1, 9)
    assert _compile.kv(pb_kv) == typed_kv
    assert _compile.result(rpc.ResponseOp(response_put=rpc.PutResponse())) == PutResult()
    assert _compile.result(rpc.ResponseOp(response_range=rpc.RangeResponse(kvs=[pb_kv]))) == GetResult((typed_kv,))
    assert _compile.result(rpc.ResponseOp(response_range=rpc.RangeResponse())) == GetResult(())
    assert _compile.result(rpc.ResponseOp(response_delete_range=rpc.DeleteRangeResponse(
        deleted=1, prev_kvs=[pb_kv]))) == DeleteResult(1, (typed_kv,))
    nested = rpc.ResponseOp(response_txn=rpc.TxnResponse(succeeded=False, responses=[
        rpc.ResponseOp(response_range=rpc.RangeResponse(kvs=[pb_kv]))]))
    assert _compile.result(nested) == NestedResult(False, (GetResult((typed_kv,)),))


def test_a_branch_of_reads_alone_is_not_a_write() -> None:
    # No read-only Txn is ever sent (etcd#14110): nested transactions of reads do not count as writes.
    assert not has_write([Get(b"a"), Txn((Absent(b"a"),), (Get(b"a"),), (Txn((), (Get(b"b"),)),))])
    assert has_write([Get(b"a"), Txn((Absent(b"a"),), (Get(b"a"),), (Txn((), (Delete(b"b"),)),))])
    assert has_write([Put(b"a", b"")])


@given(st.binary(max_size=20), st.binary(max_size=40), st.integers(0, 1 << 62), st.integers(0, 1 << 62),
       st.integers(0, 1 << 40), st.integers(0, 1 << 62))
def test_a_key_read_is_the_kv_its_constructor_makes_and_stays_frozen(key: bytes, value: bytes, create: int, mod: int,
                                                                     version: int, lease: int) -> None:
    """``_compile.kv`` builds a ``KV`` without its ``__init__``: the same object in every way that shows."""
    got = _compile.kv(rpc.KeyValue(key=key, value=value, create_revision=create, mod_revision=mod, version=version,
                                   lease=lease))
    want = KV(key, value, create, mod, version, lease)
    assert got == want and hash(got) == hash(want) and repr(got) == repr(want)
    assert dataclasses.astuple(got) == dataclasses.astuple(want)
    with pytest.raises(dataclasses.FrozenInstanceError):
        got.value = b"x"    # type: ignore[misc]
