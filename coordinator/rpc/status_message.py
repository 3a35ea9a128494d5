"""Messages of the Coordinator service built from the replica's records: a lease, the status of the hosts
(from the replica's ``StatusReport``), and what an agent may see of it."""
from __future__ import annotations

import json
from typing import Any, Callable, Sequence

from agent_client.api import coordinator_pb2 as pb
from coordinator.aio import Pacer
from coordinator.host_records import CordonRecord
from coordinator.policy.departing import process_state
from coordinator.policy.host import HostView
from coordinator.policy.waiting import WaitReason
from coordinator.records import EvictionRecord, VramLease
from coordinator.replica.status import StatusReport, host_json


def lease_pb(lease: VramLease, ttl_remaining: int = 0, parts: Sequence[VramLease] = ()) -> pb.Lease:
    """The lease as a message: a gang (``parts``: every GPU's record) as one lease over its GPUs, whose
    single-GPU fields name the first GPU. A multi-host gang's (issue 30) ``hosts`` lists its hosts in rank
    order, and its GPUs (those of ``parts``: every host's in an acquire's answer, one host's in a status)
    come in rank order, then index order, each with its host and rank; the single-GPU fields name the
    first of them (rank 0's first GPU when every part is given)."""
    rank_of = {host: n for n, (host, _) in enumerate(lease.hosts)}
    parts = sorted(parts or (lease,), key=lambda x: (rank_of.get(x.host, 0), x.gpu_index))
    first = parts[0]
    return pb.Lease(id=first.id, host=first.host, gpu_uuid=first.gpu_uuid, gpu_index=first.gpu_index,
                    vram_mb=first.vram_mb, priority=first.priority, preemptible=first.preemptible, token=first.token,
                    agent=first.agent, session_id=first.session_id, request_id=first.request_id,
                    created_at=first.created_at, ttl_remaining=ttl_remaining, pids=list(first.pids), pgid=first.pgid,
                    gpus=[pb.LeaseGpu(index=x.gpu_index, uuid=x.gpu_uuid, token=x.token, vram_mb=x.vram_mb,
                                      host=x.host, rank=rank_of.get(x.host, 0)) for x in parts],
                    exclusive=first.exclusive, topology=first.topology, min_runtime_seconds=first.min_runtime_s,
                    over_quota=bool(first.over_quota), time_limit_seconds=first.time_limit_s,
                    hosts=[host for host, _ in lease.hosts])


def wait_pb(entry: pb.QueueEntry, wait: WaitReason) -> None:
    """Why the entry waits, on its message (docs/policies.md "Why a request waits")."""
    entry.position, entry.reason = wait.position, wait.reason
    entry.has_estimate = wait.estimated_start is not None
    entry.estimated_start_unix = wait.estimated_start or 0.0
    for b in wait.blockers:
        entry.blockers.add(kind=b.kind, detail=b.detail, lease_id=b.lease_id, agent=b.agent, gpus=list(b.gpus),
                           vram_mb=b.vram_mb, ends_at_unix=b.ends_at or 0.0, rank=b.rank, priority=b.priority)


async def status_response(report: StatusReport,
                          as_notice: Callable[[EvictionRecord], pb.EvictionNotice]) -> pb.GetStatusResponse:
    """The hosts' status as a message; ``as_notice``: an eviction notice as an agent gets it. Built host by host,
    in slices with pauses for the event loop (a fleet's status is seconds of work)."""
    out = pb.GetStatusResponse(revision=report.revision, leader=report.leader)
    pacer = Pacer()
    for view in report.views:
        _host(out, host_json(view, report.ttls, report.idle), view, report, as_notice)
        await pacer.step()
    for n, e in enumerate(sorted(report.gangs, key=lambda e: e.rank), 1):
        held = sorted(v.host for v in report.views if any(x.lease_id == e.lease_id for x in v.entries))
        shape = f"{e.hosts} hosts x {e.gpu_count} {'whole GPUs' if e.exclusive else f'GPUs with {e.vram_mb} MiB each'}"
        out.gang_queue.add(rank=e.rank, agent=e.agent, vram_mb=e.vram_mb, priority=e.priority, request_id=e.request_id,
                           gpu_count=e.gpu_count, exclusive=e.exclusive, topology=e.topology, hosts=e.hosts,
                           same=e.same, prefer=e.prefer, start_after_unix=e.start_after, position=n,
                           reason=f"waits for {shape}; " + (f"reserves {', '.join(held)}" if held else
                                                             "reserves no host: every set it could get is cordoned"))
    return out


def _host(out: pb.GetStatusResponse, h: dict[str, Any], view: HostView, report: StatusReport,
          as_notice: Callable[[EvictionRecord], pb.EvictionNotice]) -> None:
    """One host of the status (``h``: its ``host_json``), added to ``out``."""
    hs = out.hosts.add(host=h["host"], address=h["address"], alive=h["alive"], simulated=h["simulated"],
                       invalid=h["invalid"], usage_age_seconds=h["usage_age_s"], usage_stale=h["usage_stale"],
                       partition_mode=h["partition_mode"], cpu_count=h["cpu_count"], mem_bytes=h["mem_bytes"],
                       disk_bytes=h["disk_bytes"], labels=h["labels"])
    for g in h["gpus"]:
        gs = hs.gpus.add(index=g["index"], uuid=g["uuid"], name=g["name"], total_mb=g["total_mb"],
                         usable_mb=g["usable_mb"], leased_mb=g["leased_mb"], used_mb=g["used_mb"],
                         untracked_mb=g["untracked_mb"], free_mb=g["free_mb"], seq=g["seq"],
                         numa_node=g["numa_node"], nvlink_peers=g["nvlink_peers"])
        for p in g["processes"]:
            gs.processes.add(pid=int(p["pid"]), used_mb=int(p["used_mb"]), state=str(p.get("state", "")),
                             lease_id=str(p.get("lease_id", "")))
        for u in g["lease_use"]:
            gs.lease_use.add(lease_id=u["lease_id"], agent=u["agent"], vram_mb=int(u["vram_mb"]),
                             used_mb=int(u["used_mb"]), over_use=bool(u["over_use"]),
                             pids=[int(x) for x in u["pids"]])
        gs.departing_mb = int(g["departing_mb"])
        gs.utilization_percent = int(g["utilization_pct"])
        for p in g["process_utilization"]:
            gs.process_utilization.add(pid=int(p["pid"]), sm_percent=int(p["sm_pct"]))
        for d in g["departing"]:
            gs.departing.add(**d)
    for a in h["agents"]:
        hs.agents.add(agent=a["agent"], allocation_json=json.dumps(a["allocation"]),
                      leased_mb=a["leased_mb"], leases=a["leases"])
    parts: dict[str, list[VramLease]] = {}
    for g in view.gpus.values():
        for x in g.leases:
            parts.setdefault(x.id, []).append(x)
    for lease in view.leases.values():
        msg = lease_pb(lease, report.ttls.get(lease.etcd_lease, -1), parts.get(lease.id, ()))
        idle = report.idle.get(lease.id)
        if idle is not None:
            msg.idle, msg.idle_since, msg.idle_action = idle["idle"], idle["idle_since"], idle["idle_action"]
        notice = report.notices.get(lease.id)
        if notice is not None:
            msg.eviction.CopyFrom(as_notice(notice))
            msg.eviction.processes = process_state(view.usage, lease.gpu_uuid, lease.id, lease.pids,
                                                   lease.pgid)
        hs.leases.append(msg)
    for q in h["queue"]:
        hs.queue.add(rank=q["rank"], agent=q.get("agent", ""), vram_mb=q.get("vram_mb", 0),
                     priority=q.get("priority", 0), gpu=q.get("gpu", ""), request_id=q.get("request_id", ""),
                     gpu_count=q.get("gpu_count", 1), exclusive=q.get("exclusive", False),
                     gpus=q.get("gpus", []), topology=q.get("topology", "any"), hosts=q.get("hosts", 1),
                     same=q.get("same", ""), prefer=q.get("prefer", ""), reserve=q.get("reserve", []),
                     start_after_unix=q.get("start_after", 0.0))
        wait = report.waits.get(h["host"], {}).get(q["rank"])
        if wait is not None:
            wait_pb(hs.queue[-1], wait)
    hs.cordoned, hs.draining = h["cordoned"], h["draining"]
    if view.cordon is not None:
        hs.cordon.CopyFrom(cordon_pb(view.cordon))


def cordon_pb(record: CordonRecord) -> pb.Cordon:
    return pb.Cordon(reason=record.reason, drain=record.drain, grace_seconds=record.grace_s,
                     asked_by=record.asked_by, created_at_unix=record.created_at)


def redact_for_agent(status: pb.GetStatusResponse, agent: str) -> None:
    """What an agent may see of a host (G9): its own leases in full; of other agents' leases, neither the
    session id, the request id nor the processes (pids, pgid), nor who asked for an eviction. Of the GPUs'
    processes only its own leases' appear (of other agents' departing leases, neither their processes nor
    who asked); the queue shows no other agent's request id. The etcd cluster's members are not its concern."""
    del status.etcd_members[:]
    del status.usage_days[:]
    for hs in status.hosts:
        if hs.HasField("cordon"):
            hs.cordon.asked_by = ""   # which operator cordoned it: the reason is enough
        own = {lease.id for lease in hs.leases if lease.agent == agent}
        for lease in hs.leases:
            if lease.agent == agent:
                continue
            lease.session_id = lease.request_id = ""
            del lease.pids[:]
            lease.pgid = 0
            if lease.HasField("eviction"):
                lease.eviction.requested_by = ""
        for gpu in hs.gpus:
            mine = [p for p in gpu.processes if p.lease_id in own]
            del gpu.processes[:]
            gpu.processes.extend(mine)
            for use in gpu.lease_use:
                if use.lease_id not in own:
                    del use.pids[:]
            for gone in gpu.departing:
                if gone.agent != agent:
                    del gone.pids[:]
                    gone.requested_by = ""
        for entry in hs.queue:
            if entry.agent != agent:
                entry.request_id = ""
    for entry in status.gang_queue:
        if entry.agent != agent:
            entry.request_id = ""
