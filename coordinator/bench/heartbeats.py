"""What node daemons do to gpucoord while a fleet is idle: each host rewrites its usage report every interval.

Simulated hosts (``gpucoord node --fake-hosts``) write theirs once; here each one is written again every
``interval_s``, spread evenly over the interval, for as long as asked, with a new ``ts`` and nothing else new, in a
daemon's bytes (compact JSON, sorted keys): the watch events every replica then follows, as in a real fleet whose
figures hold still. (The interval a report states is left as the host registered it: a daemon keeps its own.)"""
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
    """Rewrite ``hosts``' usage reports every ``interval_s`` for ``seconds``; returns how many were written."""
    async with Store(endpoints) as store:
        reports = [kv for kv in (await store.get_many([keys.usage(h) for h in hosts])).values() if kv is not None]
        per_tick = max(1, round(len(reports) * TICK_S / interval_s))
        written, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds and reports:
            batch = []
            for _ in range(per_tick):
                kv = reports[written % len(reports)]
                doc = json.loads(kv.value) | {"ts": time.time()}
                batch.append(Put(kv.key, dumps(doc), kv.etcd_lease))
                written += 1
            for at in range(0, len(batch), PUTS_PER_TXN):
                await store.commit([], batch[at:at + PUTS_PER_TXN])
            await asyncio.sleep(TICK_S)
        return written
