"""Group commit of releases: a batch never passes etcd's --max-txn-ops (128) in compares or operations, whatever
mix of single-GPU and gang releases is pending (a gang's release compares and deletes every GPU's record)."""
from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.replica.release_batch import OPS_PER_TXN, _take_batch
from coordinator.txn import Delete, ModRevisionIs


def release(gpus: int) -> tuple[list[ModRevisionIs], list[Delete], asyncio.Future[bool]]:
    """A release of a lease on ``gpus`` GPUs: its notice and every GPU's record, each compared and deleted."""
    keys = [f"k{i}".encode() for i in range(gpus + 1)]
    loop = asyncio.new_event_loop()
    try:
        future: asyncio.Future[bool] = loop.create_future()
    finally:
        loop.close()
    return [ModRevisionIs(k, 1) for k in keys], [Delete(k) for k in keys], future


def test_single_gpu_releases_fill_one_transaction() -> None:
    pending = [release(1) for _ in range(60)]
    batch = _take_batch(pending)
    assert len(batch) == OPS_PER_TXN // 2 and len(pending) == 60 - len(batch)


def test_eight_gpu_gang_releases_are_split_under_the_ops_limit() -> None:
    pending = [release(8) for _ in range(48)]
    batch = _take_batch(pending)
    assert len(batch) == OPS_PER_TXN // 9
    assert sum(len(ops) for _, ops, _ in batch) <= OPS_PER_TXN


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=8), min_size=1, max_size=80))
def test_every_batch_fits_and_every_release_is_taken_once_in_order(sizes: list[int]) -> None:
    pending = [release(n) for n in sizes]
    originals = list(pending)
    taken = []
    while pending:
        batch = _take_batch(pending)
        assert batch, "a batch takes at least one release"
        assert sum(len(cs) for cs, _, _ in batch) <= OPS_PER_TXN
        assert sum(len(ops) for _, ops, _ in batch) <= OPS_PER_TXN
        taken.extend(batch)
    assert taken == originals
