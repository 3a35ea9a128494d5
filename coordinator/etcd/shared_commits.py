"""Commits shared across hosts: the transactions a replica commits together go to etcd as one transaction,
each nested in its branch with its own compares, so that one raft entry carries many (group commit across
hosts, as ``policy/planner.py``'s rounds share one commit on a host).

A transaction alone is sent as it is, from its caller's task (a serial client pays nothing: one proposal per
commit, no task between). While ``IN_FLIGHT`` transactions are in flight, new ones wait and leave together in
the next, as many as may share one (``sharing.share``: none writes what another reads or writes; within etcd's
operations limit, the parts cap and the bytes budget). Each part's answer is its nested transaction's: a compare
that failed fails that part alone, at the shared revision. etcd refuses a whole request for one part's fault (a
put on an etcd_lease that has just expired, a limit): the parts are then committed one by one, so each hears its
own answer. An error of etcd itself (out of reach, timed out, outcome unknown) is every part's.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Sequence

from coordinator import errors
from coordinator.aio import spawn
from coordinator.etcd.sharing import Footprint, footprint, share
from coordinator.etcd.store import Store
from coordinator.etcd.types import NestedResult, TxnResult
from coordinator.txn import Compare, Op, Txn

# Shared transactions in flight at once: the second lets a batch form while the first is being committed
# without the first one's parts waiting for it.
IN_FLIGHT = 2
# etcd's --max-request-bytes is 1.5 MiB; a shared transaction stays well below it.
SHARED_BYTES_BUDGET = 1_000_000
# Errors that etcd gives a whole request for one part's fault: each part is then committed alone.
PART_FAULTS = (errors.SessionGone, errors.InvalidArgument, errors.FailedPrecondition)


@dataclasses.dataclass(eq=False)
class _Part:
    compares: tuple[Compare, ...]
    success: tuple[Op, ...]
    failure: tuple[Op, ...]
    deadline: float | None
    future: asyncio.Future[TxnResult]
    _footprint: Footprint | None = None

    @property
    def footprint(self) -> Footprint:
        """Computed when another part may share with it (a part alone is sent as it is)."""
        if self._footprint is None:
            self._footprint = footprint(self.compares, self.success, self.failure)
        return self._footprint


class SharedCommits:
    """``commit`` as ``Store.commit``, sharing etcd transactions with other callers' commits (module doc).
    ``max_parts`` of 1 turns sharing off."""

    def __init__(self, store: Store, max_txn_ops: int, max_parts: int) -> None:
        self.store = store
        self.max_txn_ops = max_txn_ops
        self.max_parts = max_parts
        self._pending: list[_Part] = []
        self._in_flight = 0
        self.shared = 0     # transactions that carried more than one part (tests, bench)

    async def commit(self, compares: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = (),
                     deadline: float | None = None) -> TxnResult:
        if self.max_parts <= 1:
            return await self.store.commit(compares, success, failure, deadline=deadline)
        if not self._in_flight:
            # Nothing in flight: this one goes at once, from the caller's own task (no task, no future: a serial
            # caller's commit costs what ``Store.commit`` does). Those that come meanwhile gather behind it.
            self._in_flight += 1
            try:
                return await self.store.commit(compares, success, failure, deadline=deadline)
            finally:
                self._in_flight -= 1
        future: asyncio.Future[TxnResult] = asyncio.get_running_loop().create_future()
        # A caller that went away (cancelled) while its part was in flight leaves the answer to nobody: it
        # is retrieved here, so that an error is not reported as never retrieved.
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        part = _Part(tuple(compares), tuple(success), tuple(failure), deadline, future)
        self._pending.append(part)
        if self._in_flight < IN_FLIGHT:
            self._in_flight += 1
            spawn(self._send(), "shared etcd commits")
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if part in self._pending:     # not sent: it never will be
                self._pending.remove(part)
            raise

    async def _send(self) -> None:
        batch: list[_Part] = []
        try:
            while self._pending:
                chosen = [0] if len(self._pending) == 1 else share(
                    [p.footprint for p in self._pending], self.max_txn_ops, self.max_parts, SHARED_BYTES_BUDGET)
                batch = [self._pending[i] for i in chosen]
                taken = set(chosen)
                self._pending = [p for i, p in enumerate(self._pending) if i not in taken]
                await self._commit(batch)
        except asyncio.CancelledError:
            # Shutting down: nobody waits for ever. What was in flight may have committed.
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(errors.OutcomeUnknown("commit: the replica stopped while it was in flight"))
            if self._in_flight == 1:
                for p in self._pending:
                    if not p.future.done():
                        p.future.set_exception(errors.Unavailable("commit: the replica stopped"))
                self._pending = []
            raise
        finally:
            self._in_flight -= 1

    async def _commit(self, batch: list[_Part]) -> None:
        if len(batch) == 1:
            await _alone(self.store, batch[0])
            return
        deadlines = [p.deadline for p in batch if p.deadline is not None]
        try:
            res = await self.store.commit([], [Txn(p.compares, p.success, p.failure) for p in batch],
                                          deadline=min(deadlines) if deadlines else None)
        except PART_FAULTS:
            await asyncio.gather(*(_alone(self.store, p) for p in batch))
            return
        except Exception as e:  # noqa: BLE001 - etcd's own error (out of reach, outcome unknown) is every part's
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(e)
            return
        self.shared += 1
        for p, r in zip(batch, res.responses):
            assert isinstance(r, NestedResult), r
            if not p.future.done():
                p.future.set_result(TxnResult(r.succeeded, res.revision, r.responses))


async def _alone(store: Store, p: _Part) -> None:
    try:
        res = await store.commit(p.compares, p.success, p.failure, deadline=p.deadline)
    except Exception as e:  # noqa: BLE001 - the part's caller gets its error
        if not p.future.done():
            p.future.set_exception(e)
        return
    if not p.future.done():
        p.future.set_result(res)
