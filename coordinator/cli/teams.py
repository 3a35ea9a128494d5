"""``gpucoord team set|show|list|delete``: the teams that share the fleet (operator only; docs/teams.md "Teams")."""
from __future__ import annotations

import argparse
import json
from typing import Any, Callable

from coordinator.cli.common import (
    CliError,
    UsageError,
    _client_tls,
    _stub,
    check_name,
    duration,
    rpc_error,
)
from coordinator.limits import quote
from coordinator.rpc.status_json import message_to_json

_TLS = ("tls-ca", "tls-cert", "tls-key")


def add_parsers(sub: Any, command: Callable[..., argparse.ArgumentParser]) -> None:
    """``team`` on ``sub``; ``command(sub, name, uses, **kw)`` makes a subcommand (coordinator.cli.main)."""
    uses = ("coordinator", *_TLS)
    te = command(sub, "team", uses, help="teams: guaranteed VRAM quotas, limits and weights over the fleet")
    tsub = te.add_subparsers(dest="team_cmd", required=True, metavar="set|show|list|delete")
    se = command(tsub, "set", uses, help="create or change a team (fields not given keep their values)")
    se.add_argument("name")
    se.add_argument("--quota", default=None, metavar="SIZE",
                    help="VRAM guaranteed to the team over the fleet, e.g. 320GiB (VRAM x GPUs of its leases)")
    se.add_argument("--limit", default=None, metavar="SIZE|none", help="hard cap on the team's VRAM; none: no cap")
    se.add_argument("--weight", type=float, default=None, help="share of idle VRAM beyond the quotas (default 1)")
    se.add_argument("--members", default=None, metavar="PATTERN[,PATTERN...]",
                    help="agent names or prefixes such as 'research-*' (replaces the list; '' for none)")
    se.add_argument("--model-quota", action="append", default=None, metavar="MODEL=SIZE",
                    help="a guarantee on one GPU model (repeatable; replaces them all; 'none' clears them)")
    se.add_argument("--max-min-runtime", type=float, default=None, metavar="SECONDS",
                    help="the longest minimum runtime before reclaim that its leases may declare (default 0)")
    se.add_argument("--max-time-limit", type=duration, default=None, metavar="DURATION",
                    help="the longest time limit its agents may ask (90, 5m, 2h; 0: the fleet's maximum)")
    se.add_argument("--default-time-limit", type=duration, default=None, metavar="DURATION",
                    help="the time limit of its requests that ask none (0: the fleet's default)")
    se.add_argument("--idle-after", type=duration, default=None, metavar="DURATION",
                    help="its idle window (docs/policies.md 'Idle GPUs'; 0: the fleet's)")
    se.add_argument("--idle-below", type=float, default=None, metavar="PERCENT", help="its idle threshold (0: the fleet's)")
    se.add_argument("--idle-action", choices=("warn", "evict", ""), default=None, help="its idle action ('': the fleet's)")
    se.add_argument("--json", action="store_true")
    sh = command(tsub, "show", uses, help="one team, with its usage")
    sh.add_argument("name")
    sh.add_argument("--json", action="store_true")
    li = command(tsub, "list", uses, help="every team (and default) with its usage")
    li.add_argument("--json", action="store_true")
    de = command(tsub, "delete", uses, help="delete a team: its agents fall to the next matching team, else default")
    de.add_argument("name")
    te.set_defaults(fn=cmd_team)


_HELP = "see 'gpucoord team set --help'"


def size_mb(text: str, flag: str) -> int:
    """A size (docs/cli.md, "Sizes": ``320GiB``, ``4096MiB``; a number without a unit is bytes, ``0`` is none) in
    whole MiB, rounded down; under 1 MiB but not 0 is refused."""
    from coordinator.policy.partition import PartitionError, parse_mib
    try:
        return parse_mib(text, flag)
    except PartitionError as e:
        raise UsageError(str(e), _HELP) from None


def _patterns(text: str) -> list[str]:
    """``--members``: comma-separated patterns; '' for none. An empty one between commas is a typo."""
    if not text.strip():
        return []
    patterns = [p.strip() for p in text.split(",")]
    if not all(patterns):
        raise UsageError(f"--members: {quote(text)} has an empty pattern (two commas, or one at an end)", _HELP)
    return patterns


def _model_quotas(items: list[str]) -> dict[str, int]:
    """``--model-quota MODEL=SIZE`` given one or more times (each model once), or ``none`` alone."""
    if [i.strip().lower() for i in items] == ["none"]:
        return {}
    quotas: dict[str, int] = {}
    for item in items:
        model, eq, size = item.rpartition("=")
        if not eq or not model.strip():
            raise UsageError(f"--model-quota: {quote(item)} is not MODEL=SIZE ('none' alone clears them)", _HELP)
        if model.strip() in quotas:
            raise UsageError(f"--model-quota: {quote(model.strip())} is given twice", _HELP)
        quotas[model.strip()] = size_mb(size, "--model-quota")
    return quotas


def set_request(args: argparse.Namespace) -> Any:
    """The SetTeamRequest of ``team set``, every field checked here on its own first (exit 2, nothing sent);
    what ties fields to the stored team (the limit against the quota) the coordinator checks."""
    from agent_client.api import coordinator_pb2 as pb
    from coordinator.keys import valid_name
    from coordinator.policy.teams import TeamError, check_changes
    if not valid_name(args.name):
        raise UsageError(f"name: {quote(args.name)} is not a valid team name (letters, digits, '.', '_', ':', "
                         "'@', '-'; at most 128)", _HELP)
    req = pb.SetTeamRequest(name=args.name)
    changes: dict[str, Any] = {}
    if args.quota is not None:
        req.quota_mb = changes["quota_mb"] = size_mb(args.quota, "--quota")
    if args.limit is not None:
        limit = None if args.limit.strip().lower() == "none" else size_mb(args.limit, "--limit")
        req.limit_mb = -1 if limit is None else limit
        changes["limit_mb"] = limit
    if args.weight is not None:
        req.weight = changes["weight"] = args.weight
    if args.members is not None:
        req.members.SetInParent()
        changes["members"] = _patterns(args.members)
        req.members.patterns.extend(changes["members"])
    if args.model_quota is not None:
        req.quota_by_model.SetInParent()
        changes["quota_by_model"] = _model_quotas(args.model_quota)
        for model, mb in changes["quota_by_model"].items():
            req.quota_by_model.mb[model] = mb
    if args.max_min_runtime is not None:
        req.max_min_runtime_seconds = changes["max_min_runtime_s"] = args.max_min_runtime
    if args.max_time_limit is not None:
        req.max_time_limit_seconds = changes["max_time_limit_s"] = args.max_time_limit
    if args.default_time_limit is not None:
        req.default_time_limit_seconds = changes["default_time_limit_s"] = args.default_time_limit
    if args.idle_after is not None:
        req.idle_after_seconds = changes["idle_after_s"] = args.idle_after
    if args.idle_below is not None:
        req.idle_below_percent = changes["idle_below_pct"] = args.idle_below
    if args.idle_action is not None:
        req.idle_action = changes["idle_action"] = args.idle_action
    try:
        check_changes(changes)
    except TeamError as e:
        flag = {"quota_mb": "--quota", "limit_mb": "--limit", "weight": "--weight", "members": "--members",
                "max_min_runtime_s": "--max-min-runtime", "max_time_limit_s": "--max-time-limit",
                "default_time_limit_s": "--default-time-limit", "idle_after_s": "--idle-after",
                "idle_below_pct": "--idle-below", "idle_action": "--idle-action"}.get(e.field, "--model-quota")
        raise UsageError(f"{flag}: {e.message}", _HELP) from None
    return req


def _mib(mb: int) -> str:
    from coordinator.policy.partition import show_mib
    return show_mib(mb)


def describe(team: dict[str, Any]) -> str:
    """A team's settings on one line."""
    models = team.get("quota_by_model_mb") or {}
    return ", ".join([
        f"quota {_mib(int(team.get('quota_mb', 0)))}"
        + "".join(f" ({m}: {_mib(int(v))})" for m, v in sorted(models.items())),
        f"limit {_mib(int(team.get('limit_mb', 0)))}" if team.get("has_limit") else "no limit",
        f"weight {float(team.get('weight', 1.0)):g}",
        "members " + (", ".join(team.get("members", [])) or "none"),
    ] + ([f"max min runtime {float(team['max_min_runtime_seconds']):g}s"]
         if team.get("max_min_runtime_seconds") else [])
      + [f"{what} time limit {float(team[f'{what}_time_limit_seconds']):g}s" for what in ("max", "default")
         if team.get(f"{what}_time_limit_seconds")]
      + ([f"idle {team.get('idle_action') or 'policy'} after {float(team.get('idle_after_seconds') or 0):g}s below "
          f"{float(team.get('idle_below_percent') or 0):g}% (0: the fleet's)"]
         if team.get("idle_after_seconds") or team.get("idle_below_percent") or team.get("idle_action") else []))


def render_teams(rows: list[dict[str, Any]]) -> str:
    """The teams table: quota, limit, used, borrowed (used above quota), waiting, weight, decayed usage (GPU-hours)
    and members."""
    header = ("TEAM", "QUOTA", "LIMIT", "USED", "BORROWED", "WAITING", "WEIGHT", "DECAYED", "MEMBERS")
    lines = [header]
    for row in rows:
        t, u = row.get("team", {}), row.get("usage", {})
        models = t.get("quota_by_model_mb") or {}
        quota = _mib(int(t.get("quota_mb", 0))) + "".join(f" {m}:{_mib(int(v))}" for m, v in sorted(models.items()))
        lines.append((
            str(t.get("name", "?")) + ("" if row.get("stored") else " (no record)"),
            quota,
            _mib(int(t.get("limit_mb", 0))) if t.get("has_limit") else "-",
            f"{_mib(int(u.get('used_mb', 0)))} ({u.get('leases', 0)})",
            f"{_mib(int(u.get('borrowed_mb', 0)))} ({u.get('over_quota_leases', 0)})",
            f"{_mib(int(u.get('waiting_mb', 0)))} ({u.get('waiting', 0)})",
            f"{float(t.get('weight', 1.0)):g}",
            f"{float(u.get('decayed_gpu_hours', 0.0)):.1f}h",
            ",".join(t.get("members", [])) or "-",
        ))
    widths = [max(len(r[i]) for r in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in lines)


def cmd_team(args: argparse.Namespace) -> int:
    import grpc

    from agent_client.api import coordinator_pb2 as pb
    if args.team_cmd != "list":
        check_name("name", args.name, f"team {args.team_cmd}")
    request = set_request(args) if args.team_cmd == "set" else None
    stub = _stub(args.coordinator, _client_tls(args))
    try:
        if request is not None:
            resp = stub.SetTeam(request, timeout=15)
            doc = message_to_json(resp.team)
            print(json.dumps(doc, indent=2) if args.json else
                  f"team {args.name} {'created' if resp.created else 'changed'}: {describe(doc)}")
        elif args.team_cmd == "show":
            row = message_to_json(stub.GetTeam(pb.GetTeamRequest(name=args.name), timeout=10).team)
            print(json.dumps(row, indent=2) if args.json else render_teams([row]))
        elif args.team_cmd == "list":
            rows = message_to_json(stub.ListTeams(pb.ListTeamsRequest(), timeout=10)).get("teams", [])
            print(json.dumps(rows, indent=2) if args.json else render_teams(rows))
        else:
            if not stub.DeleteTeam(pb.DeleteTeamRequest(name=args.name), timeout=10).deleted:
                raise CliError(f"NOT_FOUND: name: no team {args.name!r}", "'gpucoord team list' shows them",
                               refused=True)
            print(f"team {args.name} deleted; its agents fall to the next matching team, else default")
    except grpc.RpcError as e:
        raise rpc_error(e, args.coordinator) from None
    return 0
