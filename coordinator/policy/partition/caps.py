"""Priority caps: the highest priority an agent may ask for, and whether it may ask for non-preemptible leases,
set by the operator (G9). Pure: plain data in, an error or None out.

The operator writes them in a host's partition spec, per agent name or name pattern::

    [priority_caps]
    "agent-a" = { max_priority = 100, non_preemptible = true }
    "batch-*" = { max_priority = 10 }
    "*"       = { max_priority = 0 }            # everyone else on this host

An agent's cap is the entry of its exact name, else that of the most specific pattern that matches it (the
longest; ties by name), else the built-in default: with TLS, ``TLS_DEFAULT`` (priority at most 0, preemptible
leases only), so an agent the operator has not named can neither evict anyone at priority 0 or above nor
hold a lease nobody can evict; without TLS, ``UNCAPPED`` (no identity to cap: an agent name is whatever a
request says, so caps the operator wrote apply to the names requests claim, and protect against accidents,
not against abuse). An operator's own acquires are not capped.
"""
from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping, Sequence

from coordinator import errors
from coordinator.limits import MAX_PRIORITY, quote
from coordinator.policy.partition.units import MAX_AGENTS, PartitionError, _key, _show

PATTERN_CHARS = frozenset("*?[]")
_CAP_KEYS = ("max_priority", "non_preemptible")


@dataclasses.dataclass(frozen=True)
class PriorityCap:
    max_priority: int
    non_preemptible: bool = False   # may ask for leases that no higher-priority request can evict

    def to_json(self) -> dict[str, object]:
        return {"max_priority": self.max_priority, "non_preemptible": self.non_preemptible}


UNCAPPED = PriorityCap(MAX_PRIORITY, True)
TLS_DEFAULT = PriorityCap(0, False)


def valid_pattern(name: str) -> bool:
    """An agent name or a pattern of them: the one syntax of priority caps and team members."""
    allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:@-") | PATTERN_CHARS
    return 0 < len(name) <= 128 and all(c in allowed for c in name)


def parse_caps(v: object) -> tuple[tuple[str, PriorityCap], ...]:
    """``[priority_caps]`` of a spec: sorted by name. PartitionError naming the entry when malformed."""
    if not isinstance(v, Mapping):
        raise PartitionError("priority_caps", f"expected a table, got {type(v).__name__}")
    if len(v) > MAX_AGENTS:
        raise PartitionError("priority_caps", f"too many entries ({len(v)}, at most {MAX_AGENTS})")
    out = []
    for name, entry in v.items():
        f = f"priority_caps.{_key(name)}"
        if not isinstance(name, str) or not valid_pattern(name):
            raise PartitionError(f, "not an agent name or pattern (letters, digits, '.', '_', ':', '@', '-', and "
                                    "the wildcards '*', '?', '[...]'; at most 128)")
        if not isinstance(entry, Mapping):
            raise PartitionError(f, f"expected a table like {{ max_priority = 10 }}, got {type(entry).__name__}")
        for k in entry:
            if k not in _CAP_KEYS:
                raise PartitionError(f"{f}.{_key(k)}", f"unknown key (expected one of: {', '.join(_CAP_KEYS)})")
        if "max_priority" not in entry:
            raise PartitionError(f"{f}.max_priority", "missing")
        top = entry["max_priority"]
        if isinstance(top, bool) or not isinstance(top, int) or not -MAX_PRIORITY <= top <= MAX_PRIORITY:
            raise PartitionError(f"{f}.max_priority", f"expected an integer within [-{MAX_PRIORITY}, "
                                                      f"{MAX_PRIORITY}], got {_show(top)}")
        pinned = entry.get("non_preemptible", False)
        if not isinstance(pinned, bool):
            raise PartitionError(f"{f}.non_preemptible", f"expected true or false, got {_show(pinned)}")
        out.append((name, PriorityCap(top, pinned)))
    return tuple(sorted(out))


def cap_for(agent: str, caps: Sequence[tuple[str, PriorityCap]], default: PriorityCap) -> tuple[PriorityCap, str]:
    """``agent``'s cap and the entry it comes from (its name, a pattern, or "the default")."""
    patterns = []
    for name, cap in caps:
        if name == agent:
            return cap, name
        if PATTERN_CHARS & set(name) and fnmatch.fnmatchcase(agent, name):
            patterns.append((-len(name), name, cap))
    if patterns:
        _, name, cap = min(patterns)
        return cap, name
    return default, "the default"


def check(agent: str, host: str, priority: int, preemptible: bool, caps: Sequence[tuple[str, PriorityCap]],
          default: PriorityCap) -> errors.NotOwner | None:
    """PERMISSION_DENIED naming ``priority`` (or ``preemptible``) and the cap, or None when the request is
    within ``agent``'s cap on ``host``."""
    cap, source = cap_for(agent, caps, default)
    where = f"priority_caps entry {quote(source)}" if source != "the default" else \
        "the default for agents the operator has not named"
    if priority > cap.max_priority:
        return errors.NotOwner(
            f"priority: {priority} is above the cap of agent {quote(agent)} on host {quote(host)}: max_priority "
            f"{cap.max_priority} ({where}; the operator sets it in the host's partition spec)", "priority")
    if not preemptible and not cap.non_preemptible:
        return errors.NotOwner(
            f"preemptible: agent {quote(agent)} may not ask for non-preemptible leases on host {quote(host)} "
            f"({where}: non_preemptible = false; the operator sets it in the host's partition spec)", "preemptible")
    return None
