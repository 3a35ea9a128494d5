"""``gpucoord team set|show|list|delete``: the teams that share the fleet (operator only; README "Teams")."""
from __future__ import annotations

import argparse
import json
from typing import Any, Callable

from coordinator.cli.common import (
    CliError,
    UsageError,
    _client_tls,
    _stub,
    message_to_json,
    rpc_error,
)

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
    se.add_argument("--json", action="store_true")
    sh = command(tsub, "show", uses, help="one team, with its usage")
    sh.add_argument("name")
    sh.add_argument("--json", action="store_true")
    li = command(tsub, "list", uses, help="every team (and default) with its usage")
    li.add_argument("--json", action="store_true")
    de = command(tsub, "delete", uses, help="delete a team: its agents fall to the next matching team, else default")
    de.add_argument("name")
    te.set_defaults(fn=cmd_team)


def size_mb(text: str, flag: str) -> int:
    """A size with a unit (``320GiB``, ``4096MiB``), in whole MiB (rounded down)."""
    from coordinator.policy.partition import PartitionError, parse_size
    if text.strip().replace(".", "", 1).isdigit():
        raise UsageError(f"{flag}: {text!r} has no unit; give a size such as 320GiB or 4096MiB",
                         "see 'gpucoord team set --help'")
    try:
        return parse_size(text, flag) // (1 << 20)
    except PartitionError as e:
        raise UsageError(str(e), "see 'gpucoord team set --help'") from None


def set_request(args: argparse.Namespace) -> Any:
    from agent_client.api import coordinator_pb2 as pb
    req = pb.SetTeamRequest(name=args.name)
    if args.quota is not None:
        req.quota_mb = size_mb(args.quota, "--quota")
    if args.limit is not None:
        req.limit_mb = -1 if args.limit.strip().lower() == "none" else size_mb(args.limit, "--limit")
    if args.weight is not None:
        req.weight = args.weight
    if args.members is not None:
        req.members.SetInParent()
        req.members.patterns.extend(p.strip() for p in args.members.split(",") if p.strip())
    if args.model_quota is not None:
        req.quota_by_model.SetInParent()
        for item in args.model_quota:
            if item.strip().lower() == "none":
                continue
            model, eq, size = item.rpartition("=")
            if not eq or not model.strip():
                raise UsageError(f"--model-quota: {item!r} is not MODEL=SIZE", "see 'gpucoord team set --help'")
            req.quota_by_model.mb[model.strip()] = size_mb(size, "--model-quota")
    if args.max_min_runtime is not None:
        req.max_min_runtime_seconds = args.max_min_runtime
    return req


def _mib(mb: int) -> str:
    return f"{mb / 1024:g}GiB" if mb % 1024 == 0 and mb else f"{mb}MiB"


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
         if team.get("max_min_runtime_seconds") else []))


def render_teams(rows: list[dict[str, Any]]) -> str:
    """The teams table: quota, limit, used, borrowed (used above quota), waiting, weight and members."""
    header = ("TEAM", "QUOTA", "LIMIT", "USED", "BORROWED", "WAITING", "WEIGHT", "MEMBERS")
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
            ",".join(t.get("members", [])) or "-",
        ))
    widths = [max(len(r[i]) for r in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in lines)


def cmd_team(args: argparse.Namespace) -> int:
    import grpc

    from agent_client.api import coordinator_pb2 as pb
    stub = _stub(args.coordinator, _client_tls(args))
    try:
        if args.team_cmd == "set":
            resp = stub.SetTeam(set_request(args), timeout=15)
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
                raise CliError(f"NOT_FOUND: name: no team {args.name!r}", "'gpucoord team list' shows them")
            print(f"team {args.name} deleted; its agents fall to the next matching team, else default")
    except grpc.RpcError as e:
        raise rpc_error(e, args.coordinator) from None
    return 0
