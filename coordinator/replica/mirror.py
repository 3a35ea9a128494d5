"""A watch-fed copy of every key under the prefix, consistent at one revision.

The replica's single watch keeps it current. Admission may decide from it instead of reading a snapshot:
a mirror at revision R is exactly the snapshot etcd would have served at R, and every grant decided from
it is validated by the commit's compares (any admission since R changed a ledger). Decisions that a
stale copy could get wrong in the other direction (a refusal, a wait, an unknown session) are never
answered from the mirror: the caller reads etcd instead.
"""
from __future__ import annotations

import asyncio
from typing import Collection, Iterable

from coordinator.changelog import ChangeLog
from coordinator.etcd.types import KV, WatchBatch
from coordinator.keys import Keys, last_segment, prefix_range_end
from coordinator.replica.view import HostSnapshot
from coordinator.txn import Range

_PER_HOST = ("gpus", "leases", "queue", "departing")
_EMPTY: dict[bytes, KV] = {}
# Byte markers of lease records that periodic duties look for among every lease (``marked_leases``): a
# multi-host gang's parts (the host-loss sweep) and a time limit (the time-limit sweep). Kept as indexes so
# that those duties cost what the marked leases are, not what every lease of the fleet is.
MULTI_HOST = b'"hosts":[['
TIME_LIMITED = b'"time_limit_s"'
_MARKERS = (MULTI_HOST, TIME_LIMITED)


# Kinds no replica decides on, kept out of memory: usage records and rollups (the leader's accountant reads etcd).
_NOT_MIRRORED = frozenset({"accounting"})
_HOST_SINGLES = ("hosts", "usage", "partitions", "cordons")   # flat kinds of one key per host, named last
_PUT_ORDERED = frozenset({"usage", "hosts"})   # the kinds ``puts_since`` answers for (not sessions: too many)
HOST_LOG_KEPT = 1 << 16   # the changes of host stamps ``hosts_changed_since`` looks back over


# Kinds of many keys in a large fleet, each read as a range of its own: the ranges after a snapshot's first are read
# side by side (``Store.snapshot``), so that etcd serves several at once while the replica converts the pages it
# has; etcd also counts only the keys left in one kind for each page. A restart at 100,000 leases read 200,000 keys
# as one range, page after page.
_LARGE = ("gpus", "hosts", "leases", "sessions", "usage")


def mirrored_ranges(keys: Keys) -> list[Range]:
    """The ranges that hold every key the mirror keeps, end to end: the whole prefix, less the kinds it does not
    keep, cut where each large kind begins and ends."""
    skipped = {keys.kind(kind): prefix_range_end(keys.kind(kind)) for kind in _NOT_MIRRORED}
    cuts = {keys.root(), prefix_range_end(keys.root()), *skipped, *skipped.values()}
    cuts |= {keys.kind(kind) for kind in _LARGE} | {prefix_range_end(keys.kind(kind)) for kind in _LARGE}
    points = sorted(cuts)
    return [Range(start, until=end) for start, end in zip(points, points[1:]) if skipped.get(start) != end]


class Mirror:
    def __init__(self, keys: Keys) -> None:
        self.keys = keys
        self.revision = 0
        self.ready = False
        self._flat: dict[bytes, KV] = {}
        # Flat keys again, by kind: ``items(kind)`` reads one kind without scanning every host and session.
        self._kinds: dict[str, dict[bytes, KV]] = {}
        self._changes = 0                        # every change to a flat key, ever (resets included)
        self._kind_changed: dict[str, int] = {}  # kind -> the value of ``_changes`` at its last change
        self._kind_keys_changed: dict[str, int] = {}   # kind -> the same, at its last key that came or went
        # kind -> key -> the value of ``_changes`` at its last put, in that order (a put moves its key to the end):
        # ``puts_since`` reads only the keys put since a generation, newest first.
        self._put_order: dict[str, dict[bytes, int]] = {}
        self._buckets: dict[tuple[str, str], dict[bytes, KV]] = {}
        # kind -> the hosts with a bucket of that kind: ``all_host_items`` reads the departing records of a fleet
        # (the leader, at each usage report) without a look at its other buckets.
        self._kind_hosts: dict[str, set[str]] = {kind: set() for kind in _PER_HOST}
        self._lease_keys: dict[str, bytes] = {}      # lease id -> its key
        # host -> when its leases last changed (a count of lease changes that never goes back, resets included);
        # only hosts with leases.
        self._lease_stamps: dict[str, int] = {}
        self._lease_changes = 0
        # host -> when any of its keys (per-host kinds, registration, usage, partition, cordon) last changed: a
        # count that never goes back; only hosts with keys.
        self._host_stamps: dict[str, int] = {}
        # host -> the same, for its keys other than its usage report (which its daemon rewrites every few seconds).
        self._shape_stamps: dict[str, int] = {}
        self._host_changes = 0
        # The host of each change of a host stamp (put, delete): ``hosts_changed_since`` reads the hosts changed since
        # a mark without a look at the others.
        self._host_log = ChangeLog(HOST_LOG_KEPT)
        self._log_hosts = True
        self._marked: dict[bytes, dict[bytes, KV]] = {m: {} for m in _MARKERS}   # marker -> lease key -> its KV
        self._leases_prefix = keys.kind("leases")
        self._teams_prefix = keys.kind("teams")
        self._reset_at = 0
        self._advanced: asyncio.Event | None = None    # set (and replaced) each time the revision moves
        # The revision of the last event that may have given a team room (``eases_teams``), or of the last reset.
        self.teams_eased_at = 0

    async def caught_up(self, revision: int, timeout: float) -> bool:
        """Wait (at most ``timeout``) until the mirror has applied ``revision``; whether it has."""
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout
        while self.ready and self.revision < revision:
            left = until - loop.time()
            if left <= 0:
                return False
            if self._advanced is None:
                self._advanced = asyncio.Event()
            try:
                await asyncio.wait_for(self._advanced.wait(), left)
            except asyncio.TimeoutError:
                return False
        return self.ready and self.revision >= revision

    def _moved(self) -> None:
        if self._advanced is not None:
            self._advanced.set()
            self._advanced = None

    def reset(self, kvs: Iterable[KV], revision: int) -> None:
        self._flat.clear()
        self._kinds.clear()
        self._changes += 1
        self._kind_changed.clear()
        self._put_order.clear()
        self._reset_at = self._changes
        self._buckets.clear()
        for hosts in self._kind_hosts.values():
            hosts.clear()
        self._lease_keys.clear()
        self._lease_stamps.clear()
        self._host_stamps.clear()
        self._shape_stamps.clear()
        self._host_log.void()    # every mark given before is from before the reset
        for marked in self._marked.values():
            marked.clear()
        self._log_hosts = False     # (every host changed: no log needed to say so; 10 % of a reset of 200,000 keys)
        for kv in kvs:
            self._put(kv)
        self._log_hosts = True
        self.revision = revision
        self.teams_eased_at = revision    # anything may have changed
        self.ready = True
        self._moved()

    def apply(self, batch: WatchBatch) -> None:
        for ev in batch.events:
            if ev.kind == "PUT":
                self._put(ev.kv)
            else:
                self._delete(ev.kv.key)
            self.revision = max(self.revision, ev.kv.mod_revision)
            if self.eases_teams(ev.kv.key, ev.kind):
                self.teams_eased_at = self.revision
        self._moved()

    def eases_teams(self, key: bytes, event: str) -> bool:
        """Whether a watch event (``event``: PUT or DELETE) of ``key`` may give a team room under its limit
        (G11): a lease deleted (released, evicted, expired: a team's use drops) or a team changed (a raised
        limit, other members)."""
        return key.startswith(self._teams_prefix) or (event != "PUT" and key.startswith(self._leases_prefix))

    def _bucket(self, key: bytes) -> dict[bytes, KV] | None:
        kind, parts = self._parse(key)
        if kind in _PER_HOST and len(parts) > 1:
            return self._buckets.get((kind, parts[0]), _EMPTY)
        return None

    def _parse(self, key: bytes) -> tuple[str | None, list[str]]:
        try:
            return self.keys.parse(key)
        except ValueError:
            return None, []

    def _put(self, kv: KV) -> None:
        kind, parts = self._parse(kv.key)
        if kind not in _PER_HOST or len(parts) < 2:
            self._put_flat(kv, kind)
            if kind in _HOST_SINGLES and parts:
                self._stamp(parts[-1], usage=kind == "usage")
            return
        host = parts[0]
        bucket = self._buckets.get((kind, host))
        if bucket is None:
            bucket = self._buckets[(kind, host)] = {}
            self._kind_hosts[kind].add(host)
        bucket[kv.key] = kv
        self._stamp(host)
        if kind == "leases":
            self._lease_keys[parts[-1]] = kv.key
            self._lease_changes += 1
            self._lease_stamps[host] = self._lease_changes
            for marker, marked in self._marked.items():
                if marker in kv.value:
                    marked[kv.key] = kv
                else:
                    marked.pop(kv.key, None)

    def _stamp(self, host: str, usage: bool = False) -> None:
        self._host_changes += 1
        self._host_stamps[host] = self._host_changes
        if not usage:
            self._shape_stamps[host] = self._host_changes
        if self._log_hosts:
            self._host_log.add(host)

    def _unstamp_if_gone(self, host: str) -> None:
        k = self.keys
        if not any((kind, host) in self._buckets for kind in _PER_HOST) and not any(
                key in self._flat for key in (k.host(host), k.usage(host), k.partition(host), k.cordon(host))):
            self._host_stamps.pop(host, None)
            self._shape_stamps.pop(host, None)

    def _delete(self, key: bytes) -> None:
        kind, parts = self._parse(key)
        if kind is None:
            self._delete_flat(key, None)
            return
        if kind in _HOST_SINGLES and parts:
            self._delete_flat(key, kind)
            self._stamp(parts[-1], usage=kind == "usage")
            self._unstamp_if_gone(parts[-1])
            return
        if kind in _PER_HOST and len(parts) > 1:
            self._stamp(parts[0])
            bucket = self._buckets.get((kind, parts[0]))
            if bucket is not None:
                bucket.pop(key, None)
                if not bucket:   # a host's last key gone: its bucket goes too (bounded by live keys)
                    del self._buckets[(kind, parts[0])]
                    self._kind_hosts[kind].discard(parts[0])
            if kind == "leases":
                self._lease_keys.pop(parts[-1], None)
                for marked in self._marked.values():
                    marked.pop(key, None)
                self._lease_changes += 1
                if (kind, parts[0]) in self._buckets:
                    self._lease_stamps[parts[0]] = self._lease_changes
                else:
                    self._lease_stamps.pop(parts[0], None)
            self._unstamp_if_gone(parts[0])
        else:
            self._delete_flat(key, kind)

    def _put_flat(self, kv: KV, kind: str | None) -> None:
        if kind in _NOT_MIRRORED:
            return
        self._flat[kv.key] = kv
        if kind is not None:
            of_kind = self._kinds.setdefault(kind, {})
            came = kv.key not in of_kind
            of_kind[kv.key] = kv
            self._changes += 1
            self._kind_changed[kind] = self._changes
            if came:
                self._kind_keys_changed[kind] = self._changes
            if kind in _PUT_ORDERED:
                order = self._put_order.setdefault(kind, {})
                order.pop(kv.key, None)
                order[kv.key] = self._changes

    def _delete_flat(self, key: bytes, kind: str | None) -> None:
        if self._flat.pop(key, None) is None or kind is None:
            return
        of_kind = self._kinds.get(kind)
        if of_kind is not None:
            of_kind.pop(key, None)
            if not of_kind:
                del self._kinds[kind]
        self._put_order.get(kind, {}).pop(key, None)
        self._changes += 1
        self._kind_changed[kind] = self._changes
        self._kind_keys_changed[kind] = self._changes

    def generation(self, kind: str) -> int:
        """Changes when a flat key of ``kind`` changes (or the mirror is reset): a cache key for what is
        derived from ``items(kind)``."""
        return max(self._kind_changed.get(kind, 0), self._reset_at)

    def keys_generation(self, kind: str) -> int:
        """As ``generation``, but only a key of ``kind`` that comes or goes moves it, not one rewritten: a cache
        key for what is derived from the keys alone (the hosts that have a usage report, say)."""
        return max(self._kind_keys_changed.get(kind, 0), self._reset_at)

    def puts_since(self, kind: str, generation: int) -> list[KV] | None:
        """The keys of ``kind`` (one of ``_PUT_ORDERED``) put (come or rewritten) after ``generation`` (a
        ``generation(kind)`` value), newest first; None when the mirror was reset since (then read ``items(kind)``).
        A key deleted since is not among them (``keys_generation`` moved)."""
        if kind not in _PUT_ORDERED:
            raise ValueError(f"puts_since: the mirror keeps no put order of {kind!r}")
        if generation < self._reset_at:
            return None
        out = []
        of_kind = self._kinds.get(kind, {})
        for key, at in reversed(self._put_order.get(kind, {}).items()):
            if at <= generation:
                break
            out.append(of_kind[key])
        return out

    def flat(self, key: bytes) -> KV | None:
        """``get`` of a key of a kind that is not per host (a session, a host's registration), without parsing
        the key to find its bucket; None while the mirror is not ready (the caller reads etcd)."""
        return self._flat.get(key) if self.ready else None

    def get(self, key: bytes) -> KV | None:
        bucket = self._bucket(key)
        return (bucket if bucket is not None else self._flat).get(key)

    def lease(self, lease_id: str) -> KV | None:
        """The lease's key, by its id alone (ids are unique across hosts and GPUs)."""
        key = self._lease_keys.get(lease_id)
        return self.get(key) if key is not None else None

    def tracked(self) -> dict[str, int]:
        """How many structures the mirror holds (tests of bounded memory)."""
        return {"keys": len(self._flat) + sum(len(b) for b in self._buckets.values()),
                "buckets": len(self._buckets), "kind_hosts": sum(len(h) for h in self._kind_hosts.values()),
                "lease_index": len(self._lease_keys),
                "marked_leases": sum(len(m) for m in self._marked.values()), "host_stamps": len(self._host_stamps),
                "shape_stamps": len(self._shape_stamps)}

    def host_items(self, kind: str, host: str) -> tuple[KV, ...]:
        bucket = self._buckets.get((kind, host), {})
        return tuple(bucket[k] for k in sorted(bucket))

    def host_snapshot(self, host: str, extra_keys: Iterable[bytes] = ()) -> HostSnapshot:
        """What ``view.read_host`` would read (plus the single keys ``extra_keys``), as of ``revision``."""
        k = self.keys
        return HostSnapshot(self.revision, self._flat.get(k.host(host)), self._flat.get(k.usage(host)),
                            self._flat.get(k.partition(host)), self.host_items("gpus", host),
                            self.host_items("leases", host), self.host_items("queue", host),
                            self.host_items("departing", host), tuple(self._flat.get(key) for key in extra_keys),
                            cordon=self._flat.get(k.cordon(host)))

    def host_stamp(self, host: str) -> int:
        """A number that changes whenever one of ``host``'s keys is put or deleted (or the mirror is reset) and
        never comes back (0: no key of it): what is derived from a host's snapshot is kept until it moves."""
        return self._host_stamps.get(host, 0)

    def hosts_changed_since(self, mark: int) -> tuple[int, set[str] | None]:
        """The hosts whose stamp moved (a key of theirs put or deleted) since ``mark`` (a mark this returned before),
        and the mark to pass next time; None instead of the hosts when the log no longer reaches back to ``mark``
        or the mirror was reset since (any host may have changed: look at them all)."""
        return self._host_log.since(mark)

    def shape_stamp(self, host: str) -> int:
        """As ``host_stamp``, but a change of the host's usage report alone leaves it as it is."""
        return self._shape_stamps.get(host, 0)

    def lease_stamps(self) -> dict[str, int]:
        """Every host with leases, with a number that changes whenever one of its leases is put or deleted
        (or the mirror is reset) and never comes back: what is derived from a host's leases is kept until its
        number moves. Read-only: the mirror's own copy."""
        return self._lease_stamps

    def hosts(self) -> set[str]:
        """Every host some key names (its registration, usage, partition, cordon, or a per-host kind)."""
        out = {host for _, host in self._buckets}
        for kind in ("hosts", "usage", "partitions", "cordons"):
            out |= {last_segment(k) for k in self._kinds.get(kind, {})}
        return out

    def all_host_items(self, kind: str) -> list[KV]:
        """Every key of one per-host kind (e.g. ``departing``), over all hosts."""
        return [kv for host in self._kind_hosts.get(kind, ()) for kv in self._buckets[(kind, host)].values()]

    def on_etcd_leases(self, etcd_leases: Collection[int]) -> dict[int, list[KV]]:
        """etcd lease -> the keys held here that are attached to it, for those of ``etcd_leases`` (one pass over
        every key: for many sessions at once)."""
        out: dict[int, list[KV]] = {}
        for kvs in (self._flat.values(), *(bucket.values() for bucket in self._buckets.values())):
            for kv in kvs:
                if kv.etcd_lease in etcd_leases:
                    out.setdefault(kv.etcd_lease, []).append(kv)
        return out

    def marked_leases(self, marker: bytes) -> list[KV]:
        """Every lease record whose value holds ``marker`` (``MULTI_HOST``, ``TIME_LIMITED``), over all hosts."""
        return list(self._marked[marker].values())

    def items(self, kind: str) -> list[KV]:
        """Every flat key of one kind (e.g. ``evictions``)."""
        return list(self._kinds.get(kind, {}).values())
