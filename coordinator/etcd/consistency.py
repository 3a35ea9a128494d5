"""etcd's own corruption check, run from outside: every member's HashKV at one revision.

A member that re-applies raft entries after a crash (etcd-io/etcd#13766, in 3.5.0-3.5.2) or otherwise drifts
holds other keys, or the same keys at other revisions, than its peers; the hash of its key-value store at a
revision that every member has applied then differs. ``compare_members`` asks each member for its own
revision (Maintenance Status: served by the member itself, not by the leader), takes the lowest (every member
has applied it, and nothing here compacts), and asks each member for ``HashKV`` at that revision. The fault
tier runs it at the end of every test on a 3-member cluster; an operator can run it against a plaintext
cluster as ``python -m coordinator.etcd.consistency HOST:PORT...`` (etcd's own ``etcdctl endpoint hashkv``
does the same with credentials).
"""
from __future__ import annotations

import asyncio
import dataclasses
import sys
from typing import Awaitable, Callable, Mapping, Sequence, TypeVar

import grpc
from aetcd import rpc

from coordinator.etcd.auth import ChannelFactory, default_channel
from coordinator.security.etcd_auth import EtcdSecurity

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class MemberHash:
    endpoint: str             # as the caller named the member ("m0 127.0.0.1:2379", or the endpoint alone)
    revision: int             # the revision hashed
    compact_revision: int     # the member's last compaction (hashes compare only at the same one)
    hash: int


@dataclasses.dataclass(frozen=True)
class HashReport:
    revision: int
    members: tuple[MemberHash, ...]
    unreachable: tuple[str, ...] = ()   # members that did not answer (endpoint: why)

    @property
    def consistent(self) -> bool:
        return not self.unreachable and len({(m.hash, m.compact_revision) for m in self.members}) <= 1

    def differing(self) -> list[str]:
        """The members whose hash is not the most common one (all of them when every hash differs)."""
        counts: dict[tuple[int, int], int] = {}
        for m in self.members:
            counts[(m.hash, m.compact_revision)] = counts.get((m.hash, m.compact_revision), 0) + 1
        if len(counts) <= 1:
            return []
        top = max(counts.values())
        majority = [k for k, n in counts.items() if n == top]
        keep = majority[0] if len(majority) == 1 else None
        return [m.endpoint for m in self.members if (m.hash, m.compact_revision) != keep]

    def describe(self) -> str:
        hashes = ", ".join(f"{m.endpoint}={m.hash:#010x}" + (f" compacted@{m.compact_revision}" if m.compact_revision > 0 else "")
                           for m in self.members)
        if self.consistent:
            return f"HashKV at revision {self.revision}: {len(self.members)} members equal ({hashes})"
        parts = [f"HashKV at revision {self.revision} DIFFERS: {hashes}"]
        if self.differing():
            parts.append(f"drifted: {', '.join(self.differing())}")
        if self.unreachable:
            parts.append(f"no answer: {', '.join(self.unreachable)}")
        return "; ".join(parts)


async def compare_members(endpoints: Sequence[str], channel: ChannelFactory | None = None,
                          timeout: float = 10.0, names: Mapping[str, str] | None = None) -> HashReport:
    """Every member's HashKV at the lowest revision that every member reports (see the module's text).
    ``names`` (endpoint -> member name) labels the members in the report."""
    label = {ep: f"{names[ep]} {ep}" if names and ep in names else ep for ep in endpoints}
    factory = channel or default_channel(EtcdSecurity())
    channels = {ep: factory(ep) for ep in endpoints}
    try:
        unreachable: list[str] = []

        async def each(eps: Sequence[str], ask: Callable[[str], Awaitable[T]]) -> dict[str, T]:
            """``ask`` of every member at once: the answers, and each member that failed in ``unreachable``."""
            out: dict[str, T] = {}
            for ep, got in zip(eps, await asyncio.gather(*(ask(ep) for ep in eps), return_exceptions=True)):
                if isinstance(got, BaseException):
                    unreachable.append(f"{label[ep]}: {_why(got)}")
                else:
                    out[ep] = got
            return out

        async def revision(ep: str) -> int:
            resp = await rpc.MaintenanceStub(channels[ep]).Status(rpc.StatusRequest(), timeout=timeout)
            return int(resp.header.revision)

        revisions = await each(endpoints, revision)
        if not revisions:
            return HashReport(0, (), tuple(unreachable))
        at = min(revisions.values())

        async def hash_kv(ep: str) -> MemberHash:
            resp = await rpc.MaintenanceStub(channels[ep]).HashKV(rpc.HashKVRequest(revision=at), timeout=timeout)
            return MemberHash(label[ep], at, int(resp.compact_revision), int(resp.hash))

        members = list((await each(list(revisions), hash_kv)).values())
        return HashReport(at, tuple(members), tuple(unreachable))
    finally:
        await asyncio.gather(*(c.close() for c in channels.values()), return_exceptions=True)


async def member_revision(endpoint: str, channel: ChannelFactory | None = None, timeout: float = 5.0) -> int:
    """The revision that this member itself has applied (its Maintenance Status; no quorum needed)."""
    ch = (channel or default_channel(EtcdSecurity()))(endpoint)
    try:
        resp = await rpc.MaintenanceStub(ch).Status(rpc.StatusRequest(), timeout=timeout)
        return int(resp.header.revision)
    finally:
        await ch.close()


def _why(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name} {e.details() or ''}".strip()[:120]
    return repr(e)[:120]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m coordinator.etcd.consistency HOST:PORT...``: prints the report; exit 1 if members differ."""
    endpoints = list(sys.argv[1:] if argv is None else argv)
    if not endpoints:
        print("usage: python -m coordinator.etcd.consistency HOST:PORT [HOST:PORT...]", file=sys.stderr)
        return 2
    report = asyncio.run(compare_members(endpoints))
    print(report.describe())
    return 0 if report.consistent else 1


if __name__ == "__main__":
    sys.exit(main())
