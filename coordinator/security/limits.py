"""Fair service: per-identity limits that the interceptor applies before any other work (docs/security.md "Fair
service under a flood").

* a token bucket of calls per identity: ``calls_per_s`` tokens a second, at most ``burst`` saved up; every
  unary call, every stream's opening and every message of a stream takes its cost in tokens (``COSTS``:
  1, and more for the calls that read or write much: a GetStatus or an OpenSession takes 10, a
  KeepAliveSessions message one more per 64 sessions it names); a health check takes 1, like any call.
* a cap on the KeepAlive and Session streams one identity holds open at once.

A refusal is RESOURCE_EXHAUSTED naming the limit (``rate`` or ``streams``) and costs no etcd read, no
authorization and no log line (a flood must not fill the log); ``gpucoord_refusals_total`` counts it.
A call refused for its rate is answered only after ``TARPIT_S`` (a flood that waits for its answers, as
every client with a bounded number of calls in flight does, is slowed down to what it can hold in flight
per second, instead of being refused thousands of times a second at the cost of everyone else's CPU); at
most ``MAX_HELD`` refused calls of one identity, and only small requests, are held so, the others are
answered at once. Limits apply to verified identities only: without TLS there is no identity to limit
(loopback dev mode).

Plain data and a clock, no I/O: the buckets are a bounded map (an idle identity's bucket, once full again,
is forgotten), so a stream of new identities costs no more than ``MAX_TRACKED`` entries.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable

from coordinator import errors

MAX_TRACKED = 65_536   # identities whose bucket or open streams are remembered at once
TARPIT_S = 1.0         # a call refused for its rate is answered after this long ...
MAX_HELD = 64          # ... when its identity has fewer refused calls waiting so,
MAX_HELD_ALL = 1024    # all identities together fewer than this,
MAX_HELD_BYTES = 64 * 1024   # and the request is smaller than this (held requests: at most 64 MiB)
# Tokens a call takes: the calls that cost the server a whole read of a host (or an etcd lease and a write)
# take more, so that a flood of them is held to fewer per second than one of cheap calls.
COSTS = {"GetStatus": 10, "OpenSession": 10, "ApplyPartition": 10, "GetPartition": 2,
         "ListTeams": 10, "GetTeam": 10, "SetTeam": 2}   # the team reads take every lease of the fleet
KEPT_PER_TOKEN = 64   # a KeepAliveSessions message takes 1 token and 1 more per this many sessions it names


def cost(rpc: str, request: object) -> int:
    """The tokens a call (or a stream's message) takes: ``COSTS``, and for a KeepAliveSessions message its
    number of sessions (each may cost the server an etcd read), so that one message is not 10,000 calls' work
    for one token."""
    if rpc == "KeepAliveSessions" and request is not None:
        return 1 + len(getattr(request, "sessions", ())) // KEPT_PER_TOKEN
    return COSTS.get(rpc, 1)


@dataclasses.dataclass
class _Bucket:
    tokens: float
    at: float


class Limits:
    # The coordinator's defaults (``CoordinatorConfig``); the node daemon uses them as they are.
    DEFAULT_CALLS_PER_S = 100.0
    DEFAULT_BURST = 200
    DEFAULT_MAX_STREAMS = 128

    def __init__(self, calls_per_s: float, burst: int, max_streams: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.calls_per_s, self.burst, self.max_streams = calls_per_s, burst, max_streams
        self._clock = clock
        self._buckets: collections.OrderedDict[str, _Bucket] = collections.OrderedDict()
        self._streams: dict[str, int] = {}
        self._held: dict[str, int] = {}
        self._held_all = 0

    def take(self, who: str, cost: int = 1) -> None:
        """Take ``cost`` tokens of ``who``'s bucket, or raise RESOURCE_EXHAUSTED naming ``rate``."""
        if self.calls_per_s <= 0:
            return
        now = self._clock()
        bucket = self._buckets.pop(who, None)
        if bucket is None:
            bucket = _Bucket(float(self.burst), now)
        else:
            bucket.tokens = min(float(self.burst), bucket.tokens + (now - bucket.at) * self.calls_per_s)
            bucket.at = now
        self._buckets[who] = bucket   # most recently used last
        while len(self._buckets) > MAX_TRACKED:
            self._buckets.popitem(last=False)   # the least recently used: its bucket has refilled by now
        if bucket.tokens < cost:
            raise errors.CapacityError(
                f"rate: {who} is over its limit of {self.calls_per_s:g} calls a second (burst {self.burst}; "
                "calls_per_s_per_identity); slow down and retry", "rate")
        bucket.tokens -= cost

    def hold(self, who: str, request_bytes: int) -> bool:
        """Whether a call of ``who`` refused for its rate is held for ``TARPIT_S`` before its answer (then
        ``release_held`` once answered)."""
        held = self._held.get(who, 0)
        if held >= MAX_HELD or request_bytes >= MAX_HELD_BYTES or self._held_all >= MAX_HELD_ALL:
            return False
        self._held[who] = held + 1
        self._held_all += 1
        return True

    def release_held(self, who: str) -> None:
        held = self._held.get(who, 0) - 1
        if held > 0:
            self._held[who] = held
        else:
            self._held.pop(who, None)
        self._held_all = max(0, self._held_all - 1)

    def open_stream(self, who: str) -> None:
        """Count one more open stream of ``who``, or raise RESOURCE_EXHAUSTED naming ``streams``."""
        held = self._streams.get(who, 0)
        if held >= self.max_streams:
            raise errors.CapacityError(
                f"streams: {who} already holds {held} open streams, the most allowed (max_streams_per_identity); "
                "close one first", "streams")
        if held == 0 and len(self._streams) >= MAX_TRACKED:
            raise errors.CapacityError("streams: too many identities hold streams on this server; retry", "streams")
        self._streams[who] = held + 1

    def close_stream(self, who: str) -> None:
        held = self._streams.get(who, 0) - 1
        if held > 0:
            self._streams[who] = held
        else:
            self._streams.pop(who, None)

    def streams(self, who: str) -> int:
        return self._streams.get(who, 0)
