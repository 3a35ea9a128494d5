"""A host's registration in etcd: ``hosts/<host>`` and ``usage/<host>`` on one etcd_lease.

Written by the node daemon itself in the etcd-direct mode (``gpucoord node --etcd``), and by a coordinator
replica on behalf of a node in the registry mode (``gpucoord node --coordinator``, ``coordinator.rpc.
registry_server``): the same transactions either way.

``hosts/<host>`` is written only by a transaction that compares it is absent or already on the writer's
etcd_lease, and ``usage/<host>`` only while ``hosts/<host>`` is on it, so a second daemon never overwrites
the first: it gets :class:`HostTaken`, naming the live one.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time

from coordinator import errors
from coordinator.etcd.store import Store
from coordinator.etcd.types import KV, GetResult, NestedResult
from coordinator.keys import Keys
from coordinator.limits import quote
from coordinator.txn import Absent, Get, LeaseIs, Put, Txn

log = logging.getLogger(__name__)


class HostTaken(errors.FailedPrecondition):
    """``hosts/<host>`` belongs to another daemon (another etcd_lease): this one must not publish."""


def describe_owner(host: str, kv: KV) -> str:
    """Who holds ``hosts/<host>``, for an error message: address, pid, start time and etcd_lease."""
    try:
        doc = json.loads(kv.value)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        doc = {}
    started = doc.get("started_at")
    parts = [f"address {quote(doc.get('address', '?'))}"]
    if isinstance(doc.get("pid"), int):
        parts.append(f"pid {doc['pid']}")
    if isinstance(started, (int, float)):
        parts.append("started " + time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)))
    if kv.etcd_lease:
        parts.append(f"etcd_lease {kv.etcd_lease:x}")
    else:
        parts.append("written without an etcd_lease (by hand?): delete it to free the host")
    return f"host {host!r} already has a live node daemon ({', '.join(parts)})"


async def wait_host_free(store: Store, keys: Keys, host: str) -> None:
    """Return once ``hosts/<host>`` is free; raise HostTaken while a live registration holds it.

    A live registration's etcd_lease is refreshed every TTL/3, so its remaining TTL goes up within that
    time; one that only runs down was left by a daemon that died (kill -9, a crash), and is waited out, so
    that a daemon restarted at once takes over its host when the old registration expires.
    """
    key = keys.host(host)
    watched, lowest = 0, 0
    give_up = 0.0
    while True:
        kv = await store.get(key)
        if kv is None:
            return
        if not kv.etcd_lease:
            raise HostTaken(describe_owner(host, kv), "host")
        remaining = await store.time_to_live(kv.etcd_lease)
        if remaining < 0:
            continue        # it expired just now: read again
        now = time.monotonic()
        if kv.etcd_lease != watched:
            watched, lowest = kv.etcd_lease, remaining
            give_up = now + remaining + 2.0
            log.info("hosts/%s is on etcd_lease %x (%d s left): waiting to see whether its daemon is alive",
                     host, watched, remaining)
        elif remaining > lowest or now > give_up:
            raise HostTaken(describe_owner(host, kv), "host")
        lowest = min(lowest, remaining)
        await asyncio.sleep(0.5)


async def publish_host(store: Store, keys: Keys, host: str, value: bytes, etcd_lease: int) -> int:
    """One transaction: put ``hosts/<host>`` if it is on ``etcd_lease``, or else if it is absent, or else read
    it (to name the owner in HostTaken). Returns the revision."""
    key = keys.host(host)
    put = Put(key, value, etcd_lease)
    res = await store.commit([LeaseIs(key, etcd_lease)], [put], [Txn((Absent(key),), (put,), (Get(key),))])
    if not res.succeeded:
        inner = res.responses[0]
        assert isinstance(inner, NestedResult)
        if not inner.succeeded:
            got = inner.responses[0]
            assert isinstance(got, GetResult)
            if not got.kvs:   # it went away between the two compares of one revision: impossible, but retry
                raise errors.Unavailable(f"hosts/{host}: registration raced; retry")
            raise HostTaken(describe_owner(host, got.kvs[0]), "host")
    return res.revision


async def write_usage(store: Store, keys: Keys, host: str, value: bytes, etcd_lease: int) -> bool:
    """Put ``usage/<host>`` on ``etcd_lease`` while ``hosts/<host>`` is on it; False (nothing written) when it
    is not (gone, or another daemon's: never write over its usage)."""
    res = await store.commit([LeaseIs(keys.host(host), etcd_lease)], [Put(keys.usage(host), value, etcd_lease)])
    return res.succeeded
