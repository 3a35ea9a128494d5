"""``gpucoord lease show ID``: one lease as the hosts' status lists it. A lease of one host: its fields. A multi-host
gang (issue 30): also a hostfile (one line per rank, ``host slots=N``) and the environment each rank's command
gets from ``gpucoord run --join ID --rank R`` (``agent_client.gang_env``, the same function)."""
from __future__ import annotations

import argparse
import shlex
import time
from typing import Mapping, Sequence

from agent_client.api import coordinator_pb2 as pb
from agent_client.gang_env import hostfile, lease_parts, master_host, rank_env
from coordinator.cli.common import CliError, _client_tls, _stub, rpc_error


def lease_text(found: Sequence[tuple[str, pb.Lease]], addresses: Mapping[str, str]) -> str:
    """What ``lease show`` prints: ``found`` is the lease's message as each host's status lists it (host, message),
    ``addresses`` each host's registered node address (rank 0's gives ``PET_MASTER_ADDR``)."""
    msg = found[0][1]
    gpus = [g for _, x in found for g in x.gpus] or [pb.LeaseGpu(index=msg.gpu_index, uuid=msg.gpu_uuid,
                                                                  token=msg.token, vram_mb=msg.vram_mb)]
    lines = [f"lease {msg.id}",
             f"  agent {msg.agent}, session {msg.session_id}, request {msg.request_id}",
             f"  priority {msg.priority}, {'preemptible' if msg.preemptible else 'not preemptible'}"
             f"{', exclusive' if msg.exclusive else ''}, topology {msg.topology or 'any'}",
             f"  granted {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(msg.created_at))}"
             + (f", time limit {msg.time_limit_seconds:g} s" if msg.time_limit_seconds else "")]
    if msg.pids or msg.pgid:
        lines.append(f"  processes {', '.join(str(p) for p in msg.pids) or '-'}, group {msg.pgid or '-'}")
    lines.append("  GPUs:")
    lines += [f"    {g.host or msg.host} GPU {g.index} {g.uuid} {g.vram_mb} MiB token {g.token}" for g in gpus]
    if not msg.hosts:
        return "\n".join(lines) + "\n"
    parts = lease_parts(found)
    rank0 = parts[0].host
    master = master_host(addresses.get(rank0, ""), rank0)
    lines += ["", "hostfile:", *hostfile(parts).splitlines()]
    missing = [p.host for p in parts if not p.uuids]
    if missing:
        lines.append(f"(no status read for {', '.join(missing)}: its slots are unknown)")
    for p in parts:
        lines += ["", f"rank {p.rank} ({p.host}): gpucoord run --join {msg.id} --rank {p.rank} --host {p.host} "
                      f"--agent {msg.agent} -- CMD"]
        lines += [f"  {k}={shlex.quote(v)}" for k, v in rank_env(msg.id, parts, p.rank, master).items()]
    return "\n".join(lines) + "\n"


def cmd_lease_show(args: argparse.Namespace) -> int:
    """Read every host's status (an agent's certificate sees the hosts it has a session on) and print the lease."""
    import grpc
    stub = _stub(args.coordinator, _client_tls(args))
    try:
        resp = stub.GetStatus(pb.GetStatusRequest(), timeout=10)
    except grpc.RpcError as e:
        raise rpc_error(e, args.coordinator) from None
    found = [(hs.host, x) for hs in resp.hosts for x in hs.leases if x.id == args.id]
    if not found:
        raise CliError(f"NOT_FOUND: lease_id: no live lease {args.id}", "'gpucoord status' lists the live leases",
                       refused=True)
    print(lease_text(found, {hs.host: hs.address for hs in resp.hosts}), end="")
    return 0
