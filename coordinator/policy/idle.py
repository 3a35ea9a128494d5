"""Idle GPUs (issue 31, docs/policies.md "Idle GPUs"): which leases compute nothing, from the nodes' utilization reports.

Pure: no I/O, no clock of its own (every time is given, on the caller's monotonic clock). A replica feeds
``UtilizationHistory`` with each GPU's utilization as the node reports it (``observe``), -1 when it is unknown:
the node cannot read it, the report is stale or gone. The history keeps, per GPU, the points where the reported
value changed: the signal is piecewise constant, each value holding from when it was first seen until the next
one, and unknown before the first.

A lease is **idle** at ``now`` under a policy (``IdlePolicy``: window ``after_s``, threshold ``below_pct``) when
every GPU it holds reported a known utilization strictly below the threshold over the whole window
[now - after_s, now], and the lease itself was seen at or before now - after_s (a fresh lease is never idle
before its window has passed). An unknown utilization is never idle. ``idle_since`` is when that stretch began
(the latest of the lease's first sighting and each GPU's last move to below the threshold).

A history that was cut (a replica that started late, a new leader, the bound on points per GPU) only ever makes
the stretch start later, so a lease can be judged idle late, never early.
"""
from __future__ import annotations

import dataclasses
from typing import Collection, Iterable, Mapping

from coordinator import errors
from coordinator.changelog import ChangeLog

REASON = "idle"                 # the reason of an idle lease's eviction notice
ACTIONS = ("warn", "evict")
UNKNOWN = -1
MAX_POINTS = 256                # change points kept per GPU (the oldest go first: later, never earlier)
MAX_IDLE_AFTER_S = 30 * 86400.0
MOVES_KEPT = 1 << 16            # GPUs named by ``moved_since``'s log before its older half goes


@dataclasses.dataclass(frozen=True)
class IdlePolicy:
    """``after_s``: the window (0: idle reclaim off); ``below_pct``: the threshold, percent; ``action``: ``warn``
    (shown in status and metrics only) or ``evict`` (an eviction notice with the reason ``idle``)."""

    after_s: float = 0.0
    below_pct: float = 5.0
    action: str = "warn"

    @property
    def on(self) -> bool:
        return self.after_s > 0


def check_policy(after_s: float, below_pct: float, action: str, prefix: str = "idle_") -> None:
    """InvalidArgument naming the field for a window outside [0, 30 days], a threshold outside [0, 100], or an
    action other than warn, evict (or "": the fleet's, for a team)."""
    if after_s != after_s or not 0 <= after_s <= MAX_IDLE_AFTER_S:
        raise errors.InvalidArgument(f"{prefix}after_seconds: must be within [0, {MAX_IDLE_AFTER_S:g}] seconds "
                                     f"(0: off), got {after_s:g}", f"{prefix}after_seconds")
    if below_pct != below_pct or not 0 <= below_pct <= 100:
        raise errors.InvalidArgument(f"{prefix}below_percent: must be within [0, 100], got {below_pct:g}",
                                     f"{prefix}below_percent")
    if action not in ("", *ACTIONS):
        raise errors.InvalidArgument(f"{prefix}action: must be one of {', '.join(ACTIONS)}, got {action[:32]!r}",
                                     f"{prefix}action")


def team_policy(fleet: IdlePolicy, after_s: float, below_pct: float, action: str) -> IdlePolicy:
    """A team's policy: each of its settings where it sets one (0 or "": the fleet's)."""
    return IdlePolicy(after_s or fleet.after_s, below_pct or fleet.below_pct, action or fleet.action)


Points = tuple[tuple[float, int], ...]
"""(time first seen, percent or UNKNOWN) at each change of one GPU's reported utilization, oldest first."""


class UtilizationHistory:
    """Per GPU uuid, the change points of its reported utilization (see the module's docstring)."""

    def __init__(self, max_points: int = MAX_POINTS) -> None:
        self.max_points = max_points
        self._points: dict[str, list[tuple[float, int]]] = {}
        self._current: dict[str, int] = {}
        self._moves = ChangeLog(MOVES_KEPT)   # the GPU of each change of the points (see ``moved_since``)

    def observe(self, gpu_uuid: str, at: float, pct: int, thresholds: Collection[float] = ()) -> None:
        """The GPU reports ``pct`` (UNKNOWN: cannot tell) as seen at ``at``; times never go back (an earlier
        ``at`` counts as the last point's). With ``thresholds`` (the idle thresholds in use) a point is kept only
        when the value moves across one of them or to or from unknown: a busy GPU whose load wanders, or an idle
        one at 0-3 %, adds no point, so the bounded history spans hours of a long lease."""
        pct = pct if 0 <= pct <= 100 else UNKNOWN
        self._current[gpu_uuid] = pct
        points = self._points.setdefault(gpu_uuid, [])
        if points and _same_band(points[-1][1], pct, thresholds):
            return
        at = max(at, points[-1][0]) if points else at
        points.append((at, pct))
        if len(points) > self.max_points:
            del points[0]
        self._moves.add(gpu_uuid)

    def points(self, gpu_uuid: str) -> Points:
        return tuple(self._points.get(gpu_uuid, ()))

    def keep_only(self, gpu_uuids: Iterable[str]) -> None:
        keep = set(gpu_uuids)
        for uuid in [u for u in self._points if u not in keep]:
            del self._points[uuid]
            self._current.pop(uuid, None)
            self._moves.add(uuid)

    def moved_since(self, mark: int) -> tuple[int, set[str] | None]:
        """The GPUs whose points changed since ``mark`` (0, or a mark this returned before), and the mark to pass
        next time; None instead of the GPUs when the log no longer reaches back to ``mark`` (any may have)."""
        return self._moves.since(mark)

    def current(self, gpu_uuid: str) -> int:
        """The GPU's last reported value (the points keep only the moves across thresholds)."""
        return self._current.get(gpu_uuid, UNKNOWN)


def _same_band(a: int, b: int, thresholds: Collection[float]) -> bool:
    """Whether two values tell every judgment the same: equal, or (with thresholds) both known and on the same
    side of each threshold."""
    if a == b or not thresholds:
        return a == b
    return a != UNKNOWN and b != UNKNOWN and all((a < t) == (b < t) for t in thresholds)


def below_since(points: Points, below_pct: float) -> float | None:
    """Since when the GPU's utilization has been known and below the threshold without a break; None when its
    latest value is not (unknown, or at or above the threshold)."""
    since = None
    for at, pct in reversed(points):
        if pct == UNKNOWN or pct >= below_pct:
            break
        since = at
    return since


def idle_seconds(points: Points, start: float, end: float, below_pct: float) -> float:
    """How long within [start, end] the GPU's utilization was known and below the threshold, each value holding from
    when it was first seen until the next one and the last until ``end`` (unknown before the first): never more
    than it was idle, as this history saw it (usage accounting's idle GPU-seconds)."""
    total = 0.0
    for i, (at, pct) in enumerate(points):
        if pct == UNKNOWN or pct >= below_pct:
            continue
        until = points[i + 1][0] if i + 1 < len(points) else end
        total += max(0.0, min(until, end) - max(at, start))
    return total


@dataclasses.dataclass(frozen=True)
class LeaseIdle:
    """One lease's judgment: ``idle_since`` (None: not below the threshold now), ``idle`` (below for the whole
    window) and the policy's action ("" when its policy is off)."""

    lease_id: str
    idle_since: float | None
    idle: bool
    action: str


def judge(lease_id: str, seen_at: float, gpu_uuids: Iterable[str], history: UtilizationHistory | Mapping[str, Points],
          policy: IdlePolicy, now: float) -> LeaseIdle:
    """Whether the lease (first seen at ``seen_at``, holding ``gpu_uuids``) is idle at ``now`` under ``policy``."""
    uuids = list(gpu_uuids)
    if not policy.on:
        return LeaseIdle(lease_id, None, False, "")   # (no action: idle reclaim is off for it)
    if not uuids:
        return LeaseIdle(lease_id, None, False, policy.action)
    since = seen_at
    for uuid in uuids:
        points = history.points(uuid) if isinstance(history, UtilizationHistory) else history.get(uuid, ())
        gpu_since = below_since(points, policy.below_pct)
        if gpu_since is None:
            return LeaseIdle(lease_id, None, False, policy.action)
        since = max(since, gpu_since)
    return LeaseIdle(lease_id, since, now - since >= policy.after_s, policy.action)


def to_evict(judged: Iterable[LeaseIdle], noticed: Iterable[str]) -> list[str]:
    """The idle leases under ``evict`` that have no eviction notice yet, in id order."""
    skip = set(noticed)
    return sorted(x.lease_id for x in judged if x.idle and x.action == "evict" and x.lease_id not in skip)
