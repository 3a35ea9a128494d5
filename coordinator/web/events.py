"""What happened between two status documents (pure), and the feed that reads them while a page watches.

An event is what one document shows changed from the one before: a lease granted or ended, an eviction or
revoke notice (with its reason), a host lost or back, cordoned (or drained) or uncordoned, a queue entry. The
console sees what its reads show: a lease granted and ended between two reads is not seen, and a plain revoke
(a lease bound to no process) reads as an ended lease.
"""
from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Any, Callable, Iterator

from coordinator.web.gangs import lease_hosts

Doc = dict[str, Any]
Event = dict[str, Any]

KEEP = 200          # events kept for the pages that open later
INTERVAL_S = 0.5    # between two reads while a page watches, at least
READ_SHARE = 0.2    # ... and at most this share of the time reading: a fleet's status is seconds of the replica's work


def _gib(mb: int | float) -> str:
    return f"{mb / 1024:.1f} GiB"


def _gpus(lease: dict[str, Any]) -> str:
    indexes = [str(g.get("index", 0)) for g in lease.get("gpus", [])] or [str(lease.get("gpu_index", 0))]
    return ("GPU " if len(indexes) == 1 else "GPUs ") + ",".join(indexes)


def _leases(doc: Doc) -> dict[str, dict[str, Any]]:
    return {lease["id"]: lease for h in doc.get("hosts", []) for lease in h.get("leases", [])}


def _queue(doc: Doc) -> dict[tuple[str, str], dict[str, Any]]:
    return {(h["host"], q["rank"]): q for h in doc.get("hosts", []) for q in h.get("queue", [])}


def _notice(lease: dict[str, Any]) -> dict[str, Any] | None:
    notice = lease.get("eviction") or None
    return notice if notice and notice.get("lease_id") and not notice.get("withdrawn") else None


def changes(old: Doc | None, new: Doc) -> list[Event]:
    """The events that tell ``old`` from ``new`` (none for the first document), in a stable order."""
    if old is None:
        return []
    out: list[Event] = []

    def add(kind: str, host: str, text: str, lease: str = "") -> None:
        out.append({"kind": kind, "host": host, "lease": lease, "text": text})

    before = {h["host"]: h for h in old.get("hosts", [])}
    for h in new.get("hosts", []):
        was = before.get(h["host"])
        if was is None:
            add("host", h["host"], f"host {h['host']} joined")
        elif was.get("alive") and not h.get("alive"):
            add("host-lost", h["host"], f"host {h['host']} lost (its registration is gone)")
        elif h.get("alive") and not was.get("alive"):
            add("host", h["host"], f"host {h['host']} is back")
        if was is not None and h.get("cordoned") and not was.get("cordoned"):
            c = h.get("cordon") or {}
            add("cordon", h["host"], f"host {h['host']} cordoned{' for a drain' if c.get('drain') else ''}: "
                f"{c.get('reason') or 'no reason given'} (by {c.get('asked_by') or '?'})")
        elif was is not None and was.get("cordoned") and not h.get("cordoned"):
            add("uncordon", h["host"], f"host {h['host']} uncordoned")
    old_leases, new_leases = _leases(old), _leases(new)
    for lid, lease in new_leases.items():
        who = f"{lease.get('agent', '')} on {lease_hosts(lease) or lease.get('host', '') + ' ' + _gpus(lease)}"
        if lid not in old_leases:
            add("grant", lease.get("host", ""), f"granted {lid}: {_gib(lease.get('vram_mb', 0))} to {who}", lid)
        notice, had = _notice(lease), _notice(old_leases.get(lid, {}))
        if notice is not None and had is None:
            kind = "revoke" if notice.get("revoke") else "evict"
            by = notice.get("requested_by") or "?"
            reclaim = f", reclaimed for team {notice['reclaim_team']}" if notice.get("reclaim_team") else ""
            add(kind, lease.get("host", ""), f"{'revoked' if kind == 'revoke' else 'evicting'} {lid} of {who}: "
                f"{notice.get('reason') or 'no reason given'} (by {by}{reclaim})", lid)
    for lid, lease in old_leases.items():
        if lid not in new_leases:
            how = "after its eviction notice" if _notice(lease) is not None else "released, revoked or expired"
            add("end", lease.get("host", ""), f"ended {lid} of {lease.get('agent', '')} on {lease.get('host', '')}"
                f" {_gpus(lease)} ({how})", lid)
    old_queue = _queue(old)
    for (host, rank), q in _queue(new).items():
        if (host, rank) not in old_queue:
            add("queue", host, f"{q.get('agent', '')} waits on {host} for {_gib(q.get('vram_mb', 0))}"
                f"{' x' + str(q['gpu_count']) if int(q.get('gpu_count', 1)) > 1 else ''}")
    return out


class Feed:
    """Reads the status document every ``interval`` s while at least one page watches, and keeps the events
    between two reads (the last ``keep``). Thread-safe: the HTTP server's threads wait on it."""

    def __init__(self, read: Callable[[], Doc], interval: float = INTERVAL_S, keep: int = KEEP,
                 clock: Callable[[], float] = time.time) -> None:
        self._read, self._interval, self._clock = read, interval, clock
        self._cond = threading.Condition()
        self._events: collections.deque[Event] = collections.deque(maxlen=keep)
        self._seq = 0
        self._watchers = 0
        self._thread: threading.Thread | None = None
        self.doc: Doc | None = None
        self.error = ""
        self.version = 0      # one more per read

    def events(self, after: int = 0) -> list[Event]:
        """The kept events with a sequence number above ``after``, oldest first."""
        with self._cond:
            return [e for e in self._events if e["seq"] > after]

    def last_seq(self) -> int:
        with self._cond:
            return self._seq

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """While in this context the feed reads (for an SSE stream's life)."""
        with self._cond:
            self._watchers += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="console-feed")
                self._thread.start()
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._watchers -= 1

    def wait_past(self, version: int, timeout: float) -> int:
        """Wait until a read newer than ``version`` (or ``timeout``); the newest version."""
        with self._cond:
            self._cond.wait_for(lambda: self.version > version, timeout)
            return self.version

    def _run(self) -> None:
        pace = threading.Event()     # never set: its wait is the pause between two reads
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._watchers > 0)
            began = time.monotonic()
            try:
                doc: Doc | None = self._read()
                error = ""
            except Exception as e:  # noqa: BLE001 - any failure of a read is shown on the pages, and the feed goes on
                doc, error = None, str(e) or type(e).__name__
            took = time.monotonic() - began
            with self._cond:
                if doc is not None:
                    now = self._clock()
                    for event in changes(self.doc, doc):
                        self._seq += 1
                        self._events.append({**event, "seq": self._seq, "time": now})
                    self.doc = doc
                self.error = error
                self.version += 1
                self._cond.notify_all()
            pace.wait(self.pause_after(took))

    def pause_after(self, took: float) -> float:
        """The pause after a read that took ``took`` seconds: ``interval``, or longer, so that reads take at most
        ``READ_SHARE`` of the time (10,000 hosts are a status of seconds)."""
        return max(self._interval, took * (1 - READ_SHARE) / READ_SHARE)


__all__ = ["Feed", "changes"]
