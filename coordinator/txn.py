"""A transaction as plain data: the compares and operations that a decision asks etcd to commit.

The pure policy (``policy/planner.py``) states its writes with these, importing nothing of etcd's client;
``etcd/ops.py`` (``compile_compare``, ``compile_op``) turns them into etcd's messages at the boundary.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Put:
    key: bytes
    value: bytes
    etcd_lease: int = 0


@dataclasses.dataclass(frozen=True)
class Delete:
    key: bytes


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


Op = Put | Delete
Compare = ModRevisionIs | Exists | Absent | NothingWrittenSince
