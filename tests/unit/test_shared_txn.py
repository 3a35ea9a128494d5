"""Which transactions may share one etcd transaction (``coordinator/etcd/sharing.py``): never two where one
writes what the other reads or writes (etcd evaluates every nested compare before any write: sharing them
would let both of a write-skew pair pass), and never past etcd's operations limit as it counts nested ones."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.etcd.sharing import Footprint, footprint, share
from coordinator.txn import Delete, Get, ModRevisionIs, NothingWrittenSince, Put, Txn

BIG = 10**9


def test_two_grants_on_different_hosts_share() -> None:
    a = footprint([ModRevisionIs(b"/h/a/ledger", 3)], [Put(b"/h/a/ledger", b"1"), Put(b"/h/a/lease/1", b"x")])
    b = footprint([ModRevisionIs(b"/h/b/ledger", 4)], [Put(b"/h/b/ledger", b"1"), Put(b"/h/b/lease/2", b"x")])
    assert share([a, b], 128, 64, BIG) == [0, 1]


def test_both_halves_of_a_write_skew_pair_never_share() -> None:
    """Each compares both keys and writes one: alone, the second fails; shared, both would pass."""
    x = footprint([ModRevisionIs(b"x", 1), ModRevisionIs(b"y", 1)], [Put(b"x", b"1")])
    y = footprint([ModRevisionIs(b"x", 1), ModRevisionIs(b"y", 1)], [Put(b"y", b"1")])
    assert share([x, y], 128, 64, BIG) == [0]
    assert share([y, x], 128, 64, BIG) == [0]


def test_a_put_under_another_parts_prefix_delete_or_prefix_compare_does_not_share() -> None:
    put = footprint([], [Put(b"/q/h/1", b"")])
    assert share([footprint([], [Delete(b"/q/h/", prefix=True)]), put], 128, 64, BIG) == [0]
    assert share([footprint([NothingWrittenSince(b"/q/", 5)], [Put(b"/other", b"")]), put], 128, 64, BIG) == [0]
    assert share([put, footprint([], [Delete(b"/q/", prefix=True)])], 128, 64, BIG) == [0]
    assert share([put, footprint([], [Delete(b"/q/h/2")])], 128, 64, BIG) == [0, 1]


def test_reads_in_common_share() -> None:
    """Releases on one host all compare its usage report: reading the same key is no conflict."""
    parts = [footprint([ModRevisionIs(b"/usage/a", 9), ModRevisionIs(f"/l/{i}".encode(), 2)],
                       [Delete(f"/l/{i}".encode())]) for i in range(5)]
    assert share(parts, 128, 64, BIG) == [0, 1, 2, 3, 4]


def test_nested_transactions_count_against_the_limit_as_etcd_counts_them() -> None:
    inner = Txn((ModRevisionIs(b"k", 1),), (Put(b"k", b""),), (Get(b"k"),))
    fp = footprint([ModRevisionIs(b"a", 1)] * 3, [Put(b"a", b"")], [inner])
    assert fp.need == 3 + 1
    assert b"k" in fp.write_keys and b"k" in fp.read_keys


def test_the_operations_limit_caps_the_parts() -> None:
    parts = [footprint([ModRevisionIs(f"c{i}".encode(), 1)] * 10, [Put(f"p{i}".encode(), b"")]) for i in range(50)]
    chosen = share(parts, 40, 64, BIG)
    assert len(chosen) == 30          # 30 nested transactions leave each of them 10
    assert share(parts, 128, 7, BIG) == list(range(7))
    assert share(parts, 128, 64, 3 * parts[0].size) == [0, 1, 2]


KEYS = [b"a", b"b", b"c", b"d", b"e"]
ops = st.one_of(st.sampled_from(KEYS).map(lambda k: Put(k, b"")), st.sampled_from(KEYS).map(Delete),
                st.sampled_from([b"a", b"d"]).map(lambda k: Delete(k, prefix=True)))
compares = st.one_of(st.sampled_from(KEYS).map(lambda k: ModRevisionIs(k, 1)),
                     st.sampled_from([b"a", b"b"]).map(lambda k: NothingWrittenSince(k, 1)))
txns = st.tuples(st.lists(compares, max_size=3), st.lists(ops, min_size=1, max_size=3))


def _touches(a: Footprint, b: Footprint) -> bool:
    """Brute force: whether ``a`` writes something ``b`` reads or writes, over every key that exists."""
    universe = [k + s for k in KEYS for s in (b"", b"x")]

    def hit(keys: frozenset[bytes], ranges: tuple[tuple[bytes, bytes], ...]) -> set[bytes]:
        return {k for k in universe if k in keys or any(s <= k < e for s, e in ranges)}
    written = hit(a.write_keys, a.write_ranges)
    return bool(written & (hit(b.read_keys, b.read_ranges) | hit(b.write_keys, b.write_ranges)))


@settings(max_examples=400, deadline=None)
@given(st.lists(txns, min_size=1, max_size=12), st.integers(min_value=1, max_value=12))
def test_shared_parts_never_touch_each_others_writes_and_a_part_left_out_had_a_reason(
        parts: list[tuple[list[ModRevisionIs], list[Put]]], max_parts: int) -> None:
    fps = [footprint(c, o) for c, o in parts]
    chosen = share(fps, 128, max_parts, BIG)
    assert chosen[0] == 0 and chosen == sorted(set(chosen)) and len(chosen) <= max_parts
    for i in chosen:
        for j in chosen:
            if i != j:
                assert not _touches(fps[i], fps[j]), (parts[i], parts[j])
    if len(chosen) < max_parts:     # never full: each part left out touches one taken before it
        for i in range(len(fps)):
            if i not in chosen:
                assert any(_touches(fps[i], fps[j]) or _touches(fps[j], fps[i]) for j in chosen if j < i)
