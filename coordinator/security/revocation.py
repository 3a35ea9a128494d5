"""The deny list of certificates: ``revoked/<serial>`` in etcd, followed by a watch in every coordinator
replica and node daemon, so that a revoked certificate is refused within a moment of the write, without a
restart (docs/security.md "Revoking a certificate").

A coordinator writes the keys when an operator asks (``gpucoord certs revoke``, the RevokeCertificate RPC;
``coordinator.rpc.certificates``), or etcd's root does (break glass); the key's last segment is the certificate's serial number in lowercase hex, and that is all the
check needs, so even a malformed value revokes. The interceptor asks ``is_revoked`` for the serial of the
verified peer certificate on every call and every stream message.

Until the first read of ``revoked/`` has completed a server does not serve (``ready``); while the watch is
broken, the list it last had stays in force (it may miss a revocation for that long, never forget one).
"""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Callable, Iterable, Protocol, Sequence

from coordinator.aio import retry_forever
from coordinator.keys import Keys, last_segment

log = logging.getLogger(__name__)


class _KV(Protocol):
    @property
    def key(self) -> bytes: ...


class _PrefixRead(Protocol):
    @property
    def revision(self) -> int: ...

    @property
    def kvs(self) -> Sequence[_KV]: ...


class _Event(Protocol):
    @property
    def kind(self) -> str: ...

    @property
    def kv(self) -> _KV: ...


class _Batch(Protocol):
    @property
    def resync(self) -> bool: ...

    @property
    def events(self) -> Sequence[_Event]: ...


class _Store(Protocol):
    """What following the deny list needs of the store (``coordinator.etcd.store.Store`` has it; this layer
    does not import etcd/)."""

    async def get_prefix(self, prefix: bytes) -> _PrefixRead: ...

    def watch(self, key: bytes, *, prefix: bool = True, start_revision: int = 0,
              prev_kv: bool = False) -> AsyncIterator[_Batch]: ...


def serial_hex(serial: int) -> str:
    """A certificate serial number as ``revoked/<serial>`` names it: lowercase hex, no leading zeros."""
    return format(serial, "x")


class Revocations:
    """The serials of revoked certificates, as this process last read them from etcd."""

    def __init__(self) -> None:
        self._serials: set[str] = set()
        self.ready = asyncio.Event()

    def is_revoked(self, serial: str) -> bool:
        return serial in self._serials

    def __len__(self) -> int:
        return len(self._serials)

    def reset(self, kvs: Iterable[_KV]) -> None:
        self._serials = {last_segment(kv.key) for kv in kvs}

    def apply(self, kind: str, kv: _KV) -> None:
        serial = last_segment(kv.key)
        if kind == "PUT":
            if serial not in self._serials:
                log.warning("certificate serial %s is revoked: calls with it are refused from now on", serial[:64])
            self._serials.add(serial)
        else:
            self._serials.discard(serial)

    async def follow(self, store: _Store, keys: Keys, stop: Callable[[], bool] = lambda: False) -> None:
        """Keep the list current until cancelled: one read of ``revoked/``, then a watch from there."""
        async def once() -> None:
            prefix = keys.revocations()
            snap = await store.get_prefix(prefix)
            self.reset(snap.kvs)
            self.ready.set()
            async for batch in store.watch(prefix, start_revision=snap.revision + 1):
                if batch.resync:
                    return   # history lost: read the whole list again
                for ev in batch.events:
                    self.apply(ev.kind, ev.kv)
        await retry_forever("the watch of revoked certificates", once, stop=stop)
