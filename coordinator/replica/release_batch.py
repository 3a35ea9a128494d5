"""Group commit of releases (``Leases.release``): one transaction for the releases that arrive together."""
from __future__ import annotations

import asyncio
from typing import Sequence

from coordinator.aio import spawn
from coordinator.etcd.store import Store
from coordinator.txn import Compare, Delete, Op, Put

# A group commit holds releases while its compares and its operations each stay within this many: etcd refuses a
# transaction with more than 128 of either (its default --max-txn-ops). A single-GPU release is two or three
# compares and two deletes (48 of them fit); a gang's release compares and deletes every GPU's record, so fewer
# fit. A release that alone is over the budget is committed alone.
OPS_PER_TXN = 120


class ReleaseCommits:
    """Group commit of releases: the releases that arrive while one transaction is in flight are committed
    together in the next one, which compares every lease's mod_revision. When any compare fails (rare: a
    lease changed since it was read), each release of that batch is committed alone, so that one lost
    compare costs the others nothing but a second round trip."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._pending: list[tuple[Sequence[Compare], Sequence[Op], asyncio.Future[bool]]] = []
        self._task: asyncio.Task[None] | None = None

    async def commit(self, compares: Sequence[Compare], ops: Sequence[Op]) -> bool:
        """Whether ``compares`` held and ``ops`` were committed (the same answer as a transaction of its own)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        # A caller that went away (its RPC cancelled) leaves the outcome to nobody: retrieved here, so that
        # an error (OutcomeUnknown while etcd is out of reach) is not reported as never retrieved.
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._pending.append((compares, ops, future))
        if self._task is None or self._task.done():
            self._task = spawn(self._flush(), "batched releases")
        return await asyncio.shield(future)

    async def _flush(self) -> None:
        while self._pending:
            batch = _take_batch(self._pending)
            try:
                # etcd refuses a transaction that writes a key twice (the same release retried while the
                # first is pending): such a batch is committed one release at a time. (Compares may repeat a
                # key: releases on one host all compare its usage report.)
                keys = [_op_key(op) for _, ops, _ in batch for op in ops]
                if len(batch) > 1 and len(set(keys)) == len(keys):
                    res = await self.store.commit([c for cs, _, _ in batch for c in cs],
                                                  [op for _, ops, _ in batch for op in ops])
                    if res.succeeded:
                        for _, _, future in batch:
                            if not future.done():
                                future.set_result(True)
                        continue
                outcomes = await asyncio.gather(*(self.store.commit(list(cs), ops) for cs, ops, _ in batch),
                                                return_exceptions=True)
                for (_, _, future), out in zip(batch, outcomes):
                    if future.done():
                        continue
                    if isinstance(out, BaseException):
                        future.set_exception(out)
                    else:
                        future.set_result(out.succeeded)
            except Exception as e:   # noqa: BLE001 - every waiter gets the error, nothing hangs
                for _, _, future in batch:
                    if not future.done():
                        future.set_exception(e)


_Pending = tuple[Sequence[Compare], Sequence[Op], "asyncio.Future[bool]"]


def _take_batch(pending: list[_Pending]) -> list[_Pending]:
    """The first releases of ``pending`` (removed from it) whose compares and operations fit one transaction;
    at least one."""
    n = compares = ops = 0
    for cs, os_, _ in pending:
        if n and (compares + len(cs) > OPS_PER_TXN or ops + len(os_) > OPS_PER_TXN):
            break
        n, compares, ops = n + 1, compares + len(cs), ops + len(os_)
    batch = pending[:n]
    del pending[:n]
    return batch


def _op_key(op: Op) -> bytes:
    """The key a put or delete of a transaction writes."""
    return op.key if isinstance(op, (Put, Delete)) else b""
