"""Many simulated hosts from one process (``gpucoord node --fake-hosts N``), for benchmarks at fleet scale.

A real node daemon per host costs a process, a gRPC server, a watch and a session each: a thousand of them
would measure the machine, not the coordinator. This registers ``N`` hosts named ``PREFIX-0000``... with
the same ``hosts/`` and ``usage/`` values a daemon writes, all under ONE etcd_lease kept alive by one
session, so the coordinator sees exactly what it would see from N daemons. Usage is written once, with an
interval long enough that it never goes stale (simulated GPUs use no VRAM outside their leases).
It serves no Node RPCs: CheckToken and process attribution need a real daemon.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from typing import Callable

from coordinator import __version__
from coordinator.aio import first_of
from coordinator.etcd.session import EtcdSession
from coordinator.etcd.store import Store
from coordinator.keys import Keys
from coordinator.node.fake import FakeGpuSource
from coordinator.node.inventory import read_inventory
from coordinator.records import dumps
from coordinator.txn import Put

log = logging.getLogger(__name__)

# Puts per transaction: below etcd's default --max-txn-ops (128).
_PUTS_PER_TXN = 100
# Usage written once is "fresh" for 3 intervals: a day.
_USAGE_INTERVAL_S = 8 * 3600.0


def fake_host_names(prefix: str, count: int) -> list[str]:
    return [f"{prefix}-{i:04d}" for i in range(count)]


async def register_fake_hosts(store: Store, keys: Keys, prefix: str, count: int, fake_gpus: str,
                              ttl_s: int = 10) -> EtcdSession:
    """Register ``count`` simulated hosts under one etcd_lease; returns the session that keeps them alive
    (close it to deregister them all at once)."""
    if count < 1:
        raise ValueError(f"--fake-hosts: must be >= 1, got {count}")
    session = await EtcdSession(store, ttl_s, f"{count} fake hosts").open()
    now = time.time()
    puts = []
    template = read_inventory(prefix, "", FakeGpuSource(fake_gpus, prefix), "/", __version__)
    for name in fake_host_names(prefix, count):
        source = FakeGpuSource(fake_gpus, name)
        inventory = dataclasses.replace(template, host=name, gpus=source.gpus())
        puts.append(Put(keys.host(name), dumps({"address": "", "inventory": inventory.to_json(),
                                                   "version": __version__, "pid": os.getpid(),
                                                   "started_at": now}), session.etcd_lease))
        gpus = [{"index": u.index, "uuid": u.uuid, "vram_used_mb": u.vram_used_mb, "vram_free_mb": u.vram_free_mb,
                 "untracked_mb": 0, "processes": [], "leases": []} for u in source.usage()]
        puts.append(Put(keys.usage(name), dumps({"ts": now, "interval_s": _USAGE_INTERVAL_S, "gpus": gpus}),
                           session.etcd_lease))
    for i in range(0, len(puts), _PUTS_PER_TXN):
        await store.commit([], puts[i:i + _PUTS_PER_TXN])
    log.info("registered %d fake hosts %s-0000.. on etcd_lease %x", count, prefix, session.etcd_lease)
    return session


async def run_fake_hosts(store: Store, keys: Keys, prefix: str, count: int, fake_gpus: str, ttl_s: int,
                         stop: asyncio.Event, ready: Callable[[int], None] | None = None) -> None:
    async with store:
        session = await register_fake_hosts(store, keys, prefix, count, fake_gpus, ttl_s)
        try:
            if ready is not None:
                ready(0)
            await first_of(stop.wait(), session.done.wait())
        finally:
            await session.close()
