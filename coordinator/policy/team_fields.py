"""A team's fields one by one (``coordinator.policy.teams`` has the record they make): their bounds, and the
checks ``Team.from_json`` runs on each, which the CLI also runs on a ``team set`` before it sends anything.
Pure."""
from __future__ import annotations

import math
from typing import Any, Mapping

from coordinator.limits import MAX_TIME_LIMIT_S, quote
from coordinator.policy.partition.caps import valid_pattern

MAX_TEAM_MEMBERS = 256          # member patterns of one team
MAX_TEAM_MODELS = 64            # per-model quotas of one team
MAX_TEAM_MB = 1 << 50           # a quota or limit: 1 ZiB in MiB; anything above is a typo
MIN_WEIGHT = 0.001              # a smaller weight would make borrowed / weight overflow a float
MAX_WEIGHT = 1_000_000.0
MAX_MIN_RUNTIME_S = 7 * 86400.0
MAX_MODEL_NAME_LEN = 128

_FIELDS = ("quota_mb", "quota_by_model", "limit_mb", "weight", "members", "max_min_runtime_s", "max_time_limit_s",
           "default_time_limit_s", "idle_after_s", "idle_below_pct", "idle_action")
TIME_LIMIT_FIELDS = ("max_time_limit_s", "default_time_limit_s")   # stored only when set (docs/policies.md "Time limits")
IDLE_FIELDS = ("idle_after_s", "idle_below_pct", "idle_action")      # stored only when set (docs/policies.md "Idle GPUs")
MAX_IDLE_AFTER_S = 30 * 86400.0


def check_idle(doc: Mapping[str, Any]) -> tuple[float, float, str]:
    """A team's idle policy (each field where set; 0 or "": the fleet's); TeamError naming the field."""
    after = _number(doc.get("idle_after_s", 0.0), "idle_after_s", 0.0, MAX_IDLE_AFTER_S)
    below = _number(doc.get("idle_below_pct", 0.0), "idle_below_pct", 0.0, 100.0)
    action = doc.get("idle_action", "")
    if action not in ("", "warn", "evict"):
        raise TeamError("idle_action", f"expected warn or evict, got {quote(action)}")
    return after, below, action


class TeamError(ValueError):
    """A team that cannot be stored. ``field`` names the entry, ``message`` says why."""

    def __init__(self, field: str, message: str) -> None:
        self.field, self.message = field, message
        super().__init__(f"{field}: {message}")


def _amount(value: Any, field: str, hi: int = MAX_TEAM_MB) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TeamError(field, f"expected a whole number of MiB, got {type(value).__name__}")
    if not 0 <= value <= hi:
        raise TeamError(field, f"{str(value)[:24]} is outside [0, {hi}] MiB")
    return value


def _number(value: Any, field: str, lo: float, hi: float, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TeamError(field, f"expected a finite number, got {quote(value)}")
    if value < lo or (lo_open and value == lo) or value > hi:
        raise TeamError(field, f"{quote(value)} is outside {'(' if lo_open else '['}{lo:g}, {hi:g}]")
    return float(value)


def check_pattern(pattern: Any, field: str = "members") -> str:
    """An agent name, or a pattern of them (fnmatch's ``*``, ``?``, ``[...]``: ``research-*``), the same
    syntax as a partition's priority caps."""
    if not isinstance(pattern, str):
        raise TeamError(field, f"expected agent names or patterns, got {type(pattern).__name__}")
    if not valid_pattern(pattern):
        raise TeamError(field, f"{quote(pattern)} is neither an agent name nor a pattern such as 'research-*' "
                               "(letters, digits, '.', '_', ':', '@', '-', and the wildcards '*', '?', '[...]'; "
                               "at most 128)")
    return pattern


def _models(models: Any) -> list[tuple[str, int]]:
    if not isinstance(models, dict):
        raise TeamError("quota_by_model", f"expected an object of GPU model: MiB, got {type(models).__name__}")
    if len(models) > MAX_TEAM_MODELS:
        raise TeamError("quota_by_model", f"at most {MAX_TEAM_MODELS} GPU models, got {len(models)}")
    by_model = []
    for model, mb in sorted(models.items()):
        field = f"quota_by_model[{quote(model)}]"
        if not isinstance(model, str) or not model.strip() or len(model) > MAX_MODEL_NAME_LEN \
                or not model.isprintable():
            raise TeamError(field, f"a GPU model is a printable name of 1 to {MAX_MODEL_NAME_LEN} characters")
        by_model.append((model, _amount(mb, field)))
    return by_model


def _members(members: Any) -> list[str]:
    if not isinstance(members, (list, tuple)):
        raise TeamError("members", f"expected a list of agent names or prefixes, got {type(members).__name__}")
    if len(members) > MAX_TEAM_MEMBERS:
        raise TeamError("members", f"at most {MAX_TEAM_MEMBERS} patterns, got {len(members)}")
    patterns = [check_pattern(m) for m in members]
    if len(set(patterns)) != len(patterns):
        twice = next(p for p in patterns if patterns.count(p) > 1)
        raise TeamError("members", f"{quote(twice)} is given twice")
    return patterns


def check_changes(changes: Mapping[str, Any]) -> None:
    """Each field of ``changes`` (a team's JSON document, in part) on its own, as ``Team.from_json`` checks it:
    TeamError naming the first bad one. What ties fields together (the limit against the quota) needs the
    stored team: ``Team.changed``. The CLI checks a ``team set`` with this before it sends anything."""
    unknown = sorted(set(changes) - set(_FIELDS))
    if unknown:
        raise TeamError(unknown[0][:32], "unknown field")
    if "quota_mb" in changes:
        _amount(changes["quota_mb"], "quota_mb")
    if changes.get("limit_mb") is not None:
        _amount(changes["limit_mb"], "limit_mb")
    if "weight" in changes:
        _number(changes["weight"], "weight", MIN_WEIGHT, MAX_WEIGHT)
    if "members" in changes:
        _members(changes["members"])
    if "quota_by_model" in changes:
        _models(changes["quota_by_model"])
    if "max_min_runtime_s" in changes:
        _number(changes["max_min_runtime_s"], "max_min_runtime_s", 0.0, MAX_MIN_RUNTIME_S)
    for field in TIME_LIMIT_FIELDS:
        if field in changes:
            _number(changes[field], field, 0.0, MAX_TIME_LIMIT_S)
    check_idle(changes)


