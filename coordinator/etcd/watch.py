"""etcd's Watch as batches that resume by themselves (``Store.watch``).

A watch yields one ``WatchBatch`` per response with events, and resumes after a disconnect from the
revision after the last event delivered. Only events move the resume point: a progress notification's
revision is not trusted (etcd before 3.5.8 can send one to a watcher still catching up, etcd-io/etcd#15220).
After a compaction it yields one ``resync`` batch and carries on from the current revision.
"""
from __future__ import annotations

import asyncio
import logging
import random
from typing import AsyncIterator, Callable

import grpc
from aetcd import rpc

from coordinator import errors
from coordinator.aio import drain
from coordinator.etcd import _compile
from coordinator.etcd.types import WatchBatch, WatchEvent
from coordinator.keys import prefix_range_end

log = logging.getLogger(__name__)


async def watch_batches(channel: Callable[[], grpc.aio.Channel], answered: Callable[[], None],
                        closed: Callable[[], bool], key: bytes, *, prefix: bool = True, start_revision: int = 0,
                        prev_kv: bool = False, deletes_only: bool = False) -> AsyncIterator[WatchBatch]:
    """Watch ``key`` (a prefix by default) from ``start_revision`` (0: from now) on the store's current
    ``channel()``, until ``closed()``; ``answered()`` on every response. ``deletes_only``: etcd leaves the
    puts out (its NOPUT filter)."""
    next_rev = start_revision
    backoff = 0.05
    while not closed():
        create = rpc.WatchCreateRequest(key=key, start_revision=next_rev, prev_kv=prev_kv,
                                        progress_notify=True,
                                        filters=[rpc.WatchCreateRequest.NOPUT] if deletes_only else [])
        if prefix:
            create.range_end = prefix_range_end(key)
        requests: asyncio.Queue[rpc.WatchRequest | None] = asyncio.Queue()
        requests.put_nowait(rpc.WatchRequest(create_request=create))
        call = rpc.WatchStub(channel()).Watch(drain(requests), wait_for_ready=True)
        try:
            async for resp in call:
                answered()
                backoff = 0.05
                if resp.compact_revision:
                    log.warning("watch on %r lost history below revision %d: resync", key, resp.compact_revision)
                    next_rev = 0
                    yield WatchBatch(resp.header.revision, (), resync=True)
                    break
                if resp.canceled:
                    raise errors.Unavailable(f"etcd cancelled the watch: {resp.cancel_reason}")
                evs = tuple(
                    WatchEvent("DELETE" if ev.type == rpc.Event.DELETE else "PUT", _compile.kv(ev.kv),
                               _compile.kv(ev.prev_kv) if ev.HasField("prev_kv") else None)
                    for ev in resp.events)
                # Only events move the resume point. A progress notification's revision is not trusted:
                # etcd before 3.5.8 can send one to a watcher still catching up (etcd-io/etcd#15220),
                # and resuming after it would skip the events in between.
                if evs:
                    next_rev = evs[-1].kv.mod_revision + 1
                if evs or resp.created:
                    if resp.created and next_rev == 0:
                        next_rev = resp.header.revision + 1
                    yield WatchBatch(resp.header.revision, evs)
        except grpc.aio.AioRpcError as e:
            if closed():
                return
            log.info("watch on %r broke (%s); resuming from revision %d", key, e.code().name, next_rev)
            await asyncio.sleep(backoff * (1 + random.random()))
            backoff = min(backoff * 2, 2.0)
        finally:
            requests.put_nowait(None)
            call.cancel()
