"""``gpucoord queue [--host H] [--json]``: every waiting request, its place in its host's queue, why it waits and
its estimated start (docs/policies.md "Why a request waits"). One ``GetStatus`` call: the reasons are fields of the
status's queue entries (``QueueEntry.position``, ``reason``, ``blockers``, ``estimated_start_unix``,
``has_estimate``), computed by the coordinator at the status's revision."""
from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable

from coordinator.cli.common import _client_tls, check_name, fetch_status, rpc_error
from coordinator.policy.partition.units import show_mib
from coordinator.web.gangs import reservation

_TLS = ("tls-ca", "tls-cert", "tls-key")


def add_parsers(sub: Any, command: Callable[..., argparse.ArgumentParser]) -> None:
    """``queue`` on ``sub``; ``command(sub, name, uses, **kw)`` makes a subcommand (coordinator.cli.main)."""
    qu = command(sub, "queue", ("coordinator", *_TLS),
                 help="waiting requests: position, why they wait, estimated start")
    qu.add_argument("--host", default=None, help="only this host's queue")
    qu.add_argument("--json", action="store_true", help="one JSON document: {revision, waiting: [...]}")
    qu.set_defaults(fn=cmd_queue)


def queue_doc(status: dict[str, Any]) -> dict[str, Any]:
    """The waiting requests of a status document, host by host in rank order. A multi-host gang's reservation
    on a host also names its reserved GPUs by index (``reserve_gpus``; ``reserve`` has their uuids)."""
    waiting = []
    for h in status.get("hosts", []):
        index_of = {g["uuid"]: g["index"] for g in h.get("gpus", [])}
        for q in h.get("queue", []):
            waiting.append({"host": h["host"], **q,
                            "estimated_start_unix": q.get("estimated_start_unix") if q.get("has_estimate") else None})
            if q.get("reserve"):
                waiting[-1]["reserve_gpus"] = [index_of.get(u, u) for u in q["reserve"]]
    return {"revision": status.get("revision", 0), "waiting": waiting, "gangs": list(status.get("gang_queue", []))}


def render_queue(doc: dict[str, Any], now: float) -> str:
    """One line per waiting request, then its reason; ``now``: to show the estimate as a time from now. Then the
    multi-host gangs waiting, each with the hosts it reserves."""
    gangs = [f"multi-host gang {g.get('position', 0)}: {g.get('agent', '')} priority {g.get('priority', 0)}: "
             f"{g.get('reason', '')}" for g in doc.get("gangs", [])]
    if not doc["waiting"]:
        return "\n".join(gangs) if gangs else "no request waits"
    lines = [f"{'host':<16} {'pos':>3} {'agent':<14} {'asks':>14} {'prio':>5} {'estimated start':<16}"]
    for q in doc["waiting"]:
        start = q.get("estimated_start_unix")
        when = f"in {max(0.0, start - now):.1f} s" if start is not None else "unknown"
        count = int(q.get("gpu_count") or 1)
        # Sizes by the one display rule (README "Sizes"); a gang's shape as status shows it.
        what = (f"{count} whole GPU{'s' if count > 1 else ''}" if q.get("exclusive")
                else show_mib(int(q.get("vram_mb", 0))) + (f" x {count}" if count > 1 else ""))
        lines.append(f"{q['host']:<16} {q.get('position', 0):>3} {q.get('agent', ''):<14} {what:>14} "
                     f"{q.get('priority', 0):>5} {when:<16}")
        lines.append(f"  {q.get('reason', '')}")
        held = reservation(q, dict(zip(q.get("reserve") or (), q.get("reserve_gpus") or ())))
        if held:
            lines.append(f"  {held}")
    return "\n".join(lines + gangs)


def cmd_queue(args: argparse.Namespace) -> int:
    import grpc
    if args.host:
        check_name("--host", args.host, "queue")
    try:
        status = fetch_status(args.coordinator, args.host or "", _client_tls(args))
    except grpc.RpcError as e:
        raise rpc_error(e, args.coordinator) from None
    doc = queue_doc(status)
    print(json.dumps(doc, indent=2) if args.json else render_queue(doc, time.time()))
    return 0
