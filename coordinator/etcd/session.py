"""An etcd-lease-backed session, as etcd's Go ``concurrency.Session``: one etcd_lease kept alive in the background.

Keys written under ``etcd_lease`` live exactly as long as the session. ``done`` is set when the session ends:
the etcd_lease expired or was revoked (keys gone), or ``close()``/``orphan()`` was called. A holder that must
act only while it holds the session (the replica's candidacy, the node's registration) waits on ``done``.

* ``open()`` grants the etcd_lease and starts refreshing it every ``ttl / 3``.
* A refresh that fails (etcd unreachable) is retried at the next tick; the session ends only when etcd
  says the etcd_lease is gone, or when no refresh has succeeded for a whole TTL (it has then expired, as
  far as anyone can know).
* ``close()`` stops refreshing and revokes (every key on it goes at once); ``orphan()`` stops refreshing
  and leaves the keys to expire with the TTL.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from coordinator import errors
from coordinator.aio import cancel_and_wait
from coordinator.etcd.store import Store

log = logging.getLogger(__name__)


class EtcdSession:
    def __init__(self, store: Store, ttl_s: int, name: str = "session") -> None:
        if ttl_s < 1:
            raise ValueError(f"ttl_s: must be >= 1, got {ttl_s}")
        self.store = store
        self.ttl_s = ttl_s
        self.name = name
        self.etcd_lease = 0
        self.done = asyncio.Event()
        self.lost = False            # ended by etcd (expired or revoked), not by close()/orphan()
        self._task: asyncio.Task[None] | None = None

    async def open(self) -> EtcdSession:
        self.etcd_lease = await self.store.grant(self.ttl_s)
        self._task = asyncio.get_running_loop().create_task(self._refresh())
        return self

    async def __aenter__(self) -> EtcdSession:
        return await self.open()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def _refresh(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.ttl_s / 3
        # A refresh that met a hung etcd member (its connection stays open) is given up after a sixth of
        # the TTL and tried again at once, on a fresh stream and most likely another member: waiting the
        # store's whole timeout, then a whole interval, could let the etcd_lease expire on a minority fault.
        attempt = max(0.2, min(self.store.timeout, self.ttl_s / 6))
        last_ok = loop.time()
        pause = interval
        try:
            while True:
                await asyncio.sleep(pause)
                sent = loop.time()
                try:
                    ttl = await self.store.keepalive(self.etcd_lease, timeout=attempt)
                except errors.GpucoordError as e:
                    if loop.time() - last_ok > self.ttl_s:
                        log.warning("%s: no keepalive for %d s (%s): the etcd_lease has expired", self.name,
                                    self.ttl_s, e)
                        self.lost = True
                        return
                    log.warning("%s: keepalive failed, retrying: %s", self.name, e)
                    pause = min(interval, 0.1)
                    continue
                pause = interval
                if ttl <= 0:
                    log.warning("%s: etcd_lease %x is gone", self.name, self.etcd_lease)
                    self.lost = True
                    return
                last_ok = sent
        finally:
            self.done.set()

    async def _stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
        self.done.set()

    async def close(self) -> None:
        """End the session now: stop refreshing and revoke, so every key on it is deleted at once."""
        await self._stop()
        if self.etcd_lease:
            try:
                await self.store.revoke(self.etcd_lease)
                self.etcd_lease = 0
            except errors.GpucoordError as e:
                log.warning("%s: could not revoke etcd_lease %x (it expires with its TTL): %s", self.name,
                            self.etcd_lease, e)

    async def orphan(self) -> None:
        """Stop refreshing and leave the keys: they expire with the TTL."""
        await self._stop()
