"""Fair service: per-identity limits that the interceptor applies before any other work (README "Fair
service under a flood").

* a token bucket of calls per identity: ``calls_per_s`` tokens a second, at most ``burst`` saved up; every
  unary call, every stream's opening and every message of a stream takes one. Health checks take none.
* a cap on the KeepAlive and Session streams one identity holds open at once.

A refusal is RESOURCE_EXHAUSTED naming the limit (``rate`` or ``streams``) and costs no etcd read, no
authorization and no log line (a flood must not fill the log); ``gpucoord_refusals_total`` counts it.
Limits apply to verified identities only: without TLS there is no identity to limit (loopback dev mode).

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

    def take(self, who: str) -> None:
        """Take one call's token of ``who``'s bucket, or raise RESOURCE_EXHAUSTED naming ``rate``."""
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
        if bucket.tokens < 1.0:
            raise errors.CapacityError(
                f"rate: {who} is over its limit of {self.calls_per_s:g} calls a second (burst {self.burst}; "
                "calls_per_s_per_identity); slow down and retry", "rate")
        bucket.tokens -= 1.0

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
