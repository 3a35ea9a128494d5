"""Time limits (issue 31, docs/policies.md "Time limits"): what a request's limit becomes, and when its lease is warned.

Pure: no I/O, no clock of its own. The replica resolves a request's limit at acquire (``resolve``) and stores the
result on the lease (``time_limit_s``, ``time_limit_warning_s``); the leader's duty (``replica/time_limits.py``)
asks ``due`` which leases must get their ``time-limit`` notice now, and with what grace.
"""
from __future__ import annotations

import dataclasses

from coordinator import errors
from coordinator.limits import MAX_TIME_LIMIT_S

REASON = "time-limit"   # the reason of the notice a lease gets before its end
FIELD = "time_limit_seconds"


def check(seconds: float, field: str = FIELD) -> None:
    """A limit or a warning as asked: a finite number of seconds within [0, MAX_TIME_LIMIT_S] (0: none, or
    the coordinator's default)."""
    if seconds != seconds or not 0 <= seconds <= MAX_TIME_LIMIT_S:
        raise errors.InvalidArgument(f"{field}: must be within [0, {MAX_TIME_LIMIT_S:g}] seconds (0: no limit), "
                                     f"got {seconds:g}", field)


def resolve(asked_s: float, asked_warning_s: float, default_s: float, max_s: float,
            warning_s: float, min_runtime_s: float = 0.0) -> tuple[float, float]:
    """The (limit, warning) a new lease records, from what was asked (validated by ``check``) and the
    coordinator's ``default_time_limit_s``, ``max_time_limit_s`` (0: none) and ``time_limit_warning_s``.
    ``default_s`` and ``max_s`` are the team's where it sets them (``team_limits``). No limit asked takes the
    default (capped at the maximum); a limit above the maximum is INVALID_ARGUMENT naming
    ``time_limit_seconds``. The warning is the one asked (0: the coordinator's), capped at the limit; (0, 0)
    for a lease without a limit. A minimum runtime (teams) above the limit is INVALID_ARGUMENT naming
    ``min_runtime_seconds``: the lease could not run it."""
    if max_s and default_s > max_s:
        default_s = max_s   # (a fleet's default above a team's maximum)
    if max_s and asked_s > max_s:
        raise errors.InvalidArgument(f"{FIELD}: {asked_s:g} s is above this fleet's maximum time limit "
                                     f"({max_s:g} s)", FIELD)
    limit = asked_s or default_s
    if not limit:
        return 0.0, 0.0
    if min_runtime_s > limit:
        raise errors.InvalidArgument(f"min_runtime_seconds: {min_runtime_s:g} s is above the lease's time limit "
                                     f"({limit:g} s)", "min_runtime_seconds")
    return limit, min(asked_warning_s or warning_s, limit)


def team_limits(fleet_default_s: float, fleet_max_s: float, team_default_s: float,
                team_max_s: float) -> tuple[float, float]:
    """The (default, maximum) for an agent: its team's where the team sets them, the tighter maximum of the two
    (0: none)."""
    maxima = [x for x in (fleet_max_s, team_max_s) if x]
    return team_default_s or fleet_default_s, min(maxima) if maxima else 0.0


@dataclasses.dataclass(frozen=True)
class Limited:
    """One lease with a time limit as the leader sees it: its end on the leader's monotonic clock (when the
    leader's replica first saw the lease + the limit), its warning, and whether it has an operator's notice
    already (a drain's, a revoke's, or its own ``time-limit`` notice sent before)."""

    lease_id: str
    ends_at: float
    warning_s: float
    noticed: bool


def due(leases: list[Limited], now: float) -> tuple[list[tuple[str, float]], float | None]:
    """(lease id, grace) for each lease that must get its notice now (the grace is the time left to its end,
    never below a small floor, so a late notice still has a deadline: at once), and when to look again (the
    next warning time; None if there is none)."""
    out: list[tuple[str, float]] = []
    upcoming: list[float] = []
    for lease in leases:
        if lease.noticed:
            continue
        warn_at = lease.ends_at - lease.warning_s
        if now >= warn_at:
            out.append((lease.lease_id, max(MIN_GRACE_S, lease.ends_at - now)))
        else:
            upcoming.append(warn_at)
    return out, min(upcoming) if upcoming else None


MIN_GRACE_S = 0.001   # ``Leases.evict`` reads a grace of 0 as the fleet's default grace
