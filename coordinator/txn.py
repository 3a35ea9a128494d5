"""A transaction as plain data: the reads, compares and operations that a caller asks etcd for.

Every module outside ``coordinator/etcd/`` states its reads (``Range``) and its writes (``Compare``, ``Op``)
with these, importing nothing of etcd's client; ``etcd/_compile.py`` turns them into etcd's messages at the
boundary, and ``Store`` hands back typed results (``etcd/types.py``).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable


@dataclasses.dataclass(frozen=True)
class Put:
    key: bytes
    value: bytes
    etcd_lease: int = 0


@dataclasses.dataclass(frozen=True)
class Delete:
    """Delete ``key`` (every key under it when ``prefix``); ``prev_kv`` asks for what was deleted."""

    key: bytes
    prefix: bool = False
    prev_kv: bool = False


@dataclasses.dataclass(frozen=True)
class Get:
    """Read ``key`` inside a transaction's branch (one key; a read on its own is a ``Range``)."""

    key: bytes


@dataclasses.dataclass(frozen=True)
class Txn:
    """A transaction nested in another one's branch: how one transaction says "A, or else B"."""

    compares: tuple[Compare, ...]
    success: tuple[Op, ...]
    failure: tuple[Op, ...] = ()


@dataclasses.dataclass(frozen=True)
class ModRevisionIs:
    """``key`` was not written since ``mod_revision`` (0: it does not exist)."""

    key: bytes
    mod_revision: int


@dataclasses.dataclass(frozen=True)
class Exists:
    key: bytes


@dataclasses.dataclass(frozen=True)
class Absent:
    key: bytes


@dataclasses.dataclass(frozen=True)
class NothingWrittenSince:
    """No key under ``prefix`` was created or modified after ``revision``."""

    prefix: bytes
    revision: int


@dataclasses.dataclass(frozen=True)
class CreateRevisionIs:
    """``key`` is the very key created at ``create_revision`` (not deleted and written again; 0: it does not
    exist). A leader's fence."""

    key: bytes
    create_revision: int


@dataclasses.dataclass(frozen=True)
class LeaseIs:
    """``key`` exists on ``etcd_lease`` (an absent key compares as etcd_lease 0)."""

    key: bytes
    etcd_lease: int


@dataclasses.dataclass(frozen=True)
class Range:
    """A read: one key, or every key under ``key`` when ``prefix``, or every key from ``key`` up to ``until``
    (excluded) when it is given; ``keys_only`` leaves the values out."""

    key: bytes
    prefix: bool = False
    keys_only: bool = False
    until: bytes = b""


Op = Put | Delete | Get | Txn
Compare = ModRevisionIs | Exists | Absent | NothingWrittenSince | CreateRevisionIs | LeaseIs


def has_write(ops: Iterable[Op]) -> bool:
    """Whether these operations put or delete anything (nested transactions included)."""
    for op in ops:
        if isinstance(op, (Put, Delete)):
            return True
        if isinstance(op, Txn) and (has_write(op.success) or has_write(op.failure)):
            return True
    return False
