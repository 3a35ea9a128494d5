"""The Teams RPCs' messages (operator only): a SetTeamRequest as the changes it asks for, teams and their usage
as messages. The servicer (``coordinator_server``) calls these around ``coordinator.replica.teams.Teams``."""
from __future__ import annotations

from typing import Any, Iterable

from agent_client.api import coordinator_pb2 as pb
from coordinator import errors
from coordinator.limits import quote
from coordinator.policy.host import HostView
from coordinator.policy.teams import DEFAULT_TEAM, Team, Usage
from coordinator.replica.teams import Teams
from coordinator.rpc.validate import check_name


def team_name(name: str) -> str:
    return check_name("name", name)


def team_changes(request: pb.SetTeamRequest) -> dict[str, Any]:
    """The fields a SetTeamRequest gives, as changes to the team's JSON document (checked as a whole by the
    team's record, which names the field at fault)."""
    team_name(request.name)
    changes: dict[str, Any] = {}
    if request.HasField("quota_mb"):
        changes["quota_mb"] = request.quota_mb
    if request.HasField("limit_mb"):
        changes["limit_mb"] = None if request.limit_mb == -1 else request.limit_mb
    if request.HasField("weight"):
        changes["weight"] = request.weight
    if request.HasField("members"):
        changes["members"] = list(request.members.patterns)
    if request.HasField("quota_by_model"):
        changes["quota_by_model"] = dict(request.quota_by_model.mb)
    if request.HasField("max_min_runtime_seconds"):
        changes["max_min_runtime_s"] = request.max_min_runtime_seconds
    for field in ("max_time_limit", "default_time_limit"):
        if request.HasField(f"{field}_seconds"):
            changes[f"{field}_s"] = getattr(request, f"{field}_seconds")
    if request.HasField("idle_after_seconds"):
        changes["idle_after_s"] = request.idle_after_seconds
    if request.HasField("idle_below_percent"):
        changes["idle_below_pct"] = request.idle_below_percent
    if request.HasField("idle_action"):
        changes["idle_action"] = request.idle_action
    return changes


def team_pb(team: Team) -> pb.Team:
    return pb.Team(name=team.name, quota_mb=team.quota_mb, has_limit=team.limit_mb is not None,
                   limit_mb=team.limit_mb or 0, weight=team.weight, members=list(team.members),
                   quota_by_model_mb=dict(team.quota_by_model), max_min_runtime_seconds=team.max_min_runtime_s,
                   max_time_limit_seconds=team.max_time_limit_s, default_time_limit_seconds=team.default_time_limit_s,
                   idle_after_seconds=team.idle_after_s, idle_below_percent=team.idle_below_pct,
                   idle_action=team.idle_action)


def team_status_pb(team: Team, usage: Usage, stored: bool) -> pb.TeamStatus:
    return pb.TeamStatus(team=team_pb(team), stored=stored, usage=pb.TeamUsage(
        used_mb=usage.used_mb, borrowed_mb=usage.borrowed_mb, waiting_mb=usage.waiting_mb, leases=usage.leases,
        over_quota_leases=usage.over_quota_leases, waiting=usage.waiting,
        decayed_gpu_hours=round(usage.decayed_gpu_s / 3600.0, 3)))


async def set_team(teams: Teams, request: pb.SetTeamRequest) -> pb.SetTeamResponse:
    changes = team_changes(request)
    team, created = await teams.set_team(request.name, changes)
    return pb.SetTeamResponse(team=team_pb(team), created=created)


async def get_team(teams: Teams, request: pb.GetTeamRequest) -> pb.GetTeamResponse:
    team_name(request.name)
    _, [(team, usage, stored)] = await teams.team_status(request.name)
    if not stored and request.name != DEFAULT_TEAM:
        raise errors.NotFound(f"name: no team {quote(request.name)} ('gpucoord team list' shows them)", "name")
    return pb.GetTeamResponse(team=team_status_pb(team, usage, stored))


async def list_teams(teams: Teams) -> pb.ListTeamsResponse:
    revision, rows = await teams.team_status()
    return pb.ListTeamsResponse(teams=[team_status_pb(*row) for row in rows], revision=revision)


async def status_teams(teams: Teams, views: Iterable[HostView]) -> tuple[list[pb.TeamStatus], list[pb.UsageDay]]:
    """GetStatus's teams: every stored team and ``default`` with their usage in ``views``, and the last days'
    GPU-seconds per team. (The per-team gauges come from the watch: ``coordinator.replica.gauges``.)"""
    rows, days = await teams.status_rows(views)
    return [team_status_pb(*row) for row in rows], [pb.UsageDay(day=d, gpu_seconds=t) for d, t in days.items()]


async def delete_team(teams: Teams, request: pb.DeleteTeamRequest) -> pb.DeleteTeamResponse:
    team_name(request.name)
    return pb.DeleteTeamResponse(deleted=await teams.delete_team(request.name))
