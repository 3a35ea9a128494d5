"""Fault injection by wrapping one component's own objects, never by editing the code under test:
``patch_method``, ``patch_commit``, ``deafen`` (a leader deaf to its loss, its revokes counted), and
``is_put``/``is_delete`` to recognise a transaction's ops."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Awaitable, Callable

from coordinator.txn import Delete, Op, Put, Txn
from tests.support.cluster import Cluster
from tests.support.waiting import wait_for


def patch_method(cluster: Cluster, obj: Any, name: str, replacement: Callable[..., Any]) -> Callable[[], None]:
    """Install ``obj.name = replacement`` on the cluster's loop thread (where ``obj`` is used); returns an
    undo that removes it there again and waits until it is gone."""
    cluster.lt.loop.call_soon_threadsafe(lambda: setattr(obj, name, replacement))
    wait_for(lambda: obj.__dict__.get(name) is replacement, 2, f"the patch of {name}")

    def undo() -> None:
        if cluster.lt.thread.is_alive():
            cluster.lt.loop.call_soon_threadsafe(lambda: obj.__dict__.pop(name, None))
            wait_for(lambda: obj.__dict__.get(name) is not replacement, 2, f"the undo of the patch of {name}")
        else:
            obj.__dict__.pop(name, None)
    return undo


def patch_commit(cluster: Cluster, svc: Any,
                 hook: Callable[[Any, Any, Callable[[], Awaitable[Any]]], Awaitable[Any]]) -> Callable[[], None]:
    """Wrap ``svc.store.commit``: ``await hook(compares, success, commit)`` decides, ``commit()`` being the
    real call. Returns an undo."""
    store = svc.store
    orig = store.commit

    async def commit(compares: Any, success: Any, failure: Any = (), deadline: float | None = None) -> Any:
        return await hook(list(compares), list(success), lambda: orig(compares, success, failure, deadline))
    return patch_method(cluster, store, "commit", commit)


def is_put(op: Op, key_part: bytes) -> bool:
    """``op`` (an operation of ``coordinator.txn``) puts a key containing ``key_part``; a transaction nested in a
    shared one (``coordinator/etcd/shared_commits.py``: a round's commit that went with another's) if its success
    branch does."""
    if isinstance(op, Txn):
        return any(is_put(o, key_part) for o in op.success)
    return isinstance(op, Put) and key_part in op.key


def is_delete(op: Op, key_part: bytes) -> bool:
    if isinstance(op, Txn):
        return any(is_delete(o, key_part) for o in op.success)
    return isinstance(op, Delete) and key_part in op.key


@dataclasses.dataclass
class DeafLeader:
    """A leader kept from noticing the loss of its election (its step-down is a no-op), so its duties run on,
    with every try of its lease revoke recorded: (time.monotonic() when it ended, its result or its error)."""
    tries: list[tuple[float, object]]
    undo: Callable[[], None]


def deafen(cluster: Cluster, leadership: Any) -> DeafLeader:
    """Make ``leadership`` (a replica's Leadership) deaf to its loss and count its revokes; ``undo()`` after."""
    tries: list[tuple[float, object]] = []
    revoke = leadership.leases.revoke

    async def counted_revoke(*args: object, **kw: object) -> bool:
        try:
            out = await revoke(*args, **kw)
        except Exception as e:
            tries.append((time.monotonic(), e))
            raise
        tries.append((time.monotonic(), out))
        return out

    undos = [patch_method(cluster, leadership, "_step_down", lambda: None),
             patch_method(cluster, leadership.leases, "revoke", counted_revoke)]

    def undo() -> None:
        for u in undos:
            u()
    return DeafLeader(tries, undo)
