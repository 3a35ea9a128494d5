"""The usage export (issue 33): the leader appends every usage record to JSON-lines files a site ships to its
own database (docs/teams.md, "Usage accounting").

``usage_export_dir`` (empty: no export) holds one file per UTC day of the records' end, ``usage-YYYY-MM-DD.jsonl``:
each line is a record's JSON plus ``record_revision``, the etcd revision that wrote the record. Lines are
appended in ``record_revision`` order, so the files themselves say how far the export got: a leader starts
from the highest ``record_revision`` at the end of any file (a last line a crash left half-written is cut
off first), reads the records in etcd written after it, appends them, and follows the new ones with a watch.
Every replica must see the same directory (a shared file system): the files, not etcd, are the cursor, so a
new leader neither repeats nor skips a line. A record deleted by retention before it was exported (the export
lagged by more than ``usage_retention_s``) is not in the files.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Iterable

from coordinator import errors
from coordinator.etcd.election import Election
from coordinator.etcd.types import KV
from coordinator.records import dumps
from coordinator.replica.context import ReplicaContext

log = logging.getLogger(__name__)


def day_file(directory: Path, end_unix: float) -> Path:
    return directory / time.strftime("usage-%Y-%m-%d.jsonl", time.gmtime(end_unix))


def exported_through(directory: Path) -> int:
    """The highest ``record_revision`` in the files, after cutting off a half-written last line."""
    directory.mkdir(parents=True, exist_ok=True)
    highest = 0
    for path in sorted(directory.glob("usage-*.jsonl")):
        with open(path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)    # a crash mid-line: that line is written again
                data = data[: data.rfind(b"\n") + 1]
        lines = data.splitlines()
        if lines:
            highest = max(highest, int(json.loads(lines[-1])["record_revision"]))
    return highest


def append_lines(directory: Path, kvs: Iterable[KV]) -> None:
    """Append each record (in order) to its day's file, and make it durable."""
    files: dict[Path, list[bytes]] = {}
    for kv in kvs:
        doc = json.loads(kv.value)
        doc["record_revision"] = kv.mod_revision
        files.setdefault(day_file(directory, float(doc["end_unix"])), []).append(
            dumps(doc) + b"\n")
    for path, lines in files.items():
        with open(path, "ab") as f:
            f.write(b"".join(lines))
            f.flush()
            os.fsync(f.fileno())


class Exporter:
    def __init__(self, ctx: ReplicaContext) -> None:
        self.ctx = ctx
        self.directory = Path(ctx.config.usage_export_dir) if ctx.config.usage_export_dir else None

    async def run(self, term: Election) -> None:
        if self.directory is None:
            return
        while True:
            try:
                await self._follow(term, self.directory)
            except (errors.GpucoordError, OSError, ValueError, KeyError) as e:
                log.warning("usage export to %s: %s; starting over", self.directory, e)
                await asyncio.sleep(1.0)

    async def _follow(self, term: Election, directory: Path) -> None:
        done = await asyncio.to_thread(exported_through, directory)
        snap = await self.ctx.store.get_prefix(self.ctx.keys.usage_records())
        await self._append(term, directory, sorted((kv for kv in snap.kvs if kv.mod_revision > done),
                                                   key=lambda kv: kv.mod_revision))
        async for batch in self.ctx.store.watch(self.ctx.keys.usage_records(), start_revision=snap.revision + 1):
            if batch.resync:
                return      # read the records again from the files' end
            await self._append(term, directory, [ev.kv for ev in batch.events if ev.kind == "PUT"])

    async def _append(self, term: Election, directory: Path, kvs: list[KV]) -> None:
        if not kvs:
            return
        # A leader that lost its candidacy stops here (one paused past its TTL that has not learned it yet
        # could still write one batch beside its successor: lines carry their record's key to dedupe by).
        if not await term.holds():
            raise errors.NotOwner("usage export: this replica is no longer the leader", "leader")
        await asyncio.to_thread(append_lines, directory, kvs)
