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
* ``in_doubt``: two refreshes in a row have failed (the second on a fresh stream, so most likely through
  another member): etcd is out of reach, and the etcd_lease may expire at ``expires_by``. A holder that must
  not act once it may have lost the session (a leader) stops at once, well before the TTL runs out, and
  ``on_doubt(True)`` tells it; ``on_doubt(False)`` when a refresh succeeds again.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

from coordinator import errors
from coordinator.aio import cancel_and_wait, spawn
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
        self.in_doubt = False        # the last two refreshes failed: etcd is out of reach
        self.on_doubt: Callable[[bool], None] | None = None
        self.on_refresh: Callable[[bool], None] | None = None    # after every refresh: whether it got through
        self._probe = asyncio.Event()
        # loop.time() before which etcd cannot have expired the etcd_lease: a TTL after the last refresh
        # that succeeded was sent (etcd counts from when it received it, which was later).
        self.expires_by = 0.0
        self._task: asyncio.Task[None] | None = None

    async def open(self) -> EtcdSession:
        sent = asyncio.get_running_loop().time()
        self.etcd_lease = await self.store.grant(self.ttl_s)
        self.expires_by = sent + self.ttl_s
        self._task = spawn(self._refresh(), f"the keepalive of {self.name}")
        return self

    def probe(self) -> None:
        """Refresh now rather than at the next tick (its holder suspects that etcd is out of reach)."""
        self._probe.set()

    async def _pause(self, seconds: float) -> None:
        self._probe.clear()
        try:
            await asyncio.wait_for(self._probe.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    def _refreshed(self, ok: bool) -> None:
        if self.on_refresh is not None:
            self.on_refresh(ok)

    def _set_doubt(self, doubt: bool) -> None:
        if doubt != self.in_doubt:
            self.in_doubt = doubt
            if self.on_doubt is not None:
                self.on_doubt(doubt)

    async def __aenter__(self) -> EtcdSession:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _refresh(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.ttl_s / 3
        # A refresh that met a hung etcd member (its connection stays open) is given up after a sixth of
        # the TTL and tried again at once, on a fresh stream and most likely another member: waiting the
        # store's whole timeout, then a whole interval, could let the etcd_lease expire on a minority fault.
        attempt = max(0.2, min(self.store.timeout, self.ttl_s / 6))
        last_ok = self.expires_by - self.ttl_s
        pause = interval
        failures = 0
        try:
            while True:
                await self._pause(pause)
                sent = loop.time()
                try:
                    ttl = await self.store.keepalive(self.etcd_lease, timeout=attempt)
                except errors.GpucoordError as e:
                    failures += 1
                    self._refreshed(False)
                    if loop.time() - last_ok > self.ttl_s:
                        log.warning("%s: no keepalive for %d s (%s): the etcd_lease has expired", self.name,
                                    self.ttl_s, e)
                        self.lost = True
                        return
                    log.warning("%s: keepalive failed, retrying: %s", self.name, e)
                    if failures >= 2:
                        self._set_doubt(True)
                    pause = min(interval, 0.1)
                    continue
                failures = 0
                pause = interval
                if ttl <= 0:
                    log.warning("%s: etcd_lease %x is gone", self.name, self.etcd_lease)
                    self.lost = True
                    return
                last_ok = sent
                self.expires_by = sent + self.ttl_s
                self._set_doubt(False)
                self._refreshed(True)
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
