"""What node daemons do to gpucoord while a fleet is idle: each host rewrites its usage report every interval.

Simulated hosts (``gpucoord node --fake-hosts``) write theirs once; here each one is written again every
``interval_s`` (its ``ts`` and ``interval_s`` as a daemon writes them, in a daemon's bytes: compact JSON, sorted
keys), spread evenly over the interval, for as long as asked: the watch events every replica then follows, as in a
real fleet."""
from __future__ import annotations

import asyncio
import json
import time

from coordinator.etcd.store import Store
from coordinator.keys import Keys
from coordinator.record_fields import dumps
from coordinator.txn import Put

TICK_S = 0.1          # reports are written in batches, one batch per tick
PUTS_PER_TXN = 100    # below etcd's default --max-txn-ops


async def report_usage(endpoints: list[str], keys: Keys, hosts: list[str], interval_s: float, seconds: float) -> int:
    """Rewrite ``hosts``' usage reports every ``interval_s`` for ``seconds``; returns how many were written.
    ``seconds=0`` writes each host's report once, at once: a daemon's first report, with its interval."""
    async with Store(endpoints) as store:
        reports = [kv for kv in (await store.get_many([keys.usage(h) for h in hosts])).values() if kv is not None]
        if not seconds:
            batch = [Put(kv.key, _rewritten(kv.value, interval_s), kv.etcd_lease) for kv in reports]
            for at in range(0, len(batch), PUTS_PER_TXN):
                await store.commit([], batch[at:at + PUTS_PER_TXN])
            return len(batch)
        per_tick = max(1, round(len(reports) * TICK_S / interval_s))
        written, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds and reports:
            batch = []
            for _ in range(per_tick):
                kv = reports[written % len(reports)]
                batch.append(Put(kv.key, _rewritten(kv.value, interval_s), kv.etcd_lease))
                written += 1
            for at in range(0, len(batch), PUTS_PER_TXN):
                await store.commit([], batch[at:at + PUTS_PER_TXN])
            await asyncio.sleep(TICK_S)
        return written


def _rewritten(value: bytes, interval_s: float) -> bytes:
    return dumps(json.loads(value) | {"ts": time.time(), "interval_s": interval_s})
